"""bias_gelu in Triton: y = gelu(x + bias), exact (erf) or tanh-approximated, forward and backward.

Three layers: jit kernels, host functions that launch them (`bias_gelu_forward`, `bias_gelu_backward`),
and nothing else: which backend runs is fastbert.dispatch's business, the torch.library op lives in
fastbert/ops/bias_gelu.py. Arithmetic is fp32 whatever the input dtype; outputs are in the input dtype.
The bias gradient is reduced in fp32: every program sums its rows' dx into one row of a [G, N] fp32
buffer, and the host sums those G rows.

Host functions write into outputs the caller allocated (kernels/_launch.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastbert.kernels._launch import on_device_of

SQRT_1_2 = tl.constexpr(1.0 / math.sqrt(2.0))  # erf form: gelu(z) = z * Phi(z), Phi(z) = (1 + erf(z / sqrt 2)) / 2
INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))  # phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
SQRT_2_PI = tl.constexpr(math.sqrt(2.0 / math.pi))  # tanh form: u = sqrt(2/pi) (z + 0.044715 z^3)
TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def gelu(z, TANH: tl.constexpr):
    """gelu(z) of an fp32 block."""
    if TANH:
        # 0.5 z (1 + tanh(u)) = z * sigmoid(2u): no tanh needed, stable for any u.
        u = SQRT_2_PI * (z + TANH_CUBIC * z * z * z)
        return z * tl.sigmoid(2.0 * u)
    else:
        return 0.5 * z * (1.0 + tl.erf(z * SQRT_1_2))


@triton.jit
def gelu_grad(z, TANH: tl.constexpr):
    """d gelu(z) / dz of an fp32 block."""
    if TANH:
        u = SQRT_2_PI * (z + TANH_CUBIC * z * z * z)
        s = tl.sigmoid(2.0 * u)  # = (1 + tanh u) / 2; (1 - tanh^2 u) / 2 = 2 s (1 - s)
        slope = 2.0 * s * (1.0 - s)  # 0 where s saturates; z^2 is inf past |z| ~ 1.8e19: 0, not 0 * inf = NaN
        return s + tl.where(slope == 0.0, 0.0, z * slope * SQRT_2_PI * (1.0 + 3.0 * TANH_CUBIC * z * z))
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * SQRT_1_2))
        pdf = tl.exp(-0.5 * z * z) * INV_SQRT_2PI
        return cdf + z * pdf


@triton.jit
def _bias_gelu_forward_kernel(
    Y_ptr,  # out: gelu(x + bias), [n_rows, n_cols], input dtype, rows Y_row_stride apart
    Y_row_stride,  # elements between rows of Y
    X_ptr,  # x, [n_rows, n_cols], rows X_row_stride apart (columns contiguous)
    X_row_stride,  # elements between rows of X
    B_ptr,  # bias, [n_cols], contiguous
    n_rows,  # rows of x (every leading dimension flattened)
    n_cols,  # N, the last dimension
    TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program (a power of two; the tail is masked)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)

    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = gelu(x + b[None, :], TANH)
    tl.store(Y_ptr + rows[:, None] * Y_row_stride + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_backward_kernel(
    DX_ptr,  # out: dL/dx, [n_rows, n_cols], input dtype, contiguous
    DB_partial_ptr,  # out: fp32 [G, n_cols], row g = sum of dx over the rows program (g, *) visited
    DY_ptr,  # dL/dy, [n_rows, n_cols], rows DY_row_stride apart
    DY_row_stride,  # elements between rows of DY
    X_ptr,  # x saved from the forward, [n_rows, n_cols], rows X_row_stride apart
    X_row_stride,  # elements between rows of X
    B_ptr,  # bias, [n_cols], contiguous
    n_rows,  # rows of x
    n_cols,  # N, the last dimension
    TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK_M: tl.constexpr,  # rows per step of a program's loop
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Grid (G, column blocks): program (g, j) walks row blocks g, g + G, g + 2G, ... of column block j.
    group = tl.program_id(0)
    n_groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(group * BLOCK_M, n_rows, n_groups * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + rows[:, None] * DY_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = dy * gelu_grad(x + b[None, :], TANH)  # masked elements: dy = 0, so dx = 0
        tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    tl.store(DB_partial_ptr + group.to(tl.int64) * n_cols + cols, db, mask=col_mask)


# ------------------------------------------------------------------------------------------- host


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., N] -> [rows, N] with contiguous columns (a view where possible)."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = min(max(1, 4096 // block_n), triton.next_power_of_2(n_rows))
    return block_m, block_n


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool, y: torch.Tensor) -> torch.Tensor:
    """y (contiguous, x's shape and dtype) = gelu(x + bias); x [..., N], bias [N]."""
    n_cols = x.shape[-1]
    x2 = _rows(x, n_cols)
    n_rows = x2.shape[0]
    if y.numel() == 0:
        return y
    block_m, block_n = _blocks(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    with on_device_of(x):
        _bias_gelu_forward_kernel[grid](
            y, n_cols, x2, x2.stride(0), bias.contiguous(), n_rows, n_cols,
            TANH=tanh, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return y


def bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool, dx: torch.Tensor,
                       dbias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (contiguous, x's shape and dtype) = dL/dx and dbias (bias's shape and dtype) = dL/dbias,
    reduced in fp32, from dL/dy `grad`."""
    n_cols = x.shape[-1]
    x2, dy = _rows(x, n_cols), _rows(grad, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return dx, dbias.zero_()
    block_m, block_n = _blocks(n_rows, n_cols)
    col_blocks = triton.cdiv(n_cols, block_n)
    row_blocks = triton.cdiv(n_rows, block_m)
    if x.is_cuda:  # enough programs to fill the GPU, few enough that the partial sums stay small
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        groups = min(row_blocks, max(1, 4 * sms // col_blocks))
    else:  # the interpreter: programs run one after another, fewer is faster
        groups = min(row_blocks, 4)
    db_partial = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)  # every row written
    with on_device_of(x):
        _bias_gelu_backward_kernel[(groups, col_blocks)](
            dx, db_partial, dy, dy.stride(0), x2, x2.stride(0), bias.contiguous(), n_rows, n_cols,
            TANH=tanh, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return dx, dbias.copy_(db_partial.sum(0))
