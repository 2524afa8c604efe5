"""Output allocation: kernels allocate their outputs here, so tests can poison every output (NaN) before
a kernel writes it, and an element a kernel forgets fails."""
from __future__ import annotations

import contextlib
import threading

import torch

# Process-wide, not per thread: autograd runs CUDA backward kernels on its own worker threads.
_poisoning = [0]
_lock = threading.Lock()


@contextlib.contextmanager
def poison_outputs():
    """Inside the block, kernel outputs start NaN-filled (integer ones random), so an element a kernel
    forgets fails."""
    with _lock:
        _poisoning[0] += 1
    try:
        yield
    finally:
        with _lock:
            _poisoning[0] -= 1


def empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)) and shape[0]:
        shape = shape[0]  # torch.empty(*sizes) parses ~1 us faster than torch.empty(torch.Size)
    out = torch.empty(*shape, dtype=dtype, device=device)
    if _poisoning[0]:
        _poison(out)
    return out


def _poison(out: torch.Tensor) -> None:
    if out.is_floating_point():
        out.fill_(float("nan"))
    elif out.numel():  # an integer has no NaN: random values, which a parity check tells from the right ones
        info = torch.iinfo(out.dtype)
        noise = torch.Generator().manual_seed(out.numel())
        out.copy_(torch.randint(info.min, info.max, out.shape, generator=noise, dtype=out.dtype))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, dtype=t.dtype, device=t.device)
