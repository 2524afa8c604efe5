"""quantized_dense at BERT-base shapes (CPU): fastbert's int8 GEMM (per-token activations, epilogue in
row blocks) vs the same layer through dense in its float dtype, and torch's own dynamic int8 linear."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import PreparedWeights, reference

SHAPES = [(768, 3072, "gelu"), (3072, 768, "none"), (768, 2304, "none")]  # FFN up, FFN down, QKV


def int8(x, w, b, activation, prepared=PreparedWeights(), cache={}):
    if w not in cache:  # quantized once per weight, as fastbert.quantize does
        cache.clear()
        cache[w] = reference.quantize_weight(w)
    values, scale = cache[w]
    return ops.quantized_dense(x, values, scale, b, activation, prepared=prepared)


def float_dense(x, w, b, activation, prepared=PreparedWeights()):
    return ops.dense(x, w, b, activation, prepared=prepared)


def torch_dynamic_int8(x, w, b, activation, cache={}):
    if w not in cache:
        cache.clear()
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(w.float())
            linear.bias.copy_(b.float())
        cache[w] = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, torch.qint8)
    y = cache[w](x.float()).to(x.dtype)
    return torch.nn.functional.gelu(y) if activation == "gelu" else y


CONTENDERS = ([*fastbert_contenders("quantized_dense", int8), ("fastbert dense (float)", float_dense)]
              + ([("torch.ao dynamic int8", torch_dynamic_int8)] if hasattr(torch.ao, "quantization") else []))


@pytest.mark.skipif(DEVICE != "cpu", reason="int8 runs on CPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens", [1024])
@pytest.mark.parametrize("k,n,activation", SHAPES, ids=[f"{k}x{n}-{a}" for k, n, a in SHAPES])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_quantized_dense(benchmark, name, fn, tokens, k, n, activation, dtype):
    x, w, b = torch.randn(tokens, k).to(dtype), (torch.randn(n, k) * k**-0.5).to(dtype), torch.randn(n).to(dtype)
    benchmark.extra_info["GOP"] = 2 * tokens * k * n / 1e9
    time_it(benchmark, f"int8 dense {tokens}x{k}->{n} {activation} {dtype_id(dtype)}", fn, x, w, b, activation)
