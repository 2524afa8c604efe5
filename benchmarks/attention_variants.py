"""The cpu backend's attention variants side by side, each forced, taking turns call by call (medians):
fastbert's C++ kernel, the same kernel on ATen's brgemm, torch's SDPA; forward (inference) and forward +
backward, bfloat16 by default, BERT-base heads (12 x d 64), the first sequence a quarter padding.

    .venv/bin/python benchmarks/attention_variants.py [--shapes 8x128,2x512,1x1024] [--rounds 9] [--dtype bf16]
"""
import argparse

import torch

from fastbert import dispatch, ops
from fastbert.apps.timing import alternating_medians

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def contenders(batch, seq, dtype, train):
    q, k, v = (torch.randn(batch, 12, seq, 64).to(dtype).requires_grad_(train) for _ in range(3))
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[0, seq * 3 // 4:] = False
    grad = torch.randn(batch, 12, seq, 64).to(dtype)
    facts = dispatch.Facts(("cpu",), (dtype,), 64)
    usable = [v.name for v in dispatch.usable_variants("attention", "cpu", facts)[0]]

    def run(name):
        with dispatch.use_variant("attention", name):
            if train:
                ops.attention(q, k, v, mask).backward(grad)
            else:
                with torch.inference_mode():
                    ops.attention(q, k, v, mask)

    return {name: (lambda name=name: run(name)) for name in usable}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x128,2x512,1x1024")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, medians of {args.rounds} alternating rounds (ms)")
    for shape in args.shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        for train in (False, True):
            medians = alternating_medians(contenders(batch, seq, DTYPES[args.dtype], train), args.rounds, warmup=2)
            first = medians.get("fastbert")
            line = "  ".join(f"{name} {ms:.2f}" + (f" ({first / ms:.2f}x)" if first else "") for name, ms in medians.items())
            print(f"{shape} {'forward+backward' if train else 'forward'}: {line}", flush=True)


if __name__ == "__main__":
    main()
