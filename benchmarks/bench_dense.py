"""dense (+GELU) at BERT-base shapes: fastbert vs F.linear (+ F.gelu), and oneDNN's plain packed GEMM
(the machine's GEMM rate: fastbert's fused GEMM should come close to it)."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import PreparedWeights, _onednn

SHAPES = [(768, 3072, "gelu"), (3072, 768, "none"), (768, 2304, "none")]  # FFN up, FFN down, QKV


def torch_composite(x, w, b, activation):
    y = torch.nn.functional.linear(x, w, b)
    return torch.nn.functional.gelu(y) if activation == "gelu" else y


def onednn_plain(x, w, b, activation, prepared=PreparedWeights()):
    return _onednn.linear(x, prepared.get("onednn", (w,), lambda w: _onednn.pack(w, x.shape[0])), b, "none")


def dense_as_a_model_calls_it(x, w, b, activation, prepared=PreparedWeights()):
    return ops.dense(x, w, b, activation, prepared=prepared)  # the weights' owner keeps their packed copy


CONTENDERS = [("torch F.linear(+F.gelu)", torch_composite), *fastbert_contenders("dense", dense_as_a_model_calls_it)]
if DEVICE == "cpu" and not _onednn.missing():
    CONTENDERS.append(("oneDNN plain GEMM", onednn_plain))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens", [128, 1024, 4096])
@pytest.mark.parametrize("k,n,activation", SHAPES, ids=[f"{k}x{n}-{a}" for k, n, a in SHAPES])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_dense(benchmark, name, fn, tokens, k, n, activation, dtype):
    x, w, b = torch.randn(tokens, k).to(DEVICE, dtype), (torch.randn(n, k) * k**-0.5).to(DEVICE, dtype), torch.randn(n).to(DEVICE, dtype)
    benchmark.extra_info["GFLOP"] = 2 * tokens * k * n / 1e9
    time_it(benchmark, f"dense {tokens}x{k}->{n} {activation} {dtype_id(dtype)}", fn, x, w, b, activation)
