"""Padding-free layers: remove pad tokens once before the encoder, restore them once at the end.

Between the two, every layer runs on packed tokens [T, H] (T = real tokens) and attention sees each
sequence through cu_seqlens, so no FLOP is spent on padding. Pad positions of the restored output
are zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    indices: torch.Tensor  # [T] int64: where each real token sits in the flattened [B * S]
    cu_seqlens: torch.Tensor  # [B + 1] int32: sequence i is packed rows cu_seqlens[i]:cu_seqlens[i + 1]
    max_seqlen: int
    batch: int
    seq: int


def worth_unpadding(attention_mask: torch.Tensor) -> bool:
    """There is padding to remove, and every sequence keeps its first token (the pooler reads it)."""
    return not bool(attention_mask.all()) and bool(attention_mask[:, 0].all())


def packing(attention_mask: torch.Tensor) -> Packing:
    """attention_mask: bool [B, S], True = token (holes allowed: positions were already embedded)."""
    b, s = attention_mask.shape
    lengths = attention_mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    indices = attention_mask.flatten().nonzero().flatten()
    return Packing(indices, cu_seqlens, int(lengths.max()), b, s)


def unpad(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """[B, S, H] -> [T, H]"""
    return x.reshape(p.batch * p.seq, x.shape[-1]).index_select(0, p.indices)


def pad(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """[T, H] -> [B, S, H], zeros at pad positions"""
    out = x.new_zeros(p.batch * p.seq, x.shape[-1]).index_copy(0, p.indices, x)
    return out.view(p.batch, p.seq, x.shape[-1])
