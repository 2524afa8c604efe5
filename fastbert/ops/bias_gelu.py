"""bias_gelu: gelu(x + bias), exact (erf) or tanh-approximated."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference

APPROXIMATIONS = ("none", "tanh")


@dispatch.follows_autocast
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias); x [..., N], bias [N]. approximate="tanh" for gelu_new / gelu_pytorch_tanh."""
    _checks.tensor("x", x, (1, 2, 3, 4))
    _checks.tensor("bias", bias, (1,))
    _checks.same_dtype_device(x=x, bias=bias)
    _checks.shape("bias", bias, (x.shape[-1],), "the last dimension of x")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    return dispatch.call("bias_gelu", {"tensors": (x, bias)}, x, bias, approximate)


dispatch.register("bias_gelu", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(reference.bias_gelu)


# ------------------------------------------------------------------------------ cpu (C++) and cuda
# One pair of custom ops serves both compiled backends: torch.ops.fastbert_C.* dispatches on the
# tensors' device to csrc/cpu (CPU) or csrc/cuda/bindings.cpp (CUDA; only in a CUDA build of _C).


@dispatch.custom_op("fastbert::bias_gelu_cpu")
def _cpu_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    x = x.contiguous()
    out = dispatch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.fastbert_C.bias_gelu_fwd(x, bias.contiguous(), tanh, out)
    return out


@torch.library.custom_op("fastbert::bias_gelu_cpu_backward", mutates_args=())
def _cpu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    x = x.contiguous()
    grad_x = dispatch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.fastbert_C.bias_gelu_bwd(grad.contiguous(), x, bias.contiguous(), tanh, grad_x)
    return grad_x


@_cpu_forward.register_fake
def _(x, bias, tanh):
    return x.new_empty(x.shape)


@_cpu_backward.register_fake
def _(grad, x, bias, tanh):
    return x.new_empty(x.shape)


def _cpu_setup_context(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _cpu_autograd(ctx, grad):
    x, bias = ctx.saved_tensors
    dispatch.note("bias_gelu.backward", "cuda" if x.device.type == "cuda" else "cpu")
    grad_x = _cpu_backward(grad, x, bias, ctx.tanh)
    if x.device.type == "cuda":  # summed in fp32 (as the triton backend does), returned in bias's dtype
        return grad_x, grad_x.reshape(-1, bias.shape[0]).sum(0, dtype=torch.float32).to(bias.dtype), None
    return grad_x, grad_x.reshape(-1, bias.shape[0]).sum(0), None


_cpu_forward.register_autograd(_cpu_autograd, setup_context=_cpu_setup_context)


@dispatch.register("bias_gelu", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)))
def _cpu(x, bias, approximate):
    return dispatch.entry(_cpu_forward, x, bias)(x, bias, approximate == "tanh")


dispatch.register("bias_gelu", "cuda",
                  dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32), dropout=True))(_cpu)


# ------------------------------------------------------------------------------------------- triton
# Kernels in kernels/bias_gelu.py (fastbert.kernels.bias_gelu), imported on first call: a missing
# triton never breaks `import fastbert`. custom_op with an explicit fake (not triton_op), so eager,
# autograd, opcheck and torch.compile(fullgraph=True) all work, under the interpreter too.


@dispatch.custom_op("fastbert::bias_gelu_triton")
def _triton_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    from fastbert.kernels import bias_gelu as kernel

    return kernel.bias_gelu_forward(x, bias, tanh, empty=dispatch.empty)


@torch.library.custom_op("fastbert::bias_gelu_triton_backward", mutates_args=())
def _triton_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                     tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from fastbert.kernels import bias_gelu as kernel

    return kernel.bias_gelu_backward(grad, x, bias, tanh, empty=dispatch.empty)


@_triton_forward.register_fake
def _(x, bias, tanh):
    return x.new_empty(x.shape)


@_triton_backward.register_fake
def _(grad, x, bias, tanh):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _triton_setup_context(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _triton_autograd(ctx, grad):
    dispatch.note("bias_gelu.backward", "triton")
    x, bias = ctx.saved_tensors
    grad_x, grad_bias = _triton_backward(grad, x, bias, ctx.tanh)
    return grad_x, grad_bias, None


_triton_forward.register_autograd(_triton_autograd, setup_context=_triton_setup_context)


@dispatch.register("bias_gelu", "triton",
                   dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))
def _triton(x, bias, approximate):
    return dispatch.entry(_triton_forward, x, bias)(x, bias, approximate == "tanh")
