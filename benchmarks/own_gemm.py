"""fastbert's own float32 / bfloat16 GEMM (csrc/cpu/float_gemm.h, dense's and qkv_projection's `fastbert`
variant) against oneDNN's packed GEMM (their `onednn` variant), alternating in one process, medians:

1. the four linears of BERT-base (h768) and MiniLM (h384) at 16, 128 and 1024 rows, bias (and GELU on FFN
   in) included, each on its kept packed weight;
2. whole forwards (plans replaying, one C++ call a layer) with every linear on one or the other, and with
   each linear on the variant tuning picked for it alone (run with an empty FASTBERT_CACHE_DIR to measure
   afresh); shapes as `python -m fastbert bench` makes them (ragged32: 32 sentences of 16-128 tokens).

    .venv/bin/python benchmarks/own_gemm.py [--dtypes fp32,bf16] [--rows 16,128,1024]
                                            [--models base:1x128,minilm:1x16,base:8x128,base:ragged32]
"""
import argparse
import copy
import statistics
import time

import torch

import fastbert
from fastbert import _C, dispatch  # noqa: F401  (_C: the fastbert_C ops, called directly here)
from fastbert.apps.bench import make_batch
from fastbert.apps.demo import minilm_dir
from fastbert.ops import _onednn
from fastbert.ops.dense import own_pack, own_reasons


def alternate(fns: dict, rounds: int = 25, min_s: float = 0.002) -> dict:
    """{name: median seconds a call}: each round times every fn in turn (order flipped every round)."""
    for fn in fns.values():
        fn()
    start = time.perf_counter()
    next(iter(fns.values()))()
    calls = max(1, int(min_s / max(time.perf_counter() - start, 1e-7)))
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gemms(dtype, rows_list):
    torch.manual_seed(0)
    for rows in rows_list:
        for h in (768, 384):
            for k, n, activation in ((h, 3 * h, "none"), (h, h, "none"), (h, 4 * h, "gelu"), (4 * h, h, "none")):
                x = torch.randn(rows, k).to(DTYPES[dtype])
                weight, bias = (torch.randn(n, k) * k**-0.5).to(DTYPES[dtype]), torch.randn(n).to(DTYPES[dtype])
                packed, blocked = own_pack(weight), _onednn.pack(weight, rows)
                out = torch.empty(rows, n, dtype=DTYPES[dtype])
                code = 1 if activation == "gelu" else 0
                ms = alternate({
                    "own": lambda: torch.ops.fastbert_C.dense_gemm(x, packed, n, k, bias, code, 0, out),
                    "onednn": lambda: _onednn.linear(x, blocked, bias, activation)})
                flop = 2 * rows * n * k
                print(f"{dtype} rows {rows:5d} k {k:4d} n {n:4d} {activation:4s}: own {ms['own'] * 1e6:8.1f} us "
                      f"({flop / ms['own'] / 1e9:4.0f} GFLOP/s), oneDNN {ms['onednn'] * 1e6:8.1f} us "
                      f"({flop / ms['onednn'] / 1e9:4.0f} GFLOP/s): {ms['onednn'] / ms['own']:.2f}x", flush=True)


def forwards(dtype, specs):
    """Each model three times, its linears' variant chosen as `onednn` or `fastbert` while its plans record
    (tuning's choice replaced, so the plans, and the one call a layer, stay on), or as tuning picks them
    op by op (`tuned`), then timed alternating."""
    real = dispatch._choose_variant
    for spec in specs:
        name, shape = spec.split(":")
        torch.manual_seed(0)
        if name == "minilm":
            base = fastbert.BertModel.from_pretrained(minilm_dir()).eval().to(DTYPES[dtype])
        else:
            base = fastbert.BertModel(fastbert.BertConfig.base()).eval().to(DTYPES[dtype])
        ids, mask = make_batch(shape, base.config.vocab_size)
        models, outputs = {}, {}
        for variant in ("onednn", "fastbert", "tuned"):
            model = copy.deepcopy(base)

            def chosen(op, backend, usable, key, args, variant=variant):
                if op in ("dense", "qkv_projection") and variant != "tuned":
                    return next(v for v in usable if v.name == variant)
                return real(op, backend, usable, key, args)

            dispatch._choose_variant = chosen
            try:
                with torch.inference_mode(), dispatch.record() as calls:
                    for _ in range(3):  # record the plan, build the layer programs, replay
                        outputs[variant] = model(ids, attention_mask=mask).last_hidden_state
            finally:
                dispatch._choose_variant = real
            ran = {c.variant for c in calls if c.op in ("dense", "qkv_projection")}
            assert variant == "tuned" or ran == {variant}, f"{variant} forward ran {ran}"
            if variant == "tuned":
                print(f"{spec} {dtype}: tuning picked " + ", ".join(sorted(
                    {f"{c.op}:{c.variant}" for c in calls if c.op in ("dense", "qkv_projection")})), flush=True)
            models[variant] = model
        diff = (outputs["fastbert"].float() - outputs["onednn"].float()).norm() / outputs["onednn"].float().norm()
        with torch.inference_mode():
            ms = alternate({v: lambda m=m: m(ids, attention_mask=mask) for v, m in models.items()}, rounds=21)
        print(f"{spec} {dtype}: own GEMM {ms['fastbert'] * 1e3:.2f} ms, oneDNN {ms['onednn'] * 1e3:.2f} ms: "
              f"{ms['onednn'] / ms['fastbert']:.2f}x (outputs differ by {diff:.1e} relative); tuned "
              f"{ms['tuned'] * 1e3:.2f} ms, {min(ms['onednn'], ms['fastbert']) / ms['tuned']:.2f}x the better one",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rows", default="16,128,1024")
    parser.add_argument("--models", default="base:1x128,minilm:1x16,base:8x128,base:ragged32")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for dtype in args.dtypes.split(","):
        reasons = own_reasons(dispatch.Facts(("cpu",), (DTYPES[dtype],)))
        if reasons:  # (its portable C++ form is for tests, not for timing)
            print(f"{dtype}: the own GEMM does not serve here: {'; '.join(reasons)}")
            continue
        gemms(dtype, [int(r) for r in args.rows.split(",") if r])
        forwards(dtype, [m for m in args.models.split(",") if m])
