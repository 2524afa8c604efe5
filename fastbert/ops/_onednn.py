"""oneDNN linear from torch's own build: prepacked weights and fused bias / GELU post-ops.

On some CPUs oneDNN's packed GEMM beats torch's default (MKL) F.linear, and it applies bias and GELU
inside the GEMM's epilogue. A packed weight is a copy in oneDNN's blocked layout: whoever packs it
owns it (fastbert.ops.prepared.PreparedWeights on the module), never a cache keyed by a tensor's
identity. oneDNN has no autograd: dense's onednn kernel pair has its own backward (qkv_projection's cpu
path runs on that pair).
"""
from __future__ import annotations

import torch

from fastbert.ops import _alloc

POST_OPS = {"none": ("none", [None], ""), "gelu": ("gelu", [None], "none"), "gelu_tanh": ("gelu", [None], "tanh")}


def missing(namespace: str = "mkldnn", names=("_linear_pointwise", "_reorder_linear_weight")) -> list[str]:
    """Why oneDNN's ops torch.ops.<namespace>.<names> (default: the float linear's) cannot be used from
    this torch build; empty when they can."""
    if not torch.backends.mkldnn.is_available():
        return ["this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"]
    for name in names:
        if not hasattr(getattr(torch.ops, namespace), name):
            return [f"this torch build lacks torch.ops.{namespace}.{name}"]
    return []


def dtype_missing(dtypes) -> list[str]:
    """Why oneDNN's float linear cannot run `dtypes` on this CPU: it has bfloat16 kernels only with
    AVX-512 or AMX (on an AVX2-only CPU it fails to create the primitive), float16 ones only with
    avx512_fp16 or AMX-FP16; empty when it can."""
    if torch.bfloat16 in dtypes and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ["oneDNN has no bfloat16 GEMM on this CPU (it needs AVX-512 or AMX; "
                "torch.ops.mkldnn._is_mkldnn_bf16_supported() is False)"]
    if torch.float16 in dtypes and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return ["oneDNN has no float16 GEMM on this CPU (it needs avx512_fp16 or AMX-FP16; "
                "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)"]
    return []


def pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """`weight` [N, K] copied into oneDNN's blocked layout (packed for rows_hint rows; serves any)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), max(rows_hint, 1))


def _overlapping(t: torch.Tensor) -> bool:
    """Do two elements of the 2-D `t` share memory? (A layout with gaps, a slice's, is fine for oneDNN.)"""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)  # inner first
    return bool(dims) and (dims[0][0] == 0 or len(dims) == 2 and dims[1][0] < dims[0][0] * dims[0][1])


def linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none",
           per_thread: bool = False):
    """activation(x2d @ weight.T + bias) for x2d [M, K] in one oneDNN call over all threads, or with
    `per_thread` one single-threaded call per thread on its share of the rows (fastbert._C's
    dense_onednn_rows); `weight` [N, K] as `pack` made it, or a plain tensor."""
    attr, scalars, algorithm = POST_OPS[activation]
    # oneDNN reads the bias as a dense vector whatever its strides (a strided bias gave wrong sums), and
    # refuses a weight whose rows or columns overlap in memory (an expanded or as_strided view).
    bias = None if bias is None else bias.contiguous()
    if not weight.is_mkldnn and not weight.is_contiguous() and _overlapping(weight):  # (packed: opaque strides)
        weight = weight.contiguous()
    if not per_thread:
        return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, attr, scalars, algorithm)
    out = _alloc.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype, device=x2d.device)
    torch.ops.fastbert_C.dense_onednn_rows(x2d, weight, bias, attr, algorithm, out)
    return out
