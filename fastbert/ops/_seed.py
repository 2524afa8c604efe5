"""Dropout seeds for the kernels: drawn from torch's generator (so torch.manual_seed reproduces every
mask) and passed as a tensor (so a compiled graph draws a fresh one per call)."""
from __future__ import annotations

import torch


def dropout_seed(dropout_p: float, device="cpu") -> torch.Tensor | None:
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device) if dropout_p > 0 else None


def seed_int(seed: torch.Tensor | None) -> int:
    """The seed as the C++ kernels take it (0 when there is no dropout)."""
    return 0 if seed is None else int(seed)
