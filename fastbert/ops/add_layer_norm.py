"""add_layer_norm: layer_norm(dropout(x) + residual), the end of every BERT sub-layer."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _alloc, _checks, reference
from fastbert.ops._op import OpSpec, by_device, needs_grad
from fastbert.ops._seed import dropout_seed, seed_int
from fastbert.ops.reference import QuantizedRows

@dispatch.follows_autocast(in_float32=True)
def add_layer_norm(x, residual, weight, bias, eps: float, dropout_p: float = 0.0, quantize_output: bool = False):
    """x, residual [..., N]; weight, bias [N]. Statistics over the last dimension. `quantize_output`
    (inference, int8 models): returns (out, out as QuantizedRows), the rows quantized while the kernel
    still holds them, for the quantized_dense that reads them next. weight and bias may be float32 for a
    bfloat16 / float16 x, as torch's layer_norm allows ("LayerNorms kept in float32"): rounded to x's dtype."""
    weight, bias = _in_dtype_of(x, weight, bias)
    if not dispatch.trusted("add_layer_norm", x, eps, dropout_p, quantize_output):
        _checks.tensor("x", x, (1, 2, 3))
        _checks.tensor("residual", residual, (1, 2, 3))
        _checks.tensor("weight", weight, (1,))
        _checks.tensor("bias", bias, (1,))
        _checks.same_dtype_device(x=x, residual=residual, weight=weight, bias=bias)
        _checks.features("x", x)
        _checks.shape("residual", residual, x.shape, "the shape of x")
        _checks.shape("weight", weight, (x.shape[-1],), "x's last dimension")
        _checks.shape("bias", bias, (x.shape[-1],), "x's last dimension")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps}")
        _checks.probability("dropout_p", dropout_p)
        if quantize_output:
            if torch.compiler.is_compiling():
                raise NotImplementedError("int8 models run eagerly: torch.compile of add_layer_norm's quantize_output "
                                          "is not supported yet")
            if dropout_p > 0 or needs_grad(x, residual, weight, bias):
                raise ValueError("quantize_output is for inference: it needs dropout_p == 0 and no gradient "
                                 "(run under torch.no_grad() or torch.inference_mode())")
    inputs = {"tensors": (x, residual, weight, bias), "dropout_p": dropout_p, "quantize_output": quantize_output,
              "row_width": int(x.shape[-1])}
    return dispatch.call("add_layer_norm", inputs, x, residual, weight, bias, float(eps), float(dropout_p),
                         bool(quantize_output))


def _in_dtype_of(x, weight, bias):
    """float32 weight and bias of bf16 / fp16 rows rounded to the rows' dtype; anything else as given."""
    if isinstance(x, torch.Tensor) and x.dtype in reference.HALVES and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in (weight, bias)):
        return weight.to(x.dtype), bias.to(x.dtype)
    return weight, bias


_add_layer_norm_in_float32 = reference.in_float32(reference.add_layer_norm)


@dispatch.register("add_layer_norm", "reference",
                   dispatch.Support(("cpu", "cuda"), dispatch.FLOATS, quantized_output=True))
def _reference(x, residual, weight, bias, eps, dropout_p, quantize_output):
    out = _add_layer_norm_in_float32(x, residual, weight, bias, eps, dropout_p)
    if not quantize_output:
        return out
    q, scale, zero_point = reference.quantize_rows(out.reshape(-1, out.shape[-1]))
    return out, QuantizedRows(q.view(out.shape), scale, zero_point, out.dtype)


def _statistics(x):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


def _grads(inputs, grads):
    grad_h, grad_x, grad_weight, grad_bias = grads
    dropout_p = inputs[5]
    # Without dropout d(x + residual) reaches both inputs unchanged; the kernels then skip grad_x ([0]).
    return grad_x if dropout_p > 0 else grad_h, grad_h, grad_weight, grad_bias, None, None, None


# Dropout happens inside the kernels: keep decisions are hashed from `seed` (int64 [1], drawn from torch's
# generator, so torch.manual_seed reproduces it) and the backward regenerates them: no mask is saved.
SPEC = OpSpec(
    "add_layer_norm",
    forward_schema="(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, float dropout_p, "
                   "Tensor? seed) -> (Tensor, Tensor, Tensor)",  # out, mean, rstd (fp32 [rows])
    backward_schema="(Tensor grad, Tensor x, Tensor residual, Tensor weight, Tensor mean, Tensor rstd, "
                    "float dropout_p, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor)",  # grad of h, x, weight, bias
    forward_fake=lambda x, residual, weight, bias, eps, dropout_p, seed: (x.new_empty(x.shape), *_statistics(x)),
    backward_fake=lambda grad, x, residual, weight, mean, rstd, dropout_p, seed: (
        x.new_empty(x.shape), x.new_empty(x.shape if dropout_p > 0 else (0,)), weight.new_empty(weight.shape),
        weight.new_empty(weight.shape)),
    saved=lambda inputs, outputs: (*inputs[:3], *outputs[1:], *inputs[5:]),  # x, residual, weight, mean, rstd, p, seed
    input_grads=_grads,
)


# ---------------------------------------------------------------- cxx: C++ kernels (csrc/cpu, csrc/cuda)
# torch.ops.fastbert_C.* dispatch on the tensors' device to csrc/cpu or csrc/cuda (in a CUDA build of _C).


def _cxx_forward(x, residual, weight, bias, eps, dropout_p, seed):
    x, residual = x.contiguous(), residual.contiguous()
    out = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    mean = _alloc.empty(rows, dtype=torch.float32, device=x.device)
    rstd = _alloc.empty(rows, dtype=torch.float32, device=x.device)
    torch.ops.fastbert_C.add_layer_norm_fwd(x, residual, weight.contiguous(), bias.contiguous(), eps, dropout_p,
                                            seed_int(seed), out, mean, rstd)
    return out, mean, rstd


def _cxx_backward(grad, x, residual, weight, mean, rstd, dropout_p, seed):
    x = x.contiguous()
    grad_h = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_x = _alloc.empty(x.shape if dropout_p > 0 else (0,), dtype=x.dtype, device=x.device)
    grad_weight = _alloc.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    grad_bias = _alloc.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    torch.ops.fastbert_C.add_layer_norm_bwd(grad.contiguous(), x, residual.contiguous(), weight.contiguous(), mean,
                                            rstd, dropout_p, seed_int(seed), grad_h, grad_x, grad_weight, grad_bias)
    return grad_h, grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


CXX = SPEC.kernels("cxx", _cxx_forward, _cxx_backward, by_device)


def _cxx(x, residual, weight, bias, eps, dropout_p, quantize_output=False):
    # On CUDA too the seed stays on the CPU: reading it into the kernel's arguments never waits for the GPU.
    return CXX(x, residual, weight, bias, eps, dropout_p, dropout_seed(dropout_p))[0]


@dispatch.register("add_layer_norm", "cpu",
                   dispatch.Support(("cpu",), (torch.float32, torch.bfloat16), quantized_output=True))
def _cpu(x, residual, weight, bias, eps, dropout_p, quantize_output):
    if not quantize_output:
        return _cxx(x, residual, weight, bias, eps, dropout_p)
    x, residual = x.contiguous(), residual.contiguous()
    rows = x.numel() // x.shape[-1]
    out = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    quantized = QuantizedRows(_alloc.empty(x.shape, dtype=torch.uint8, device=x.device),
                              _alloc.empty(rows, dtype=torch.float32, device=x.device),
                              _alloc.empty(rows, dtype=torch.int32, device=x.device), x.dtype)
    torch.ops.fastbert_C.add_layer_norm_quantize(x, residual, weight.contiguous(), bias.contiguous(), eps, out,
                                                 *quantized[:3])
    return out, quantized

CUDA_MAX_ROW = 8192  # csrc/cuda/add_layer_norm.cu holds a row in registers


def _cuda_row_reasons(f: dispatch.Facts) -> list[str]:
    if f.row_width is not None and f.row_width > CUDA_MAX_ROW:
        return [f"rows of {f.row_width} (the cuda kernel holds a row in registers: at most {CUDA_MAX_ROW})"]
    return []


dispatch.register("add_layer_norm", "cuda", dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32)),
                  _cuda_row_reasons)(_cxx)


# -------------------------------------------------------------------- triton (kernels/add_layer_norm.py)
# Imported on first call: a missing triton never breaks `import fastbert`. The kernel keeps an element
# where tl.rand(seed, its index) >= p; the seed lives on the tensors' device.


def _triton_forward(x, residual, weight, bias, eps, dropout_p, seed):
    from fastbert.kernels import add_layer_norm as kernel

    rows = x.numel() // x.shape[-1]
    out = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = (_alloc.empty(rows, dtype=torch.float32, device=x.device) for _ in range(2))
    return kernel.add_layer_norm_forward(x, residual, weight, bias, eps, dropout_p, seed, out, mean, rstd)


def _triton_backward(grad, x, residual, weight, mean, rstd, dropout_p, seed):
    from fastbert.kernels import add_layer_norm as kernel

    grad_h = _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_x = _alloc.empty(x.shape if dropout_p > 0 else (0,), dtype=x.dtype, device=x.device)
    return kernel.add_layer_norm_backward(grad, x, residual, weight, mean, rstd, dropout_p, seed, grad_h, grad_x,
                                          _alloc.empty_like(weight), _alloc.empty_like(weight))


TRITON = SPEC.kernels("triton", _triton_forward, _triton_backward, "triton")


@dispatch.register("add_layer_norm", "triton",
                   dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32)))
def _triton(x, residual, weight, bias, eps, dropout_p, quantize_output=False):
    return TRITON(x, residual, weight, bias, eps, dropout_p, dropout_seed(dropout_p, x.device))[0]
