"""quantized_dense: dense with int8 weights, for inference. The weight is int8 per output channel
(symmetric, reference.quantize_weight); x is quantized per row (per token) to uint8 with a zero point
(reference.quantize_rows); the product is summed in int32 and dequantized, with bias and GELU, into x's
dtype."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from fastbert import dispatch, tuning
from fastbert.ops import _alloc, _checks, _onednn, reference
from fastbert.ops._op import needs_grad
from fastbert.ops.dense import ACTIVATION_CODES, EPILOGUES, linear_checks, linear_class
from fastbert.ops.prepared import PreparedWeights
from fastbert.ops.reference import QuantizedRows


EAGER_ONLY = "int8 models run eagerly: torch.compile of quantized_dense is not supported yet"


def _run_eagerly(fn):
    """Dynamo never traces `fn` or what it calls: a compiled int8 model runs its int8 GEMMs eagerly (a graph
    break around each), and fullgraph=True fails naming EAGER_ONLY. torch before 2.8 takes no reason."""
    try:
        return torch.compiler.disable(fn, reason=EAGER_ONLY)
    except TypeError:
        return torch.compiler.disable(fn)


@_run_eagerly
def quantized_dense(x, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    activation: str = "none", approximate: str = "none", prepared: PreparedWeights | None = None,
                    quantize_output: bool = False, input_scale: torch.Tensor | None = None,
                    input_zero_point: torch.Tensor | None = None):
    """x [..., K] float32 or bfloat16, or QuantizedRows of it; weight int8 [N, K] and weight_scale float32
    [N] (weight ~= values x scale, as reference.quantize_weight makes them); bias [N] or None -> [..., N] in
    x's dtype, or with `quantize_output` as QuantizedRows, the next quantized_dense's input (the float
    result is never written). activation and approximate as for dense; `prepared`: the owner's
    PreparedWeights, where kernels keep the packed weight. `input_scale` (float32, 0-dim) and
    `input_zero_point` (int32, 0-dim): static quantization, x quantized with this calibrated range
    instead of each row's own (then bias and GELU run inside oneDNN's GEMM)."""
    if torch.compiler.is_compiling():  # tracers that do not honour compiler.disable (torch.export non-strict)
        raise NotImplementedError(EAGER_ONLY)
    rows = isinstance(x, QuantizedRows)
    tensors = (x.values, weight, x.scale) if rows else (x, weight)
    trusted = dispatch.trusted("quantized_dense", tensors[0], activation, approximate, quantize_output, rows,
                               bias is None, input_scale is None)
    if not trusted or input_scale is not None:  # static layers' checks read the calibrated range: every call
        _checks_of(x, weight, weight_scale, bias, activation, approximate, prepared, quantize_output, input_scale,
                   input_zero_point)
    epilogue = EPILOGUES[activation, approximate]
    # The kernels read the scales densely: a strided weight_scale gave oneDNN's GEMM other channels' scales.
    weight_scale = weight_scale.contiguous()
    if rows and not (x.scale.is_contiguous() and x.zero_point.is_contiguous()):
        x = x._replace(scale=x.scale.contiguous(), zero_point=x.zero_point.contiguous())
    # QuantizedRows stand for a float dtype no tensor of theirs holds: the result's, which a backend must serve
    inputs = {"tensors": tensors, "dtypes": (x.dtype,)} if rows else {"tensors": tensors}
    return dispatch.call("quantized_dense", inputs, x, weight, weight_scale, bias, epilogue, prepared,
                         bool(quantize_output), input_scale, input_zero_point)


def _checks_of(x, weight, weight_scale, bias, activation, approximate, prepared, quantize_output, input_scale,
               input_zero_point) -> None:
    first = x.values if isinstance(x, QuantizedRows) else x
    if isinstance(x, QuantizedRows):
        _check_rows(x)
    else:
        _checks.tensor("x", x, (1, 2, 3, 4))
    _checks.tensor("weight", weight, (2,), floating=False)
    if weight.dtype != torch.int8:
        raise ValueError(f"weight must be int8 (reference.quantize_weight makes it), got {weight.dtype}")
    _checks.tensor("weight_scale", weight_scale, (1,))
    if weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32, got {weight_scale.dtype}")
    _checks.shape("weight_scale", weight_scale, (weight.shape[0],), "weight's first dimension")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None:
            _checks.same_device(name, t, "x", first)
    linear_checks(first, weight, bias, activation, approximate, prepared)
    if (input_scale is None) != (input_zero_point is None):
        raise ValueError("input_scale and input_zero_point come together (static quantization) or not at all")
    if input_scale is not None:
        if isinstance(x, QuantizedRows) or quantize_output:
            raise ValueError("static quantization (input_scale) takes float x and returns floats")
        if input_scale.dtype != torch.float32 or input_scale.dim() != 0 or not float(input_scale) > 0:
            raise ValueError(f"input_scale must be a positive float32 0-dim tensor, got {input_scale!r}")
        if input_zero_point.dtype != torch.int32 or input_zero_point.dim() != 0 or not 0 <= int(input_zero_point) <= 255:
            raise ValueError(f"input_zero_point must be an int32 0-dim tensor in [0, 255], got {input_zero_point!r}")
    if needs_grad(first, bias):
        raise ValueError("quantized_dense is for inference: int8 weights have no gradient (run under "
                         "torch.no_grad() or torch.inference_mode(), or train the float model and quantize it after)")


def _check_rows(x: QuantizedRows) -> None:
    if x.values.dtype != torch.uint8 or x.values.dim() not in (2, 3, 4):
        raise ValueError(f"QuantizedRows.values must be 2-D to 4-D uint8, got {x.values.dtype} {tuple(x.values.shape)}")
    rows = x.values.numel() // max(x.values.shape[-1], 1)
    if x.scale.dtype != torch.float32 or x.scale.shape != (rows,):
        raise ValueError(f"QuantizedRows.scale must be float32 [{rows}], got {x.scale.dtype} {tuple(x.scale.shape)}")
    if x.zero_point.dtype != torch.int32 or x.zero_point.shape != (rows,):
        raise ValueError(f"QuantizedRows.zero_point must be int32 [{rows}], got {x.zero_point.dtype} "
                         f"{tuple(x.zero_point.shape)}")
    if x.dtype not in dispatch.FLOATS:
        raise ValueError(f"QuantizedRows.dtype must be a float dtype, got {x.dtype}")


@dispatch.register("quantized_dense", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))
def _reference(x, weight, weight_scale, bias, epilogue, prepared, quantize_output, input_scale, input_zero_point):
    activation, approximate = next(k for k, v in EPILOGUES.items() if v == epilogue)
    return reference.quantized_dense(x, weight, weight_scale, bias, activation, approximate, quantize_output,
                                     input_scale, input_zero_point)


# ------------------------- cpu: a u8 x s8 GEMM (oneDNN's, or own_gemm) between fastbert._C's quantize and epilogue



def _packed(weight, rows_hint):
    return torch.ops.onednn.qlinear_prepack(weight.contiguous(), [max(rows_hint, 1), weight.shape[1]])


def _prepared_int8(prepared, weight, rows):
    if prepared is None:
        return _packed(weight, rows)
    return prepared.get("onednn_int8", (weight,), lambda w: _packed(w, rows))


def _weight_sums(weight, weight_scale):
    """weight_scale x each output channel's sum of int8 values: the zero point's share of the GEMM."""
    return weight.sum(1, dtype=torch.int32).float() * weight_scale


class Int8Gemm(NamedTuple):
    """The u8 x s8 GEMM step of the cpu kernel, from oneDNN (ONEDNN_GEMM) or fastbert._C (own_gemm_step).
    `pack(weight, prepared, rows)`: the weight in the GEMM's form, made once per call (kept in `prepared`);
    `run(q, packed, weight_scale)`: float32 [rows, N] = weight_scale x float(q @ weight^T) for q uint8
    [rows, K], the integer sums exact (x's scale 1 and zero point 0: the epilogue applies each row's);
    `dequantize(q, packed, weight_scale, scale, zero_point, wsum, bias, activation, out)`, where the GEMM
    has it: run and dequantize_rows in one, each tile dequantized while in cache (None: two steps)."""
    pack: Callable
    run: Callable
    dequantize: Callable | None = None


def _onednn_pack(weight, prepared, rows):
    return _prepared_int8(prepared, weight, rows), torch.zeros(weight.shape[0], dtype=torch.int64)


def _onednn_run(q, packed, weight_scale):
    packed, zeros = packed
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, weight_scale, zeros, None, 1.0, 0, torch.float32,
                                             "none", [], "")


ONEDNN_GEMM = Int8Gemm(_onednn_pack, _onednn_run)


@functools.lru_cache(maxsize=None)
def onednn_inexact() -> list[str]:
    """Why oneDNN's int8 GEMM gives wrong sums on this CPU; empty where it is exact. Without VNNI or AMX
    (AVX2-only CPUs, AVX-512 before Cascade Lake) oneDNN adds pairs of u8 x s8 products in int16 with
    saturation (vpmaddubsw), so large activations against large weights clip: checked once, at the worst
    case, and on random values at a small shape and at BERT's width (oneDNN picks kernels by shape)."""
    k, n = 64, 16
    generator = torch.Generator().manual_seed(0)

    def random(m, k, n):
        return (torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=generator),
                torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator))

    cases = {"255 x 127": (torch.full((4, k), 255, dtype=torch.uint8), torch.full((n, k), 127, dtype=torch.int8)),
             "random": random(4, k, n), "random 32x768x64": random(32, 768, 64)}
    for name, (q, weight) in cases.items():
        exact = (q.double() @ weight.double().t()).float()
        try:
            got = _onednn_run(q, _onednn_pack(weight, None, q.shape[0]), torch.ones(weight.shape[0]))
        except RuntimeError as e:
            return [f"oneDNN's int8 GEMM fails on this CPU ({str(e).splitlines()[0]})"]
        if not torch.equal(got, exact):
            return [f"oneDNN's int8 GEMM saturates on this CPU (no VNNI or AMX: pairs of u8 x s8 products are "
                    f"summed in int16): {name} sums were off by up to {(got - exact).abs().max().item():.0f}"]
    return []


def _own_pack(weight, prepared, rows):
    """(packed, n, k): int8_matmul takes the weight's shape beside its padded packing."""
    if prepared is None:
        return torch.ops.fastbert_C.int8_pack(weight), *weight.shape
    return prepared.get("int8_packed", (weight,), torch.ops.fastbert_C.int8_pack), *weight.shape


def _own_run(q, packed, weight_scale, isa):
    packed, n, k = packed
    out = _alloc.empty((q.shape[0], n), dtype=torch.float32, device=q.device)
    torch.ops.fastbert_C.int8_matmul(q, packed, n, k, weight_scale.contiguous(), isa, out)
    return out


def _own_dequantize(q, packed, weight_scale, scale, zero_point, wsum, bias, activation, out, isa):
    packed, n, k = packed
    torch.ops.fastbert_C.int8_matmul_dequantize(q, packed, n, k, weight_scale.contiguous(), scale, zero_point, wsum,
                                                bias, activation, isa, out)


ISAS = {"best": 0, "portable": 1, "avx_vnni": 2, "avx512_vnni": 3, "avx2": 4, "amx": 5}  # int8_matmul's isa codes


@functools.lru_cache(maxsize=None)
def own_gemm_step(isa: int = 0) -> Int8Gemm:
    """fastbert's own GEMM (csrc/cpu/int8_gemm.h) as the cpu kernel's GEMM step: where torch's build lacks
    oneDNN's quantized ops. `isa` as ISAS: 0 picks the best this CPU has; forcing one it lacks raises."""
    from fastbert import _C  # noqa: F401  (defines torch.ops.fastbert_C; own_gemm may run before dispatch loads it)

    return Int8Gemm(_own_pack, functools.partial(_own_run, isa=isa), functools.partial(_own_dequantize, isa=isa))


def own_gemm(q, weight, weight_scale, prepared: PreparedWeights | None, isa: int = 0) -> torch.Tensor:
    """float32 [M, N] = weight_scale x float(q @ weight^T) for q uint8 [M, K], weight int8 [N, K] and
    weight_scale float32 [N], the int32 sums exact: what oneDNN's GEMM gives the epilogue. The packed
    weight is kept in `prepared` under "int8_packed" (packed on every call without one)."""
    step = own_gemm_step(isa)
    return step.run(q.contiguous(), step.pack(weight, prepared, q.shape[0]), weight_scale)


@dispatch.register("quantized_dense", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)))
def _cpu(x, weight, weight_scale, bias, epilogue, prepared, quantize_output, input_scale, input_zero_point,
         gemm: Int8Gemm = ONEDNN_GEMM):
    n, k = weight.shape
    if isinstance(x, QuantizedRows):
        lead, dtype, device = x.values.shape[:-1], x.dtype, x.values.device
        q, scale, zero_point = x.values.reshape(-1, k).contiguous(), x.scale, x.zero_point
    else:
        lead, dtype, device = x.shape[:-1], x.dtype, x.device
        x2d = x.reshape(-1, k).contiguous()
        q = _alloc.empty(x2d.shape, dtype=torch.uint8, device=device)
        if input_scale is not None and gemm is ONEDNN_GEMM:
            return _static(x2d, q, lead, weight, weight_scale, bias, epilogue, prepared, input_scale, input_zero_point)
        if input_scale is not None:
            # Another GEMM has no fused static epilogue: every row takes the one calibrated scale and zero
            # point, and the rows' epilogue below applies them.
            torch.ops.fastbert_C.quantize_tensor(x2d, float(input_scale), int(input_zero_point), q)
            scale = torch.full((x2d.shape[0],), float(input_scale), dtype=torch.float32, device=device)
            zero_point = torch.full((x2d.shape[0],), int(input_zero_point), dtype=torch.int32, device=device)
        else:
            scale = _alloc.empty((x2d.shape[0],), dtype=torch.float32, device=device)
            zero_point = _alloc.empty((x2d.shape[0],), dtype=torch.int32, device=device)
            torch.ops.fastbert_C.quantize_rows(x2d, q, scale, zero_point)
    m = q.shape[0]
    packed = gemm.pack(weight, prepared, m)
    wsum = _weight_sums(weight, weight_scale) if prepared is None else prepared.get(
        "int8_sums", (weight, weight_scale), _weight_sums)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()  # (a call saved where it is already: Int8Linear keeps it so)
    code = ACTIVATION_CODES[epilogue]
    if quantize_output:
        out = QuantizedRows(_alloc.empty((m, n), dtype=torch.uint8, device=device),
                            _alloc.empty((m,), dtype=torch.float32, device=device),
                            _alloc.empty((m,), dtype=torch.int32, device=device), dtype)
    else:
        out = _alloc.empty((m, n), dtype=dtype, device=device)
        if gemm.dequantize is not None:  # no float32 product: each tile is dequantized in cache
            gemm.dequantize(q, packed, weight_scale, scale, zero_point, wsum, bias, code, out)
            return out.view(*lead, n)
    # Blocks of rows, so that the GEMM's float32 block is still in cache when the epilogue reads it.
    step = rows_per_block(n)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        block = (lambda t: t) if r1 - r0 == m else (lambda t: t[r0:r1])  # one block: no slicing calls
        acc = gemm.run(block(q), packed, weight_scale)  # weight_scale x (q @ weight^T); rows are scaled after
        rows = (acc, block(scale), block(zero_point), wsum, bias, code)
        if quantize_output:
            torch.ops.fastbert_C.requantize_rows(*rows, block(out.values), block(out.scale), block(out.zero_point))
        else:
            torch.ops.fastbert_C.dequantize_rows(*rows, block(out))
    if quantize_output:
        return out._replace(values=out.values.view(*lead, n))
    return out.view(*lead, n)


def _cache_bytes() -> int:
    """Twice one core's L2 (2 MiB where it cannot be read): what a GEMM block may fill. Smaller blocks leave
    oneDNN too few rows to be fast; whole GEMMs spill to memory (benchmarks/RESULTS.md)."""
    return 2 * (tuning.cache_bytes(2) or 1 << 20)


def rows_per_block(n: int) -> int:
    """Rows of a float32 [rows, n] GEMM block that fit _cache_bytes, in multiples of 32 (at least 32)."""
    return max(32, _cache_bytes() // (4 * n) // 32 * 32)


def _static(x2d, q, lead, weight, weight_scale, bias, epilogue, prepared, input_scale, input_zero_point):
    """One calibrated scale for x: oneDNN applies it, the zero point, bias and GELU inside the GEMM."""
    scale, zero_point = float(input_scale), int(input_zero_point)
    torch.ops.fastbert_C.quantize_tensor(x2d, scale, zero_point, q)
    n = weight.shape[0]
    post, scalars, algorithm = _onednn.POST_OPS[epilogue]
    out = torch.ops.onednn.qlinear_pointwise(
        q, scale, zero_point, _prepared_int8(prepared, weight, q.shape[0]), weight_scale,
        torch.zeros(n, dtype=torch.int64), None if bias is None else bias.float().contiguous(), 1.0, 0, x2d.dtype,
        post, scalars, algorithm)
    return out.view(*lead, n)


def _shape_class(x, weight, weight_scale, bias, epilogue, prepared, quantize_output, input_scale, *_):
    quantized = isinstance(x, QuantizedRows)
    # x's float dtype by name: QuantizedRows' tensors (uint8, float32 scales) do not say it.
    source = ("rows " if quantized else "") + str(x.dtype).replace("torch.", "")
    return (*linear_class(x.values if quantized else x, weight), epilogue, source,
            "static" if input_scale is not None else "dynamic", "to-rows" if quantize_output else "to-float")


# oneDNN's GEMM first (AMX where the CPU has it); fastbert's own (VNNI, AVX2 or portable C++) where torch's
# build lacks oneDNN's quantized ops, where oneDNN's sums are wrong (no VNNI), or where it measures faster.
dispatch.register_variants("quantized_dense", "cpu", (
    dispatch.Variant("onednn", _cpu, lambda facts: _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise"))
                     or onednn_inexact()),
    dispatch.Variant("fastbert", lambda *args: _cpu(*args, gemm=own_gemm_step(0))),
), _shape_class, weights=True)
