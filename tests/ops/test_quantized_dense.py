"""quantized_dense: the cpu kernels equal the reference fed the same quantized bytes, and the C++
quantization produces exactly the reference's bytes."""
import sys
import zlib

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import _alloc, _onednn, reference
from fastbert.ops.dense import EPILOGUES
from fastbert.ops.prepared import PreparedWeights
from fastbert.ops.quantized_dense import ONEDNN_GEMM, _cpu, onednn_inexact, own_gemm, own_gemm_step
from fastbert.testing import assert_close, assert_ran, poison_outputs, tolerance
from grids import skip_unless_runnable, skip_unless_variant
from harness import DERANDOMIZE, EXAMPLES, HIDDEN, INNER, SEEDS, _require_hypothesis, _settings, hypothesis, st

SHAPES = [((1, 7), 5, "none", "none"), ((13, 97), 64, "gelu", "none"), ((2, 9, 768), 3072, "gelu", "tanh"),
          ((33, 3072), 768, "none", "none"), ((4, 1, 128), 384, "none", "none"),
          ((100, 64), 3072, "gelu", "tanh")]  # several row blocks (rows_per_block) where the GEMM is oneDNN's


def layer(n, k, bias=True):
    weight, scale = reference.quantize_weight(torch.randn(n, k) * k ** -0.5)
    return weight, scale, (torch.randn(n) if bias else None)


@pytest.mark.parametrize("variant", dispatch.variant_names("quantized_dense", "cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,n,activation,approximate", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference_on_the_same_quantized_input(shape, n, activation, approximate, dtype, bias, variant):
    skip_unless_variant("quantized_dense", variant, dtype)
    # An offset and a spread per row, as hidden states have: each row gets its own scale and zero point.
    x = (torch.randn(*shape) * (0.5 + torch.rand(*shape[:-1], 1) * 4) + torch.randn(*shape[:-1], 1)).to(dtype)
    weight, scale, b = layer(n, shape[-1], bias)
    with torch.no_grad(), poison_outputs(), dispatch.use_variant("quantized_dense", variant), \
            dispatch.record() as calls:
        out = ops.quantized_dense(x, weight, scale, b, activation, approximate)
    assert_ran(calls, "quantized_dense", "cpu")
    assert {c.variant for c in calls} == {variant}
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    truth = reference.quantized_dense(x.double(), weight, scale, None if b is None else b.double(), activation, approximate)
    naive = reference.quantized_dense(x, weight, scale, b, activation, approximate)
    assert_close(out, truth, dtype, "matmul", naive=naive)


@pytest.mark.parametrize("variant", dispatch.variant_names("quantized_dense", "cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_properties(dtype, variant):
    """Each variant equals the reference fed the same quantized bytes on what hypothesis draws: rows 1-300
    (row blocks, partial AMX strips), any k from 1 (odd ones: the VNNI groups of 4, AMX's 64), n from 7, rows
    with their own offset and spread (or constant: a zero range), bias or none, each epilogue."""
    _require_hypothesis()
    skip_unless_variant("quantized_dense", variant, dtype)

    @_settings(EXAMPLES)
    @hypothesis.given(m=st.integers(1, 300), k=INNER, n=HIDDEN, activation=st.sampled_from(sorted(EPILOGUES)),
                      bias=st.booleans(), constant_rows=st.booleans(), seed=SEEDS)
    def prop(m, k, n, activation, bias, constant_rows, seed):
        torch.manual_seed(seed)
        spread = torch.zeros(m, 1) if constant_rows else 0.5 + torch.rand(m, 1) * 4
        x = (torch.randn(m, k) * spread + torch.randn(m, 1)).to(dtype)
        weight, scale, b = layer(n, k, bias)
        with torch.no_grad(), poison_outputs(), dispatch.use_variant("quantized_dense", variant), \
                dispatch.record() as calls:
            out = ops.quantized_dense(x, weight, scale, b, *activation)
        assert_ran(calls, "quantized_dense", "cpu")
        assert {c.variant for c in calls} == {variant}
        assert out.dtype == dtype and out.shape == (m, n)
        truth = reference.quantized_dense(x.double(), weight, scale, None if b is None else b.double(), *activation)
        naive = reference.quantized_dense(x, weight, scale, b, *activation)
        assert_close(out, truth, dtype, "matmul", naive=naive)

    if DERANDOMIZE:  # each (dtype, variant) its own seed, as harness._run gives each op's
        prop = hypothesis.seed(zlib.crc32(f"quantized_dense/{variant}/{dtype}".encode()))(prop)
    prop()


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


@pytest.mark.parametrize("variant", dispatch.variant_names("quantized_dense", "cpu"))
@pytest.mark.parametrize("quantize_output", [False, True], ids=["to-float", "to-rows"])
def test_row_blocks_equal_one_block(monkeypatch, variant, quantize_output):
    """The GEMM in blocks of rows (rows_per_block, sized by the machine's L2) gives what one block gives:
    forced to 32-row blocks here, whatever the L2."""
    skip_unless_variant("quantized_dense", variant, torch.float32)
    qd = sys.modules["fastbert.ops.quantized_dense"]
    x = torch.randn(100, 64) * 2
    weight, scale, b = layer(96, 64)

    def run():
        with torch.no_grad(), poison_outputs(), dispatch.use_variant("quantized_dense", variant), \
                dispatch.record() as calls:
            out = ops.quantized_dense(x, weight, scale, b, "gelu", quantize_output=quantize_output)
        assert_ran(calls, "quantized_dense", "cpu")
        assert calls[0].variant == variant
        return out

    whole = run()
    monkeypatch.setattr(qd, "_cache_bytes", lambda: 32 * 4 * 96)
    assert qd.rows_per_block(96) == 32
    blocks = run()
    if quantize_output:  # QuantizedRows: values, scale, zero point
        assert all(torch.equal(got, want) for got, want in zip(blocks[:3], whole[:3])) and blocks.dtype == whole.dtype
    else:
        assert torch.equal(blocks, whole)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("variant", dispatch.variant_names("quantized_dense", "cpu"))
def test_strided_scales_are_read_as_their_values(variant, static):
    """oneDNN's GEMM read a strided weight_scale as if dense (outputs off by 50 where they were ~6, no error),
    and strided QuantizedRows scales were refused as of the wrong shape."""
    skip_unless_variant("quantized_dense", variant, torch.float32)
    x = torch.randn(4, 2, 96)
    weight, scale, b = layer(40, 96)
    strided = torch.stack([scale, 7 * scale], 1)[:, 0]  # scale's values, every other element of a buffer
    static_scales = dict(input_scale=torch.tensor(0.05), input_zero_point=torch.tensor(128, dtype=torch.int32))
    kwargs = static_scales if static else {}
    with torch.no_grad(), dispatch.use_variant("quantized_dense", variant):
        want = ops.quantized_dense(x, weight, scale, b, **kwargs)
        with poison_outputs(), dispatch.record() as calls:
            got = ops.quantized_dense(x, weight, strided, b, **kwargs)
        assert {c.variant for c in calls} == {variant}
        assert torch.equal(got, want)
        if not static:
            q, s, z = reference.quantize_rows(x.reshape(-1, 96))
            s, z = (torch.stack([t, t], 1)[:, 0] for t in (s, z))
            assert torch.equal(ops.quantized_dense(ops.QuantizedRows(q.reshape(x.shape), s, z, torch.float32), weight,
                                                   scale, b), want)


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
    x[7] = torch.randn(k) * 1e-38  # a range whose step (~1e-40) has no finite reciprocal: float32's smallest normal
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
    assert 0 <= int(zero_point.min()) and int(zero_point.max()) <= 255 and scale[7] == torch.finfo(torch.float32).tiny
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


# ------------------------------------------------- fastbert's own int8 GEMM (own_gemm): bit for bit, every tail

ISAS = [("best", 0), ("portable", 1), ("avx_vnni", 2), ("avx512_vnni", 3), ("avx2", 4), ("amx", 5)]
CPU_FLAGS = {2: "avx_vnni", 3: "avx512_vnni", 4: "avx2", 5: "amx_int8"}  # /proc/cpuinfo's names of what isas 2-5 need
GEMM_M = (1, 3, 17, 128, 300)  # 300: rows shared out between threads, each share ending in a partial strip
GEMM_K = (1, 5, 64, 768, 3072)
GEMM_N = (1, 15, 17, 64, 768, 2304)


def skip_unless_isa(isa):
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    if not torch.ops.fastbert_C.int8_isa_supported(isa):
        pytest.skip(f"this CPU lacks {CPU_FLAGS[isa]} (isa {isa})")


def skip_unless_onednn():
    missing = _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise")) or onednn_inexact()
    if missing:
        pytest.skip("; ".join(missing))


def int8_operands(m, k, n, seed=0):
    """Full-range q and weight with the extremes in place: q's row 0 all 255, weight's row 0 all -128 and
    its last row all 127 (the largest sums of either sign), everything else uniform."""
    gen = torch.Generator().manual_seed(seed * 7919 + m * 131 + k * 17 + n)
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=gen)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0] = 255
    weight[0] = -128
    weight[-1] = 127
    weight_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return q, weight, weight_scale


def exact_gemm(q, weight, weight_scale):
    """The GEMM's contract in torch: the sums in int32 (exact: |sum| < k x 255 x 128), one float32 multiply."""
    return weight_scale * (q.int() @ weight.int().T).float()


@pytest.mark.parametrize("isa_name,isa", ISAS, ids=[name for name, _ in ISAS])
@pytest.mark.parametrize("n", GEMM_N)
@pytest.mark.parametrize("k", GEMM_K)
@pytest.mark.parametrize("m", GEMM_M)
def test_own_gemm_is_exact(m, k, n, isa_name, isa):
    skip_unless_isa(isa)
    q, weight, weight_scale = int8_operands(m, k, n)
    with poison_outputs():
        out = own_gemm(q, weight, weight_scale, None, isa)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    want = exact_gemm(q, weight, weight_scale)
    diff = (out - want).abs().nan_to_num(float("inf"))
    assert torch.equal(out, want), f"{int((diff > 0).sum())} of {out.numel()} differ, largest {float(diff.max()):.3g}"


@pytest.mark.parametrize("isa_name,isa", ISAS, ids=[name for name, _ in ISAS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", [0, 1, 2], ids=["none", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("m,k,n", [(1, 5, 17), (13, 96, 64), (7, 768, 100), (130, 64, 200)])
def test_dequantize_in_the_tiles_equals_the_two_steps(m, k, n, activation, dtype, isa_name, isa):
    """int8_matmul_dequantize gives int8_matmul then dequantize_rows bit for bit (tails of m, n, k too)."""
    skip_unless_isa(isa)
    q, weight, weight_scale = int8_operands(m, k, n)
    scale, zero_point = torch.rand(m) / 10 + 0.01, torch.randint(0, 256, (m,), dtype=torch.int32)
    wsum = weight.sum(1, dtype=torch.int32).float() * weight_scale
    packed = torch.ops.fastbert_C.int8_pack(weight)
    for bias in (torch.randn(n), None):
        with poison_outputs():
            want = _alloc.empty((m, n), dtype=dtype, device="cpu")
            torch.ops.fastbert_C.dequantize_rows(own_gemm(q, weight, weight_scale, None, isa), scale, zero_point, wsum,
                                                 bias, activation, want)
            got = _alloc.empty((m, n), dtype=dtype, device="cpu")
            torch.ops.fastbert_C.int8_matmul_dequantize(q, packed, n, k, weight_scale, scale, zero_point, wsum, bias,
                                                        activation, isa, got)
        assert torch.isfinite(got).all() and torch.equal(got, want)


def bad_dequantize(scale=None, out=None):
    """int8_matmul_dequantize on a good [3, 8] x [5, 8] problem with the row scale or the output replaced."""
    q, packed = torch.zeros(3, 8, dtype=torch.uint8), torch.ops.fastbert_C.int8_pack(torch.zeros(5, 8, dtype=torch.int8))
    scale = torch.ones(3) if scale is None else scale
    out = torch.empty(3, 5) if out is None else out
    torch.ops.fastbert_C.int8_matmul_dequantize(q, packed, 5, 8, torch.ones(5), scale, torch.zeros(3, dtype=torch.int32),
                                                torch.zeros(5), None, 0, 0, out)


@pytest.mark.parametrize("call,message", [
    (lambda: bad_dequantize(out=torch.empty(3, 5, dtype=torch.float64)),
     "int8_matmul_dequantize: out must be a contiguous float32 or bfloat16 \\[3, 5\\]"),
    (lambda: bad_dequantize(out=torch.empty(5, 3).T), "int8_matmul_dequantize: out must be a contiguous"),
    (lambda: bad_dequantize(scale=torch.ones(4)), "int8_matmul_dequantize: scale \\(float32\\) and zero_point"),
    (lambda: torch.ops.fastbert_C.int8_matmul_dequantize(
        torch.zeros(3, 7, dtype=torch.uint8), torch.ops.fastbert_C.int8_pack(torch.zeros(5, 8, dtype=torch.int8)), 5, 8,
        torch.ones(5), torch.ones(3), torch.zeros(3, dtype=torch.int32), torch.zeros(5), None, 0, 0, torch.empty(3, 5)),
     "int8_matmul_dequantize: q must be a contiguous uint8 \\[m, k = 8\\]"),
])
def test_dequantize_in_the_tiles_bad_input_is_named(call, message):
    skip_unless_isa(1)
    with pytest.raises(RuntimeError, match=message):
        call()


def test_int8_pack_layout():
    skip_unless_isa(1)
    weight = torch.randint(-128, 128, (19, 7), dtype=torch.int8)
    packed = torch.ops.fastbert_C.int8_pack(weight)
    assert packed.dtype == torch.int8 and packed.shape == (2, 2, 16, 4)  # n 19 -> 2 blocks of 16, k 7 -> 2 groups of 4
    # packed[block, group, channel, t] = weight[16 block + channel, 4 group + t], zero past n and k.
    padded = torch.zeros(32, 8, dtype=torch.int8)
    padded[:19, :7] = weight
    assert torch.equal(packed, padded.view(2, 16, 2, 4).permute(0, 2, 1, 3))
    assert torch.equal(torch.ops.fastbert_C.int8_pack(weight.T.contiguous().T), packed)  # any strides


def test_own_gemm_keeps_the_packed_weight_in_prepared():
    skip_unless_isa(1)
    q, weight, weight_scale = int8_operands(5, 40, 33)
    prepared = PreparedWeights()
    first = own_gemm(q, weight, weight_scale, prepared)
    packed = prepared.get("int8_packed", (weight,), lambda w: pytest.fail("packed again though weight is unchanged"))
    assert torch.equal(packed, torch.ops.fastbert_C.int8_pack(weight))
    assert torch.equal(own_gemm(q, weight, weight_scale, prepared), first)
    weight.neg_()  # an in-place write: the packing is made again
    assert torch.equal(own_gemm(q, weight, weight_scale, prepared), exact_gemm(q, weight, weight_scale))


def bad_matmul(q=None, packed=None, n=5, k=8, weight_scale=None, isa=0, out=None):
    """int8_matmul on a good [3, 8] x [5, 8] problem with one argument replaced."""
    q = torch.zeros(3, 8, dtype=torch.uint8) if q is None else q
    packed = torch.ops.fastbert_C.int8_pack(torch.zeros(5, 8, dtype=torch.int8)) if packed is None else packed
    weight_scale = torch.ones(5) if weight_scale is None else weight_scale
    out = torch.empty(3, 5) if out is None else out
    torch.ops.fastbert_C.int8_matmul(q, packed, n, k, weight_scale, isa, out)


@pytest.mark.parametrize("call,message", [
    (lambda: bad_matmul(q=torch.zeros(3, 8, dtype=torch.int8)), "q must be a contiguous uint8 \\[m, k = 8\\]"),
    (lambda: bad_matmul(q=torch.zeros(8, 3, dtype=torch.uint8).T), "q must be .* \\(not contiguous\\)"),
    (lambda: bad_matmul(q=torch.zeros(3, 2, 4, dtype=torch.uint8)), "q must be a contiguous uint8"),
    (lambda: bad_matmul(q=torch.zeros(3, 7, dtype=torch.uint8)),
     "q must be a contiguous uint8 \\[m, k = 8\\] .* \\[3, 7\\]"),
    (lambda: bad_matmul(weight_scale=torch.ones(5, dtype=torch.float64)), "weight_scale must be a contiguous float32"),
    (lambda: bad_matmul(weight_scale=torch.ones(6)), "weight_scale must be a contiguous float32 \\[n = 5\\]"),
    (lambda: bad_matmul(n=17, weight_scale=torch.ones(17), out=torch.empty(3, 17)),
     "packed must be int8_pack's output for an \\[n, k\\] = \\[17, 8\\] weight: int8 \\[2, 2, 16, 4\\]"),
    (lambda: bad_matmul(packed=torch.zeros(1, 2, 16, 4, dtype=torch.uint8)), "packed must be int8_pack's output"),
    (lambda: bad_matmul(n=-1), "n and k \\(the weight's shape\\) must be >= 0"),
    (lambda: bad_matmul(out=torch.empty(3, 6)), "out must be a contiguous float32 \\[3, 5\\]"),
    (lambda: bad_matmul(out=torch.empty(3, 5, dtype=torch.bfloat16)), "out must be a contiguous float32"),
    (lambda: bad_matmul(out=torch.empty(5, 3).T), "out must be a contiguous float32"),
    (lambda: bad_matmul(isa=6), "isa must be 0 \\(best available\\), 1 \\(portable C\\+\\+\\)"),
    (lambda: bad_matmul(isa=-1), "isa must be 0"),
    (lambda: torch.ops.fastbert_C.int8_pack(torch.zeros(3, 4)), "int8_pack: weight must be an int8 \\[n, k\\]"),
    (lambda: torch.ops.fastbert_C.int8_pack(torch.zeros(3, dtype=torch.int8)), "int8_pack: weight must be an int8"),
    (lambda: torch.ops.fastbert_C.int8_pack(torch.zeros(1, 65794, dtype=torch.int8)), "could overflow"),
    (lambda: own_gemm(torch.zeros(2, 7, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.int8), torch.ones(3), None),
     "q must be a contiguous uint8 \\[m, k = 8\\]"),
    (lambda: own_gemm(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.int8), torch.ones(4), None),
     "weight_scale must be a contiguous float32 \\[n = 3\\]"),
])
def test_own_gemm_bad_input_is_named(call, message):
    skip_unless_isa(1)
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("isa", [2, 3, 4, 5])
def test_forcing_an_isa_the_cpu_lacks_raises(isa):
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    if torch.ops.fastbert_C.int8_isa_supported(isa):
        pytest.skip(f"this CPU has {CPU_FLAGS[isa]}: nothing to refuse")
    with pytest.raises(RuntimeError, match=f"isa {isa} .* needs a CPU with .*; this CPU lacks it"):
        bad_matmul(isa=isa)


def run_cpu(x, weight, weight_scale, b, activation, approximate, gemm, prepared=None, **kw):
    """The cpu kernel with the GEMM step `gemm` (dispatch's "fastbert" variant takes the best ISA only)."""
    with torch.no_grad(), poison_outputs():
        return _cpu(x, weight, weight_scale, b, EPILOGUES[activation, approximate], prepared,
                       kw.get("quantize_output", False), kw.get("input_scale"), kw.get("input_zero_point"), gemm=gemm)


@pytest.mark.parametrize("isa_name,isa", ISAS, ids=[name for name, _ in ISAS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,n,activation,approximate", SHAPES, ids=str)
def test_own_gemm_op_equals_onednn(shape, n, activation, approximate, dtype, isa_name, isa):
    skip_unless_isa(isa)
    skip_unless_onednn()
    x = (torch.randn(*shape) * (0.5 + torch.rand(*shape[:-1], 1) * 4) + torch.randn(*shape[:-1], 1)).to(dtype)
    weight, w_scale, b = layer(n, shape[-1])
    own, onednn = own_gemm_step(isa), ONEDNN_GEMM
    prepared = PreparedWeights()
    # Dynamic: the same bytes into both GEMMs, whose integer sums are exact; twice with `prepared`, so the
    # second call runs on the kept packing.
    want = run_cpu(x, weight, w_scale, b, activation, approximate, onednn)
    for _ in range(2):
        assert_close(run_cpu(x, weight, w_scale, b, activation, approximate, own, prepared), want, dtype, "matmul")
    assert "int8_packed" in repr(prepared)
    # Dynamic, quantized output: the next layer's bytes, dequantized.
    rows = run_cpu(x, weight, w_scale, b, activation, approximate, own, quantize_output=True)
    want_rows = run_cpu(x, weight, w_scale, b, activation, approximate, onednn, quantize_output=True)
    assert isinstance(rows, ops.QuantizedRows) and rows.values.shape == want_rows.values.shape
    assert_close(rows.dequantize(), want_rows.dequantize(), dtype, "matmul")
    # Static: one calibrated range; oneDNN fuses bias and GELU, the own GEMM goes through the rows' epilogue.
    scale, zero_point = reference.range_to_scale(float(x.min()) * 0.8, float(x.max()) * 0.8)
    static = dict(input_scale=scale, input_zero_point=zero_point)
    out = run_cpu(x, weight, w_scale, b, activation, approximate, own, **static)
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    assert_close(out, run_cpu(x, weight, w_scale, b, activation, approximate, onednn, **static), dtype, "matmul")


def test_onednn_is_refused_exactly_where_its_sums_are_wrong():
    """Without VNNI or AMX (AVX2-only CPUs) oneDNN's u8 x s8 GEMM saturates pairs of products in int16:
    dispatch must never pick it there, and must keep it where it is exact. Checked on other values than
    onednn_inexact's own."""
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    if _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise")):
        pytest.skip("; ".join(_onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise"))))
    q = torch.randint(192, 256, (3, 256), dtype=torch.uint8)
    weight = torch.randint(-127, 128, (16, 256), dtype=torch.int8)
    weight[1], weight[2] = 127, -128
    exact = (q.double() @ weight.double().t()).float()
    got = ONEDNN_GEMM.run(q, ONEDNN_GEMM.pack(weight, None, q.shape[0]), torch.ones(16))
    why = dispatch.usable_variants("quantized_dense", "cpu", dispatch.Facts(("cpu",), (torch.float32,)))[1]
    if torch.equal(got, exact):
        assert "onednn" not in why, why
        return
    assert "saturates" in why["onednn"][0], why
    x = torch.randn(5, 64)
    weight, scale, b = layer(32, 64)
    with torch.no_grad(), dispatch.record() as calls:
        ops.quantized_dense(x, weight, scale, b, "gelu")
    assert [c.variant for c in calls] == ["fastbert"]


def test_without_onednn_int8_runs_on_fastbert_own_gemm(monkeypatch):
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    from fastbert.ops import _onednn

    missing = _onednn.missing
    monkeypatch.setattr(_onednn, "missing", lambda namespace="mkldnn", names=(): (
        ["this torch build lacks torch.ops.onednn.qlinear_pointwise"] if namespace == "onednn" else missing(namespace, names)))
    dispatch._choices.clear()
    x = torch.randn(5, 64)
    weight, scale, b = layer(32, 64)
    try:
        with torch.no_grad(), dispatch.record() as calls:
            out = ops.quantized_dense(x, weight, scale, b, "gelu")
        why = dispatch.usable_variants("quantized_dense", "cpu", dispatch.Facts(("cpu",), (torch.float32,)))[1]
    finally:
        dispatch._choices.clear()
    assert_ran(calls, "quantized_dense", "cpu")
    assert calls[0].variant == "fastbert" and "qlinear_pointwise" in why["onednn"][0]
    assert_close(out, reference.quantized_dense(x.double(), weight, scale, b.double(), "gelu"), torch.float32, "matmul",
                 naive=reference.quantized_dense(x, weight, scale, b, "gelu"))
