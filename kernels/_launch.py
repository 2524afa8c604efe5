"""What every launcher in fastbert.kernels shares: it writes into outputs its caller allocated (so the
caller can poison them, and decides their layout) and launches on the tensors' own device."""
from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """The CUDA device guard for `t` (Triton launches on the current device, not the tensor's)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
