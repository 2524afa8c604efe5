"""The C++ extension is built (where CI asks for it), and fastbert works without it. The CUDA kernels
(csrc/cuda/*.cu) are torch-free, so plain nvcc compiles them on any machine with a CUDA toolkit, GPU or
not: every file, for sm_80 and sm_90 (bindings.cpp needs a CUDA build of torch and is compiled only by
setup.py there); skipped, with the reason, where nvcc is absent. The C++ CPU kernels are compiled for every
instruction set setup.py knows, not only the one this machine's build used."""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time

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


def python_output(code: str) -> str:
    """stdout of `code` run in a fresh interpreter, which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


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
    out = python_output(code)
    assert "fastbert._C was not built: ImportError: simulated missing build" in out
    assert "[('bias_gelu', 'reference')]" in out


def test_fastbert_runs_without_transformers():
    """transformers is an optional extra ("hf"): importing fastbert and running its own model need none of it."""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = sys.modules['sentence_transformers'] = None  # import raises\n"
        "import torch, fastbert\n"
        "config = fastbert.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,\n"
        "                             intermediate_size=64)\n"
        "out = fastbert.BertModel(config).eval()(torch.randint(1, 50, (2, 5))).last_hidden_state\n"
        "print(tuple(out.shape))\n"
    )
    assert "(2, 5, 32)" in python_output(code)


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "fastbert", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for op in dispatch.OPS:
        assert f"| {op}" in out.stdout
    assert "Priority" in out.stdout


def test_info_names_settings_every_call_would_raise_on():
    """The command a user runs to find out why calls fail crashed on those settings (tracebacks), or was silent."""
    env = {**os.environ, "FASTBERT_VARIANT_DENSE": "bogus", "FASTBERT_CPU_TUNE": "yes", "FASTBERT_BACKEND": "gpu",
           "FASTBERT_BACKEND_GELU": "cpu"}  # (bias_gelu's is FASTBERT_BACKEND_BIAS_GELU)
    out = subprocess.run([sys.executable, "-m", "fastbert", "info"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    for message in ("calls raise: FASTBERT_CPU_TUNE must be 0", "calls raise: FASTBERT_BACKEND: unknown backend 'gpu'",
                    "calls raise: FASTBERT_VARIANT_DENSE: dense has no variant 'bogus'", "cannot be listed",
                    "ignored (no call reads it): FASTBERT_BACKEND_GELU names no op"):
        assert message in out.stdout, out.stdout[-3000:]


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


def _setup_py():
    spec = importlib.util.spec_from_file_location("fastbert_setup", os.path.join(ROOT, "setup.py"))
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # defines ISA_BUILDS and the helpers; setup() runs only as __main__
    return setup_py


@pytest.mark.parametrize("case", ["cuda fails", "cuda fails, required", "cpu fails"])
def test_a_failed_cuda_build_builds_the_cpu_kernels(monkeypatch, capsys, case):
    """The build with the CUDA kernels failing (nvcc refusing the host gcc, say) failed the whole install; it
    builds the CPU kernels instead and says why, unless FASTBERT_REQUIRE_CUDA=1. A CPU build's failure stays
    a failure. (torch's build itself is replaced by a stand-in that fails where there is a .cu source.)"""
    from setuptools import Distribution
    from torch.utils import cpp_extension

    monkeypatch.chdir(ROOT)
    setup_py = _setup_py()
    built = []

    def stand_in(self):
        sources = [src for ext in self.extensions for src in ext.sources]
        built.append(sources)
        if case == "cpu fails" or any(src.endswith(".cu") for src in sources):
            raise RuntimeError("nvcc: unsupported GNU version")

    monkeypatch.setattr(cpp_extension.BuildExtension, "run", stand_in)
    if case.endswith("required"):
        monkeypatch.setenv("FASTBERT_REQUIRE_CUDA", "1")
    first = setup_py.cpu_extension()
    if case != "cpu fails":  # (CUDAExtension itself wants a CUDA_HOME: the sources are what matters)
        first = cpp_extension.CppExtension("fastbert._C", first.sources + sorted(glob.glob("csrc/cuda/*.cu")))
    command = setup_py.build_command()(Distribution({"ext_modules": [first]}))
    command.extensions = [first]
    if case == "cuda fails":
        command.run()
        assert len(built) == 2 and any(src.endswith(".cu") for src in built[0])
        assert built[1] and not any(src.endswith(".cu") or "/cuda/" in src for src in built[1])
        assert "building the CPU kernels only" in capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError, match="unsupported GNU version"):
            command.run()
        assert len(built) == 1


@pytest.mark.parametrize("torch_cuda, nvcc_says, builds_cuda", [
    ("12.8", "Cuda compilation tools, release 12.9, V12.9.86", True),  # minor versions may differ (torch warns)
    ("12.8", "Cuda compilation tools, release 13.0, V13.0.48", False),  # torch's builder refuses: CPU only
    ("13.0", "no version here", False),
])
def test_a_toolkit_of_another_cuda_major_builds_the_cpu_kernels(tmp_path, monkeypatch, capsys, torch_cuda,
                                                                 nvcc_says, builds_cuda):
    """A CUDA torch beside a toolkit of another major version (torch cu128, nvcc 13) failed the whole install
    in torch's extension builder; it builds the CPU kernels instead, and says why."""
    from torch.utils import cpp_extension

    import torch

    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(f"#!/bin/sh\necho '{nvcc_says}'\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("FASTBERT_NO_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    assert _setup_py().cuda_toolkit() == (str(tmp_path) if builds_cuda else None)
    err = capsys.readouterr().err
    if builds_cuda:
        assert err == ""
    else:
        assert "building the CPU kernels only" in err and f"CUDA {torch_cuda}" in err, err
        monkeypatch.setenv("FASTBERT_REQUIRE_CUDA", "1")  # ... or fails, where the user asks for the CUDA kernels
        with pytest.raises(RuntimeError, match=f"FASTBERT_REQUIRE_CUDA=1, but torch is built with CUDA {torch_cuda}"):
            _setup_py().cuda_toolkit()


def test_cpu_kernels_compile_for_every_isa(tmp_path):
    """setup.py builds fastbert._C for the best ISA this CPU has, so the code paths of every other ISA
    (AVX-512 with bfloat16 dot products on an AVX2 machine, AVX2 and portable C++ on an AVX-512 one) would
    never be compiled here: compile them (to objects: an intrinsic outside its target fails to inline even at
    -O0, where -fsyntax-only would pass it)."""
    from torch.utils import cpp_extension

    import torch

    setup_py = _setup_py()
    builds, sources = setup_py.ISA_BUILDS, [os.path.join(ROOT, src) for src in setup_py.cpu_sources(ROOT)]
    try:
        from fastbert import _C

        built = "AVX512_BF16" if _C.AVX512_BF16 else _C.CPU_CAPABILITY
        assert built in builds, (built, list(builds))
    except ImportError:
        built = None  # nothing built here: check them all
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    jobs, failures = [], []
    for isa, (_, flags) in builds.items():
        if isa == built:
            continue
        for src in sources:
            obj = tmp_path / f"{isa}.{os.path.basename(src)}.o"
            cmd = [compiler, "-c", "-std=c++17", "-O0", "-w", "-fPIC", "-fopenmp", *flags, *defines, *includes, src,
                   "-o", str(obj)]
            jobs.append((cmd, obj))
    # Two at a time: each compile holds ~1 GiB and a core.
    running = []
    while jobs or running:
        while jobs and len(running) < 2:
            cmd, obj = jobs.pop()
            running.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                        text=True)))
        cmd, obj, proc = running.pop(0)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S * 3)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0 or not obj.exists():
            failures.append(f"{' '.join(cmd[:12])} ... {cmd[-3]}\nexit {proc.returncode}\n{err[-4000:]}{out}")
    assert not failures, "C++ compile failed:\n\n" + "\n\n".join(failures)
