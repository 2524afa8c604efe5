"""attention: softmax(q k^T * scale) v over [B, heads, S, d] with a key-padding mask."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference


def attention(q, k, v, attention_mask=None, dropout_p: float = 0.0, scale: float | None = None, need_weights=False):
    """q, k, v [B, heads, S, d]; attention_mask [B, S], 1 = keep (bool, int or float 0/1).
    Returns [B, heads, S, d]; with need_weights=True also the probabilities [B, heads, S, S].
    A query row with no kept key gives zeros."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t, (4,))
    _checks.same_dtype_device(q=q, k=k, v=v)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have the same shape [B, heads, S, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if attention_mask is not None:
        _checks.tensor("attention_mask", attention_mask, (2,), floating=False)
        _checks.same_device("attention_mask", attention_mask, "q", q)
        _checks.shape("attention_mask", attention_mask, (q.shape[0], q.shape[2]), "[batch, seq] of q")
    _checks.probability("dropout_p", dropout_p)
    inputs = {"tensors": (q, k, v), "head_dim": q.shape[-1], "dropout_p": dropout_p, "need_weights": need_weights}
    return dispatch.call("attention", inputs, q, k, v, attention_mask, float(dropout_p), scale, need_weights)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0, scale: float | None = None):
    """q, k, v [T, heads, d] packed; cu_seqlens int32 [B + 1] from 0 to T; max_seqlen the longest length."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t, (3,))
    _checks.same_dtype_device(q=q, k=k, v=v)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have the same shape [T, heads, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _checks.tensor("cu_seqlens", cu_seqlens, (1,), floating=False)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32, got dtype {cu_seqlens.dtype}")
    _checks.same_device("cu_seqlens", cu_seqlens, "q", q)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    if not torch.compiler.is_compiling():  # value checks are data-dependent: eager only
        lengths = cu_seqlens.diff()
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0] or bool((lengths < 0).any()):
            raise ValueError(
                f"cu_seqlens must rise from 0 to the token count {q.shape[0]} without decreasing, got {cu_seqlens.tolist()}"
            )
        if int(lengths.max()) > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({int(lengths.max())})")
    _checks.probability("dropout_p", dropout_p)
    inputs = {"tensors": (q, k, v), "head_dim": q.shape[-1], "dropout_p": dropout_p}
    return dispatch.call("varlen_attention", inputs, q, k, v, cu_seqlens, int(max_seqlen), float(dropout_p), scale)


dispatch.register("attention", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS, probabilities=True))(
    reference.attention
)
dispatch.register("varlen_attention", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(
    reference.varlen_attention
)
