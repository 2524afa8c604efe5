"""Output allocation: kernels allocate their outputs here, so tests can poison every output (NaN) before
a kernel writes it, and an element a kernel forgets fails."""
from __future__ import annotations

import contextlib
import threading

import torch

_poison = threading.local()


@contextlib.contextmanager
def poison_outputs():
    """Inside the block, kernel outputs start NaN-filled, so an element a kernel forgets fails."""
    previous = getattr(_poison, "on", False)
    _poison.on = True
    try:
        yield
    finally:
        _poison.on = previous


def empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)) and shape[0]:
        shape = shape[0]  # torch.empty(*sizes) parses ~1 us faster than torch.empty(torch.Size)
    out = torch.empty(*shape, dtype=dtype, device=device)
    if getattr(_poison, "on", False) and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, dtype=t.dtype, device=t.device)
