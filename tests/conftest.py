import atexit
import os
import shutil
import tempfile

# The Triton interpreter must be on before triton is imported anywhere (CI sets it too).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Each op's static default variant, so a test sees the same implementation on every CPU (tests/test_tuning.py
# turns measuring on), and never the user's cache of measurements.
os.environ.setdefault("FASTBERT_CPU_TUNE", "0")
os.environ["FASTBERT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastbert-cache-")
atexit.register(shutil.rmtree, os.environ["FASTBERT_CACHE_DIR"], ignore_errors=True)
# A compile cache of this run's own: torch's shared one (/tmp/torchinductor_$USER) can hand a checkout
# the backward graph an earlier checkout at the same path compiled (a custom op's backward is traced from
# Python that its cache key does not cover: seen after an op was renamed).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastbert-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs per test, the same for a test id run to run (FASTBERT_TEST_SEED varies them).
    salt = os.environ.get("FASTBERT_TEST_SEED", "")
    torch.manual_seed(zlib.crc32((request.node.nodeid + salt).encode()))
    yield


@pytest.fixture(scope="session")
def emulated_cuda_library(tmp_path_factory):
    """csrc/cuda's kernels built for the CPU emulator (tests/emulated_cuda.py), once per run."""
    import emulated_cuda

    why = emulated_cuda.compiler_missing()
    if why:
        pytest.skip(why)
    return emulated_cuda.build(tmp_path_factory.mktemp("emulated-cuda"))
