"""Large CPU tensors without page faults: an opt-in, process-wide setting of glibc's malloc.

torch's CPU allocator has no cache: every tensor is a malloc. glibc serves allocations above its mmap
threshold (at most 32 MB however it adapts) with fresh pages from the kernel and returns them on free,
so a BERT activation of 50 MB (4096 tokens x 3072 fp32) is faulted in page by page on every call
(what that costs: benchmarks/RESULTS.md, "fastbert.keep_freed_memory()"). ONNX Runtime avoids the
same cost with its own arena. The price: memory freed by Python is kept by the process (its
resident size stays at its peak) instead of going back to the operating system.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_LARGEST = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Make malloc keep freed memory and serve every size from it (no mmap per allocation, no trimming),
    for the whole process, from now on. Returns False where the C library is not glibc, or where glibc
    refuses a threshold that large (older releases cap it at 32 MB). Call it once at startup, before
    the large tensors exist."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST)) and bool(mallopt(_M_TRIM_THRESHOLD, _LARGEST))
