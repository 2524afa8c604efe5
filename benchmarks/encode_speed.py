"""Corpus encoding speed: `fastbert.encode` against sentence-transformers' encode, side by side in one run.

    .venv/bin/python benchmarks/encode_speed.py [--texts 2000] [--rounds 3] [--out benchmarks/out]

The corpus (fixed seed) mixes search queries (2-8 words, 30%), sentences (50%) and passages of several
sentences up to MiniLM's 256-token limit (20%), drawn from tests/data/sentences.txt. Every contender embeds
the whole corpus with all-MiniLM-L6-v2 (mean pooling, normalized); embeddings are checked against
sentence-transformers float32 first (float32: the table's matmul bound as rel err; bfloat16: its bf16
bound; int8: the int8 row's per-sentence cosine), then timed in alternating rounds (medians, texts/s).

sentence-transformers' own onnx and openvino backends need optimum, whose releases require transformers < 5
(not installable beside this project's transformers 5.24): they run here as what those backends are, ONNX
Runtime (ORT-optimized export) and OpenVINO on the same model under sentence-transformers' batching (sorted by
length, 32 a batch, padded to the batch's longest), with int8 from ORT's dynamic quantization and NNCF.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

import fastbert
from fastbert.apps import bench
from fastbert.apps.demo import minilm_dir
from fastbert.apps.timing import alternating_medians
from fastbert.info import cpu_line
from fastbert.quantization import fast_activation_dtype
from fastbert.testing import INT8, rel_err, tolerance

SENTENCES = Path(__file__).resolve().parent.parent / "tests" / "data" / "sentences.txt"


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    sentences = [s for s in SENTENCES.read_text("utf-8").split("\n") if s]
    words = " ".join(sentences).split()
    texts = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:
            start = rng.randrange(len(words) - 8)
            texts.append(" ".join(words[start:start + rng.randint(2, 8)]))
        elif kind < 0.8:
            texts.append(rng.choice(sentences))
        else:
            passage, target = [], rng.randint(60, 200)  # words; MiniLM truncates past 256 tokens
            while sum(len(p.split()) for p in passage) < target:
                passage.append(rng.choice(sentences))
            texts.append(" ".join(passage))
    return texts


def st_batching(run, tokenizer, texts, batch_size=32, max_length=256):
    """sentence-transformers' encode loop around `run(ids, mask) -> hidden`: length-sorted batches of
    `batch_size`, mean pooling, L2 normalization, input order restored."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = [None] * len(texts)
    for b in range(0, len(texts), batch_size):
        idx = order[b:b + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        hidden = run(enc["input_ids"], enc["attention_mask"]).float()
        m = enc["attention_mask"].unsqueeze(-1).float()
        pooled = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)
        for k, i in enumerate(idx):
            out[i] = pooled[k]
    return torch.stack(out)


def contenders(texts, tokenizer, workdir):
    """{name: (precision class, () -> embeddings [N, H])}; a contender that cannot be built is a string (why)."""
    import sentence_transformers as st
    import transformers

    path = minilm_dir()
    out = {}
    ours = fastbert.BertModel.from_pretrained(path)
    for name, model in (("fastbert fp32", ours), ("fastbert bf16", copy.deepcopy(ours).to(torch.bfloat16)),
                        ("fastbert int8", fastbert.quantize(copy.deepcopy(ours)).to(fast_activation_dtype()))):
        out[name] = (name.split()[1], lambda m=model: fastbert.encode(m, texts, tokenizer, max_length=256))
    for dtype, cls in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = st.SentenceTransformer(path, device="cpu", model_kwargs={"dtype": dtype})
        out[f"sentence-transformers torch {cls}"] = (cls, lambda m=model: m.encode(
            texts, batch_size=32, convert_to_tensor=True, normalize_embeddings=True).float())
    hf = transformers.BertModel.from_pretrained(path).eval()
    for quantized, cls in ((False, "fp32"), (True, "int8")):
        run, why = bench.onnxruntime_runner(copy.deepcopy(hf), torch.float32, os.path.join(workdir, f"onnx-{cls}"), quantized)
        out[f"onnxruntime {cls}"] = (cls, (lambda r=run: st_batching(r, tokenizer, texts)) if run else why)
    for dtype, quantized, cls in ((torch.float32, False, "fp32"), (torch.bfloat16, False, "bf16"), (torch.float32, True, "int8")):
        calibration = None
        if quantized:  # NNCF calibrates on real text: 4 batches of the corpus
            enc = tokenizer(texts[:64], padding=True, truncation=True, max_length=256, return_tensors="pt")
            calibration = [(enc["input_ids"][i::4], enc["attention_mask"][i::4]) for i in range(4)]
        run, why = bench.openvino_runner(copy.deepcopy(hf), dtype, quantized, calibration)
        out[f"openvino {cls}"] = (cls, (lambda r=run: st_batching(r, tokenizer, texts)) if run else why)
    return out


def check(name, cls, got, truth) -> str:
    """'' if `got` passes its precision class's check against the float32 truth, else why not."""
    if not torch.isfinite(got).all():
        return "non-finite embeddings"
    if cls == "int8":
        worst = float((got * truth).sum(-1).min())
        return "" if worst >= INT8.sentence_cosine else f"worst cosine {worst:.4f} < {INT8.sentence_cosine}"
    bound = tolerance(torch.float32 if cls == "fp32" else torch.bfloat16, "matmul")
    err = rel_err(got.double(), truth.double())
    return "" if err <= bound else f"rel err {err:.2e} > {bound}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    import transformers

    texts = corpus(args.texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    tokens = sum(min(len(t), 256) for t in tokenizer(texts)["input_ids"])
    built = contenders(texts, tokenizer, args.out)
    truth = built["sentence-transformers torch fp32"][1]()
    timed, notes, errors = {}, {}, {}
    for name, (cls, run) in built.items():
        if isinstance(run, str):
            notes[name] = run
            continue
        bench.settle()  # the threads of what ran before (ORT, OpenVINO) spin down: fastbert tunes in its first run
        got = run()
        errors[name] = float((got * truth).sum(-1).min())
        why = check(name, cls, got, truth)
        if why:
            notes[name] = f"failed the accuracy check: {why}"
        else:
            timed[name] = run
    ms = alternating_medians(timed, args.rounds, warmup=0, before=bench.settle)
    rows = [f"{len(texts)} texts, {tokens} tokens (after truncation to 256); {cpu_line()}, {torch.get_num_threads()} threads",
            "", "| contender | precision | texts/s | tokens/s | vs best sentence-transformers-class of its precision | worst cosine vs ST fp32 |",
            "|---|---|---|---|---|---|"]
    best = {}
    for name, t in ms.items():
        cls = built[name][0]
        if not name.startswith("fastbert"):
            best[cls] = min(best.get(cls, float("inf")), t)
    for name, t in sorted(ms.items(), key=lambda kv: (built[kv[0]][0], kv[1])):
        cls = built[name][0]
        ratio = f"{best[cls] / t:.2f}x" if name.startswith("fastbert") and cls in best else ""
        rows.append(f"| {name} | {cls} | {len(texts) / (t / 1e3):.0f} | {tokens / (t / 1e3):.0f} | {ratio} | {errors[name]:.4f} |")
    rows += [f"- {n}: {why}" for n, why in notes.items()]
    print("\n".join(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "encode_speed.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "texts": len(texts), "tokens": tokens, "ms": ms,
                   "worst_cosine": errors, "notes": notes, "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
