"""FASTBERT_* settings read from the environment on every op call, so that a change takes effect at once."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def _key(name: str):
    return os.environ.encodekey(name)


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default), at a fraction of its cost: dispatch asks for up to four settings per
    op call, and os.environ.get encodes the name and decodes the value each time (~1 us; 0.2-0.3 ms of a
    12-layer forward's Python). CPython's os.environ keeps its values in `_data` under the encoded name,
    updated by every assignment and deletion through os.environ, which is what os.environ.get reads too."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict) or not hasattr(os.environ, "decodevalue"):
        return os.environ.get(name, default)  # not CPython's os._Environ
    raw = data.get(_key(name))
    return default if raw is None else os.environ.decodevalue(raw)
