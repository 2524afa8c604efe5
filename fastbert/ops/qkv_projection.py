"""qkv_projection: one GEMM for query, key and value, returned head-major."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _alloc, _checks, reference
from fastbert.ops.dense import (float32_training_reasons, linear_backward_fake, linear_class, linear_input_grads,
                                onednn_linear, onednn_pair_for, onednn_reasons, onednn_rows, onednn_rows_reasons,
                                onednn_torch_backward, onednn_torch_backward_pair_for, own_linear, own_pair_for,
                                own_reasons, torch_linear, triton_linear_backward, upcast_linear, upcast_reasons)
from fastbert.ops._op import OpSpec
from fastbert.ops.prepared import PreparedWeights


@dispatch.follows_autocast
def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   prepared: PreparedWeights | None = None):
    """x [B, S, H] or [T, H]; weight [3H, H] (rows: q, k, v); bias [3H].
    Returns q, k, v, each [B, heads, S, d] (or [T, heads, d]). `prepared`: as for dense."""
    hidden = x.shape[-1]
    if not dispatch.trusted("qkv_projection", x, num_heads, bias is None):
        _checks.tensor("x", x, (2, 3))
        _checks.tensor("weight", weight, (2,))
        _checks.same_dtype_device(x=x, weight=weight, bias=bias)
        _checks.features("x", x)
        _checks.shape("weight", weight, (3 * hidden, hidden), "3 x hidden rows for q, k, v; hidden columns")
        if bias is not None:
            _checks.shape("bias", bias, (3 * hidden,), "3 x hidden")
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0 or hidden % num_heads:
            raise ValueError(f"num_heads must be a positive int dividing the hidden size {hidden}, got {num_heads!r}")
        if prepared is not None and not isinstance(prepared, PreparedWeights):
            raise ValueError(f"prepared must be a fastbert.ops.PreparedWeights or None, got {type(prepared).__name__}")
    inputs = {"tensors": (x, weight, bias), "head_dim": hidden // num_heads}
    return dispatch.call("qkv_projection", inputs, x, weight, bias, num_heads, prepared)


@dispatch.register("qkv_projection", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))
def _reference(x, weight, bias, num_heads, prepared):
    return reference.qkv_projection(x, weight, bias, num_heads)


# -------------------------------------------- cpu: dense's oneDNN kernels, q/k/v as views of their output

ONEDNN = onednn_pair_for("qkv_projection")
ONEDNN_TORCH_BACKWARD = onednn_torch_backward_pair_for("qkv_projection")
OWN = own_pair_for("qkv_projection")


@dispatch.register("qkv_projection", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)))
def _cpu(x, weight, bias, num_heads, prepared):
    return head_major(onednn_linear(x, weight, bias, "none", prepared, ONEDNN), num_heads)  # one GEMM


def _torch(x, weight, bias, num_heads, prepared):
    """torch_linear as a variant (the cpu backend's built-in one, the cuda backend's cuBLAS one)."""
    return head_major(torch_linear(x, weight, bias), num_heads)


def _bucket(x, weight, *_):
    return linear_class(x, weight)


dispatch.register_variants("qkv_projection", "cpu", (
    dispatch.Variant("onednn", _cpu, onednn_reasons),
    dispatch.Variant("onednn-fp32", lambda x, weight, bias, num_heads, prepared: head_major(
        upcast_linear(x, weight, bias, "none", prepared, ONEDNN), num_heads), upcast_reasons),
    dispatch.Variant("torch", _torch),
    dispatch.Variant("fastbert", lambda x, weight, bias, num_heads, prepared: head_major(
        own_linear(x, weight, bias, "none", prepared, OWN), num_heads), own_reasons),
    dispatch.Variant("onednn-rows", lambda x, weight, bias, num_heads, prepared: head_major(
        onednn_rows(x, weight, bias, "none", prepared, ONEDNN), num_heads), onednn_rows_reasons),
    dispatch.Variant("onednn+torch_backward", lambda x, weight, bias, num_heads, prepared: head_major(
        onednn_torch_backward(x, weight, bias, "none", prepared, ONEDNN_TORCH_BACKWARD), num_heads),
        float32_training_reasons, training_only=True),
), _bucket, weights=True)


def head_major(qkv: torch.Tensor, num_heads: int):
    """A GEMM's [B, S, 3H] (or [T, 3H]) output as q, k, v: 3 x [B, heads, S, d] (or [T, heads, d]), strided
    views that the attention kernels read in place."""
    head_dim = qkv.shape[-1] // 3 // num_heads
    if qkv.dim() == 3:
        b, s, _ = qkv.shape
        return qkv.view(b, s, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return qkv.view(-1, 3, num_heads, head_dim).unbind(1)


# ------------------------------------------------------------------------ triton (GEMM + epilogue)


def _head_major_shape(x, num_heads):
    d = x.shape[-1] // num_heads
    return (3, x.shape[0], num_heads, x.shape[1], d) if x.dim() == 3 else (3, x.shape[0], num_heads, d)


# One GEMM writing q, k, v head-major: [3, B, heads, S, d] (or [3, T, heads, d] for [T, H] input).
SPEC = OpSpec(
    "qkv_projection",
    forward_schema="(Tensor x, Tensor weight, Tensor? bias, int num_heads) -> Tensor",
    backward_schema="(Tensor grad, Tensor x, Tensor weight, Tensor? bias, int num_heads) -> (Tensor, Tensor, Tensor)",
    forward_fake=lambda x, weight, bias, num_heads: x.new_empty(_head_major_shape(x, num_heads)),
    backward_fake=lambda grad, x, weight, bias, num_heads: linear_backward_fake(x, weight, bias),
    saved=lambda inputs, outputs: inputs,
    input_grads=linear_input_grads,
)


def _triton_forward(x, weight, bias, num_heads):
    from fastbert.kernels import qkv_projection as kernel

    out = _alloc.empty(_head_major_shape(x, num_heads), dtype=x.dtype, device=x.device)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    kernel.qkv_head_major(x2d, weight.contiguous(), None if bias is None else bias.contiguous(), num_heads,
                          x.shape[1] if x.dim() == 3 else 0, out)
    return out


def _triton_backward(grad, x, weight, bias, num_heads):
    # Back from head-major to [..., 3H] rows, then the linear layer's gradients.
    # (3H given, not -1: without tokens there is nothing to infer -1 from)
    if x.dim() == 3:  # [B, S, 3, heads, d] -> [B, S, 3H]
        grad_rows = grad.permute(1, 3, 0, 2, 4).reshape(*x.shape[:2], weight.shape[0])
    else:  # [T, 3, heads, d] -> [T, 3H]
        grad_rows = grad.permute(1, 0, 2, 3).reshape(x.shape[0], weight.shape[0])
    return triton_linear_backward(grad_rows, x, weight, bias, "none")


TRITON = SPEC.kernels("triton", _triton_forward, _triton_backward, "triton")


@dispatch.register("qkv_projection", "triton", dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))
def _triton(x, weight, bias, num_heads, prepared):
    return TRITON(x, weight, bias, num_heads).unbind(0)


# ------------------------------------------------------- cuda: cuBLAS, through torch (see dense's cuda)


dispatch.register("qkv_projection", "cuda", dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32)))(
    _torch)
dispatch.register_variants("qkv_projection", "cuda", (dispatch.Variant("torch", _torch),), _bucket)
