"""dense: x @ weight.T + bias, with an optional GELU fused into the epilogue."""
from __future__ import annotations

import dataclasses

import torch

from fastbert import dispatch
from fastbert.ops import _alloc, _checks, _onednn, reference
from fastbert.ops._op import OpSpec, entry, needs_grad
from fastbert.ops.bias_gelu import CXX as bias_gelu_cxx
from fastbert.ops.prepared import PreparedWeights


@dispatch.follows_autocast
def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
          approximate: str = "none", prepared: PreparedWeights | None = None):
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]; activation "none" | "gelu", GELU's form
    `approximate` "none" (erf) | "tanh", as in bias_gelu and torch's F.gelu.
    `prepared`: the PreparedWeights of the module that owns `weight`, where kernels may keep a packed copy."""
    if not dispatch.trusted("dense", x, activation, approximate, bias is None):
        _checks.tensor("x", x, (1, 2, 3, 4))
        _checks.tensor("weight", weight, (2,))
        _checks.same_dtype_device(x=x, weight=weight, bias=bias)
        linear_checks(x, weight, bias, activation, approximate, prepared)
    epilogue = EPILOGUES[activation, approximate]
    inputs = {"tensors": (x, weight, bias), "gelu": epilogue != "none" and bias is not None}
    return dispatch.call("dense", inputs, x, weight, bias, epilogue, prepared)


# The kernels' one code for what follows the GEMM.
EPILOGUES = {("none", "none"): "none", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh"}


def linear_checks(x, weight, bias, activation, approximate, prepared) -> None:
    """The checks every linear op shares (dense, quantized_dense) past its tensors' own."""
    _checks.features("x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape [N, {x.shape[-1]}] (x's last dimension), got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"weight has no rows (0 output features), shape {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, (1,))
        _checks.shape("bias", bias, (weight.shape[0],), "weight's first dimension")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    if approximate not in reference.APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {reference.APPROXIMATIONS}, got {approximate!r}")
    if activation == "none" and approximate != "none":
        raise ValueError(f"approximate={approximate!r} is GELU's form: it needs activation='gelu'")
    if prepared is not None and not isinstance(prepared, PreparedWeights):
        raise ValueError(f"prepared must be a fastbert.ops.PreparedWeights or None, got {type(prepared).__name__}")


@dispatch.register("dense", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))
def _reference(x, weight, bias, epilogue, prepared):
    activation, approximate = next(k for k, v in EPILOGUES.items() if v == epilogue)
    return reference.dense(x, weight, bias, activation, approximate)


def linear_backward_fake(x, weight, bias):
    """Gradients of x, weight and bias (shape [0] without a bias) of a linear layer, as fakes."""
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0] if bias is not None else 0)


def linear_input_grads(inputs, grads):
    """(x, weight, bias, flag) inputs of a linear layer's kernel pair: the bias's gradient only where given."""
    return grads[0], grads[1], None if inputs[2] is None else grads[2], None


# epilogue(x @ weight.T + bias) for x [..., K], weight [N, K], epilogue "none" | "gelu" | "gelu_tanh" (the
# kernels' one code, EPILOGUES); the backward returns (grad of x, of weight, of bias: [0] without one).
SPEC = OpSpec(
    "dense",
    forward_schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor",
    backward_schema="(Tensor grad, Tensor x, Tensor weight, Tensor? bias, str activation) -> (Tensor, Tensor, Tensor)",
    forward_fake=lambda x, weight, bias, activation: x.new_empty(*x.shape[:-1], weight.shape[0]),
    backward_fake=lambda grad, x, weight, bias, activation: linear_backward_fake(x, weight, bias),
    saved=lambda inputs, outputs: inputs,  # the backward recomputes the pre-activation where there is a GELU
    input_grads=linear_input_grads,
)


def approximation(epilogue: str) -> str:
    """The bias_gelu op's `approximate` for a GELU epilogue ("gelu" or "gelu_tanh")."""
    return "tanh" if epilogue == "gelu_tanh" else "none"


# ------------------------------------------------------------------------ onednn: torch's own oneDNN GEMM


def _onednn_forward(x, weight, bias, activation):
    y = _onednn.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, activation)
    return y.view(*x.shape[:-1], weight.shape[0])


def _onednn_backward(grad, x, weight, bias, activation, float32_on_onednn=True):
    g2d, x2d = grad.reshape(-1, weight.shape[0]).contiguous(), x.reshape(-1, x.shape[-1]).contiguous()
    if activation != "none":  # training normally saves the pre-activation (see _cpu); this recomputes it
        z = _onednn.linear(x2d, weight, bias, "none")
        g2d, _ = bias_gelu_cxx.backward(g2d, z, torch.zeros_like(weight[:, 0]), approximation(activation))
    if x.dtype == torch.float32 and x2d.shape[0] > 0 and float32_on_onednn:
        # g @ W and g^T @ x as oneDNN linears over transposed views (oneDNN copies a transposed input
        # first): in float32 1.8x torch's matmul (MKL) on a Zen 5, 0.5-0.9x on a Xeon with AMX
        # (benchmarks/RESULTS.md): the onednn+torch_backward variant is the other choice.
        grad_x = _onednn.linear(g2d, weight.contiguous().t(), None)
        grad_weight = _onednn.linear(g2d.t(), x2d.t(), None)
    else:  # bfloat16: torch's matmul is oneDNN already, and faster in this form
        grad_x, grad_weight = g2d @ weight, g2d.t() @ x2d
    grad_bias = g2d.sum(0) if bias is not None else g2d.new_empty(0)
    return grad_x.view(x.shape), grad_weight, grad_bias


ONEDNN = SPEC.kernels("onednn", _onednn_forward, _onednn_backward, "cpu")


def onednn_pair_for(op: str):
    """dense's onednn kernels as another op's pair (fastbert::<op>_onednn), so its backward records `op`."""
    return dataclasses.replace(SPEC, name=op).kernels("onednn", _onednn_forward, _onednn_backward, "cpu")


def _torch_backward(grad, x, weight, bias, activation):
    return _onednn_backward(grad, x, weight, bias, activation, float32_on_onednn=False)


def onednn_torch_backward_pair_for(op: str):
    """oneDNN's forward with the backward's GEMMs on torch's matmul (MKL in float32), as `op`'s pair
    (fastbert::<op>_onednn_torch_bwd)."""
    return dataclasses.replace(SPEC, name=op).kernels("onednn_torch_bwd", _onednn_forward, _torch_backward, "cpu")


ONEDNN_TORCH_BACKWARD = onednn_torch_backward_pair_for("dense")


# ------------------------------------- fastbert: the own float32 / bfloat16 GEMM (csrc/cpu/float_gemm.h)

GEMM_ISAS = {"best": 0, "portable": 1, "avx512": 2}  # dense_gemm's isa codes
ACTIVATION_CODES = {"none": 0, "gelu": 1, "gelu_tanh": 2}  # the C++ kernels' codes for an epilogue


def own_pack(weight, prepared: PreparedWeights | None = None):
    """weight in dense_gemm's packed layout: kept in `prepared` (the owner's), else packed now."""
    if prepared is None:
        return torch.ops.fastbert_C.dense_pack(weight)
    return prepared.get("own_packed", (weight,), torch.ops.fastbert_C.dense_pack)


def own_gemm(x, weight, bias, activation, prepared: PreparedWeights | None = None, isa: int = 0):
    """epilogue(x @ weight.T + bias) on fastbert's own GEMM, bias and GELU in its tiles; `isa` as GEMM_ISAS
    (0 the best this CPU has; forcing one it lacks raises)."""
    n, k = weight.shape
    x2d = x.reshape(x.shape[:-1].numel(), k).contiguous()  # (-1 cannot infer the rows where k is 0)
    out = _alloc.empty((x2d.shape[0], n), dtype=x.dtype, device=x.device)
    torch.ops.fastbert_C.dense_gemm(x2d, own_pack(weight, prepared), n, k, bias, ACTIVATION_CODES[activation], isa, out)
    return out.view(*x.shape[:-1], n)


def own_pair_for(op: str):
    """dense's fastbert kernels (the forward on the own GEMM, the backward on oneDNN's) as `op`'s pair
    (fastbert::<op>_fastbert), so its backward records `op`."""
    return dataclasses.replace(SPEC, name=op).kernels("fastbert", own_gemm, _onednn_backward, "cpu")


OWN = own_pair_for("dense")


def own_linear(x, weight, bias, activation, prepared: PreparedWeights | None, pair=OWN):
    """The own GEMM (through `pair`); in eager calls with no autograd on the packed copy of `weight` that
    `prepared` keeps. Training keeps the pre-activation for backward, as _cpu does."""
    if prepared is None or entry(pair.forward, x, weight, bias) is not pair.forward.direct:
        if activation != "none" and bias is not None and needs_grad(x, weight, bias):
            return bias_gelu_cxx(pair(x, weight, None, "none"), bias, approximation(activation))
        return pair(x, weight, bias, activation)
    return own_gemm(x, weight, bias, activation, prepared)


def own_reasons(facts) -> list[str]:
    """Why the own GEMM should not serve a call: one dtype, float32 or bfloat16, on CPUs with its AVX-512
    tiles (its portable C++ form is for tests and other architectures, far slower than oneDNN)."""
    if _onednn.missing():
        return _onednn.missing()  # (its backward is oneDNN's)
    if len(set(facts.dtypes)) != 1 or facts.dtypes[0] not in (torch.float32, torch.bfloat16):
        return ["float32 or bfloat16 only"]
    if dispatch.machine_reasons("cpu"):  # fastbert._C missing: `info` still lists this variant
        return list(dispatch.machine_reasons("cpu"))
    from fastbert import _C  # noqa: F401  (defines torch.ops.fastbert_C)

    if not torch.ops.fastbert_C.dense_isa_supported(GEMM_ISAS["avx512"], facts.dtypes[0]):
        return ["this CPU lacks avx512f" + (" and avx512_bf16 (vdpbf16ps)" if facts.dtypes[0] == torch.bfloat16 else "")
                + ", which the own GEMM's tiles need"]
    return []


@dispatch.register("dense", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)))
def _cpu(x, weight, bias, activation, prepared):
    return onednn_dense(x, weight, bias, activation, prepared)


def onednn_dense(x, weight, bias, activation, prepared, pair=ONEDNN, per_thread=False):
    """dense on oneDNN's kernel `pair`: onednn_linear, except where training needs the pre-activation."""
    if activation != "none" and bias is not None and needs_grad(x, weight, bias):
        # Keep the pre-activation for backward: GEMM, then the bias_gelu kernel (saves x + bias's input).
        return bias_gelu_cxx(pair(x, weight, None, "none"), bias, approximation(activation))
    return onednn_linear(x, weight, bias, activation, prepared, pair, per_thread)


def bias_gelu_in_place(y, bias, activation):
    """y = GELU(y + bias) by fastbert's kernel, over y itself (a fresh, contiguous GEMM output)."""
    torch.ops.fastbert_C.bias_gelu_fwd(y, bias.contiguous(), activation == "gelu_tanh", y)
    return y


def onednn_then_bias_gelu(x, weight, bias, activation, prepared):
    """oneDNN's GEMM without its GELU post-op, then fastbert's bias+GELU kernel over the output (in place,
    in eager inference): on a Zen 3 the post-op added 40% to the FFN's first GEMM, this 22% (RESULTS.md)."""
    if bias is None or activation == "none":
        return _cpu(x, weight, bias, activation, prepared)
    direct = prepared is not None and entry(ONEDNN.forward, x, weight, bias) is ONEDNN.forward.direct
    if not direct or needs_grad(x, weight, bias):
        return bias_gelu_cxx(ONEDNN(x, weight, None, "none"), bias, approximation(activation))
    return bias_gelu_in_place(onednn_linear(x, weight, None, "none", prepared), bias, activation)


def onednn_reasons(facts) -> list[str]:
    return _onednn.missing() or _onednn.dtype_missing(facts.dtypes)


def onednn_rows(x, weight, bias, activation, prepared, pair=ONEDNN):
    """oneDNN's linear on each thread's share of the rows, one single-threaded call per thread (eager
    inference; otherwise as _cpu): on a Xeon with AMX bf16 1024 x 3072 -> 768 ran at ~2100 GFLOP/s so and
    ~1100 as one call over both threads, while 2048 rows ran fastest as one call (benchmarks/RESULTS.md);
    tuning measures which wins where."""
    return onednn_dense(x, weight, bias, activation, prepared, pair, per_thread=True)


def onednn_torch_backward(x, weight, bias, activation, prepared, pair=ONEDNN_TORCH_BACKWARD):
    """Training: oneDNN's forward, the backward's float32 GEMMs on torch's matmul (MKL) instead of oneDNN's
    (on a Xeon with AMX MKL ran them 1.1-2.3x faster, on a Zen 5 oneDNN 1.8x: benchmarks/RESULTS.md).
    Inference is the onednn variant's."""
    return onednn_dense(x, weight, bias, activation, prepared, pair)


def float32_training_reasons(facts) -> list[str]:
    """onednn+torch_backward's: oneDNN's, and float32 only (a bfloat16 backward is on torch's matmul already)."""
    return onednn_reasons(facts) or ([] if facts.dtypes == (torch.float32,) else ["float32 only"])


def onednn_rows_reasons(facts) -> list[str]:
    return onednn_reasons(facts) or list(dispatch.machine_reasons("cpu"))  # (a fastbert._C op)


def torch_linear(x, weight, bias, activation="none"):
    """torch's own linear (MKL or oneDNN, as torch picks) and GELU: the built-in that dense replaces."""
    y = torch.nn.functional.linear(x, weight, bias)
    return y if activation == "none" else torch.nn.functional.gelu(y, approximate=approximation(activation))


def linear_class(x, weight, *_):
    """A linear call's shape class: rows by power of two, the weight's exact shape."""
    return f"m{dispatch.size_class(x.numel() // max(x.shape[-1], 1))}", f"k{weight.shape[1]}", f"n{weight.shape[0]}"


def _torch(x, weight, bias, activation, prepared):
    """torch_linear as a variant (the cpu backend's built-in one, the cuda backend's cuBLAS one)."""
    return torch_linear(x, weight, bias, activation)


def _bucket(x, weight, bias, activation, prepared):
    return (*linear_class(x, weight), activation)


def upcast_linear(x, weight, bias, activation, prepared: PreparedWeights | None, pair=ONEDNN):
    """A bfloat16 linear as oneDNN's float32 GEMM on float32 copies, the output rounded to bfloat16: for CPUs
    where oneDNN has no bf16 GEMM and torch's bf16 F.linear runs at an eighth of fp32's rate (AVX2 only).
    bf16 values are exact in float32 and bf16 GEMMs accumulate in float32, so only the summation order (and
    a float32 GELU) differ from a bf16 GEMM's. Eager inference keeps the float32 copy, packed, in `prepared`,
    and runs a GELU as fastbert's bias+GELU kernel, not oneDNN's post-op (slow on these CPUs: see
    onednn_then_bias_gelu)."""
    def up(t):
        return None if t is None else t.float()

    if prepared is not None and entry(pair.forward, x, weight, bias) is pair.forward.direct:
        x2d = x.reshape(-1, x.shape[-1]).float()
        blocked = prepared.get("onednn_fp32", (weight,), lambda w: _onednn.pack(w.float(), x2d.shape[0]))
        if activation != "none" and bias is not None:
            y = bias_gelu_in_place(_onednn.linear(x2d, blocked, None, "none"), up(bias), activation)
        else:
            y = _onednn.linear(x2d, blocked, up(bias), activation)
        y = y.view(*x.shape[:-1], weight.shape[0])
    elif activation != "none" and bias is not None and needs_grad(x, weight, bias):
        y = bias_gelu_cxx(pair(up(x), up(weight), None, "none"), up(bias), approximation(activation))
    else:
        y = pair(up(x), up(weight), up(bias), activation)
    return y.to(x.dtype)


def gemm_output_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a CPU linear's output first exists in: float32 for bfloat16 where oneDNN has no bf16 GEMM
    (onednn-fp32 rounds it after), else `dtype`. What sizes the widest activation of a batch."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not upcast_reasons(dispatch.Facts(("cpu",), (dtype,))):
        return torch.float32
    return dtype


def upcast_reasons(facts) -> list[str]:
    """Why upcast_linear should not serve a call: only bfloat16, and only where oneDNN lacks bf16 GEMMs."""
    if _onednn.missing():
        return _onednn.missing()
    if torch.bfloat16 not in facts.dtypes:
        return ["bfloat16 only (float32 GEMMs on a bf16 call's values)"]
    if not _onednn.dtype_missing(facts.dtypes):
        return ["oneDNN runs bfloat16 GEMMs natively on this CPU"]
    return []


dispatch.register_variants("dense", "cpu", (
    dispatch.Variant("onednn", _cpu, onednn_reasons),
    dispatch.Variant("onednn+bias_gelu", onednn_then_bias_gelu,
                     lambda facts: onednn_reasons(facts) or ([] if facts.gelu else ["GELU calls with a bias only"])),
    dispatch.Variant("onednn-fp32", upcast_linear, upcast_reasons),
    dispatch.Variant("torch", _torch),
    dispatch.Variant("fastbert", own_linear, own_reasons),
    dispatch.Variant("onednn-rows", onednn_rows, onednn_rows_reasons),
    dispatch.Variant("onednn+torch_backward", onednn_torch_backward, float32_training_reasons, training_only=True),
), _bucket, weights=True)


def onednn_linear(x, weight, bias, activation, prepared: PreparedWeights | None, pair=ONEDNN, per_thread=False):
    """The oneDNN linear (through `pair`, dense's onednn kernel pair or one built on its kernels); in eager
    calls with no autograd on the copy of `weight` that `prepared` (its owner's) keeps in oneDNN's
    blocked layout (`per_thread`: as _onednn.linear's)."""
    if prepared is None or entry(pair.forward, x, weight, bias) is not pair.forward.direct:
        return pair(x, weight, bias, activation)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    blocked = prepared.get("onednn", (weight,), lambda w: _onednn.pack(w, x2d.shape[0]))
    return _onednn.linear(x2d, blocked, bias, activation, per_thread).view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------- triton (GEMM + epilogue)


def _triton_forward(x, weight, bias, activation):
    from fastbert.kernels import dense as kernel

    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    out = _alloc.empty((x2d.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    kernel.dense(x2d, weight.contiguous(), None if bias is None else bias.contiguous(), activation, out)
    return out.view(*x.shape[:-1], weight.shape[0])


def triton_linear_backward(grad, x, weight, bias, activation):
    """Gradients of activation(x @ weight.T + bias), every GEMM on Triton: g @ W, g^T @ x, and the bias's
    column sums as a GEMM with a row of ones; GELU's derivative by the bias_gelu kernel."""
    from fastbert.kernels import bias_gelu as gelu_kernel
    from fastbert.kernels import dense as kernel

    n, k = weight.shape
    g2d, x2d = grad.reshape(-1, n), x.reshape(-1, k).contiguous()
    m, weight = x2d.shape[0], weight.contiguous()

    def gemm(a, b, rows, cols):  # a [rows, inner] @ b [cols, inner].T, fp32 accumulation, in a's dtype
        out = _alloc.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
        if out.numel() == 0 or a.shape[1] == 0:  # nothing to launch; an empty sum is zero
            return out.zero_()
        return kernel.dense(a, b, None, "none", out)

    if activation != "none":  # recompute the pre-activation
        b = torch.zeros(n, dtype=x2d.dtype, device=x2d.device) if bias is None else bias.contiguous()
        z = gemm(x2d, weight, m, n)
        g2d, _ = gelu_kernel.bias_gelu_backward(g2d.contiguous(), z, b, approximation(activation) == "tanh",
                                                _alloc.empty_like(z), torch.empty_like(b))
    g2d = g2d.contiguous()
    grad_t = g2d.t().contiguous()  # [N, M]
    grad_x = gemm(g2d, weight.t().contiguous(), m, k)
    grad_weight = gemm(grad_t, x2d.t().contiguous(), n, k)
    if bias is None:
        return grad_x.view(x.shape), grad_weight, x2d.new_empty(0)
    grad_bias = gemm(torch.ones(1, m, dtype=x2d.dtype, device=x2d.device), grad_t, 1, n).view(n)
    return grad_x.view(x.shape), grad_weight, grad_bias


TRITON = SPEC.kernels("triton", _triton_forward, triton_linear_backward, "triton")


@dispatch.register("dense", "triton", dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))
def _triton(x, weight, bias, activation, prepared):
    return TRITON(x, weight, bias, activation)


# ---------------------------------------------------------------------- cuda: cuBLAS, through torch


# A GPU's linears run on cuBLAS (torch's F.linear, then GELU), as the cpu backend's run on oneDNN: the Triton
# GEMM above took 1.7-6.5x cuBLAS's time at every BERT shape on an H200 (benchmarks/RESULTS.md, twenty-second
# session). Named "torch" as the cpu backend's built-in variant is: torch's autograd differentiates it. float32
# follows torch's matmul precision setting (its default, no TF32, is what fastbert's fp32 tolerance needs).
dispatch.register("dense", "cuda", dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32)))(_torch)
dispatch.register_variants("dense", "cuda", (dispatch.Variant("torch", _torch),), _bucket)
