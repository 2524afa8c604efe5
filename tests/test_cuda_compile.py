"""The CUDA kernels (csrc/cuda/*.cu) are torch-free, so plain nvcc compiles them on any machine with a
CUDA toolkit, GPU or not: every file, for sm_80 and sm_90. (bindings.cpp needs a CUDA build of torch
and is compiled only by setup.py there.) Skipped, with the reason, where nvcc is absent."""
import glob
import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
ARCHS = ("sm_80", "sm_90")
TIMEOUT_S = 120


def test_cuda_sources_exist():
    names = {os.path.basename(s) for s in SOURCES}
    assert {"add_layer_norm.cu", "attention.cu", "bias_gelu.cu"} <= names, names


def test_cuda_kernels_compile(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (no CUDA toolkit): the CUDA kernels are compile-checked where it is")
    # All compiles at once: each is a second or two, and they are independent.
    jobs = []
    for src in SOURCES:
        for arch in ARCHS:
            obj = tmp_path / f"{os.path.basename(src)}.{arch}.o"
            cmd = [nvcc, "-c", "-std=c++17", "-O2", f"-arch={arch}", src, "-o", str(obj)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            jobs.append((src, arch, obj, cmd, proc, time.monotonic()))
    failures = []
    for src, arch, obj, cmd, proc, start in jobs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{' '.join(cmd)}\ntimed out after {TIMEOUT_S} s")
            continue
        if proc.returncode != 0 or not obj.exists():
            failures.append(f"{' '.join(cmd)}\nexit {proc.returncode}\n{err}{out}")
    assert not failures, "nvcc failed:\n\n" + "\n\n".join(failures)
