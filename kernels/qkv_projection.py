"""Triton QKV projection: one GEMM for q, k and v with the bias fused, stored straight into head-major
buffers (no transpose or copy after it). The GEMM and its epilogue are dense's (kernels/dense.py); this
chooses the layout they store in.
"""
from fastbert.kernels.dense import gemm_epilogue


def qkv_head_major(x2d, weight, bias, num_heads, seq, out):
    """x2d [rows, H] @ weight [3H, H].T + bias, written head-major into a contiguous `out`: with
    seq > 0 rows are (batch, position) and out is [3, B, heads, S, d]; with seq == 0 rows are packed
    tokens and out is [3, T, heads, d]."""
    hidden = weight.shape[1]
    d = hidden // num_heads
    if seq:  # rows are (batch, position); out[p, b, h, s, :]
        b = x2d.shape[0] // seq
        stride_part, stride_group, stride_head, stride_row = b * hidden * seq, hidden * seq, seq * d, d
        rows_per_group = seq
    else:  # rows are tokens; out[p, t, h, :]
        stride_part, stride_group, stride_head, stride_row = x2d.shape[0] * hidden, 0, d, hidden
        rows_per_group = max(x2d.shape[0], 1)
    gemm_epilogue(x2d, weight, bias, out, "none", rows_per_group, stride_group, stride_row,
                  cols_per_part=hidden, cols_per_head=d, stride_part=stride_part, stride_head=stride_head)
    return out
