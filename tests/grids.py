"""Shared test grids: backends, dtypes, and which combinations this machine can run."""
import pytest
import torch

from fastbert import dispatch

KERNEL_BACKENDS = ("cuda", "triton", "cpu")  # reference is the ground truth, tested through the model
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def device_for(backend: str) -> str:
    if backend == "cuda" or (backend == "triton" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def skip_unless_runnable(op: str, backend: str, dtype: torch.dtype) -> str:
    """Skip (with the reason) what this machine cannot run; return the device to test on."""
    impl = dispatch.implementations(op).get(backend)
    if impl is None:
        pytest.skip(f"{backend} has no {op} implementation yet")
    reasons = dispatch.machine_reasons(backend)
    if reasons:
        pytest.skip(f"{backend} unavailable: {'; '.join(reasons)}")
    if dtype not in impl.support.dtypes:
        pytest.skip(f"{backend} {op} does not support {dtype}")
    device = device_for(backend)
    if device not in impl.support.devices:
        pytest.skip(f"{backend} {op} does not run on {device}")
    if backend == "triton" and device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 is wrong under the Triton interpreter (arithmetic gives NaN, tl.dot garbage); runs on a GPU")
    return device


def skip_unless_variant(op: str, variant: str, dtype: torch.dtype, **flags) -> str:
    """skip_unless_runnable for the cpu backend, and skip where its `variant` cannot serve `dtype` (and a call
    with dispatch.Facts `flags`) on this machine (dispatch never picks it then: oneDNN's bfloat16 GEMM on an
    AVX2-only CPU, a GELU-only variant on a call without GELU); the device."""
    device = skip_unless_runnable(op, "cpu", dtype)
    why = dispatch.usable_variants(op, "cpu", dispatch.Facts((device,), (dtype,), **flags))[1]
    if why.get(variant):
        pytest.skip(f"{variant}: {'; '.join(why[variant])}")
    return device
