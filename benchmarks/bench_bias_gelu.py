"""bias_gelu at BERT-base intermediate width: fastbert vs F.gelu(x + b) vs the naive reference."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import reference

CONTENDERS = [("torch F.gelu(x+b)", lambda x, b: torch.nn.functional.gelu(x + b)), ("reference", reference.bias_gelu),
              *fastbert_contenders("bias_gelu", ops.bias_gelu)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens", [1024, 4096])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_bias_gelu(benchmark, name, fn, tokens, dtype):
    x, b = torch.randn(tokens, 3072).to(DEVICE, dtype), torch.randn(3072).to(DEVICE, dtype)
    time_it(benchmark, f"bias_gelu {tokens}x3072 {dtype_id(dtype)}", fn, x, b)
