"""add_layer_norm: layer_norm(dropout(x) + residual), the end of every BERT sub-layer."""
from __future__ import annotations

from typing import Optional

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference
from fastbert.ops._seed import dropout_seed, seed_int


@dispatch.follows_autocast
def add_layer_norm(x, residual, weight, bias, eps: float, dropout_p: float = 0.0) -> torch.Tensor:
    """x, residual [..., N]; weight, bias [N]. Statistics over the last dimension."""
    _checks.tensor("x", x, (1, 2, 3))
    _checks.tensor("residual", residual, (1, 2, 3))
    _checks.tensor("weight", weight, (1,))
    _checks.tensor("bias", bias, (1,))
    _checks.same_dtype_device(x=x, residual=residual, weight=weight, bias=bias)
    _checks.shape("residual", residual, x.shape, "the shape of x")
    _checks.shape("weight", weight, (x.shape[-1],), "x's last dimension")
    _checks.shape("bias", bias, (x.shape[-1],), "x's last dimension")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _checks.probability("dropout_p", dropout_p)
    inputs = {"tensors": (x, residual, weight, bias), "dropout_p": dropout_p}
    return dispatch.call("add_layer_norm", inputs, x, residual, weight, bias, float(eps), float(dropout_p))


dispatch.register("add_layer_norm", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(
    reference.add_layer_norm
)


# ------------------------------------------------------------------------------ cpu (C++) and cuda
# One pair of custom ops serves both compiled backends: torch.ops.fastbert_C.* dispatches on the
# tensors' device to csrc/cpu (CPU) or csrc/cuda/bindings.cpp (CUDA; only in a CUDA build of _C).


# Dropout happens inside the kernel: keep decisions are hashed from `seed` (a tensor drawn from
# torch's generator, so torch.manual_seed reproduces it), and backward regenerates them.
@dispatch.custom_op("fastbert::add_layer_norm_cpu")
def _cpu_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                 dropout_p: float, seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    out = dispatch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    mean = dispatch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = dispatch.empty(rows, dtype=torch.float32, device=x.device)
    torch.ops.fastbert_C.add_layer_norm_fwd(x, residual, weight.contiguous(), bias.contiguous(), eps, dropout_p,
                                            seed_int(seed), out, mean, rstd)
    return out, mean, rstd


@torch.library.custom_op("fastbert::add_layer_norm_cpu_backward", mutates_args=())
def _cpu_backward(grad: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float,
                  seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of residual, grad of x, grad of weight, grad of bias)."""
    x = x.contiguous()
    grad_h = dispatch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_x = dispatch.empty(x.shape if dropout_p > 0 else (0,), dtype=x.dtype, device=x.device)
    grad_weight = dispatch.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    grad_bias = dispatch.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    torch.ops.fastbert_C.add_layer_norm_bwd(grad.contiguous(), x, residual.contiguous(), weight.contiguous(), mean,
                                            rstd, dropout_p, seed_int(seed), grad_h, grad_x, grad_weight, grad_bias)
    # Without dropout d(x + residual) reaches both inputs unchanged (a copy: outputs must not alias).
    return grad_h, grad_x if dropout_p > 0 else grad_h.clone(), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


@_cpu_forward.register_fake
def _(x, residual, weight, bias, eps, dropout_p, seed):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@_cpu_backward.register_fake
def _(grad, x, residual, weight, mean, rstd, dropout_p, seed):
    return x.new_empty(x.shape), x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _cpu_setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, seed = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, mean, rstd, seed)
    ctx.dropout_p = dropout_p


def _cpu_autograd(ctx, grad, _grad_mean, _grad_rstd):
    x, residual, weight, mean, rstd, seed = ctx.saved_tensors
    dispatch.note("add_layer_norm.backward", "cuda" if x.device.type == "cuda" else "cpu")
    grad_residual, grad_x, grad_weight, grad_bias = _cpu_backward(grad, x, residual, weight, mean, rstd,
                                                                  ctx.dropout_p, seed)
    return grad_x, grad_residual, grad_weight, grad_bias, None, None, None


_cpu_forward.register_autograd(_cpu_autograd, setup_context=_cpu_setup_context)


@dispatch.register("add_layer_norm", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)))
def _cpu(x, residual, weight, bias, eps, dropout_p):
    forward = dispatch.entry(_cpu_forward, x, residual, weight, bias)
    return forward(x, residual, weight, bias, eps, dropout_p, dropout_seed(dropout_p))[0]


# On CUDA the seed stays on the CPU (drawn from torch's CPU generator, so torch.manual_seed reproduces
# the mask): reading it into the kernel's arguments never waits for the GPU. Last dimension <= 8192.
dispatch.register("add_layer_norm", "cuda",
                  dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32), dropout=True))(_cpu)


# ------------------------------------------------------------------------------------------- triton
# Kernels in kernels/add_layer_norm.py (fastbert.kernels.add_layer_norm), imported on first call: a
# missing triton never breaks `import fastbert`. custom_op with an explicit fake (not triton_op), so
# eager, autograd, opcheck and torch.compile(fullgraph=True) all work, under the interpreter too.
# Dropout is fused: the kernel keeps an element where tl.rand(seed, its index) >= p and the backward
# regenerates that mask from the same seed, so only the seed (int64 [1]) is saved, never a mask.


@dispatch.custom_op("fastbert::add_layer_norm_triton")
def _triton_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    dropout_p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from fastbert.kernels import add_layer_norm as kernel

    return kernel.add_layer_norm_forward(x, residual, weight, bias, eps, dropout_p, seed, empty=dispatch.empty)


@torch.library.custom_op("fastbert::add_layer_norm_triton_backward", mutates_args=())
def _triton_backward(grad: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_residual, grad_x, grad_weight, grad_bias); without dropout grad_x equals grad_residual and
    comes back empty ([0]) rather than written twice (an op's outputs may not alias)."""
    from fastbert.kernels import add_layer_norm as kernel

    grad_h, grad_x, grad_weight, grad_bias = kernel.add_layer_norm_backward(
        grad, x, residual, weight, mean, rstd, dropout_p, seed, empty=dispatch.empty)
    if grad_x is None:
        grad_x = x.new_empty(0)
    return grad_h, grad_x, grad_weight, grad_bias


@_triton_forward.register_fake
def _(x, residual, weight, bias, eps, dropout_p, seed):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@_triton_backward.register_fake
def _(grad, x, residual, weight, mean, rstd, dropout_p, seed):
    grad_x = x.new_empty(x.shape) if dropout_p > 0 else x.new_empty(0)
    return x.new_empty(x.shape), grad_x, weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _triton_setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, seed = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, mean, rstd, seed)
    ctx.dropout_p = dropout_p


def _triton_autograd(ctx, grad, _grad_mean, _grad_rstd):
    dispatch.note("add_layer_norm.backward", "triton")
    x, residual, weight, mean, rstd, seed = ctx.saved_tensors
    grad_h, grad_x, grad_weight, grad_bias = _triton_backward(grad, x, residual, weight, mean, rstd,
                                                              ctx.dropout_p, seed)
    if ctx.dropout_p == 0:
        grad_x = grad_h  # d(x + residual) reaches both
    return grad_x, grad_h, grad_weight, grad_bias, None, None, None


_triton_forward.register_autograd(_triton_autograd, setup_context=_triton_setup_context)


@dispatch.register("add_layer_norm", "triton",
                   dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32), dropout=True))
def _triton(x, residual, weight, bias, eps, dropout_p):
    forward = dispatch.entry(_triton_forward, x, residual, weight, bias)
    return forward(x, residual, weight, bias, eps, dropout_p, dropout_seed(dropout_p, x.device))[0]
