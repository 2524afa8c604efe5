"""Input checks shared by the ops: every error names the argument and what was expected."""
from __future__ import annotations

import torch


def tensor(name: str, t, ndims: tuple[int, ...], floating: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def same_dtype_device(**tensors) -> None:
    first_name, first = next(iter(tensors.items()))
    device, dtype = first.device, first.dtype
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}")
        if t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has dtype {dtype}")


def padding_mask_values(mask) -> None:
    """A key-padding mask that is not bool holds only 0 (padding) and 1 (token): it is read as bool, and an
    additive mask (0 = keep, -inf = drop, transformers' extended form) would be read the other way round.
    Data-dependent: eager callers only."""
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got values from "
                         f"{float(mask.min())} to {float(mask.max())} (an additive mask, 0 = keep and -inf = "
                         "drop, is not a key-padding mask)")


def features(name: str, t) -> None:
    """A last dimension of 0 leaves nothing to normalize or project: an error, not a reshape deep inside."""
    if t.shape[-1] == 0:
        raise ValueError(f"{name} has a last dimension of 0 (no features), shape {tuple(t.shape)}")


def same_device(name: str, t, other_name: str, other) -> None:
    if t.device != other.device:
        raise ValueError(f"{name} is on {t.device} but {other_name} is on {other.device}")


def shape(name: str, t, expected: tuple[int, ...], what: str) -> None:
    if t.shape != expected:  # torch.Size equals the tuple of its sizes
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def probability(name: str, p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
