"""qkv_projection: one GEMM for query, key and value, returned head-major."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, _onednn, reference
from fastbert.ops.dense import _cpu_forward as _dense_cpu, cpu_packed, triton_linear_backward
from fastbert.ops.prepared import PreparedWeights


@dispatch.follows_autocast
def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   prepared: PreparedWeights | None = None):
    """x [B, S, H] or [T, H]; weight [3H, H] (rows: q, k, v); bias [3H].
    Returns q, k, v, each [B, heads, S, d] (or [T, heads, d]). `prepared`: as for dense."""
    _checks.tensor("x", x, (2, 3))
    _checks.tensor("weight", weight, (2,))
    _checks.same_dtype_device(x=x, weight=weight, bias=bias)
    hidden = x.shape[-1]
    _checks.shape("weight", weight, (3 * hidden, hidden), "3 x hidden rows for q, k, v; hidden columns")
    if bias is not None:
        _checks.shape("bias", bias, (3 * hidden,), "3 x hidden")
    if not isinstance(num_heads, int) or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"num_heads must be a positive divisor of hidden size {hidden}, got {num_heads}")
    if prepared is not None and not isinstance(prepared, PreparedWeights):
        raise ValueError(f"prepared must be a fastbert.ops.PreparedWeights or None, got {type(prepared).__name__}")
    inputs = {"tensors": (x, weight, bias), "head_dim": hidden // num_heads}
    return dispatch.call("qkv_projection", inputs, x, weight, bias, num_heads, prepared)


@dispatch.register("qkv_projection", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))
def _reference(x, weight, bias, num_heads, prepared):
    return reference.qkv_projection(x, weight, bias, num_heads)


# ------------------------------------------------------------------------------ cpu (oneDNN GEMM)


@dispatch.register("qkv_projection", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)),
                   extra_reasons=lambda facts: _onednn.missing())
def _cpu(x, weight, bias, num_heads, prepared):
    run = dispatch.entry(_dense_cpu, x, weight, bias)
    if run is _dense_cpu.direct and prepared is not None:  # eager, no autograd: the owner's packed weight
        qkv = cpu_packed(x, weight, bias, "none", prepared)  # [..., 3H], one GEMM
    else:
        qkv = run(x, weight, bias, "none")
    head_dim = x.shape[-1] // num_heads
    if x.dim() == 3:
        b, s, _ = x.shape
        # [B, S, 3, heads, d] -> 3 x [B, heads, S, d]: strided views; attention kernels read them in place.
        return qkv.view(b, s, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return qkv.view(-1, 3, num_heads, head_dim).unbind(1)  # 3 x [T, heads, d]


# ------------------------------------------------------------------------ triton (GEMM + epilogue)


@dispatch.custom_op("fastbert::qkv_projection_triton")
def _triton_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """One GEMM writing q, k, v head-major: [3, B, heads, S, d] (or [3, T, heads, d] for [T, H] input)."""
    from fastbert.kernels import dense as kernel

    out = dispatch.empty(_head_major_shape(x, num_heads), dtype=x.dtype, device=x.device)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    kernel.qkv_head_major(x2d, weight.contiguous(), None if bias is None else bias.contiguous(), num_heads,
                          x.shape[1] if x.dim() == 3 else 0, out)
    return out


def _head_major_shape(x, num_heads):
    d = x.shape[-1] // num_heads
    return (3, x.shape[0], num_heads, x.shape[1], d) if x.dim() == 3 else (3, x.shape[0], num_heads, d)


@_triton_forward.register_fake
def _(x, weight, bias, num_heads):
    return x.new_empty(_head_major_shape(x, num_heads))


def _triton_setup_context(ctx, inputs, output):
    x, weight, bias, num_heads = inputs
    ctx.save_for_backward(x, weight, bias)


def _triton_autograd(ctx, grad):
    dispatch.note("qkv_projection.backward", "triton")
    x, weight, bias = ctx.saved_tensors
    # Back from head-major to [..., 3H] rows, then the linear layer's gradients.
    if x.dim() == 3:
        grad_rows = grad.permute(1, 3, 0, 2, 4).reshape(*x.shape[:2], -1)  # [B, S, 3, heads, d] -> [B, S, 3H]
    else:
        grad_rows = grad.permute(1, 0, 2, 3).reshape(x.shape[0], -1)  # [T, 3, heads, d] -> [T, 3H]
    grad_x, grad_weight, grad_bias = triton_linear_backward(grad_rows, x, weight, bias)
    return grad_x, grad_weight, grad_bias if bias is not None else None, None


_triton_forward.register_autograd(_triton_autograd, setup_context=_triton_setup_context)


@dispatch.register("qkv_projection", "triton", dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))
def _triton(x, weight, bias, num_heads, prepared):
    return dispatch.entry(_triton_forward, x, weight, bias)(x, weight, bias, num_heads).unbind(0)
