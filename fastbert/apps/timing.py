"""The one timing helper: contenders take turns call by call (the order reversed every other round, so a
machine whose speed drifts favours none), each call between device synchronizations; medians in ms."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def alternating_medians(contenders: dict[str, Callable[[], object]], rounds: int, device: str = "cpu",
                        warmup: int = 1, before: Callable[[], object] | None = None,
                        primed: bool = False) -> dict[str, float]:
    """{name: median ms of `rounds` calls}, after `warmup` untimed rounds; `before` runs untimed ahead of
    every call (e.g. zeroing gradients); `primed`: each timed call right after an untimed call of the same
    contender (after `before`), so that it finds its own thread pool awake, as back-to-back calls of one
    model do."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders.items())
    for r in range(warmup + rounds):
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            if before is not None:
                before()
            if primed:
                fn()
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
