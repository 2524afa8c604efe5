"""add_layer_norm: layer_norm(dropout(x) + residual), the end of every BERT sub-layer."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference


def add_layer_norm(x, residual, weight, bias, eps: float, dropout_p: float = 0.0) -> torch.Tensor:
    """x, residual [..., N]; weight, bias [N]. Statistics over the last dimension."""
    _checks.tensor("x", x, (1, 2, 3))
    _checks.tensor("residual", residual, (1, 2, 3))
    _checks.tensor("weight", weight, (1,))
    _checks.tensor("bias", bias, (1,))
    _checks.same_dtype_device(x=x, residual=residual, weight=weight, bias=bias)
    _checks.shape("residual", residual, tuple(x.shape), "the shape of x")
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
