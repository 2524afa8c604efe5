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


def linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none"):
    """activation(x2d @ weight.T + bias) for x2d [M, K] in one oneDNN call."""
    attr, scalars, algorithm = POST_OPS[activation]
    # oneDNN reads the bias as a dense vector whatever its strides (a strided bias gave wrong sums).
    bias = None if bias is None else bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x2d, packed(weight, x2d.shape[0]), bias, attr, scalars, algorithm)



# A custom op: under torch.compile the backward is traced, and Inductor lowers a bare
# mkldnn._linear_pointwise only for weights it holds as constants (frozen inference graphs).
@torch.library.custom_op("fastbert::linear_backward_cpu", mutates_args=())
def linear_backward(g2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x2d, grad of weight) for x2d @ weight.T: g2d @ weight and g2d.T @ x2d as oneDNN linears
    reading transposed views in place. For float32 only: there torch's matmul (MKL) ran these at ~225
    GFLOP/s on the Zen 5 VM and oneDNN at ~410 (1024 x 768 x 3072); in bfloat16 torch's matmul is
    oneDNN already and faster than this form (770 vs 556 for the weight gradient)."""
    attr, scalars, algorithm = POST_OPS["none"]
    g2d, x2d = g2d.contiguous(), x2d.contiguous()
    grad_x = torch.ops.mkldnn._linear_pointwise(g2d, weight.contiguous().t(), None, attr, scalars, algorithm)
    grad_weight = torch.ops.mkldnn._linear_pointwise(g2d.t(), x2d.t(), None, attr, scalars, algorithm)
    return grad_x, grad_weight


@linear_backward.register_fake
def _(g2d, x2d, weight):
    return x2d.new_empty(x2d.shape), weight.new_empty(weight.shape)
