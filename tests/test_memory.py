"""fastbert.keep_freed_memory(): large tensors come from malloc's heap, not a fresh mmap each, and once
the heap has grown a tensor allocated again reuses freed pages instead of faulting in new ones.
Process-wide, so each case runs in its own interpreter."""
import ast
import platform
import subprocess
import sys

import pytest

CODE = """
import ctypes, resource, sys, torch, fastbert
if sys.argv[1] == "keep" and not fastbert.keep_freed_memory():
    print("refused")  # glibc older than ~2.35 caps the mmap threshold at 32 MB
    sys.exit(0)
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts, in_heap = [], []
for _ in range(12):
    before = faults()
    x = torch.ones((64 << 20) // 4)  # 64 MB: above the largest mmap threshold glibc adapts to
    in_heap.append(x.data_ptr() < libc.sbrk(0))  # below the program break: the heap
    del x
    counts.append(faults() - before)
print(repr((counts, in_heap)))
"""


def allocations(mode: str):
    """(page faults of each allocation, whether each came from the heap)"""
    out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "refused":
        pytest.skip("this glibc refuses a 2 GB mmap threshold")
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory sets glibc's malloc")
def test_large_tensors_reuse_freed_pages():
    faults, in_heap = allocations("keep")
    assert all(in_heap), in_heap
    assert min(faults[1:]) < 100, f"page faults of each 64 MB tensor: {faults}"
    plain_faults, plain_in_heap = allocations("plain")  # the default, for contrast: a fresh mmap each time
    assert not any(plain_in_heap), (plain_in_heap, plain_faults)
