"""fastbert.encode: embed a corpus. Texts stream through in windows; each window is sorted by length and
cut into batches by a token budget (batch size x longest text), so the budget bounds memory, batches of
short texts are wide and long ones narrow, and the model (padding-free underneath) keeps its GEMMs large.
Embeddings come back in input order."""
from __future__ import annotations

import itertools
import os
from typing import Iterable, Iterator

import torch

POOLINGS = ("mean", "cls", "none")


class TextTooLong(ValueError):
    """A text over max_length, with truncation off."""

    def __init__(self, index: int, tokens: int, max_length: int):
        super().__init__(f"text {index} has {tokens} tokens, over max_length={max_length} (truncate=True cuts it)")
        self.index, self.tokens, self.max_length = index, tokens, max_length


def load(directory, dtype: str = "fp32"):
    """(model, tokenizer) from an HF BERT directory; dtype "fp32", "bf16" or "int8" (fastbert.quantize, the
    activations between int8 GEMMs in quantization.fast_activation_dtype())."""
    import transformers

    from fastbert import quantization
    from fastbert.model import BertModel

    if dtype not in ("fp32", "bf16", "int8"):
        raise ValueError(f"dtype must be fp32, bf16 or int8, got {dtype!r}")
    model = BertModel.from_pretrained(directory)
    if dtype == "bf16":
        model.to(torch.bfloat16)
    elif dtype == "int8":
        quantization.quantize(model).to(quantization.fast_activation_dtype())
    return model, transformers.AutoTokenizer.from_pretrained(directory)


def default_max_length(model, tokenizer, directory=None) -> int:
    """sentence-transformers' max_seq_length where the directory has one, else what tokenizer and model allow."""
    if directory is not None:
        import json

        path = os.path.join(os.fspath(directory), "sentence_bert_config.json")
        if os.path.exists(path):
            with open(path) as f:
                length = json.load(f).get("max_seq_length")
            if length:
                return int(length)
    return int(min(tokenizer.model_max_length, model.config.max_position_embeddings))


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices of `lengths` sorted longest first, cut so that each batch's size x its longest is at most
    `batch_tokens` (a text longer than the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def cache_tokens(model, device: torch.device) -> int | None:
    """On a CPU, the most tokens a forward should take by the cache size sysfs reports: those whose widest
    activation (the FFN's [tokens, intermediate], in the dtype its GEMM writes) fits the last-level cache, as
    a power of two, at least 1024 (narrower GEMMs lose more than the cache saves). forward_tokens' static
    default. None on GPUs, or where the cache size cannot be read."""
    from fastbert import tuning
    from fastbert.ops.dense import gemm_output_dtype

    llc = tuning.cache_bytes(3) or tuning.cache_bytes(2)
    if device.type != "cpu" or llc is None:
        return None
    dtype = gemm_output_dtype(next(model.parameters()).dtype, device)
    width = model.config.intermediate_size * torch.finfo(dtype).bits // 8
    fits = max(llc // width, 1024)
    return 1 << (fits.bit_length() - 1)


SEQUENCE = 128  # tokens per sequence of forward_tokens' trial batches
SMALLEST_FORWARD = 2048  # narrower batches lost to wider ones on every CPU measured (benchmarks/RESULTS.md)


def forward_tokens(model, device: torch.device, budget: int) -> int:
    """How many tokens (at most `budget`) one forward takes. On a CPU, wider batches stream every layer's
    activations through memory once they leave the cache, and the cache a VM's sysfs reports need not be the
    one it gets (a Xeon VM reporting 480 MiB of L3 ran MiniLM bf16 1.3x faster at 8192 tokens than at 16384):
    so the first call times the model's first layer on `budget` random tokens, cut into forwards of each power
    of two from SMALLEST_FORWARD up to the budget, and keeps the fastest, cached per machine (fastbert.tuning).
    FASTBERT_CPU_TUNE=0: cache_tokens' rule. GPUs: the budget."""
    from fastbert import padding, tuning

    if device.type != "cpu":
        return budget
    if not tuning.enabled():
        return min(budget, cache_tokens(model, device) or budget)
    sizes = [SMALLEST_FORWARD << i for i in range(16) if SMALLEST_FORWARD << i <= budget]
    if len(sizes) < 2:
        return budget
    layer, config = model.encoder.layer[0], model.config
    key = (f"encode tokens cpu {next(model.parameters()).dtype} {type(layer.intermediate.dense).__name__} "
           f"h{config.hidden_size} i{config.intermediate_size} heads{config.num_attention_heads} to{sizes[-1]}")

    made = []

    def tokens() -> torch.Tensor:  # made only if a trial runs: once measured, a call costs a cache lookup
        if not made:
            ids = torch.randint(config.vocab_size, (sizes[-1] // SEQUENCE, SEQUENCE),
                                generator=torch.Generator().manual_seed(0))  # the caller's random stream untouched
            made.append(model.embeddings(ids).flatten(0, 1))
        return made[0]

    def trial(size: int):
        def run():
            for part in tokens().split(size):
                mask = torch.ones(part.shape[0] // SEQUENCE, SEQUENCE, dtype=torch.bool)
                layer(part, None, False, padding.packing(mask))
        return run

    with torch.inference_mode():
        # Three calls each: a whole layer over the budget is long enough to time (MiniLM fp32, 16384 tokens:
        # 200-244 ms on a Xeon with AMX).
        return int(tuning.choose(key, {str(s): trial(s) for s in sizes}, (), backward=False, repeats=3))


def tokenize(tokenizer, texts: list[str], max_length: int, truncate: bool, first_index: int = 0) -> list[list[int]]:
    """Token ids with special tokens; a text over max_length is truncated, or (truncate=False) an error
    naming its index (first_index + position)."""
    ids = tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    for k, row in enumerate(ids):
        if len(row) > max_length:
            if not truncate:
                raise TextTooLong(first_index + k, len(row), max_length)
            ids[k] = row[: max_length - 1] + row[-1:]  # keep [SEP] last, as the tokenizer's own truncation does
    return ids


def _pool(hidden, mask, pooling, normalize):
    if pooling == "none":
        return [h[m.bool()].float() for h, m in zip(hidden, mask)]
    if pooling == "cls":
        pooled = hidden[:, 0].float()
    else:  # summed in float32: a bf16 model's token states, added up in bf16, would lose digits
        m = mask.unsqueeze(-1).float()
        pooled = (hidden.float() * m).sum(1) / m.sum(1).clamp_min(1)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def encode_windows(model, texts: Iterable[str], tokenizer, pooling: str = "mean", normalize: bool = True,
                   batch_tokens: int = 16384, max_length: int | None = None, truncate: bool = True,
                   window: int = 4096, on_batch=None) -> Iterator[tuple[int, object]]:
    """(index of the window's first text, its embeddings in input order) per window of `window` texts;
    `on_batch(texts, tokens)` after each batch (progress)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if batch_tokens < 1 or window < 1:
        raise ValueError(f"batch_tokens and window must be positive, got {batch_tokens} and {window}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2 ([CLS] and [SEP]), got {max_length}")
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be an iterable of str, got one str (its characters would be the texts): pass [text]")
    if max_length is None:
        max_length = default_max_length(model, tokenizer)
    device = next(model.parameters()).device
    # Embeddings are an inference: no dropout, whatever mode the model came in (restored after; nn.Module's
    # own switch, which keeps what the model prepared: each encode call would pack its weights again).
    training = model.training
    torch.nn.Module.train(model, False)
    try:
        # The budget bounds memory; on a CPU the model runs it in batches of the width measured fastest there.
        budget = forward_tokens(model, device, batch_tokens)
        pad = tokenizer.pad_token_id or 0
        start, it = 0, iter(texts)
        while True:
            chunk = list(itertools.islice(it, window))
            if not chunk:
                return
            for k, t in enumerate(chunk):
                if not isinstance(t, str):
                    raise TypeError(f"text {start + k} is a {type(t).__name__}, not a str")
            ids = tokenize(tokenizer, chunk, max_length, truncate, start)
            results: list = [None] * len(chunk)
            for batch in token_budget_batches([len(r) for r in ids], budget):
                longest = len(ids[batch[0]])
                x = torch.full((len(batch), longest), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), longest), dtype=torch.long)
                for row, i in enumerate(batch):
                    x[row, : len(ids[i])] = torch.tensor(ids[i])
                    mask[row, : len(ids[i])] = 1
                with torch.inference_mode():
                    hidden = model(x.to(device), attention_mask=mask.to(device)).last_hidden_state
                    pooled = _pool(hidden, mask.to(device), pooling, normalize)
                for row, i in enumerate(batch):
                    results[i] = pooled[row].cpu()
                if on_batch is not None:
                    on_batch(len(batch), int(mask.sum()))
            yield start, (results if pooling == "none" else torch.stack(results))
            start += len(chunk)
    finally:
        torch.nn.Module.train(model, training)


def encode(model, texts: Iterable[str], tokenizer=None, pooling: str = "mean", normalize: bool = True,
           batch_tokens: int = 16384, max_length: int | None = None, truncate: bool = True, window: int = 4096):
    """Embeddings of `texts` (any iterable of str, read window by window) in input order: float32 [N, H]
    for pooling "mean" (sentence-transformers' default) or "cls", L2-normalized by default; for "none"
    each text's token states [tokens, H]. `model`: a fastbert BertModel (with `tokenizer`), or an HF BERT
    directory (model and tokenizer loaded from it; sentence-transformers' max_seq_length honoured).
    Texts over max_length are truncated (truncate=False: an error naming the text)."""
    directory = None
    if isinstance(model, (str, os.PathLike)):
        directory = model
        model, loaded = load(directory)
        tokenizer = tokenizer or loaded
    if tokenizer is None:
        raise ValueError("encode() needs the model's tokenizer (or pass a model directory instead of a model)")
    if max_length is None:
        max_length = default_max_length(model, tokenizer, directory)
    parts = [e for _, e in encode_windows(model, texts, tokenizer, pooling, normalize, batch_tokens, max_length,
                                          truncate, window)]
    if pooling == "none":
        return [t for part in parts for t in part]
    if not parts:
        return torch.empty(0, model.config.hidden_size)
    return torch.cat(parts)
