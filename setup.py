"""Builds fastbert._C from csrc/ with ninja, for the instruction set of the machine it builds on.

at::vec::Vectorized compiles to scalar code unless the matching -m flags and CPU_CAPABILITY defines
are set, so they are chosen here from /proc/cpuinfo (AVX512, else AVX2, else the portable default).
CUDA kernels (csrc/cuda) are built only where torch is a CUDA build and a CUDA toolkit of its major version
exists (another one, or a failed CUDA build: the CPU kernels only, with a message; FASTBERT_REQUIRE_CUDA=1
fails instead).
FASTBERT_NO_EXTENSION=1 skips the build: `import fastbert` still works on the reference backend.
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

# The instruction sets fastbert._C builds for: the -m flags and CPU_CAPABILITY defines of each, and the
# /proc/cpuinfo flags a CPU needs for it. One is built (the best this CPU has); tests/test_build.py
# compile-checks the others, so code for an ISA the build machine lacks still builds.
ISA_BUILDS = {
    # avx512_bf16 (Zen 4+, Cooper Lake+): one-instruction bfloat16 rounding (csrc/cpu/vec.h) and the
    # bfloat16 dot products of attention (csrc/cpu/attention.cpp).
    "AVX512_BF16": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
                    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx512bf16",
                     "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
    "AVX512": (("avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
    "AVX2": (("avx2", "fma"), ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "DEFAULT": ((), []),
}


def cpu_flags() -> list[str]:
    """The flags of the first ISA_BUILDS entry whose features this CPU has."""
    try:
        with open("/proc/cpuinfo") as f:
            have = set(f.read().split())
    except OSError:
        have = set()
    return next(flags for needs, flags in ISA_BUILDS.values() if set(needs) <= have)


def nvcc_release(nvcc: str) -> str | None:
    """The CUDA release `nvcc --version` reports ("13.0"); None where it does not run or say."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return f"{found[1]}.{found[2]}" if found else None


def cuda_required() -> bool:
    """FASTBERT_REQUIRE_CUDA=1: no CPU-only build in place of the CUDA one; fail and say why."""
    return os.environ.get("FASTBERT_REQUIRE_CUDA") == "1"


def cuda_toolkit() -> str | None:
    """CUDA_HOME when torch is a CUDA build and the toolkit's nvcc exists and has torch's CUDA major version;
    None otherwise (a CPU build). FASTBERT_NO_CUDA=1 forces a CPU build."""
    if os.environ.get("FASTBERT_NO_CUDA") == "1":
        return None
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None
    release = nvcc_release(nvcc)
    if release is None or release.split(".")[0] != torch.version.cuda.split(".")[0]:
        # torch's extension builder refuses another major version (a failed install): build the CPU kernels.
        why = (f"torch is built with CUDA {torch.version.cuda} and {nvcc} is "
               f"{'CUDA ' + release if release else 'not runnable'}; for the CUDA kernels point CUDA_HOME at a CUDA "
               f"{torch.version.cuda.split('.')[0]}.x toolkit")
        if cuda_required():
            raise RuntimeError(f"fastbert: FASTBERT_REQUIRE_CUDA=1, but {why}")
        print(f"fastbert: building the CPU kernels only: {why} (FASTBERT_NO_CUDA=1 builds CPU-only without this "
              "message)", file=sys.stderr)
        return None
    return CUDA_HOME


# -ffp-contract=off: the kernels write their fused multiply-adds explicitly; letting the compiler
# contract `a * b - c` elsewhere breaks exact cancellations (a LayerNorm row of one feature must get
# a zero gradient, as PyTorch gives).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-DAT_PARALLEL_OPENMP=1", *cpu_flags()]


def cpu_sources(root: str = ".") -> list[str]:
    """The C++ of the op registrations and the CPU kernels (every build compiles them), relative to `root`."""
    return sorted(glob.glob("csrc/*.cpp", root_dir=root) + glob.glob("csrc/cpu/*.cpp", root_dir=root))


def cuda_extension(cxx_flags: list[str]):
    """fastbert._C with the CPU kernels plus csrc/cuda: torch-free .cu kernels and their torch bindings."""
    from torch.utils.cpp_extension import CUDAExtension

    sources = cpu_sources() + sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    # FASTBERT_CUDA_ARCHS: the compute capabilities to build for (default 80,90; the GPU check builds 90 only).
    archs = [a for a in os.environ.get("FASTBERT_CUDA_ARCHS", "80,90").replace(" ", "").split(",") if a]
    # --threads 0: each file's architectures compile in parallel (attention.cu's 27 kernels for sm_80 and
    # sm_90: 37 s in one thread, 20 s so, on this project's 2-core build machine; 12 s for sm_90 alone).
    nvcc_flags = ["-O3", "-std=c++17", "--threads", "0", "-DFASTBERT_WITH_CUDA",
                  *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)]
    return CUDAExtension(
        "fastbert._C",
        sources,
        extra_compile_args={"cxx": [*cxx_flags, "-DFASTBERT_WITH_CUDA"], "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )


def cpu_extension():
    """fastbert._C with the CPU kernels only."""
    from torch.utils.cpp_extension import CppExtension

    return CppExtension("fastbert._C", cpu_sources(), extra_compile_args={"cxx": CXX_FLAGS},
                        extra_link_args=["-fopenmp"])


def build_command():
    """torch's BuildExtension (ninja), which builds the CPU kernels alone where the build with the CUDA kernels
    fails (nvcc refusing the host compiler, say), and says why: a CPU build rather than a failed install.
    FASTBERT_REQUIRE_CUDA=1 fails instead."""
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as e:  # a compiler's failure reaches here as whatever setuptools wraps it in
                with_cuda = any(src.endswith(".cu") for ext in self.extensions for src in ext.sources)
                if not with_cuda or cuda_required():
                    raise
                print(f"fastbert: the build with the CUDA kernels failed ({type(e).__name__}: {e}); building the "
                      "CPU kernels only (FASTBERT_REQUIRE_CUDA=1 fails instead; the compiler's messages are above)",
                      file=sys.stderr)
                self.extensions = [cpu_extension()]
                super().run()

    return Build.with_options(use_ninja=True)


def extensions():
    if os.environ.get("FASTBERT_NO_EXTENSION") == "1":
        return [], {}
    ext = cuda_extension(CXX_FLAGS) if cuda_toolkit() is not None else cpu_extension()
    return [ext], {"build_ext": build_command()}


if __name__ == "__main__":  # pip and setuptools run it so; tests/test_build.py imports ISA_BUILDS
    ext_modules, cmdclass = extensions()
    setup(
        name="fastbert",
        version="0.1.0",
        description="A BERT encoder for PyTorch on fused kernels, each proven against a naive reference",
        python_requires=">=3.10",
        packages=find_packages(include=["fastbert", "fastbert.*"]) + ["fastbert.kernels"],
        # kernels/ installs as fastbert.kernels: a top-level `kernels` would clash with HF's package.
        package_dir={"fastbert.kernels": "kernels"},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        # 2.6: the C++ calls ATen's bfloat16 brgemm and runtime-size transposes, and the dispatcher's str is
        # std::string_view (torch 2.4.1 and 2.5.1 fail to compile it: README, "Quick start").
        install_requires=["torch>=2.6", "safetensors"],
        extras_require={"triton": ["triton>=3.0"], "hf": ["transformers", "tokenizers"], "ray": ["ray[data]"],
                        "parquet": ["pyarrow"]},
    )
