"""bias_gelu: gelu(x + bias), exact (erf) or tanh-approximated."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _alloc, _checks, reference
from fastbert.ops._op import OpSpec, by_device



@dispatch.follows_autocast
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias); x [..., N], bias [N]. approximate="tanh" for gelu_new / gelu_pytorch_tanh."""
    if not dispatch.trusted("bias_gelu", x, approximate):
        _checks.tensor("x", x, (1, 2, 3, 4))
        _checks.tensor("bias", bias, (1,))
        _checks.same_dtype_device(x=x, bias=bias)
        _checks.features("x", x)
        _checks.shape("bias", bias, (x.shape[-1],), "the last dimension of x")
        if approximate not in reference.APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {reference.APPROXIMATIONS}, got {approximate!r}")
    return dispatch.call("bias_gelu", {"tensors": (x, bias)}, x, bias, approximate)


dispatch.register("bias_gelu", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(reference.bias_gelu)

SPEC = OpSpec(
    "bias_gelu",
    forward_schema="(Tensor x, Tensor bias, str approximate) -> Tensor",
    backward_schema="(Tensor grad, Tensor x, Tensor bias, str approximate) -> (Tensor, Tensor)",
    forward_fake=lambda x, bias, approximate: x.new_empty(x.shape),
    backward_fake=lambda grad, x, bias, approximate: (x.new_empty(x.shape), bias.new_empty(bias.shape)),
    saved=lambda inputs, outputs: inputs,  # x, bias, approximate: the backward recomputes x + bias
    input_grads=lambda inputs, grads: (*grads, None),
)


# ---------------------------------------------------------------- cxx: C++ kernels (csrc/cpu, csrc/cuda)
# torch.ops.fastbert_C.* dispatch on the tensors' device to csrc/cpu or csrc/cuda (in a CUDA build of _C).


def _cxx_forward(x, bias, approximate):
    x = x.contiguous()
    out = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.fastbert_C.bias_gelu_fwd(x, bias.contiguous(), approximate == "tanh", out)
    return out


def _cxx_backward(grad, x, bias, approximate):
    x = x.contiguous()
    grad_x = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.fastbert_C.bias_gelu_bwd(grad.contiguous(), x, bias.contiguous(), approximate == "tanh", grad_x)
    # The bias gradient summed in fp32 (as the triton kernel does), returned in bias's dtype.
    return grad_x, grad_x.reshape(-1, bias.shape[0]).sum(0, dtype=torch.float32).to(bias.dtype)


CXX = SPEC.kernels("cxx", _cxx_forward, _cxx_backward, by_device)
_CXX_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.float16, torch.bfloat16, torch.float32)}
for _device in ("cpu", "cuda"):
    dispatch.register("bias_gelu", _device, dispatch.Support((_device,), _CXX_DTYPES[_device]))(CXX)


# ------------------------------------------------------------------------- triton (kernels/bias_gelu.py)
# Imported on first call: a missing triton never breaks `import fastbert`.


def _triton_forward(x, bias, approximate):
    from fastbert.kernels import bias_gelu as kernel

    return kernel.bias_gelu_forward(x, bias, approximate == "tanh", _alloc.empty(x.shape, dtype=x.dtype, device=x.device))


def _triton_backward(grad, x, bias, approximate):
    from fastbert.kernels import bias_gelu as kernel

    return kernel.bias_gelu_backward(grad, x, bias, approximate == "tanh", _alloc.empty_like(x), _alloc.empty_like(bias))


TRITON = SPEC.kernels("triton", _triton_forward, _triton_backward, "triton")
dispatch.register("bias_gelu", "triton",
                  dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))(TRITON)
