"""bias_gelu: gelu(x + bias), exact (erf) or tanh-approximated."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, reference

APPROXIMATIONS = ("none", "tanh")


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
