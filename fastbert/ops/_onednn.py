"""oneDNN linear from torch's own build: prepacked weights and fused bias / GELU post-ops.

On these CPUs oneDNN's packed GEMM beats torch's default (MKL) F.linear, and it applies bias and
GELU inside the GEMM's epilogue. Weights are packed once per parameter version: an optimizer step
or a load_state_dict bumps the version and the next call repacks, so training stays right.
oneDNN has no autograd: the cpu dense / qkv ops register their own backward.
"""
from __future__ import annotations

import threading
import weakref

import torch

POST_OPS = {"none": ("none", [None], ""), "gelu": ("gelu", [None], "none"), "gelu_tanh": ("gelu", [None], "tanh")}

# id(weight) -> (weight's identity key, packed copy). Entries leave when their weight dies. Not an
# attribute on the weight: deepcopy and pickling of the model must never see oneDNN's opaque tensors.
_packed: dict[int, tuple] = {}
_lock = threading.Lock()


def missing() -> list[str]:
    """Why oneDNN's linear cannot be used from this torch build; empty when it can."""
    if not torch.backends.mkldnn.is_available():
        return ["this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"]
    for name in ("_linear_pointwise", "_reorder_linear_weight"):
        if not hasattr(torch.ops.mkldnn, name):
            return [f"this torch build lacks torch.ops.mkldnn.{name}"]
    return []


def packed(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocked layout, cached until the weight changes."""
    # Inference tensors carry no version counter (and cannot change outside inference mode).
    version = -1 if weight.is_inference() else weight._version
    key = (version, weight.data_ptr(), weight.dtype, tuple(weight.shape))
    with _lock:
        hit = _packed.get(id(weight))
    if hit is not None and hit[0] == key:
        return hit[1]
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), max(rows_hint, 1))
    with _lock:
        if id(weight) not in _packed:
            weakref.finalize(weight, _packed.pop, id(weight), None)
        _packed[id(weight)] = (key, blocked)
    return blocked


def linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none",
           packed_weight: bool = True):
    """activation(x2d @ weight.T + bias) for x2d [M, K] in one oneDNN call; the weight prepacked and
    cached, or (packed_weight=False, for operands used once) read as it is, any strides."""
    attr, scalars, algorithm = POST_OPS[activation]
    # oneDNN reads the bias as a dense vector whatever its strides (a strided bias gave wrong sums).
    bias = None if bias is None else bias.contiguous()
    weight = packed(weight, x2d.shape[0]) if packed_weight else weight
    return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, attr, scalars, algorithm)
