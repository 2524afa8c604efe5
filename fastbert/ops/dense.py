"""dense: x @ weight.T + bias, with an optional GELU fused into the epilogue."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, _onednn, reference
from fastbert.ops.bias_gelu import CXX as bias_gelu_cxx
from fastbert.ops.prepared import PreparedWeights


@dispatch.follows_autocast
def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
          prepared: PreparedWeights | None = None):
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]; activation "none" | "gelu" | "gelu_tanh".
    `prepared`: the PreparedWeights of the module that owns `weight`, where kernels may keep a packed copy."""
    _checks.tensor("x", x, (1, 2, 3, 4))
    _checks.tensor("weight", weight, (2,))
    _checks.same_dtype_device(x=x, weight=weight, bias=bias)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape [N, {x.shape[-1]}] (x's last dimension), got {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, (1,))
        _checks.shape("bias", bias, (weight.shape[0],), "weight's first dimension")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    if prepared is not None and not isinstance(prepared, PreparedWeights):
        raise ValueError(f"prepared must be a fastbert.ops.PreparedWeights or None, got {type(prepared).__name__}")
    return dispatch.call("dense", {"tensors": (x, weight, bias)}, x, weight, bias, activation, prepared)


@dispatch.register("dense", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))
def _reference(x, weight, bias, activation, prepared):
    return reference.dense(x, weight, bias, activation)


# ------------------------------------------------------------------------------ cpu (oneDNN GEMM)


@dispatch.custom_op("fastbert::dense_cpu")
def _cpu_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    y = _onednn.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, activation)
    return y.view(*x.shape[:-1], weight.shape[0])


@_cpu_forward.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _cpu_setup_context(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.activation = activation


def _cpu_autograd(ctx, grad):
    dispatch.note("dense.backward", "cpu")
    x, weight, bias = ctx.saved_tensors
    if ctx.activation != "none":
        # Training normally takes the unfused path below (pre-activation saved); this recomputes it.
        z = _cpu_forward(x, weight, bias, "none")
        grad, _ = bias_gelu_cxx.backward(grad, z, torch.zeros_like(weight[:, 0]), approximation(ctx.activation))
    return (*cpu_linear_backward(grad, x, weight, bias), None)


def cpu_linear_backward(grad, x, weight, bias):
    """Gradients of x @ weight.T + bias: (grad_x, grad_weight, grad_bias). float32 CPU GEMMs on oneDNN
    (where this torch has it), everything else on torch's matmul."""
    g2, x2 = grad.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float32 and x.device.type == "cpu" and x2.shape[0] > 0 and not _onednn.missing():
        grad_x, grad_weight = _cpu_backward(g2, x2, weight)
        grad_x = grad_x.view(x.shape)
    else:
        grad_x, grad_weight = (g2 @ weight).view(x.shape), g2.t() @ x2
    grad_bias = g2.sum(0) if bias is not None else None
    return grad_x, grad_weight, grad_bias


# A custom op (opaque to torch.compile): Inductor lowers a bare mkldnn._linear_pointwise only for weights
# it holds as constants (frozen inference graphs), and the backward is traced.
@torch.library.custom_op("fastbert::dense_cpu_backward", mutates_args=())
def _cpu_backward(g2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x2d, grad of weight) for x2d @ weight.T: g2d @ weight and g2d.T @ x2d as oneDNN linears
    (the weight argument read through its transposed view; oneDNN copies a transposed input first). For
    float32 only: there torch's matmul (MKL) ran these at ~225 GFLOP/s on the Zen 5 VM and this at ~410
    (1024 x 768 x 3072); in bfloat16 torch's matmul is oneDNN already and faster (770 vs 556)."""
    g2d, x2d = g2d.contiguous(), x2d.contiguous()
    grad_x = _onednn.linear(g2d, weight.contiguous().t(), None)
    grad_weight = _onednn.linear(g2d.t(), x2d.t(), None)
    return grad_x, grad_weight


@_cpu_backward.register_fake
def _(g2d, x2d, weight):
    return x2d.new_empty(x2d.shape), weight.new_empty(weight.shape)


_cpu_forward.register_autograd(_cpu_autograd, setup_context=_cpu_setup_context)


@dispatch.register("dense", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)),
                   extra_reasons=lambda facts: _onednn.missing())
def _cpu(x, weight, bias, activation, prepared):
    if activation != "none" and bias is not None and dispatch.needs_grad(x, weight, bias):
        # Keep the pre-activation for backward: GEMM, then the bias_gelu kernel (saves x + bias's input).
        z = _cpu_forward(x, weight, None, "none")
        return bias_gelu_cxx(z, bias, approximation(activation))
    run = dispatch.entry(_cpu_forward, x, weight, bias)
    if run is _cpu_forward.direct and prepared is not None:  # eager, no autograd: the owner's packed weight
        return cpu_packed(x, weight, bias, activation, prepared)
    return run(x, weight, bias, activation)


def approximation(activation: str) -> str:
    """The bias_gelu op's `approximate` for a dense `activation` ("gelu" or "gelu_tanh")."""
    return "tanh" if activation == "gelu_tanh" else "none"


def cpu_packed(x, weight, bias, activation, prepared: PreparedWeights):
    """The oneDNN linear on the copy of `weight` that `prepared` keeps in oneDNN's blocked layout."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    blocked = prepared.get("onednn", (weight,), lambda w: _onednn.pack(w, x2d.shape[0]))
    return _onednn.linear(x2d, blocked, bias, activation).view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------ triton (GEMM + epilogue)


@dispatch.custom_op("fastbert::dense_triton")
def _triton_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    from fastbert.kernels import dense as kernel

    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    out = dispatch.empty((x2d.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    kernel.dense(x2d, weight.contiguous(), None if bias is None else bias.contiguous(), activation, out)
    return out.view(*x.shape[:-1], weight.shape[0])


@_triton_forward.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _triton_autograd(ctx, grad):
    dispatch.note("dense.backward", "triton")
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = triton_linear_backward(grad, x, weight, bias, ctx.activation)
    return grad_x, grad_weight, grad_bias if bias is not None else None, None


def triton_linear_backward(grad, x, weight, bias, activation="none"):
    """Gradients of activation(x @ weight.T + bias), every GEMM on Triton: (grad_x, grad_weight, grad_bias;
    grad_bias is returned even without a bias, and then ignored)."""
    g2d = grad.reshape(-1, weight.shape[0])
    grad_x, grad_weight, grad_bias = _triton_backward(g2d, x.reshape(-1, x.shape[-1]), weight, bias, activation)
    return grad_x.view(x.shape), grad_weight, grad_bias


@torch.library.custom_op("fastbert::dense_triton_backward", mutates_args=())
def _triton_backward(g2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from fastbert.kernels import bias_gelu as gelu_kernel
    from fastbert.kernels import dense as kernel

    m, (n, k) = x2d.shape[0], weight.shape
    x2d, weight = x2d.contiguous(), weight.contiguous()
    bias = torch.zeros(n, dtype=x2d.dtype, device=x2d.device) if bias is None else bias.contiguous()

    def gemm(a, b, rows, cols):  # a [rows, inner] @ b [cols, inner].T, fp32 accumulation, in a's dtype
        out = dispatch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
        if out.numel() == 0 or a.shape[1] == 0:  # nothing to launch; an empty sum is zero
            return out.zero_()
        return kernel.dense(a, b, None, "none", out)

    if activation != "none":  # recompute the pre-activation; GELU's derivative applied by the bias_gelu kernel
        z = gemm(x2d, weight, m, n)
        g2d, _ = gelu_kernel.bias_gelu_backward(g2d.contiguous(), z, bias, activation == "gelu_tanh", empty=dispatch.empty)
    g2d = g2d.contiguous()
    grad_t = g2d.t().contiguous()  # [N, M]
    grad_x = gemm(g2d, weight.t().contiguous(), m, k)  # g @ W
    grad_weight = gemm(grad_t, x2d.t().contiguous(), n, k)  # g^T @ x
    grad_bias = gemm(torch.ones(1, m, dtype=x2d.dtype, device=x2d.device), grad_t, 1, n).view(n)  # column sums
    return grad_x, grad_weight, grad_bias


@_triton_backward.register_fake
def _(g2d, x2d, weight, bias, activation):
    return x2d.new_empty(x2d.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


_triton_forward.register_autograd(_triton_autograd, setup_context=_cpu_setup_context)

_TRITON_SUPPORT = dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32))


@dispatch.register("dense", "triton", _TRITON_SUPPORT)
def _triton(x, weight, bias, activation, prepared):
    return dispatch.entry(_triton_forward, x, weight, bias)(x, weight, bias, activation)
