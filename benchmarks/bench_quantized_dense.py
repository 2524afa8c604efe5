"""quantized_dense at BERT-base shapes (CPU): fastbert's int8 GEMM (per-token activations, epilogue in
row blocks) vs the same layer through dense in its float dtype, and torch's own dynamic int8 linear."""
import pytest
import torch

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import dispatch, ops
from fastbert.ops import PreparedWeights, _onednn, reference
from fastbert.ops.quantized_dense import ONEDNN_GEMM, own_gemm

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


# The GEMM step alone (no quantize, no epilogue): fastbert's own u8 x s8 GEMM against oneDNN's, both
# returning weight_scale x (q @ w^T) in float32. GOP/s = extra_info GOP / median.
GEMMS = [(1024, 768, 3072), (1024, 3072, 768), (128, 768, 2304)]  # M x K x N


def onednn_gemm(q, w, scale, cache={}):
    if w not in cache:
        cache.clear()
        cache[w] = ONEDNN_GEMM.pack(w, None, q.shape[0])
    return ONEDNN_GEMM.run(q, cache[w], scale)


def fastbert_own_gemm(q, w, scale, prepared=PreparedWeights()):
    return own_gemm(q, w, scale, prepared)


def gemm_reasons(name):
    if name == "onednn":
        return _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise"))
    return list(dispatch.machine_reasons("cpu"))


@pytest.mark.skipif(DEVICE != "cpu", reason="int8 runs on CPU")
@pytest.mark.parametrize("m,k,n", GEMMS, ids=[f"{m}x{k}x{n}" for m, k, n in GEMMS])
@pytest.mark.parametrize("name,fn", [("onednn", onednn_gemm), ("own", fastbert_own_gemm)], ids=["onednn", "own"])
def test_int8_gemm(benchmark, name, fn, m, k, n):
    if gemm_reasons(name):
        pytest.skip("; ".join(gemm_reasons(name)))
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    benchmark.extra_info["GOP"] = 2 * m * k * n / 1e9
    time_it(benchmark, f"int8 GEMM {m}x{k}x{n}", fn, q, w, torch.rand(n) * 0.01)
