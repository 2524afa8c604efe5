"""int8 accuracy on real sentences: fastbert.quantize against ONNX Runtime's dynamic int8 and OpenVINO's
NNCF int8, all on the bundled all-MiniLM-L6-v2 and the same inputs (tests/data/sentences.txt), each
compared with transformers in float32: per-sentence cosine of the mean-pooled embeddings, Spearman of
all pairwise similarities, rel err of last_hidden_state at real tokens.

    .venv/bin/python benchmarks/int8_accuracy.py [--out DIR]

OpenVINO calibrates on every fourth sentence (NNCF needs data; fastbert's dynamic mode needs none).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import transformers

import fastbert
from fastbert.apps import bench
from fastbert.apps.demo import mean_pool, minilm_dir
from fastbert.info import cpu_line
from fastbert.testing import rel_err

SENTENCES = Path(__file__).resolve().parent.parent / "tests" / "data" / "sentences.txt"


def spearman(a, b) -> float:
    rank = lambda v: v.argsort().argsort().double()  # noqa: E731
    return float(torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1])


def scores(hidden, truth_hidden, mask):
    """(min cosine, mean cosine, Spearman, rel err) of `hidden` against the float32 truth."""
    e, t = mean_pool(hidden.float(), mask), mean_pool(truth_hidden, mask)
    cosine = (e * t).sum(-1)
    upper = torch.triu_indices(len(e), len(e), 1)
    rho = spearman((t @ t.T)[upper[0], upper[1]], (e @ e.T)[upper[0], upper[1]])
    real = mask.bool()
    return float(cosine.min()), float(cosine.mean()), rho, rel_err(hidden[real].double(), truth_hidden[real].double())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/out", help="work folder for the ONNX files")
    args = parser.parse_args(argv)
    path = minilm_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sentences = [s for s in SENTENCES.read_text("utf-8").split("\n") if s]
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    hf = transformers.BertModel.from_pretrained(path).eval()
    ours = fastbert.quantize(fastbert.BertModel.from_pretrained(path))
    calibration = [(ids[i:i + 16:4], mask[i:i + 16:4]) for i in range(0, len(sentences), 16)]
    runners = {"fastbert int8 (dynamic, per token)": lambda i, m: ours(i, attention_mask=m).last_hidden_state}
    ort, why = bench.onnxruntime_runner(copy.deepcopy(hf), torch.float32, os.path.join(args.out, "onnx-minilm"), True)
    runners["onnxruntime int8 (dynamic)"] = ort if ort is not None else why
    ov, why = bench.openvino_runner(copy.deepcopy(hf), torch.float32, True, calibration)
    runners["openvino int8 (NNCF)"] = ov if ov is not None else why
    with torch.inference_mode():
        truth = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        print(f"{len(sentences)} sentences, {int(mask.sum())} tokens; {cpu_line()}")
        print("| int8 model | min cosine | mean cosine | Spearman | rel err |\n|---|---|---|---|---|")
        for name, run in runners.items():
            if isinstance(run, str):
                print(f"| {name} | n/a: {run} | | | |")
                continue
            lo, mean, rho, err = scores(run(ids, mask), truth, mask)
            print(f"| {name} | {lo:.4f} | {mean:.4f} | {rho:.4f} | {err:.4f} |")


if __name__ == "__main__":
    sys.exit(main())
