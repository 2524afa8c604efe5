"""One definition per op: its kernel pairs (forward and backward) become torch.library custom ops, with
fakes, setup_context and autograd, built here once from the op's spec. A backend writes only its two
kernel functions, with the spec's signatures.

A kernel pair is opaque to torch.compile and differentiated by autograd. The custom-op wrapper costs
microseconds a call (benchmarks/RESULTS.md), so eager calls with nothing to differentiate run the
function under it (`entry`). The backward runs on the backend whose forward ran, and records itself
under that backend's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastbert.records import note


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def entry(op, *tensors):
    """`op.direct` where the custom op would do nothing but cost time, else `op` itself: under
    torch.compile, where autograd records the call, inside torch.func transforms (vmap's wrapped
    tensors look like plain ones, and out= kernels have no batching rule) and for tensor subclasses
    (fake, functional). torch.func's grad / jvp cannot differentiate a custom op: an error that says so."""
    if torch.compiler.is_compiling():
        return op
    if torch._C._functorch.peek_interpreter_stack() is not None:  # no public API for "in a transform"
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if any(i.key() in _DIFFERENTIATING for i in retrieve_all_functorch_interpreters()):
            raise RuntimeError(f"fastbert::{getattr(op, '_name', 'op')}: fastbert's kernels cannot be differentiated "
                               "by torch.func (grad, jacrev, jvp, ...); run the model under "
                               "fastbert.use_backend('reference') for them (torch.func.vmap works)")
        return op
    if needs_grad(*tensors):
        return op
    if any(t is not None and type(t) not in _PLAIN for t in tensors):
        return op
    return op.direct


TENSOR = type("Tensor", (), {"__repr__": lambda self: "<tensor>"})()  # a tensor input, as input_grads sees it


@dataclass(frozen=True)
class OpSpec:
    name: str  # the op ("add_layer_norm"); custom ops are fastbert::<name>_<kernels>[_backward]
    forward_schema: str  # "(Tensor x, ..., float eps) -> (Tensor, Tensor)": outputs first the result(s), then saved statistics
    backward_schema: str  # "(Tensor grad, <saved>...) -> (...)": the differentiable outputs' gradients, then `saved`
    forward_fake: Callable  # forward's arguments -> outputs of the right shapes and dtypes (shared by every backend)
    backward_fake: Callable  # backward's arguments -> its outputs
    saved: Callable  # (forward inputs, forward outputs) -> the backward's arguments after the gradients
    input_grads: Callable  # (forward inputs, TENSOR in place of each tensor; backward results) -> a gradient (or None) per input
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
        return entry(self.forward, *(a for a in args if isinstance(a, torch.Tensor)))(*args)

    def _setup_context(self, ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        saved = self.spec.saved(inputs, outputs)
        # Tensors (and absent optional tensors) through save_for_backward, everything else on ctx.
        is_tensor = [a is None or isinstance(a, torch.Tensor) for a in saved]
        ctx.save_for_backward(*(a for a, t in zip(saved, is_tensor) if t))
        ctx.is_tensor, ctx.others = is_tensor, [a for a, t in zip(saved, is_tensor) if not t]
        # input_grads reads the non-tensor inputs (flags) and which optional tensors were given; tensor
        # inputs are not kept alive for it.
        ctx.input_meta = tuple(TENSOR if isinstance(a, torch.Tensor) else a for a in inputs)

    def _autograd(self, ctx, *grads):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # backward(create_graph=True)
            raise RuntimeError(f"fastbert::{self.spec.name}: fastbert's kernels have no second derivative (a "
                               "backward with create_graph=True, a gradient penalty); run the model under "
                               "fastbert.use_backend('reference') for it")
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if t else next(others) for t in ctx.is_tensor]
        first = next((a for a in saved if isinstance(a, torch.Tensor)), None)
        op = self.spec.recorded_as(saved) if self.spec.recorded_as else self.spec.name
        backend = self.backend(first.device.type) if callable(self.backend) else self.backend
        note(op + ".backward", backend)
        results = self.backward(*grads[: self.spec.differentiable_outputs], *saved)
        results = results if isinstance(results, tuple) else (results,)
        return self.spec.input_grads(ctx.input_meta, results)


def by_device(device_type: str) -> str:
    """The backend of the C++ kernels (fastbert._C): cpu for CPU tensors, cuda for CUDA tensors."""
    return device_type
