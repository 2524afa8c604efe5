"""add_layer_norm in Triton: y = layer_norm(dropout(x) + residual) over the last dim, forward and backward.

Three layers: jit kernels, host functions that launch them (`add_layer_norm_forward`,
`add_layer_norm_backward`), and nothing else: which backend runs is fastbert.dispatch's business, the
torch.library op lives in fastbert/ops/add_layer_norm.py.

One program per row (BLOCK = the next power of two of N, the tail masked), so N up to MAX_N. Statistics
and accumulation in fp32; mean and rstd are saved in fp32; y, dx and dresidual in the input dtype.

Dropout draws nothing that must be saved: element (row, col) is kept when
tl.rand(seed, row * N + col) >= p, and the backward regenerates exactly that mask from the same seed
(an int64 tensor of one element, read on the device, so a compiled graph draws a fresh one per call).
Kept elements are scaled by 1 / (1 - p), as torch.nn.functional.dropout does.

dweight and dbias: each backward program walks a contiguous chunk of rows, accumulates dy * xhat and
dy in fp32 registers, and writes one row of a [G, N] fp32 buffer; the host sums the G rows.

Host functions write into outputs the caller allocated (kernels/_launch.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.kernels._launch import on_device_of

MAX_N = 65536  # one row must fit one program's block


@triton.jit
def _dropout_keep(seed, row, cols, n_cols, p):
    """True where element (row, cols) survives dropout with probability 1 - p; the same in fwd and bwd."""
    return tl.rand(seed, cols.to(tl.int64) + row * n_cols) >= p  # int64 offsets: no wrap on big tensors


@triton.jit
def _add_layer_norm_forward_kernel(
    Y_ptr,  # out: layer_norm(h) * w + b, [n_rows, n_cols], input dtype, contiguous
    Mean_ptr,  # out: fp32 [n_rows], mean of h per row
    Rstd_ptr,  # out: fp32 [n_rows], 1 / sqrt(var(h) + eps) per row
    X_ptr,  # x (dropped out), [n_rows, n_cols], rows X_row_stride apart (columns contiguous)
    X_row_stride,  # elements between rows of X
    R_ptr,  # residual, [n_rows, n_cols], rows R_row_stride apart
    R_row_stride,  # elements between rows of R
    W_ptr,  # weight, [n_cols], contiguous
    B_ptr,  # bias, [n_cols], contiguous
    Seed_ptr,  # int64 [1], the dropout seed (read only when HAS_DROPOUT)
    n_cols,  # N, the normalized (last) dimension
    eps,  # added to the variance
    p,  # dropout probability
    scale,  # 1 / (1 - p), applied to kept elements
    HAS_DROPOUT: tl.constexpr,  # p > 0
    BLOCK: tl.constexpr,  # next power of two >= n_cols
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols

    x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R_ptr + row * R_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _dropout_keep(tl.load(Seed_ptr), row, cols, n_cols, p)
        x = tl.where(keep, x * scale, 0.0)
    h = x + r  # tail: 0

    mean = tl.sum(h, axis=0) / n_cols
    if tl.abs(mean) == float("inf"):  # the row's sum left fp32's range (a row of ~1e36): sum it scaled by 2^-72
        mean = tl.sum(h * 2.117582368135751e-22, axis=0) / n_cols * 4.722366482869645e21
    centered = tl.where(mask, h - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    if var == float("inf"):
        # The squares left fp32's range (deviations past ~1e17 in a row of 768), and rstd came out 0: the row
        # was the bias alone. LayerNorm is scale-invariant: the sum again on the deviations times 2^-72 (exact;
        # what underflows is negligible beside a deviation that overflowed, and so is eps).
        small = centered * 2.117582368135751e-22
        rstd = 2.117582368135751e-22 / tl.sqrt(tl.sum(small * small, axis=0) / n_cols)

    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centered * rstd * w + b
    tl.store(Y_ptr + row * n_cols + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(Mean_ptr + row, mean)
    tl.store(Rstd_ptr + row, rstd)


@triton.jit
def _add_layer_norm_backward_kernel(
    DH_ptr,  # out: dL/dresidual = dL/dh, [n_rows, n_cols], input dtype, contiguous
    DX_ptr,  # out: dL/dx = dL/dh * keep * scale, [n_rows, n_cols], contiguous (written only when HAS_DROPOUT)
    DW_partial_ptr,  # out: fp32 [G, n_cols], row g = sum of dy * xhat over program g's rows
    DB_partial_ptr,  # out: fp32 [G, n_cols], row g = sum of dy over program g's rows
    DY_ptr,  # dL/dy, [n_rows, n_cols], rows DY_row_stride apart (columns contiguous)
    DY_row_stride,  # elements between rows of DY
    X_ptr,  # x saved from the forward (before dropout), [n_rows, n_cols], rows X_row_stride apart
    X_row_stride,  # elements between rows of X
    R_ptr,  # residual saved from the forward, [n_rows, n_cols], rows R_row_stride apart
    R_row_stride,  # elements between rows of R
    W_ptr,  # weight, [n_cols], contiguous
    Mean_ptr,  # fp32 [n_rows], from the forward
    Rstd_ptr,  # fp32 [n_rows], from the forward
    Seed_ptr,  # int64 [1], the forward's dropout seed (read only when HAS_DROPOUT)
    n_rows,  # rows of x
    n_cols,  # N, the normalized dimension
    rows_per_program,  # program g handles rows [g * rows_per_program, (g + 1) * rows_per_program)
    p,  # dropout probability
    scale,  # 1 / (1 - p)
    HAS_DROPOUT: tl.constexpr,  # p > 0
    BLOCK: tl.constexpr,  # next power of two >= n_cols
):
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(Seed_ptr)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)

    row_start = group.to(tl.int64) * rows_per_program  # int64 bounds: an int64 loop variable
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R_ptr + row * R_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + row * DY_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, row, cols, n_cols, p)
            x = tl.where(keep, x * scale, 0.0)
        mean = tl.load(Mean_ptr + row)
        rstd = tl.load(Rstd_ptr + row)

        xhat = tl.where(mask, (x + r - mean) * rstd, 0.0)
        wdy = w * dy  # tail: 0
        c1 = tl.sum(xhat * wdy, axis=0) / n_cols
        c2 = tl.sum(wdy, axis=0) / n_cols
        dh = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DH_ptr + row * n_cols + cols, dh.to(DH_ptr.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dx = tl.where(keep, dh * scale, 0.0)
            tl.store(DX_ptr + row * n_cols + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy

    tl.store(DW_partial_ptr + group.to(tl.int64) * n_cols + cols, dw, mask=mask)
    tl.store(DB_partial_ptr + group.to(tl.int64) * n_cols + cols, db, mask=mask)


# ------------------------------------------------------------------------------------------- host


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., N] -> [rows, N] with contiguous columns (a view where possible)."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _settings(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of n_cols elements."""
    if n_cols > MAX_N:
        raise ValueError(f"add_layer_norm (triton): the last dimension is {n_cols}, at most {MAX_N} is supported")
    block = triton.next_power_of_2(n_cols)
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32
    return block, num_warps


def _dropout_args(dropout_p: float, seed: torch.Tensor | None, dummy: torch.Tensor):
    if dropout_p > 0:
        if seed is None or seed.numel() != 1 or seed.dtype != torch.int64:
            raise ValueError("add_layer_norm (triton): dropout needs an int64 seed tensor of one element")
        return seed, 1.0 / (1.0 - dropout_p)
    return dummy, 1.0  # never read


def add_layer_norm_forward(x, residual, weight, bias, eps: float, dropout_p: float, seed: torch.Tensor | None,
                           y, mean, rstd):
    """Writes y (contiguous, x's shape and dtype) = layer_norm(dropout(x) + residual), and the fp32
    statistics mean, rstd [rows]."""
    n_cols = x.shape[-1]
    block, num_warps = _settings(n_cols)
    x2, r2 = _rows(x, n_cols), _rows(residual, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return y, mean, rstd
    seed_arg, scale = _dropout_args(dropout_p, seed, x2)
    with on_device_of(x):
        _add_layer_norm_forward_kernel[(n_rows,)](
            y, mean, rstd, x2, x2.stride(0), r2, r2.stride(0), weight.contiguous(), bias.contiguous(), seed_arg,
            n_cols, eps, dropout_p, scale,
            HAS_DROPOUT=dropout_p > 0, BLOCK=block, num_warps=num_warps,
        )
    return y, mean, rstd


def add_layer_norm_backward(grad, x, residual, weight, mean, rstd, dropout_p: float, seed: torch.Tensor | None,
                            dh, dx, dweight, dbias):
    """Writes, from dL/dy `grad`: dh = dL/dresidual and, with dropout, dx = dL/dx (contiguous, x's shape
    and dtype; without dropout dx is not written: it equals dh); dweight, dbias (weight's dtype) reduced
    in fp32."""
    n_cols = x.shape[-1]
    block, num_warps = _settings(n_cols)
    x2, r2, dy = _rows(x, n_cols), _rows(residual, n_cols), _rows(grad, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return dh, dx, dweight.zero_(), dbias.zero_()
    if x.is_cuda:
        groups = min(n_rows, torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:  # the interpreter: programs run one after another, fewer is faster
        groups = min(n_rows, 8)
    rows_per_program = triton.cdiv(n_rows, groups)
    groups = triton.cdiv(n_rows, rows_per_program)  # no program without rows
    dw_partial = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)  # every row written
    db_partial = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)
    seed_arg, scale = _dropout_args(dropout_p, seed, x2)
    with on_device_of(x):
        _add_layer_norm_backward_kernel[(groups,)](
            dh, dh if dropout_p == 0 else dx, dw_partial, db_partial, dy, dy.stride(0), x2, x2.stride(0),
            r2, r2.stride(0), weight.contiguous(), mean, rstd, seed_arg,
            n_rows, n_cols, rows_per_program, dropout_p, scale,
            HAS_DROPOUT=dropout_p > 0, BLOCK=block, num_warps=num_warps,
        )
    return dh, dx, dweight.copy_(dw_partial.sum(0)), dbias.copy_(db_partial.sum(0))
