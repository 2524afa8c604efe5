"""csrc/cuda's kernels run on the CPU under an emulation of CUDA's execution model (tests/cuda_on_cpu:
each GPU thread a fiber, barriers for __syncthreads and shuffles), so their logic is tested on every
machine, GPU or not. `build(directory)` compiles them with the host C++ compiler; the wrappers below take
CPU tensors and mirror csrc/cuda/bindings.cpp's calls."""
from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "cuda_on_cpu"
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # launchers.h's DType


def _patched(source: str) -> str:
    """The two constructs a C++ compiler cannot take: dynamic shared memory and the launch syntax."""
    source = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];", r"\1* \2 = ::emulate::dynamic_shared<\1>();", source)
    return re.sub(r"([\w:]+(?:<[^<>;]*>)?)<<<(.*?)>>>\(", r"::emulate::launch(\1, \2, ", source)


def compiler_missing() -> str | None:
    """Why the emulated kernels cannot be built here, or None (g++ 12 or newer: C++20 and _Float16)."""
    if not shutil.which("g++"):
        return "g++ is not on PATH"
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    return None if int(version.split(".")[0] or 0) >= 12 else f"g++ {version} is older than 12 (no _Float16)"


def build(directory: Path) -> ctypes.CDLL:
    """Compiles csrc/cuda/*.cu (patched copies) with the emulator and the C entry points into a library."""
    sources = directory / "csrc"
    (sources / "cuda").mkdir(parents=True, exist_ok=True)
    (sources / "cpu").mkdir(exist_ok=True)
    shutil.copy(ROOT / "csrc" / "cpu" / "dropout.h", sources / "cpu")
    for path in (ROOT / "csrc" / "cuda").iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            (sources / "cuda" / path.name).write_text(_patched(path.read_text()))
    units = [*sorted((sources / "cuda").glob("*.cu")), SHIM / "driver.cpp"]
    flags = ["-std=c++20", "-O1", "-fPIC", "-w", f"-I{SHIM}", f"-I{sources / 'cuda'}"]

    def compile_unit(unit: Path) -> Path:
        obj = directory / (unit.stem + ".o")
        cmd = ["g++", *flags, "-x", "c++", "-c", str(unit), "-o", str(obj)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_unit, units))
    library = directory / "libemulated_cuda.so"
    cmd = ["g++", "-shared", *map(str, objects), "-o", str(library)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return _declare(ctypes.CDLL(str(library)))


class AttentionBatch(ctypes.Structure):
    _fields_ = [("sequences", ctypes.c_int64), ("heads", ctypes.c_int64), ("tokens", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("key_mask", ctypes.c_void_p), ("cu_seqlens", ctypes.c_void_p)]


class AttentionTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("seq", ctypes.c_int64), ("head", ctypes.c_int64), ("row", ctypes.c_int64)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    batch, tensors, f32 = ctypes.POINTER(AttentionBatch), ctypes.POINTER(AttentionTensor), ctypes.c_float
    f64 = ctypes.c_double  # dropout_p
    lib.emulated_attention_fwd.argtypes = [ctypes.c_int, batch, tensors, ctypes.c_void_p, f32, f64, ctypes.c_uint64]
    lib.emulated_attention_bwd_workspace_bytes.argtypes = [batch]
    lib.emulated_attention_bwd_workspace_bytes.restype = ctypes.c_size_t
    lib.emulated_attention_bwd.argtypes = [ctypes.c_int, batch, tensors, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_size_t, f32, f64, ctypes.c_uint64]
    i64, ptr, ptrs = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    lib.emulated_add_layer_norm_fwd.argtypes = [ctypes.c_int, ptrs, ptr, ptr, i64, i64, f32, f64, ctypes.c_uint64]
    lib.emulated_add_layer_norm_bwd_workspace_bytes.argtypes = [i64, i64, ctypes.c_int]
    lib.emulated_add_layer_norm_bwd_workspace_bytes.restype = ctypes.c_size_t
    lib.emulated_add_layer_norm_bwd.argtypes = [ctypes.c_int, ptrs, ptr, ptr, ptr, ptr, ptr, ctypes.c_size_t, i64, i64,
                                                f64, ctypes.c_uint64, ctypes.c_int]
    lib.emulated_bias_gelu_fwd.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ctypes.c_bool]
    lib.emulated_bias_gelu_bwd.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_bool]
    return lib


def _pointers(*ts):
    return (ctypes.c_void_p * len(ts))(*(None if t is None else t.data_ptr() for t in ts))


GUARD = 64  # NaN elements on either side of every float tensor a kernel gets


class Guards:
    """The float tensors of one kernel call, each inside a NaN buffer with GUARD elements on either side: a
    read past a tensor brings NaN into the results (which the tests reject), a write past one shows in
    check(). Outputs start as NaN too (poisoned)."""

    def __init__(self):
        self.buffers = []

    def output(self, shape, dtype=torch.float32):
        numel = math.prod(shape)
        buffer = torch.full((numel + 2 * GUARD,), float("nan"), dtype=dtype)
        self.buffers.append(buffer)
        return buffer[GUARD:GUARD + numel].view(shape)

    def input(self, t):
        return None if t is None else self.output(t.shape, t.dtype).copy_(t)

    def check(self, what: str) -> None:
        for buffer in self.buffers:
            bands = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
            assert bool(bands.isnan().all()), f"emulated {what} wrote past the end of a tensor"


SM_COUNT = 3  # the GPU's multiprocessor count, which sizes add_layer_norm's backward grid: a few, so rows share blocks


def add_layer_norm_function(lib: ctypes.CDLL):
    """An autograd function (x, residual, weight, bias, eps, dropout_p, seed) -> LayerNorm(dropout(x) +
    residual) * weight + bias over rows of a 2-d x, on the CUDA kernels."""

    class EmulatedCudaAddLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, weight, bias, eps, dropout_p, seed):
            guards = Guards()
            x, residual, weight, bias = (guards.input(t) for t in (x, residual, weight, bias))
            rows, n = x.shape
            out = guards.output(x.shape, x.dtype)
            mean, rstd = (guards.output((rows,)) for _ in range(2))
            _check(lib.emulated_add_layer_norm_fwd(DTYPES[x.dtype], _pointers(x, residual, weight, bias, out),
                                                   mean.data_ptr(), rstd.data_ptr(), rows, n, eps, dropout_p, seed),
                   "add_layer_norm_fwd")
            guards.check("add_layer_norm_fwd")
            ctx.save_for_backward(x, residual, weight, mean, rstd)
            ctx.dropout_p, ctx.seed = dropout_p, seed
            return out

        @staticmethod
        def backward(ctx, grad):
            guards = Guards()
            grad, x, residual, weight, mean, rstd = (guards.input(t) for t in (grad, *ctx.saved_tensors))
            rows, n = x.shape
            grad_h = guards.output(x.shape, x.dtype)
            grad_x = guards.output(x.shape, x.dtype) if ctx.dropout_p > 0 else None
            grad_weight, grad_bias = (guards.output((n,)) for _ in range(2))
            size = lib.emulated_add_layer_norm_bwd_workspace_bytes(rows, n, SM_COUNT)
            workspace = guards.output((size // 4,))
            _check(lib.emulated_add_layer_norm_bwd(DTYPES[x.dtype], _pointers(grad, x, residual, weight, grad_h, grad_x),
                                                   mean.data_ptr(), rstd.data_ptr(), grad_weight.data_ptr(),
                                                   grad_bias.data_ptr(), workspace.data_ptr(), size, rows, n,
                                                   ctx.dropout_p, ctx.seed, SM_COUNT), "add_layer_norm_bwd")
            guards.check("add_layer_norm_bwd")
            return (grad_h if grad_x is None else grad_x), grad_h, grad_weight.to(x.dtype), grad_bias.to(x.dtype), \
                None, None, None

    return EmulatedCudaAddLayerNorm.apply


def bias_gelu_function(lib: ctypes.CDLL):
    """An autograd function (x, bias, approximate) -> gelu(x + bias) over rows of x's last dimension, on the
    CUDA kernels."""

    class EmulatedCudaBiasGelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, bias, approximate):
            guards = Guards()
            x, bias = guards.input(x), guards.input(bias)
            out = guards.output(x.shape, x.dtype)
            n = x.shape[-1]
            _check(lib.emulated_bias_gelu_fwd(DTYPES[x.dtype], x.data_ptr(), bias.data_ptr(), out.data_ptr(),
                                              x.numel() // n, n, approximate == "tanh"), "bias_gelu_fwd")
            guards.check("bias_gelu_fwd")
            ctx.save_for_backward(x, bias)
            ctx.approximate = approximate
            return out

        @staticmethod
        def backward(ctx, grad):
            guards = Guards()
            grad, x, bias = (guards.input(t) for t in (grad, *ctx.saved_tensors))
            grad_x, n = guards.output(x.shape, x.dtype), x.shape[-1]
            _check(lib.emulated_bias_gelu_bwd(DTYPES[x.dtype], grad.data_ptr(), x.data_ptr(), bias.data_ptr(),
                                              grad_x.data_ptr(), x.numel() // n, n, ctx.approximate == "tanh"),
                   "bias_gelu_bwd")
            guards.check("bias_gelu_bwd")
            return grad_x, grad_x.reshape(-1, n).sum(0, dtype=torch.float32).to(bias.dtype), None  # as ops/bias_gelu.py

    return EmulatedCudaBiasGelu.apply


def _tensors(*ts):
    """bindings.cpp's attn_tensor for each: [B, heads, S, d] or [T, heads, d]."""
    return (AttentionTensor * len(ts))(*(
        AttentionTensor(t.data_ptr(), *((t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4
                                        else (0, t.stride(1), t.stride(0)))) for t in ts))


def _batch(q, key_mask, cu_seqlens):
    """bindings.cpp's attn_batch; the tensors it points into are the caller's to keep alive."""
    if q.dim() == 4:
        return AttentionBatch(q.shape[0], q.shape[1], q.shape[2], q.shape[3],
                              None if key_mask is None else key_mask.data_ptr(), None)
    return AttentionBatch(cu_seqlens.numel() - 1, q.shape[1], q.shape[0], q.shape[2], None, cu_seqlens.data_ptr())


def _check(code: int, what: str) -> None:
    assert code == 0, f"emulated {what}: cudaError {code}"


def attention_function(lib: ctypes.CDLL):
    """An autograd function (q, k, v, key_mask, cu_seqlens, scale, dropout_p, seed) -> out that runs the
    CUDA kernels forward and backward: key_mask a bool [B, S] or None for q, k, v [B, heads, S, d];
    cu_seqlens int32 [B + 1] for q, k, v [T, heads, d]."""

    class EmulatedCudaAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, key_mask, cu_seqlens, scale, dropout_p, seed):
            guards = Guards()
            q, k, v = (guards.input(t) for t in (q, k, v))
            mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
            cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()
            out = guards.output(q.shape, q.dtype)
            lse = guards.output(q.shape[:-1] if q.dim() == 4 else (q.shape[1], q.shape[0]))
            batch = _batch(q, mask, cu)
            _check(lib.emulated_attention_fwd(DTYPES[q.dtype], ctypes.byref(batch), _tensors(q, k, v, out),
                                              lse.data_ptr(), scale, dropout_p, seed), "attention_fwd")
            guards.check("attention_fwd")
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mask, ctx.cu, ctx.scale, ctx.dropout_p, ctx.seed = mask, cu, scale, dropout_p, seed
            return out

        @staticmethod
        def backward(ctx, grad):
            guards = Guards()
            grad, q, k, v, out, lse = (guards.input(t) for t in (grad, *ctx.saved_tensors))
            dq, dk, dv = (guards.output(q.shape, q.dtype) for _ in range(3))
            batch = _batch(q, ctx.mask, ctx.cu)
            size = lib.emulated_attention_bwd_workspace_bytes(ctypes.byref(batch))
            workspace = guards.output((size // 4,))  # NaN, as the GPU's is garbage
            _check(lib.emulated_attention_bwd(DTYPES[q.dtype], ctypes.byref(batch), _tensors(grad, q, k, v, out, dq, dk, dv),
                                              lse.data_ptr(), workspace.data_ptr(), size, ctx.scale, ctx.dropout_p,
                                              ctx.seed), "attention_bwd")
            guards.check("attention_bwd")
            return dq, dk, dv, None, None, None, None, None

    return EmulatedCudaAttention.apply
