"""fastbert.encode on encode_speed.py's corpus (1000 texts, all-MiniLM-L6-v2): the 16384-token budget run
in batches of the whole budget against the same budget in cache-sized batches (encode.cache_tokens),
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
    texts, cache_tokens = corpus(1000), ENCODE.cache_tokens

    def run(cache_sized: bool):
        ENCODE.cache_tokens = cache_tokens if cache_sized else (lambda model, device: None)
        try:
            start = time.perf_counter()
            out = fastbert.encode(model, texts, tokenizer, max_length=256)
            return time.perf_counter() - start, out
        finally:
            ENCODE.cache_tokens = cache_tokens

    whole, cached = run(False)[1], run(True)[1]
    print(f"cache-sized batches: {cache_tokens(model, torch.device('cpu'))} tokens; "
          f"max |difference| of the embeddings {float((whole - cached).abs().max()):.3g}")
    times = {False: [], True: []}
    for r in range(args.rounds):
        for cache_sized in ((False, True) if r % 2 == 0 else (True, False)):
            times[cache_sized].append(run(cache_sized)[0])
    before, after = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.dtype}: whole budget {len(texts) / before:.0f} texts/s, cache-sized {len(texts) / after:.0f} "
          f"texts/s: {before / after:.2f}x")


if __name__ == "__main__":
    main()
