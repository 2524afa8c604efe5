"""Records: which backend ran each op call (forward and backward), for tests and for users who want to know.

`fastbert.dispatch.record()` collects them; dispatch and the kernel pairs' backward note them.
"""
from __future__ import annotations

import contextlib
import threading

import torch


class Call(tuple):
    """(op, backend), equal to a plain 2-tuple; `.skipped` maps each passed-over backend to its reasons."""

    def __new__(cls, op: str, backend: str, skipped: dict[str, list[str]] | None = None):
        self = super().__new__(cls, (op, backend))
        self.skipped = skipped or {}
        return self

    @property
    def op(self) -> str:
        return self[0]

    @property
    def backend(self) -> str:
        return self[1]


_records_lock = threading.Lock()
_active_records: list[list[Call]] = []


@contextlib.contextmanager
def record():
    """Collect every op call (forward and backward, any thread) made inside the block."""
    calls: list[Call] = []
    with _records_lock:
        _active_records.append(calls)
    try:
        yield calls
    finally:
        with _records_lock:  # by identity: two open records may hold equal lists
            _active_records[:] = [c for c in _active_records if c is not calls]


def note(op: str, backend: str, skipped: dict[str, list[str]] | None = None) -> None:
    """Record that `backend` ran `op` (backward passes note `op + '.backward'`)."""
    if not _active_records or torch.compiler.is_compiling():
        return
    call = Call(op, backend, skipped)
    with _records_lock:
        for calls in _active_records:
            calls.append(call)
