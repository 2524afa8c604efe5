"""add_layer_norm at BERT-base width: fastbert vs F.layer_norm(x + r) vs the naive reference."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import reference

CONTENDERS = [("torch F.layer_norm(x+r)", lambda x, r, w, b, eps: torch.nn.functional.layer_norm(x + r, w.shape, w, b, eps)),
              ("reference", reference.add_layer_norm), *fastbert_contenders("add_layer_norm", ops.add_layer_norm)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens", [1024, 4096])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_add_layer_norm(benchmark, name, fn, tokens, dtype):
    x, r = torch.randn(tokens, 768).to(DEVICE, dtype), torch.randn(tokens, 768).to(DEVICE, dtype)
    w, b = torch.randn(768).to(DEVICE, dtype), torch.randn(768).to(DEVICE, dtype)
    time_it(benchmark, f"add_layer_norm {tokens}x768 {dtype_id(dtype)}", fn, x, r, w, b, 1e-12)
