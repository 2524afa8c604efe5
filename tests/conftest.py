import os

# The Triton interpreter must be on before triton is imported anywhere (CI sets it too).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs per test, reproducible per test id.
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
    yield
