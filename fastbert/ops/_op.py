"""One definition per op: its kernel pairs (forward and backward) become torch.library custom ops, with
fakes, setup_context and autograd, built here once from the op's spec. A backend writes only its two
kernel functions, with the spec's signatures.

A kernel pair is opaque to torch.compile and differentiated by autograd; eager calls with nothing to
differentiate skip the custom-op wrapper (dispatch.entry). The backward runs on the backend whose
forward ran, and records itself under that backend's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastbert import dispatch


@dataclass(frozen=True)
class OpSpec:
    name: str  # the op ("add_layer_norm"); custom ops are fastbert::<name>_<kernels>[_backward]
    forward_schema: str  # "(Tensor x, ..., float eps) -> (Tensor, Tensor)": outputs first the result(s), then saved statistics
    backward_schema: str  # "(Tensor grad, <saved>...) -> (...)": the differentiable outputs' gradients, then `saved`
    forward_fake: Callable  # forward's arguments -> outputs of the right shapes and dtypes (shared by every backend)
    backward_fake: Callable  # backward's arguments -> its outputs
    saved: Callable  # (forward inputs, forward outputs) -> the backward's arguments after the gradients
    input_grads: Callable  # (forward inputs, backward results) -> one gradient (or None) per forward input
    differentiable_outputs: int = 1  # leading outputs that carry gradients; the rest are statistics
    recorded_as: Callable | None = None  # backward's saved arguments -> the op name its record carries

    def kernels(self, kind: str, forward: Callable, backward: Callable, backend: str | Callable) -> "KernelPair":
        """The custom ops fastbert::<name>_<kind> and ..._backward over `forward` and `backward`; `backend`
        names the backend the backward records (or maps the tensors' device type to it)."""
        return KernelPair(self, kind, forward, backward, backend)


class KernelPair:
    def __init__(self, spec: OpSpec, kind: str, forward: Callable, backward: Callable, backend):
        self.spec, self.backend = spec, backend
        name = f"fastbert::{spec.name}_{kind}"
        self.forward = torch.library.custom_op(name, forward, mutates_args=(), schema=spec.forward_schema)
        self.backward = torch.library.custom_op(name + "_backward", backward, mutates_args=(),
                                                schema=spec.backward_schema)
        self.forward.register_fake(spec.forward_fake)
        self.backward.register_fake(spec.backward_fake)
        self.forward.register_autograd(self._autograd, setup_context=self._setup_context)
        self.forward.direct = forward

    def __call__(self, *args):
        """Run the forward: the custom op where autograd or a compiler needs it, else the function itself."""
        return dispatch.entry(self.forward, *(a for a in args if isinstance(a, torch.Tensor)))(*args)

    def _setup_context(self, ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        saved = self.spec.saved(inputs, outputs)
        # Tensors (and absent optional tensors) through save_for_backward, everything else on ctx.
        is_tensor = [a is None or isinstance(a, torch.Tensor) for a in saved]
        ctx.save_for_backward(*(a for a, t in zip(saved, is_tensor) if t))
        ctx.is_tensor, ctx.others = is_tensor, [a for a, t in zip(saved, is_tensor) if not t]
        # input_grads reads the non-tensor inputs (flags); tensor inputs are not kept alive for it.
        ctx.input_meta = tuple(None if isinstance(a, torch.Tensor) else a for a in inputs)

    def _autograd(self, ctx, *grads):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if t else next(others) for t in ctx.is_tensor]
        first = next((a for a in saved if isinstance(a, torch.Tensor)), None)
        op = self.spec.recorded_as(saved) if self.spec.recorded_as else self.spec.name
        backend = self.backend(first.device.type) if callable(self.backend) else self.backend
        dispatch.note(op + ".backward", backend)
        results = self.backward(*grads[: self.spec.differentiable_outputs], *saved)
        results = results if isinstance(results, tuple) else (results,)
        return self.spec.input_grads(ctx.input_meta, results)


def by_device(device_type: str) -> str:
    """The backend of the C++ kernels (fastbert._C): cpu for CPU tensors, cuda for CUDA tensors."""
    return device_type
