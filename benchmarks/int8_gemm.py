"""The int8 GEMMs this CPU can run beside the float32 GEMM they replace, taking turns call by call
(medians, GOP/s): fastbert's own GEMM at every ISA the CPU has (csrc/cpu/int8_gemm.h), oneDNN's u8 x s8
GEMM (marked where its sums are wrong: without VNNI it saturates), oneDNN's packed float32 GEMM and
torch's F.linear. BERT-base shapes: [tokens, 768] x [768 -> 768 | 3072] and [tokens, 3072] x [3072 -> 768].

    .venv/bin/python benchmarks/int8_gemm.py [--tokens 128,1024] [--rounds 7]
"""
import argparse
import sys

import torch

import fastbert  # noqa: F401  (registers the ops; fastbert.ops.quantized_dense below)
from fastbert import _C  # noqa: F401  (torch.ops.fastbert_C)
from fastbert import tuning
from fastbert.apps.timing import alternating_medians
from fastbert.ops import _onednn

SHAPES = ((768, 768), (768, 3072), (3072, 768))  # (k, n)


def contenders(m, k, n):
    qd = sys.modules["fastbert.ops.quantized_dense"]
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01 + 1e-4
    fns = {}
    for name, isa in qd.ISAS.items():
        if isa != 0 and torch.ops.fastbert_C.int8_isa_supported(isa):
            gemm = qd.own_gemm_step(isa)
            fns[f"fastbert {name}"] = lambda g=gemm, p=gemm.pack(weight, None, m): g.run(q, p, scale)
    if not _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise")):
        gemm = qd.ONEDNN_GEMM
        label = "oneDNN int8" + (" (WRONG sums here)" if qd.onednn_inexact() else "")
        fns[label] = lambda p=gemm.pack(weight, None, m): gemm.run(q, p, scale)
    x, w = torch.randn(m, k), torch.randn(n, k)
    if not _onednn.missing():
        fns["oneDNN fp32"] = lambda blocked=_onednn.pack(w, m): _onednn.linear(x, blocked, None)
    fns["F.linear fp32"] = lambda: torch.nn.functional.linear(x, w)
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,1024")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{tuning.cpu()}, {torch.get_num_threads()} threads")
    for m in (int(t) for t in args.tokens.split(",")):
        for k, n in SHAPES:
            with torch.inference_mode():
                ms = alternating_medians(contenders(m, k, n), rounds=args.rounds, device="cpu", warmup=1)
            rates = ", ".join(f"{name} {t:.2f} ms = {2 * m * k * n / t / 1e6:.0f}" for name, t in ms.items())
            print(f"{m}x{k}x{n}: {rates} (GOP/s)")


if __name__ == "__main__":
    main()
