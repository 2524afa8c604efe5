"""qkv_projection at BERT-base shape: fastbert (one GEMM, q/k/v head-major) vs F.linear followed by the
head-major split every BERT implementation writes (view, permute, unbind)."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import PreparedWeights

HIDDEN, HEADS = 768, 12


def torch_composite(x, w, b):
    b_, s, h = x.shape
    qkv = torch.nn.functional.linear(x, w, b).view(b_, s, 3, HEADS, h // HEADS)
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def qkv_as_a_model_calls_it(x, w, b, prepared=PreparedWeights()):
    return ops.qkv_projection(x, w, b, HEADS, prepared)  # the weights' owner keeps their packed copy


CONTENDERS = [("torch F.linear + split", torch_composite), *fastbert_contenders("qkv_projection", qkv_as_a_model_calls_it)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch,seq", [(8, 128), (32, 128)])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_qkv_projection(benchmark, name, fn, batch, seq, dtype):
    x = torch.randn(batch, seq, HIDDEN).to(DEVICE, dtype)
    w, b = (torch.randn(3 * HIDDEN, HIDDEN) * HIDDEN**-0.5).to(DEVICE, dtype), torch.randn(3 * HIDDEN).to(DEVICE, dtype)
    benchmark.extra_info["GFLOP"] = 2 * batch * seq * HIDDEN * 3 * HIDDEN / 1e9
    time_it(benchmark, f"qkv_projection {batch}x{seq}x{HIDDEN} {dtype_id(dtype)}", fn, x, w, b)
