"""fastbert.encode: embed a corpus. Texts stream through in windows; each window is sorted by length and
cut into batches by a token budget (batch size x longest text), so the budget bounds memory, batches of
short texts are wide and long ones narrow, and the model (padding-free underneath) keeps its GEMMs large.
Embeddings come back in input order."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import operator
import os
from typing import Iterable, Iterator

import torch

# sentence-transformers' pooling modes, and "none" (each text's token states)
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "none")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What sentence-transformers runs around the encoder: the text that goes in, the pooling after."""

    pooling: str = "mean"
    normalize: bool = True
    prompt: str = ""  # put before every text (the directory's default prompt)
    include_prompt: bool = True  # False: the prompt's tokens (and [CLS]) are left out of the pooling
    lowercase: bool = False  # sentence_bert_config.json's do_lower_case
    truncate_dim: int | None = None  # the first this many numbers of an embedding kept (after Normalize)
    unit: bool = False  # normalize=True asked with truncate_dim: unit vectors after the cut (normalize_embeddings=True)

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.truncate_dim is not None and (isinstance(self.truncate_dim, bool) or not isinstance(self.truncate_dim, int)
                                              or self.truncate_dim < 1):
            raise ValueError(f"truncate_dim must be a positive int, got {self.truncate_dim!r}")

    def width(self, hidden_size: int) -> int:
        """The numbers in one pooled embedding of a model of `hidden_size`."""
        return min(hidden_size, self.truncate_dim or hidden_size)


# The modules of a sentence-transformers directory (modules.json) fastbert runs: the encoder, then these.
_AFTER_ENCODER = ("Pooling", "Normalize")
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _json(directory, *path) -> dict | list | None:
    path = os.path.join(os.fspath(directory), *path)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def encoder_dir(directory):
    """Where a sentence-transformers directory keeps its encoder (config.json, weights, tokenizer,
    sentence_bert_config.json): its Transformer module's path, "" now, "0_Transformer" in older saves."""
    modules = _json(directory, "modules.json") if directory is not None else None
    path = modules[0].get("path", "") if isinstance(modules, list) and modules and isinstance(modules[0], dict) else ""
    return os.path.join(os.fspath(directory), path) if path else directory


def recipe_of(directory=None, pooling: str | None = None, normalize: bool | None = None) -> Recipe:
    """The recipe of a model directory: sentence-transformers' (modules.json: Transformer, then Pooling and
    Normalize; do_lower_case; the default prompt; truncate_dim), or, for a plain transformers directory or none, mean pooling
    normalized. `pooling` / `normalize`, where given, replace the directory's. A pipeline with modules fastbert
    does not run (Dense, ...) raises, naming them, rather than give other embeddings than sentence-transformers."""
    found = {}
    modules = _json(directory, "modules.json") if directory is not None else None
    if modules:
        kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        if kinds[0] != "Transformer" or any(k not in _AFTER_ENCODER for k in kinds[1:]) or kinds.count("Pooling") != 1:
            raise ValueError(f"{directory}: its sentence-transformers modules are {' -> '.join(kinds)}; fastbert.encode "
                             "runs Transformer -> Pooling (-> Normalize): run this model with sentence-transformers "
                             "after fastbert.optimize(SentenceTransformer(...))")
        config = _json(directory, modules[kinds.index("Pooling")].get("path", ""), "config.json") or {}
        mode = config.get("pooling_mode") or [v for k, v in _LEGACY_POOLING.items() if config.get(k)] or "mean"
        mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
        if not isinstance(mode, str):
            raise ValueError(f"{directory}: pooling modes {mode} concatenated: fastbert.encode pools one way")
        settings = _json(directory, "config_sentence_transformers.json") or {}
        prompt_name = settings.get("default_prompt_name")
        found = dict(pooling=mode, normalize="Normalize" in kinds, include_prompt=bool(config.get("include_prompt", True)),
                     prompt=(settings.get("prompts") or {}).get(prompt_name, "") if prompt_name else "",
                     lowercase=bool((_json(encoder_dir(directory), "sentence_bert_config.json") or {}).get("do_lower_case")),
                     truncate_dim=settings.get("truncate_dim"))
    if normalize is not None and not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True, False or None (the directory's), got {normalize!r}")
    if normalize and pooling == "none":
        raise ValueError("pooling='none' gives each text's token states, which are not normalized: leave normalize unset")
    given = {k: v for k, v in (("pooling", pooling), ("normalize", normalize)) if v is not None}
    chosen = {**found, **given}
    return Recipe(**chosen, unit=bool(normalize) and chosen.get("truncate_dim") is not None)


class TextTooLong(ValueError):
    """A text over max_length, with truncation off."""

    def __init__(self, index: int, tokens: int, max_length: int):
        super().__init__(f"text {index} has {tokens} tokens, over max_length={max_length} (truncate=True cuts it)")
        self.index, self.tokens, self.max_length = index, tokens, max_length


TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


def load(directory, dtype: str | None = "fp32", tokenizer=None):
    """(model, tokenizer) from an HF BERT directory (the tokenizer as given, else the directory's; a
    sentence-transformers one's encoder, encoder_dir); dtype "fp32", "bf16" or "int8" (fastbert.quantize, the
    activations between int8 GEMMs in quantization.fast_activation_dtype()), None: as saved (int8 or fp32)."""
    import transformers

    from fastbert import quantization
    from fastbert.model import BertModel

    if dtype not in ("fp32", "bf16", "int8", None):
        raise ValueError(f"dtype must be fp32, bf16 or int8, got {dtype!r}")
    directory = encoder_dir(directory)
    # Without its files transformers makes a tokenizer of 5 special tokens from config.json alone (every
    # word [UNK]: embeddings of nothing, and no error).
    if tokenizer is None and os.path.isdir(directory) and not any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): save the model's tokenizer "
                         "there (tokenizer.save_pretrained(directory)) or pass tokenizer=")
    model = BertModel.from_pretrained(directory, dtype=torch.float32)  # then cast as asked
    saved_int8 = quantization.is_quantized(model)
    dtype = dtype or ("int8" if saved_int8 else "fp32")
    if saved_int8 and dtype != "int8":
        raise ValueError(f"{directory} holds an int8 model (saved quantized): its dtype is int8, not {dtype}")
    if dtype == "bf16":
        model.to(torch.bfloat16)
    elif dtype == "int8":
        (model if saved_int8 else quantization.quantize(model)).to(quantization.fast_activation_dtype())
    return model, tokenizer or transformers.AutoTokenizer.from_pretrained(directory)


def default_max_length(model, tokenizer, directory=None) -> int:
    """sentence-transformers' max_seq_length where the directory has one, else what the tokenizer allows; at
    most the model's positions (a max_seq_length past them, which sentence-transformers takes, fails there on
    the first text that long)."""
    settings = _json(encoder_dir(directory), "sentence_bert_config.json") if directory is not None else None
    length = (settings or {}).get("max_seq_length")
    return int(min(length or tokenizer.model_max_length, model.config.max_position_embeddings))


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
WIDEST_TRIAL = 1 << 15  # wider forwards are not tried (a budget of 10**9 tokens must not allocate for them)


def forward_tokens(model, device: torch.device, budget: int) -> int:
    """How many tokens (at most `budget`) one forward takes. On a CPU, wider batches stream every layer's
    activations through memory once they leave the cache, and the cache a VM's sysfs reports need not be the
    one it gets (a Xeon VM reporting 480 MiB of L3 ran MiniLM bf16 1.3x faster at 8192 tokens than at 16384):
    so the first call times the model's first layer on `budget` random tokens, cut into forwards of each power
    of two from SMALLEST_FORWARD up to the budget (at most WIDEST_TRIAL), and keeps the fastest, cached per
    machine (fastbert.tuning). FASTBERT_CPU_TUNE=0, or a model other than fastbert's BertModel (a transformers
    one): cache_tokens' rule. GPUs: the budget."""
    from fastbert import padding, tuning
    from fastbert.model import BertModel

    if device.type != "cpu":
        return budget
    if not tuning.enabled() or not isinstance(model, BertModel):
        return min(budget, cache_tokens(model, device) or budget)
    sizes = [SMALLEST_FORWARD << i for i in range(16) if SMALLEST_FORWARD << i <= min(budget, WIDEST_TRIAL)]
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
    # [CLS] and [SEP] kept, as the tokenizer's own truncation does: from the end, or from the start where
    # the tokenizer's truncation_side says "left"
    left = getattr(tokenizer, "truncation_side", "right") == "left"
    for k, row in enumerate(ids):
        if len(row) > max_length:
            if not truncate:
                raise TextTooLong(first_index + k, len(row), max_length)
            ids[k] = row[:1] + row[1 - max_length:] if left else row[: max_length - 1] + row[-1:]
    return ids


def lowercasing(tokenizer):
    """The tokenizer lowercasing its texts as sentence-transformers' do_lower_case makes it: a Lowercase step
    first in the normalizer (a copy; the caller's is untouched). Python's str.lower() would differ: it turns
    "[SEP]" in a text into "[sep]" (the tokenizer matches special tokens before normalizing) and a final
    sigma into "ς" (the normalizer lowercases character by character: "σ")."""
    from tokenizers import normalizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"do_lower_case needs a fast (tokenizers) tokenizer, got {type(tokenizer).__name__}")
    steps = backend.normalizer
    steps = [] if steps is None else list(steps) if isinstance(steps, normalizers.Sequence) else [steps]
    if any(isinstance(n, normalizers.Lowercase) for n in steps):
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *steps])
    return tokenizer


def prompt_length(tokenizer, prompt: str, max_length: int) -> int:
    """The tokens sentence-transformers leaves out of the pooling with include_prompt False: the prompt's,
    with [CLS], truncated as a text is, without a closing special token ([SEP])."""
    ids = tokenize(tokenizer, [prompt], max_length, truncate=True)[0]
    return len(ids) - (ids[-1] in tokenizer.all_special_ids)


def _pool(hidden, mask, recipe: Recipe, skipped: int):
    """sentence-transformers' pooling of right-padded token states (in float32: a bf16 model's states,
    added up in bf16, would lose digits); the first `skipped` tokens (a prompt's) left out."""
    if recipe.pooling == "none":
        return [h[m.bool()].float() for h, m in zip(hidden, mask)]
    hidden, keep = hidden.float(), mask.float()
    keep[:, :skipped] = 0
    m = keep.unsqueeze(-1)
    mode = recipe.pooling
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "cls":  # the first token pooled over
        pooled = hidden[rows, keep.argmax(1)]
    elif mode == "lasttoken":  # the last one (zeros where there is none)
        pooled = hidden[rows, keep.shape[1] - 1 - keep.flip(1).argmax(1)] * keep.amax(1, keepdim=True)
    elif mode == "max":
        pooled = hidden.masked_fill(m == 0, float("-inf")).amax(1)
    elif mode == "weightedmean":  # token i weighs i + 1
        w = m * torch.arange(1, keep.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
        pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    else:
        count = m.sum(1).clamp_min(1e-9)
        pooled = (hidden * m).sum(1) / (count if mode == "mean" else count.sqrt())
    if recipe.normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
    if recipe.truncate_dim is None:
        return pooled
    pooled = pooled[:, : recipe.truncate_dim]  # as sentence-transformers cuts: after its Normalize module
    return torch.nn.functional.normalize(pooled, dim=-1) if recipe.unit else pooled


def _int(name: str, value) -> int | None:
    """An integer argument (numpy's too) as a Python int; None stays None."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _check_encoder(model) -> None:
    """A BERT encoder (fastbert's BertModel, or transformers'), with its weights: else an error naming what it is."""
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "max_position_embeddings"):
        hint = ("; a SentenceTransformer: pass its directory, or run its own encode() after fastbert.optimize(model)"
                if hasattr(model, "encode") else "")
        raise TypeError(f"encode() takes a BERT encoder (fastbert.BertModel, a transformers BertModel) or a model "
                        f"directory, got {type(model).__name__}{hint}")
    if isinstance(getattr(model, "bert", None), torch.nn.Module):
        raise TypeError(f"encode() takes a BERT encoder, got {type(model).__name__}, a model with a task head: pass "
                        "its encoder, model.bert")
    weight = next(model.parameters(), None)
    if weight is None or weight.is_meta:
        raise ValueError("the model's parameters are on the meta device (no weights loaded)")


def encode_windows(model, texts: Iterable[str], tokenizer, recipe: Recipe = Recipe(), batch_tokens: int = 16384,
                   max_length: int | None = None, truncate: bool = True, window: int = 4096,
                   on_batch=None) -> Iterator[tuple[int, object]]:
    """(index of the window's first text, its embeddings in input order) per window of `window` texts;
    `on_batch(texts, tokens)` after each batch (progress)."""
    batch_tokens, window, max_length = (_int(name, value) for name, value in (
        ("batch_tokens", batch_tokens), ("window", window), ("max_length", max_length)))
    if batch_tokens < 1 or window < 1:
        raise ValueError(f"batch_tokens and window must be positive, got {batch_tokens} and {window}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2 ([CLS] and [SEP]), got {max_length}")
    if not isinstance(truncate, bool):
        raise TypeError(f"truncate must be True or False, got {truncate!r}")
    _check_encoder(model)
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be an iterable of str, got one str (its characters would be the texts): pass [text]")
    limit = model.config.max_position_embeddings
    if max_length is None:
        max_length = default_max_length(model, tokenizer)
    elif max_length > limit:
        raise ValueError(f"max_length={max_length} is over the model's {limit} positions (max_position_embeddings)")
    if recipe.lowercase:
        tokenizer = lowercasing(tokenizer)
    skipped = 0 if recipe.include_prompt or not recipe.prompt else prompt_length(tokenizer, recipe.prompt, max_length)
    device = next(model.parameters()).device
    # Embeddings are an inference: no dropout, whatever mode the model came in (restored after; nn.Module's
    # own switch, which keeps what the model prepared: each encode call would pack its weights again).
    training = model.training
    torch.nn.Module.train(model, False)
    try:
        budget = None
        pad = tokenizer.pad_token_id or 0
        start, it = 0, iter(texts)
        while True:
            chunk = list(itertools.islice(it, window))
            if not chunk:
                return
            for k, t in enumerate(chunk):
                if not isinstance(t, str):
                    raise TypeError(f"text {start + k} is a {type(t).__name__}, not a str")
                if not t.isascii():
                    try:
                        t.encode("utf-8")
                    except UnicodeEncodeError as e:  # a lone surrogate (from JSON's "\ud800"): no tokenizer takes it
                        raise ValueError(f"text {start + k} is not valid Unicode ({e.reason} at character {e.start})") from None
            if recipe.prompt:
                chunk = [recipe.prompt + t for t in chunk]
            ids = tokenize(tokenizer, chunk, max_length, truncate, start)
            if budget is None:
                # The budget bounds memory; on a CPU the model runs it in batches of the width measured fastest
                # there. A corpus of one window within the narrowest width is one batch whatever is measured.
                small = len(chunk) < window and len(ids) * max(map(len, ids)) <= SMALLEST_FORWARD
                budget = batch_tokens if small else forward_tokens(model, device, batch_tokens)
            results: list = [None] * len(chunk)
            for batch in token_budget_batches([len(r) for r in ids], budget):
                longest = len(ids[batch[0]])
                x = torch.full((len(batch), longest), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), longest), dtype=torch.long)
                for row, i in enumerate(batch):
                    x[row, : len(ids[i])] = torch.tensor(ids[i])
                    mask[row, : len(ids[i])] = 1
                with torch.inference_mode():
                    hidden = model(x.to(device), attention_mask=mask.to(device), output_hidden_states=False,
                                   output_attentions=False, return_dict=True).last_hidden_state
                    pooled = _pool(hidden, mask.to(device), recipe, skipped)
                for row, i in enumerate(batch):
                    results[i] = pooled[row].cpu()
                if on_batch is not None:
                    on_batch(len(batch), int(mask.sum()))
            yield start, (results if recipe.pooling == "none" else torch.stack(results))
            start += len(chunk)
    finally:
        torch.nn.Module.train(model, training)


def encode(model, texts: Iterable[str], tokenizer=None, pooling: str | None = None, normalize: bool | None = None,
           batch_tokens: int = 16384, max_length: int | None = None, truncate: bool = True, window: int = 4096):
    """Embeddings of `texts` (any iterable of str, read window by window) in input order: float32 [N, H]
    pooled (POOLINGS: sentence-transformers' modes), L2-normalized or not; for pooling "none" each text's
    token states [tokens, H]. `model`: a fastbert or transformers BertModel (with `tokenizer`), or an HF BERT
    directory (model and tokenizer loaded from it, as saved: fp32 or int8): a sentence-transformers one is
    run as sentence-transformers runs it (its pooling, Normalize, max_seq_length, do_lower_case, default
    prompt and truncate_dim: [N, truncate_dim], normalized before the cut as its Normalize module does unless
    normalize=True asks for unit vectors; encode.recipe_of). Otherwise, and by default, mean pooling,
    normalized. Texts over max_length are truncated (truncate=False: an error naming the text)."""
    directory = None
    if isinstance(model, (str, os.PathLike)):
        directory = model
        model, tokenizer = load(directory, None, tokenizer)  # as saved: fp32, or int8 where it was quantized
    _check_encoder(model)
    if tokenizer is None:
        raise ValueError("encode() needs the model's tokenizer (or pass a model directory instead of a model)")
    how = recipe_of(directory, pooling, normalize)
    if max_length is None:
        max_length = default_max_length(model, tokenizer, directory)
    parts = [e for _, e in encode_windows(model, texts, tokenizer, how, batch_tokens, max_length, truncate, window)]
    if how.pooling == "none":
        return [t for part in parts for t in part]
    if not parts:
        return torch.empty(0, how.width(model.config.hidden_size))
    return torch.cat(parts)
