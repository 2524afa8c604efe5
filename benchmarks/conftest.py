"""Kernel suites (bench_<op>.py, one per op): each fastbert backend that can run here, side by side with the
naive reference and torch's built-in, in one pytest-benchmark run (medians; compare within a group).

    .venv/bin/python -m pytest benchmarks -q --benchmark-columns=median,iqr,rounds --benchmark-group-by=group
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # the interpreter is a correctness tool, not a contender

import torch  # noqa: E402

from fastbert import dispatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE == "cuda" else [])


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def fastbert_contenders(op, public):
    """(name, fn) for each backend that can run `op` on this machine's DEVICE tensors, forced."""
    out = []
    for backend in ("cpu", "triton", "cuda"):
        impl = dispatch.implementations(op).get(backend)
        if impl is not None and DEVICE in impl.support.devices and not dispatch.machine_reasons(backend):
            def run(*args, backend=backend, **kwargs):
                with dispatch.use_backend(backend, op=op):
                    return public(*args, **kwargs)
            out.append((f"fastbert-{backend}", run))
    return out


def time_it(benchmark, group, fn, *args, **kwargs):
    benchmark.group = group

    def run():
        fn(*args, **kwargs)
        sync()  # GPU launches are asynchronous: time the work, not the launch

    with torch.inference_mode():
        benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=2)
