"""A linear with GELU on CPU, five ways side by side: oneDNN's GEMM with its GELU post-op, the same GEMM
with bias only (no GELU: the floor), oneDNN's GEMM then fastbert's bias+GELU kernel in place (dense's
`onednn+bias_gelu` variant), F.linear + F.gelu (dense's `torch` variant), F.linear then the kernel.
One process, alternating rounds, medians (ms); outputs checked equal first.

    .venv/bin/python benchmarks/gelu_epilogue.py [--shapes 4096x384x1536,1024x768x3072,128x768x3072] [--rounds 7]
"""
import argparse

import torch

from fastbert import _C  # noqa: F401  (torch.ops.fastbert_C)
from fastbert.apps.timing import alternating_medians
from fastbert.info import cpu_line
from fastbert.ops import _onednn


def in_place_bias_gelu(y, bias):
    torch.ops.fastbert_C.bias_gelu_fwd(y, bias, False, y)
    return y


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x384x1536,1024x768x3072,128x768x3072")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(cpu_line(), f"{torch.get_num_threads()} threads")
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x, w, b = torch.randn(m, k), torch.randn(n, k) * k**-0.5, torch.randn(n)
        blocked = _onednn.pack(w, m)
        fns = {
            "oneDNN + GELU post-op": lambda: _onednn.linear(x, blocked, b, "gelu"),
            "oneDNN + bias (no GELU)": lambda: _onednn.linear(x, blocked, b, "none"),
            "oneDNN, then bias_gelu": lambda: in_place_bias_gelu(_onednn.linear(x, blocked, None, "none"), b),
            "F.linear + F.gelu": lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)),
            "F.linear, then bias_gelu": lambda: in_place_bias_gelu(torch.nn.functional.linear(x, w), b),
        }
        with torch.no_grad():
            truth = torch.nn.functional.gelu(x.double() @ w.double().T + b.double())
            for name, fn in fns.items():
                if "no GELU" not in name:
                    err = float((fn().double() - truth).abs().max() / truth.abs().max())
                    assert err < 1e-5, f"{name}: rel err {err:.2e}"
            ms = alternating_medians(fns, rounds=args.rounds, device="cpu", warmup=2)
        print(f"{shape}: " + ", ".join(f"{name} {t:.2f}" for name, t in ms.items()))


if __name__ == "__main__":
    main()
