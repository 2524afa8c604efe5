"""quantized_dense: the cpu kernels equal the reference fed the same quantized bytes, and the C++
quantization produces exactly the reference's bytes."""
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, assert_ran, poison_outputs, tolerance
from grids import skip_unless_runnable

SHAPES = [((1, 7), 5, "none", "none"), ((13, 97), 64, "gelu", "none"), ((2, 9, 768), 3072, "gelu", "tanh"),
          ((33, 3072), 768, "none", "none"), ((4, 1, 128), 384, "none", "none"),
          ((100, 64), 3072, "gelu", "tanh")]  # several row blocks (rows_per_block)


def layer(n, k, bias=True):
    weight, scale = reference.quantize_weight(torch.randn(n, k) * k ** -0.5)
    return weight, scale, (torch.randn(n) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,n,activation,approximate", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference_on_the_same_quantized_input(shape, n, activation, approximate, dtype, bias):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    # An offset and a spread per row, as hidden states have: each row gets its own scale and zero point.
    x = (torch.randn(*shape) * (0.5 + torch.rand(*shape[:-1], 1) * 4) + torch.randn(*shape[:-1], 1)).to(dtype)
    weight, scale, b = layer(n, shape[-1], bias)
    with torch.no_grad(), poison_outputs(), dispatch.record() as calls:
        out = ops.quantized_dense(x, weight, scale, b, activation, approximate)
    assert_ran(calls, "quantized_dense", "cpu")
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    truth = reference.quantized_dense(x.double(), weight, scale, None if b is None else b.double(), activation, approximate)
    naive = reference.quantized_dense(x, weight, scale, b, activation, approximate)
    assert_close(out, truth, dtype, "matmul", naive=naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,n,activation,approximate", SHAPES, ids=str)
def test_quantized_output_is_the_result_within_half_a_step(shape, n, activation, approximate, dtype):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    x = (torch.randn(*shape) * 2).to(dtype)
    weight, scale, b = layer(n, shape[-1])
    with torch.no_grad(), poison_outputs(), dispatch.record() as calls:
        out = ops.quantized_dense(x, weight, scale, b, activation, approximate, quantize_output=True)
    assert_ran(calls, "quantized_dense", "cpu")
    assert isinstance(out, ops.QuantizedRows) and out.dtype == dtype and out.values.shape == (*shape[:-1], n)
    truth = reference.quantized_dense(x.double(), weight, scale, b.double(), activation, approximate)
    want = reference.quantize_rows(truth.reshape(-1, n))  # the truth's own rows and their quantization
    bound = tolerance(torch.float32, "matmul")
    assert torch.isfinite(out.scale).all() and (out.scale - want[1]).abs().max() <= bound * want[1].max()
    assert (out.zero_point - want[2]).abs().max() <= 1
    # Each value within half a quantization step of the exact result (plus float32's matmul bound).
    err = (out.dequantize().reshape(-1, n) - truth.reshape(-1, n)).abs()
    assert (err <= out.scale.double()[:, None] * 0.5 + bound * truth.abs().max()).all(), float(err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_rows_input_equals_the_float_input(dtype):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    x = torch.randn(3, 5, 96).to(dtype)
    weight, scale, b = layer(40, 96)
    q, s, z = reference.quantize_rows(x.reshape(-1, 96))
    rows = ops.QuantizedRows(q.reshape(x.shape), s, z, dtype)
    assert torch.allclose(rows.dequantize(), x.double(), atol=float(s.max()) / 2 * 1.0001, rtol=0)
    with torch.no_grad(), poison_outputs():
        assert torch.equal(ops.quantized_dense(rows, weight, scale, b, "gelu"), ops.quantized_dense(x, weight, scale, b, "gelu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,n,activation,approximate", SHAPES, ids=str)
def test_static_matches_reference_on_the_same_quantized_input(shape, n, activation, approximate, dtype):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    x = (torch.randn(*shape) * 2 + 0.5).to(dtype)
    lo, hi = float(x.min()), float(x.max())
    scale, zero_point = reference.range_to_scale(lo * 0.8, hi * 0.8)  # a calibrated range that clips a little
    weight, w_scale, b = layer(n, shape[-1])
    with torch.no_grad(), dispatch.record() as calls:
        out = ops.quantized_dense(x, weight, w_scale, b, activation, approximate, input_scale=scale,
                                  input_zero_point=zero_point)
    assert_ran(calls, "quantized_dense", "cpu")
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    args = (weight, w_scale, b.double(), activation, approximate, False, scale, zero_point)
    truth = reference.quantized_dense(x.double(), *args)
    naive = reference.quantized_dense(x, weight, w_scale, b, activation, approximate, False, scale, zero_point)
    assert_close(out, truth, dtype, "matmul", naive=naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_tensor_gives_the_reference_bytes(dtype):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    x = rows_with_edges(300, dtype)
    scale, zero_point = reference.range_to_scale(-4.0, 6.0)
    q = torch.full(x.shape, 7, dtype=torch.uint8)
    torch.ops.fastbert_C.quantize_tensor(x, float(scale), int(zero_point), q)
    assert torch.equal(q, reference.quantize_tensor(x, scale, zero_point))
    assert int(q.max()) == 255 and int(q.min()) == 0  # the outlier row clips


def rows_with_edges(k, dtype):
    x = torch.randn(9, k) * 3
    x[1] = 0  # all zero: scale 1
    x[2] = x[2].abs() + 1  # all positive: zero point 0
    x[3] = -x[3].abs() - 1  # all negative: zero point 255
    x[4] = 2.5  # constant
    x[5, 0] = 1e4  # one outlier
    x[6] = torch.arange(k) / 7  # an evenly spaced ramp
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 17, 768, 3072])
def test_quantize_rows_gives_the_reference_bytes(k, dtype):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    x = rows_with_edges(k, dtype)
    q, scale, zero_point = (torch.full((9, k), 7, dtype=torch.uint8), torch.full((9,), float("nan")),
                            torch.full((9,), -1, dtype=torch.int32))
    torch.ops.fastbert_C.quantize_rows(x, q, scale, zero_point)
    want = reference.quantize_rows(x)
    assert torch.equal(q, want[0]) and torch.equal(scale, want[1]) and torch.equal(zero_point, want[2])
    assert zero_point[2] == 0 and (k == 1 or zero_point[3] == 255) and scale[1] == 1
    # Dequantized, every value is within half a step of its row's original.
    x_hat = (q.float() - zero_point[:, None]) * scale[:, None]
    assert ((x_hat - x.float()).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()


def test_quantize_weight_is_symmetric_per_channel():
    w = torch.randn(6, 40)
    w[2] = 0
    values, scale = reference.quantize_weight(w)
    assert values.dtype == torch.int8 and values.abs().max() <= 127 and scale[2] == 1
    assert torch.equal(reference.quantize_weight(-w)[0], -values)
    assert ((values.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("call,message", [
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w.float(), s), "weight must be int8"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s.double()), "weight_scale must be float32"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s[:2]), "weight_scale must have shape \\(3,\\)"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 5), w, s), "weight must have shape \\[N, 5\\]"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s, torch.randn(4)), "bias must have shape \\(3,\\)"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s, activation="relu"), "activation must be one of"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4, requires_grad=True), w, s), "is for inference"),
    (lambda w, s: ops.quantized_dense(torch.randint(0, 5, (2, 4)), w, s), "x must be a floating-point tensor"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s, input_scale=torch.tensor(0.1)), "come together"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s, input_scale=torch.tensor(-0.1),
                                      input_zero_point=torch.tensor(3, dtype=torch.int32)), "positive float32"),
    (lambda w, s: ops.quantized_dense(torch.randn(2, 4), w, s, input_scale=torch.tensor(0.1),
                                      input_zero_point=torch.tensor(300, dtype=torch.int32)), "in \\[0, 255\\]"),
    (lambda w, s: ops.quantized_dense(ops.QuantizedRows(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2),
                                                        torch.zeros(2, dtype=torch.int32), torch.float32), w, s),
     "QuantizedRows.values must be 2-D to 4-D uint8"),
    (lambda w, s: ops.quantized_dense(ops.QuantizedRows(torch.zeros(2, 4, dtype=torch.uint8), torch.ones(3),
                                                        torch.zeros(2, dtype=torch.int32), torch.float32), w, s),
     "QuantizedRows.scale must be float32 \\[2\\]"),
])
def test_bad_input_is_named(call, message):
    weight, scale = reference.quantize_weight(torch.randn(3, 4))
    with pytest.raises(ValueError, match=message):
        call(weight, scale)
