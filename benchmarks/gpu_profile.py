"""Where fastbert's time goes on a GPU, for benchmarks/gpu_check.sh (the first H200 run, 2026-12-04, found
BERT-base 0.60-0.89x transformers sdpa in bf16 and 0.36-0.56x in fp32; RESULTS.md "twenty-second session"):

1. host cost a call: each op's public entry on each backend, torch's built-in beside it, called back to back
   without a sync on tiny tensors (so the launch queue, not the kernel, sets the pace);
2. one BERT-base forward: host issue time and synchronized time, and its encoder unmasked, eager and as a
   CUDA-graph replay (the kernels alone), for fastbert and transformers sdpa, fastbert's encoder also padded
   with a key mask and padding-free (whether each captures, and replays equal to eager), plus
   torch.profiler's top host ops of fastbert's forward;
3. the Triton GEMM's tiles against cuBLAS (torch F.linear) at BERT's linears, CUDA-event medians;
4. which C++ errors crash the process (the CUDA op's shape checks segfaulted in the first run) rather than
   raise: each case in a subprocess, its exit status printed.

    python3 benchmarks/gpu_profile.py [--parts 4,1,2]   (the order they run in: cheapest first; part 3 answered
                                                          its question on 2026-12-04 and runs only when named)
"""
import argparse
import copy
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import fastbert
from fastbert import dispatch, ops, padding
from fastbert.ops import encoder_layer


def host_us(fn, calls=200):
    """Median host time a call (µs) over 5 batches of `calls` back-to-back calls, no sync inside a batch."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def device_ms(fn, reps=30):
    """Median CUDA-event time (ms) of fn, 3 warm-ups first."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def forced(backend, op, fn):
    def run():
        with dispatch.use_backend(backend, op=op):
            return fn()
    return run


def part_host_cost():
    print("\n## 1. host cost a call (µs), tiny tensors, no sync")
    d = "cuda"
    x, r = torch.randn(8, 768, device=d, dtype=torch.bfloat16), torch.randn(8, 768, device=d, dtype=torch.bfloat16)
    w, b = torch.randn(768, device=d, dtype=torch.bfloat16), torch.randn(768, device=d, dtype=torch.bfloat16)
    lw = torch.randn(768, 768, device=d, dtype=torch.bfloat16)
    q = torch.randn(1, 12, 8, 64, device=d, dtype=torch.bfloat16)
    cases = {
        "bias_gelu": (lambda: ops.bias_gelu(x, b), lambda: F.gelu(x + b)),
        "add_layer_norm": (lambda: ops.add_layer_norm(x, r, w, b, 1e-12), lambda: F.layer_norm(x + r, (768,), w, b, 1e-12)),
        "dense": (lambda: ops.dense(x, lw, b), lambda: F.linear(x, lw, b)),
        "attention": (lambda: ops.attention(q, q, q), lambda: F.scaled_dot_product_attention(q, q, q)),
    }
    with torch.inference_mode():
        for op, (ours, theirs) in cases.items():
            row = [f"torch {host_us(theirs):.1f}"]
            for backend in ("cuda", "triton", "reference"):
                try:
                    row.append(f"{backend} {host_us(forced(backend, op, ours)):.1f}")
                except Exception as e:  # a backend without this op
                    row.append(f"{backend} n/a ({type(e).__name__})")
            print(f"{op:15s} " + " | ".join(row))


def part_forward(dtype):
    import transformers
    from fastbert.apps.bench import make_batch

    print(f"\n## 2. BERT-base {dtype} forward, 8x128 (ms)")
    torch.manual_seed(0)
    ours = fastbert.BertModel(fastbert.BertConfig.base()).eval()
    hf = transformers.BertModel._from_config(transformers.BertConfig(**ours.config.to_dict()), attn_implementation="sdpa")
    hf.load_state_dict(ours.state_dict(), strict=False)
    ids, mask = (t.cuda() for t in make_batch("8x128", ours.config.vocab_size))
    models = {"fastbert": ours.to("cuda", dtype), "hf-sdpa": hf.eval().to("cuda", dtype)}
    # The graph holds the encoder alone, unmasked: a whole forward reads values on the host (fastbert's id
    # range check, transformers' mask check), which a capture refuses.
    encoders = {"fastbert": lambda x: models["fastbert"].encoder(x)[0],
                "hf-sdpa": lambda x: models["hf-sdpa"].encoder(x).last_hidden_state}
    with torch.inference_mode():
        for name, m in models.items():
            fn = lambda m=m: m(input_ids=ids, attention_mask=mask).last_hidden_state  # noqa: E731
            issue = host_us(fn, calls=10) / 1e3
            synced = device_ms(fn)
            x = m.embeddings(input_ids=ids)
            eager = device_ms(lambda: encoders[name](x))
            try:
                encoders[name](x)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    encoders[name](x)
                replay = f"{device_ms(graph.replay):.2f}"
            except Exception as e:
                replay = f"capture failed ({type(e).__name__}: {str(e)[:120]})"
            print(f"{name:9s} forward: host issue {issue:.2f}, synchronized {synced:.2f} | encoder unmasked: "
                  f"eager {eager:.2f}, graph replay {replay}")
        # fastbert's encoder on the other two paths a CUDA-graph inference path would capture: padded with a
        # key mask, and padding-free (packed tokens, cu_seqlens; packing computed outside, as it reads the
        # mask on the host). Half the tokens masked out, so that packing applies.
        half = mask.clone()
        half[:, ids.shape[1] // 2:] = 0
        x = models["fastbert"].embeddings(input_ids=ids)
        packing = padding.packing(half.bool())
        paths = {"padded with mask": lambda: models["fastbert"].encoder(x, half.bool())[0],
                 "packed": lambda: models["fastbert"].encoder(padding.unpad(x, packing), half.bool(), False, False,
                                                          packing)[0]}
        for path, fn in paths.items():
            try:
                want = fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = fn()
                graph.replay()
                torch.cuda.synchronize()
                same = torch.equal(got, want)
                print(f"fastbert  encoder {path}: eager {device_ms(fn):.2f}, graph replay {device_ms(graph.replay):.2f}"
                      f" (replay equals eager: {same})")
            except Exception as e:
                print(f"fastbert  encoder {path}: capture failed ({type(e).__name__}: {str(e)[:160]})")
        from torch.profiler import ProfilerActivity, profile

        # The same forward with each layer's calls made op by op from Python instead of as one C++ call
        # (fastbert/ops/encoder_layer.py): a copy whose plans were built while no layer program could be made.
        op_by_op = copy.deepcopy(models["fastbert"])
        real = encoder_layer.program
        encoder_layer.program = lambda *_: None
        try:
            for _ in range(3):
                op_by_op(input_ids=ids, attention_mask=mask)
        finally:
            encoder_layer.program = real
        fn = lambda: op_by_op(input_ids=ids, attention_mask=mask).last_hidden_state  # noqa: E731
        print(f"fastbert  forward, layers op by op: host issue {host_us(fn, calls=10) / 1e3:.2f}, synchronized "
              f"{device_ms(fn):.2f}")
        with dispatch.record() as calls:
            models["fastbert"](input_ids=ids, attention_mask=mask)
        print("ran:", sorted({(c.op, c.backend) for c in calls}))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                models["fastbert"](input_ids=ids, attention_mask=mask)
            torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
    print(p.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))


def part_gemm_tiles():
    from fastbert.kernels import dense as triton_dense

    print("\n## 3. Triton GEMM tiles (BLOCK_M, N, K, warps, stages) against cuBLAS, CUDA-event medians (µs)")
    tiles = [None, (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
             (128, 256, 64, 8, 3)]
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in ((1024, 768, 2304), (1024, 768, 3072), (1024, 3072, 768), (4096, 768, 3072), (4096, 3072, 768)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            want = F.linear(x.double(), w.double(), b.double())
            row = [f"cuBLAS {device_ms(lambda: F.linear(x, w, b)) * 1e3:.0f}"]
            for t in tiles:
                try:
                    run = lambda t=t: triton_dense.dense(x, w, b, "none", out, tiles=t)  # noqa: E731
                    us = device_ms(run) * 1e3
                    out.fill_(float("nan"))
                    run()
                    err = float((out.double() - want).norm() / want.norm())
                    row.append(f"{t or 'default'} {us:.0f} (err {err:.1e})")
                except Exception as e:  # out of shared memory, say
                    row.append(f"{t} failed ({type(e).__name__})")
            print(f"{str(dtype):15s} {m}x{k}->{n}: " + " | ".join(row))


CRASH_CASES = {
    "torch's own check": "torch.mm(torch.randn(2, 3, device='cuda'), torch.randn(4, 5, device='cuda'))",
    "fastbert_C cpu check": "import fastbert._C; x = torch.randn(2, 8); w = torch.ones(7); "
                            "torch.ops.fastbert.add_layer_norm_cxx(x, x, w, w, 1e-5, 0.0, None)",
    # The two crashing CUDA checks format numbers into their messages (a std::string through an
    # ostringstream); the raising ones pass string literals only. These two format a number too.
    "fastbert_C cpu, number in msg": "import fastbert._C; x = torch.randn(2, 8); w = torch.ones(8); "
                                     "torch.ops.fastbert.add_layer_norm_cxx(x, x, w, w, 1e-5, 1.5, None)",
    "fastbert_C cuda, number in msg": "import fastbert._C; x = torch.randn(2, 8, device='cuda'); "
                                      "w = torch.ones(8, device='cuda'); "
                                      "torch.ops.fastbert.add_layer_norm_cxx(x, x, w, w, 1e-5, 1.5, None)",
    "fastbert_C cuda n > 8192": "import fastbert._C; x = torch.randn(2, 8193, device='cuda'); w = torch.ones(8193, device='cuda'); "
                                "torch.ops.fastbert.add_layer_norm_cxx(x, x, w, w, 1e-5, 0.0, None)",
    "fastbert_C cuda weight size": "import fastbert._C; x = torch.randn(2, 8, device='cuda'); w = torch.ones(7, device='cuda'); "
                                   "torch.ops.fastbert.add_layer_norm_cxx(x, x, w, w, 1e-5, 0.0, None)",
    "fastbert_C cuda head_dim 160": "import fastbert._C; q = torch.randn(1, 1, 4, 160, device='cuda'); "
                                    "torch.ops.fastbert.attention_cxx(q, q, q, None, None, 4, 0.1, 0.0, None)",
}


def part_crashes():
    print("\n## 4. C++ errors: raised (exit 0) or crashed (negative exit: the signal)")
    traced = False
    for name, code in CRASH_CASES.items():
        program = ("import torch, fastbert\ntry:\n    " + code.replace("; ", "\n    ")
                   + "\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0][:150])")
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        print(f"{name:30s} exit {run.returncode}: {(run.stdout or run.stderr).strip().splitlines()[-1:]}")
        if run.returncode < 0 and shutil.which("gdb") and not traced:  # where the first crash is: its frames
            traced = True
            try:
                gdb = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c",
                                      program], capture_output=True, text=True, timeout=45)
                print("\n".join("    " + line for line in gdb.stdout.splitlines() if line.startswith("#")))
            except subprocess.TimeoutExpired:
                print("    (gdb: no backtrace within 45 s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="4,1,2")
    parts = parser.parse_args().parts.split(",")
    functions = {"1": part_host_cost, "2": lambda: [part_forward(t) for t in (torch.bfloat16, torch.float32)],
                 "3": part_gemm_tiles, "4": part_crashes}
    if set(parts) - set(functions):
        parser.error(f"unknown parts {sorted(set(parts) - set(functions))} (known: 1, 2, 3, 4)")
    print(f"torch {torch.__version__} | {torch.cuda.get_device_name()}")
    for part in parts:
        try:
            functions[part]()
        except Exception as e:  # one part failing leaves the others' numbers
            print(f"part {part} failed: {type(e).__name__}: {e}")
