"""dense: x @ weight.T + bias, with an optional GELU fused into the epilogue."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"):
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]; activation "none" | "gelu" | "gelu_tanh"."""
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
    return dispatch.call("dense", {"tensors": (x, weight, bias)}, x, weight, bias, activation)


dispatch.register("dense", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(reference.dense)
