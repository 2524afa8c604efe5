"""Triton GEMM with a fused epilogue: y = act(x @ w.T + b), for `dense`, and through gemm_epilogue for
`qkv_projection` (kernels/qkv_projection.py).

The epilogue adds the bias, applies bias_gelu's GELU (erf or tanh form) and stores each output column where the
caller's layout wants it: row-major [M, N] for dense, or straight into head-major q, k, v buffers for
the QKV projection (column n of [M, 3H] is (which of q/k/v, head, dim); row m is (batch, position)),
so no transpose or copy follows the GEMM. Accumulation is fp32; fp32 inputs use IEEE fp32 dots
(TF32 would miss fastbert's fp32 tolerance).
"""
import triton
import triton.language as tl

from fastbert.kernels._launch import on_device_of
from fastbert.kernels.bias_gelu import gelu

ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _gemm_epilogue_kernel(
    x_ptr,  # [M, K] input rows, row stride stride_xm, unit column stride
    w_ptr,  # [N, K] weight (PyTorch linear layout), row stride stride_wn, unit column stride
    b_ptr,  # [N] bias (read only when HAS_BIAS)
    y_ptr,  # output base; element (m, n) lives at the offset the layout arguments below give
    M, N, K,
    stride_xm, stride_wn,
    rows_per_group,  # rows m split as (group = m // rows_per_group, r = m % rows_per_group)
    stride_group, stride_row,  # output strides of group and r
    cols_per_part, cols_per_head,  # columns n split as (part = n // cols_per_part, head, dim)
    stride_part, stride_head,  # output strides of part and head (dim has stride 1)
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64: offsets (row x stride) pass 2^31 from M = 699k rows at N = 3072, where int32 wraps
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0:
        acc = gelu(acc, ACTIVATION == 2)
    out_rows = (rm // rows_per_group) * stride_group + (rm % rows_per_group) * stride_row
    part = rn // cols_per_part
    within = rn % cols_per_part
    out_cols = part * stride_part + (within // cols_per_head) * stride_head + within % cols_per_head
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + out_rows[:, None] + out_cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _tiles(x):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if x.is_cuda:
        return 64, 64, 32, 4, 3
    return 32, 32, 32, 1, 1  # the interpreter: small tiles keep it quick


def gemm_epilogue(x2d, weight, bias, out, activation, rows_per_group, stride_group, stride_row,
                  cols_per_part, cols_per_head, stride_part, stride_head, tiles=None):
    """act(x2d [M, K] @ weight [N, K].T + bias) into `out`, element (m, n) at the offset the row split
    (rows_per_group, stride_group, stride_row) and column split (cols_per_part, cols_per_head, stride_part,
    stride_head) give: the kernel's layout arguments. `tiles` overrides _tiles' choice (benchmarks)."""
    m, k = x2d.shape
    n = weight.shape[0]
    block_m, block_n, block_k, warps, stages = tiles or _tiles(x2d)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    with on_device_of(x2d):
        _gemm_epilogue_kernel[grid](
            x2d, weight, bias if bias is not None else weight, out, m, n, k, x2d.stride(0), weight.stride(0),
            rows_per_group, stride_group, stride_row, cols_per_part, cols_per_head, stride_part, stride_head,
            HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], IEEE=x2d.dtype.is_floating_point and x2d.element_size() == 4,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )


def dense(x2d, weight, bias, activation, out, tiles=None):
    """out [M, N] (contiguous) = act(x2d [M, K] @ weight [N, K].T + bias [N])."""
    m, n = x2d.shape[0], weight.shape[0]
    gemm_epilogue(x2d, weight, bias, out, activation, rows_per_group=max(m, 1), stride_group=0, stride_row=n,
                  cols_per_part=n, cols_per_head=n, stride_part=0, stride_head=0, tiles=tiles)
    return out
