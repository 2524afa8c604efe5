"""fastbert.encode on encode_speed.py's corpus (1000 texts, all-MiniLM-L6-v2): the 16384-token budget run
in batches of the whole budget against the same budget in forwards of the width encode.forward_tokens picks,
alternating, medians of 5 rounds; the embeddings of both compared first.

    .venv/bin/python benchmarks/encode_batches.py [--dtype fp32|bf16|int8] [--rounds 5]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import fastbert
from fastbert.apps.demo import minilm_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode_speed import corpus  # noqa: E402

ENCODE = sys.modules["fastbert.encode"]  # the module (fastbert.encode is the function)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model, tokenizer = ENCODE.load(minilm_dir(), args.dtype)
    texts, forward_tokens = corpus(1000), ENCODE.forward_tokens

    def run(narrower: bool):
        ENCODE.forward_tokens = forward_tokens if narrower else (lambda model, device, budget: budget)
        try:
            start = time.perf_counter()
            out = fastbert.encode(model, texts, tokenizer, max_length=256)
            return time.perf_counter() - start, out
        finally:
            ENCODE.forward_tokens = forward_tokens

    whole, narrower = run(False)[1], run(True)[1]
    print(f"forwards of {forward_tokens(model, torch.device('cpu'), 16384)} tokens; "
          f"max |difference| of the embeddings {float((whole - narrower).abs().max()):.3g}")
    times = {False: [], True: []}
    for r in range(args.rounds):
        for narrower in ((False, True) if r % 2 == 0 else (True, False)):
            times[narrower].append(run(narrower)[0])
    before, after = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.dtype}: whole budget {len(texts) / before:.0f} texts/s, measured width {len(texts) / after:.0f} "
          f"texts/s: {before / after:.2f}x")


if __name__ == "__main__":
    main()
