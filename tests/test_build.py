"""The C++ extension is built (where CI asks for it), and fastbert works without it."""
import os
import subprocess
import sys

import pytest

from fastbert import dispatch


def test_extension_built_when_required():
    if os.environ.get("FASTBERT_REQUIRE_EXTENSION") != "1":
        pytest.skip("set FASTBERT_REQUIRE_EXTENSION=1 to require fastbert._C (CI does)")
    assert dispatch.machine_reasons("cpu") == (), dispatch.machine_reasons("cpu")
    from fastbert import _C

    assert _C.CPU_CAPABILITY in ("AVX512", "AVX2", "DEFAULT")
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    # setup.py builds for the machine it runs on: an AVX-512 build where the CPU has avx512_bf16
    # must carry the bfloat16 dot products (bf16 attention would silently take fp32 copies otherwise).
    if _C.CPU_CAPABILITY == "AVX512":
        assert _C.AVX512_BF16 == ("avx512_bf16" in flags)


def test_import_and_info_work_without_the_extension():
    # A finder that refuses fastbert._C simulates a failed or skipped build.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fastbert._C': raise ImportError('simulated missing build')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, fastbert\n"
        "from fastbert.info import report\n"
        "print(report())\n"
        "x = torch.randn(2, 4); b = torch.randn(4)\n"
        "with fastbert.dispatch.record() as calls: fastbert.ops.bias_gelu(x, b)\n"
        "print(calls)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fastbert._C was not built: ImportError: simulated missing build" in out.stdout
    assert "[('bias_gelu', 'reference')]" in out.stdout


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "fastbert", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for op in dispatch.OPS:
        assert f"| {op}" in out.stdout
    assert "Priority" in out.stdout
