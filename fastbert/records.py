"""Records: which backend ran each op call (forward and backward), for tests and for users who want to know.

`fastbert.dispatch.record()` collects them; dispatch and the kernel pairs' backward note them.
"""
from __future__ import annotations

import contextlib
import threading

import torch


class Call(tuple):
    """(op, backend), equal to a plain 2-tuple; `.skipped` maps each passed-over backend to its reasons;
    `.variant` names which of the backend's implementations ran, where it has several (else None)."""

    def __new__(cls, op: str, backend: str, skipped: dict[str, list[str]] | None = None, variant: str | None = None):
        self = super().__new__(cls, (op, backend))
        self.skipped = skipped or {}
        self.variant = variant
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


_local = threading.local()


@contextlib.contextmanager
def muted():
    """Nothing this thread runs inside the block is recorded (dispatch's trial runs while measuring)."""
    before = getattr(_local, "muted", False)
    _local.muted = True
    try:
        yield
    finally:
        _local.muted = before


def is_muted() -> bool:
    return getattr(_local, "muted", False)


def note(op: str, backend: str, skipped: dict[str, list[str]] | None = None, variant: str | None = None) -> None:
    """Record that `backend` (its `variant`) ran `op` (backward passes note `op + '.backward'`)."""
    if torch.compiler.is_compiling() or not _active_records or is_muted():  # (compiling first: no guard on the list)
        return
    call = Call(op, backend, skipped, variant)
    with _records_lock:
        for calls in _active_records:
            calls.append(call)
