"""What every op's tests share: the op's description (Spec, Case), the parity and property checks against
the float64 reference, opcheck, bad input, dropout statistics, and the input makers.

An op's file (tests/ops/test_<op>.py) holds its cases, the tests every op gets (built here: parity_tests,
opcheck_test, bad_input_test) and thin test functions of its own calling these. The rules, the same
everywhere: truth is the reference on float64 copies; a kernel stays within the tolerance table
(fastbert/testing.py) and within 2x the same-dtype reference; outputs are poisoned (NaN) before the
kernel runs; each check asserts that the backend under test ran, forward and backward.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs, upcast
from grids import DTYPES, KERNEL_BACKENDS, device_for, skip_unless_runnable, skip_unless_variant

try:  # the lent GPU machine has no hypothesis: the property tests skip there, the rest of each file runs
    import hypothesis
    from hypothesis import strategies as st
except ImportError:
    hypothesis = st = None

CUDA_REASONS = dispatch.machine_reasons("cuda") or (() if torch.cuda.is_available() else ("no CUDA GPU",))
needs_cuda = pytest.mark.skipif(bool(CUDA_REASONS), reason="cuda unavailable: " + "; ".join(CUDA_REASONS))
needs_cpu_kernels = pytest.mark.skipif(bool(dispatch.machine_reasons("cpu")), reason="fastbert._C not built")
CPU_DTYPES = (torch.float32, torch.bfloat16)  # what the cpu kernels' edge-case tests run (fp16 on CPU: never)
NEARLY_ONE = 1 - 1e-8  # a dropout probability below 1 that is 1 in float32


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------ inputs


def randn(*shape, dtype, device, scale=1.0):
    """A leaf requiring grad. Drawn on the CPU, so a seed (a hypothesis example) gives the same values on any device."""
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype).requires_grad_()


def leaf(t, dtype):
    return t.to(dtype).requires_grad_()


def padding_mask(batch, seq, device):
    """Unequal lengths, one sequence of a single token, one full-length."""
    lengths = torch.randint(1, seq + 1, (batch,))
    lengths[0], lengths[-1] = seq, 1
    return (torch.arange(seq)[None] < lengths[:, None]).to(device)


def cu_seqlens(lengths, device="cpu"):
    """int32 [B + 1] offsets of packed sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------------------ the op


@dataclass
class Case:
    name: str
    make: Callable  # (dtype, device) -> (args, kwargs); float tensor args require grad
    facts: dict = field(default_factory=dict)  # the call's dispatch.Facts flags (gelu=True): which variants serve it


@dataclass
class Spec:
    op: str
    public: Callable
    ref: Callable
    kind: str  # tolerance column for the forward
    cases: list  # the parity grid's hand-picked Cases
    build: Callable = None  # (params, dtype, device) -> (args, kwargs): a property example's inputs
    params: Callable = None  # (draw, small) -> params: a plain dict, drawn by hypothesis (printed on failure)
    ref_args: Callable = lambda args: args  # the same computation in a form the reference takes
    check_example: Callable = None  # (params, args, kwargs, outs): what else a property example must hold


def grid(*specs):
    """(spec, case) pairs and their ids, for parametrize("spec,case", ...)."""
    pairs = [(spec, case) for spec in specs for case in spec.cases]
    return pairs, [f"{s.op}-{c.name}" for s, c in pairs]


def _float_tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad]


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def forward_backward(fn, args, kwargs, grad_outs=None):
    """fn's outputs, the gradients of its float inputs, and the output gradients (drawn if not given)."""
    outs = _outputs(fn(*args, **kwargs))
    if grad_outs is None:
        grad_outs = [torch.randn(o.shape, dtype=torch.float32).to(device=o.device, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, _float_tensors(args), [g.to(o.dtype) for g, o in zip(grad_outs, outs)])
    return outs, list(grads), grad_outs


def clones(args):
    """Fresh leaves with the same values (for the same-dtype naive computation)."""
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def check_parity(spec: Spec, backend: str, dtype: torch.dtype, args, kwargs, variant: str | None = None):
    """The op on `backend` (asserted to have run, its backward too) equals the reference, forward and
    every gradient; returns the outputs. `variant`: that one of the backend's implementations, forced
    (torch's built-ins, forced or picked, have their own autograd: their backward is not recorded)."""
    forced = dispatch.use_variant(spec.op, variant) if variant else contextlib.nullcontext()
    with dispatch.use_backend(backend, op=spec.op), forced, poison_outputs(), dispatch.record() as calls:
        outs, grads, grad_outs = forward_backward(spec.public, args, kwargs)
    assert_ran([c for c in calls if c[0] == spec.op], spec.op, backend)
    ran = {c.variant for c in calls if c[0] == spec.op}
    if variant:
        assert ran == {variant}, f"{spec.op} ran variants {ran}, expected {variant!r}"
    if "torch" not in ran:  # dispatch's pick too, where the static default cannot serve (oneDNN bf16 on AVX2)
        # Backward runs on the forward's backend (a composite kernel may record its parts' backwards).
        backwards = [c for c in calls if c[0].endswith(".backward")]
        assert backwards and {c[1] for c in backwards} == {backend}, f"backward calls: {backwards}"
        assert spec.op + ".backward" in {c[0] for c in backwards}, f"{spec.op}'s backward not recorded: {backwards}"
    compare_with_reference(spec, dtype, args, kwargs, outs, grads, grad_outs)
    return outs


def compare_with_reference(spec: Spec, dtype: torch.dtype, args, kwargs, outs, grads, grad_outs):
    """Outputs and input gradients (from forward_backward on args, kwargs) against the float64 reference,
    with plain PyTorch in `dtype` as the naive bound."""
    ref_args = spec.ref_args(args)
    truth_outs, truth_grads, _ = forward_backward(spec.ref, upcast(*ref_args), kwargs, [g.double() for g in grad_outs])
    naive_outs, naive_grads, _ = forward_backward(spec.ref, clones(ref_args), kwargs, grad_outs)

    for i, (o, t, n) in enumerate(zip(outs, truth_outs, naive_outs)):
        assert_close(o, t, dtype, spec.kind, naive=n, name=f"{spec.op} output {i}")
    floor = grad_floor(dtype, truth_grads)
    for i, (g, t, n) in enumerate(zip(grads, truth_grads, naive_grads)):
        assert_close(g, t, dtype, "grad", naive=n, name=f"{spec.op} grad of input {i}", floor=floor)


def emulated_cuda_parity_test(specs, public: Callable):
    """A parity test of csrc/cuda's kernels under the CPU emulator (tests/emulated_cuda.py) on the specs'
    grid, every dtype, forward and every gradient: `public(library, spec)` is spec.public's signature on
    the emulated library's kernels."""
    pairs, ids = grid(*specs)

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
    @pytest.mark.parametrize("spec,case", pairs, ids=ids)
    def test_emulated_cuda_parity(emulated_cuda_library, spec, case, dtype):
        args, kwargs = case.make(dtype, "cpu")
        outs, grads, grad_outs = forward_backward(public(emulated_cuda_library, spec), args, kwargs)
        compare_with_reference(spec, dtype, args, kwargs, outs, grads, grad_outs)

    return test_emulated_cuda_parity


def check_inference_parity(spec: Spec, dtype: torch.dtype, args, kwargs, variant: str):
    """For ops that keep packed weights (a `prepared` argument): the cpu `variant`, forced, in eager
    inference with a PreparedWeights (the path a model's forward takes, packed copies and in-place
    epilogues), twice (packing, then the kept copy), equals the reference's forward."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    prepared = ops.PreparedWeights()
    truth = _outputs(spec.ref(*upcast(*spec.ref_args(args)), **kwargs))
    naive = _outputs(spec.ref(*spec.ref_args(args), **kwargs))
    for attempt in ("packing", "packed"):
        with torch.no_grad(), dispatch.use_variant(spec.op, variant), poison_outputs(), dispatch.record() as calls:
            outs = _outputs(spec.public(*args, **kwargs, prepared=prepared))
        assert {c.variant for c in calls if c[0] == spec.op} == {variant}, calls
        for i, (o, t, n) in enumerate(zip(outs, truth, naive)):
            assert_close(o, t, dtype, spec.kind, naive=n, name=f"{spec.op} inference output {i} ({attempt})")


def check_case(spec: Spec, case: Case, backend: str, dtype: torch.dtype):
    device = skip_unless_runnable(spec.op, backend, dtype)
    args, kwargs = case.make(dtype, device)
    check_parity(spec, backend, dtype, args, kwargs)


# ------------------------------------------------------------------------------ memory layouts


def _relaid(t, layout: str):
    """The same values in another memory layout (a leaf again if `t` requires grad)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    with torch.no_grad():
        if layout == "channels_last" and t.dim() == 4:
            out = t.contiguous(memory_format=torch.channels_last)
        elif layout == "strided":  # every other element of a buffer twice as wide
            out = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]
            out.copy_(t)
        else:  # "transposed": all dims reversed in memory (column-major for 2-D)
            dims = tuple(reversed(range(t.dim())))
            out = t.permute(dims).contiguous().permute(dims)
    return out.requires_grad_(t.requires_grad)


def _relayable(case) -> bool:
    """Every float input has two dims > 1, so each layout below really is non-contiguous."""
    args, _ = case.make(torch.float32, "cpu")
    return all(sum(n > 1 for n in a.shape) >= 2 for a in _float_tensors(args) if a.dim() > 1)


def layout_grid(*specs):
    """Each spec's first two cases whose inputs can be laid out non-contiguously."""
    pairs = [(spec, case) for spec in specs for case in [c for c in spec.cases if _relayable(c)][:2]]
    return pairs, [f"{s.op}-{c.name}" for s, c in pairs]


def check_layout(spec: Spec, case: Case, backend: str, layout: str):
    """Non-contiguous, transposed and channels-last inputs and output gradients give the contiguous
    inputs' results (same backend, float32)."""
    device = "cpu" if backend == "reference" else skip_unless_runnable(spec.op, backend, torch.float32)
    if backend == "triton" and device == "cpu" and case is not next(c for c in spec.cases if _relayable(c)):
        pytest.skip("the Triton interpreter is slow (80 s a layout at h768): its first case covers the layouts")
    args, kwargs = case.make(torch.float32, device)
    with dispatch.use_backend(backend, op=spec.op):
        outs, grads, grad_outs = forward_backward(spec.public, args, kwargs)
        relaid = [_relaid(a, layout) for a in args]
        assert any(isinstance(a, torch.Tensor) and a.is_floating_point() and not a.is_contiguous() for a in relaid)
        with poison_outputs(), dispatch.record() as calls:
            got, got_grads, _ = forward_backward(spec.public, relaid, kwargs, [_relaid(g, layout) for g in grad_outs])
            with torch.no_grad():  # inference may take other paths (fused epilogues)
                inferred = _outputs(spec.public(*relaid, **kwargs))
    assert_ran([c for c in calls if c[0] == spec.op], spec.op, backend)
    for i, (o, want) in enumerate(zip(inferred, outs)):
        assert_close(o, want, torch.float32, spec.kind, name=f"{spec.op} {layout} no-grad output {i}")
    for i, (o, want) in enumerate(zip(got, outs)):
        assert_close(o, want, torch.float32, spec.kind, name=f"{spec.op} {layout} output {i}")
    for i, (g, want) in enumerate(zip(got_grads, grads)):
        assert_close(g, want, torch.float32, "grad", name=f"{spec.op} {layout} grad of input {i}")


# ------------------------------------------------------------------------------ edge cases on cpu
# Stress numerics of the cpu kernels: the parity rules on inputs picked to break a naive kernel.


def _grads(outs, inputs, grad_out):
    return torch.autograd.grad(outs, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad], grad_out)


def run_cpu(spec: Spec, args, kwargs=None, grad_out=None):
    """The op on the cpu backend (asserted to have run, forward and backward), with poisoned outputs."""
    skip_unless_runnable(spec.op, "cpu", args[0].dtype)
    kwargs = kwargs or {}
    with dispatch.use_backend("cpu", op=spec.op), poison_outputs(), dispatch.record() as calls:
        out = spec.public(*args, **kwargs)
        grads = _grads(out, args, grad_out.to(out.dtype)) if grad_out is not None else None
    assert_ran([c for c in calls if c[0] == spec.op], spec.op, "cpu")
    if grad_out is not None:
        assert {c[1] for c in calls if c[0].endswith(".backward")} == {"cpu"}, f"backward calls: {list(calls)}"
    return out, grads


def truth(spec: Spec, args, kwargs=None, grad_out=None):
    """The reference on float64 copies: output and (given grad_out) gradients."""
    args = upcast(*args)
    out = spec.ref(*args, **(kwargs or {}))
    grads = _grads(out, args, grad_out.double()) if grad_out is not None else None
    return out, grads


def compare_cpu(spec: Spec, args, kwargs=None, backward=True):
    """The cpu kernel vs the float64 reference (and same-dtype PyTorch), forward and, if asked, backward."""
    dtype = args[0].dtype
    grad_out = None
    if backward:
        grad_out = torch.randn(spec.ref(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                                        **(kwargs or {})).shape).to(dtype)
    out, grads = run_cpu(spec, args, kwargs, grad_out)
    t_out, t_grads = truth(spec, args, kwargs, grad_out)
    naive_args = clones(args)
    n_out = spec.ref(*naive_args, **(kwargs or {}))
    n_grads = _grads(n_out, naive_args, grad_out.to(n_out.dtype)) if backward else None
    assert_close(out, t_out, dtype, spec.kind, naive=n_out, name=f"{spec.op} output")
    if backward:
        floor = grad_floor(dtype, t_grads)
        for i, (g, t, n) in enumerate(zip(grads, t_grads, n_grads)):
            assert_close(g, t, dtype, "grad", naive=n, name=f"{spec.op} grad of input {i}", floor=floor)
    return out, t_out


# ------------------------------------------------------------------------------ properties
# FASTBERT_HYPOTHESIS_EXAMPLES examples per (op, backend, dtype) (default 10, derandomized so CI is
# reproducible); a larger number is a deep run and draws fresh random examples unless
# FASTBERT_HYPOTHESIS_DERANDOMIZE=1. The Triton interpreter is slow: it gets fp32, tiny shapes and a
# fifth of the budget. A failure prints a reproduction blob (@reproduce_failure) to replay it.

DEFAULT_EXAMPLES = 10
EXAMPLES = int(os.environ.get("FASTBERT_HYPOTHESIS_EXAMPLES", DEFAULT_EXAMPLES))
DERANDOMIZE = os.environ.get("FASTBERT_HYPOTHESIS_DERANDOMIZE", "1" if EXAMPLES <= DEFAULT_EXAMPLES else "0") == "1"
TRITON_EXAMPLES = max(1, EXAMPLES // 5)

SEEDS = HIDDEN = SMALL_HIDDEN = INNER = None  # strategies, where hypothesis is installed
if st is not None:
    SEEDS = st.integers(0, 2**31 - 1)
    # Hidden sizes: odd ones (7, 100, 1000), the BERT ones, and anything in between. Widths start at 7: an
    # output of one or two numbers that cancels (a sum of terms of size 1 landing near 0, e.g. the bias
    # gradient of bias_gelu over a few rows) has a relative error no bf16 computation meets, plain PyTorch's
    # included. A reduction (inner) dimension may be anything from 1, as long as every compared tensor
    # keeps 7 numbers or more (dense's x gradient: rows x k).
    HIDDEN = st.one_of(st.sampled_from([7, 100, 384, 768, 1000]), st.integers(7, 1024))
    SMALL_HIDDEN = st.sampled_from([7, 16, 33])
    INNER = st.one_of(st.sampled_from([1, 7, 100, 768, 1000]), st.integers(1, 1024))


def _settings(max_examples):
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=DERANDOMIZE,
        database=None if DERANDOMIZE else hypothesis.settings.default.database,
        print_blob=True,
        suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large,
                               hypothesis.HealthCheck.function_scoped_fixture],
    )


def check_example(spec: Spec, backend: str, dtype: torch.dtype, device: str, p: dict):
    """One property example: `p` built into inputs, held to the parity rules and the spec's own checks."""
    torch.manual_seed(p["seed"])
    args, kwargs = spec.build(p, dtype, device)
    outs = check_parity(spec, backend, dtype, args, kwargs)
    if spec.check_example is not None:
        spec.check_example(p, args, kwargs, outs)


def _require_hypothesis():
    if hypothesis is None:
        pytest.skip("hypothesis is not installed (pip install hypothesis; it is in requirements.txt)")


def check_properties(spec: Spec, backend: str, dtype: torch.dtype):
    """The op on `backend` equals the reference on shapes, paddings and values hypothesis draws."""
    _require_hypothesis()
    device = skip_unless_runnable(spec.op, backend, dtype)
    if backend == "triton" and device == "cpu":
        pytest.skip("the Triton interpreter is slow: covered by test_triton_interpreter_properties (small shapes)")
    _run(spec, backend, dtype, device, small=False, examples=EXAMPLES)


def check_triton_interpreter_properties(spec: Spec):
    """Triton under TRITON_INTERPRET=1 on CPU tensors: fp32, tiny shapes, a tiny budget."""
    _require_hypothesis()
    device = skip_unless_runnable(spec.op, "triton", torch.float32)
    if device != "cpu":
        pytest.skip("a GPU is present: test_properties runs triton compiled at full size")
    _run(spec, "triton", torch.float32, device, small=True, examples=TRITON_EXAMPLES)


def _run(spec, backend, dtype, device, small, examples):
    strategy = st.composite(spec.params)(small=small)

    @_settings(examples)
    @hypothesis.given(data=st.data())
    def prop(data):
        check_example(spec, backend, dtype, device, data.draw(strategy, label=f"{spec.op} params"))

    if DERANDOMIZE:  # derandomized, every (op, backend, dtype) would replay one seed: give each its own
        prop = hypothesis.seed(zlib.crc32(f"{spec.op}/{backend}/{dtype}/{small}".encode()))(prop)
    prop()


# ------------------------------------------------------------------------------ opcheck, bad input


@dataclass
class OpCheck:
    backend: str  # whose machine reasons skip it (cuda: also no GPU)
    name: str  # torch.ops.fastbert.<name>, then "-" and a label
    make_args: Callable  # () -> args; called in the test (kernels and fastbert._C may be needed)


def opcheck_ids(checks):
    return [f"{c.backend}-{c.name}-{i}" for i, c in enumerate(checks)]


def check_opcheck(check: OpCheck):
    """torch.library.opcheck: schema, fake implementation, autograd, AOT."""
    reasons = CUDA_REASONS if check.backend == "cuda" else dispatch.machine_reasons(check.backend)
    if reasons:
        pytest.skip(("cuda unavailable: " if check.backend == "cuda" else "") + "; ".join(reasons))
    op = getattr(torch.ops.fastbert, check.name.split("-")[0]).default
    device = device_for(check.backend)  # triton's cases are written on the CPU: with a GPU they run there
    torch.library.opcheck(op, tuple(on_device(a, device) for a in check.make_args()))


def on_device(a, device: str):
    """A tensor argument moved to `device`, still a leaf where it was one (others unchanged)."""
    if not isinstance(a, torch.Tensor) or a.device.type == device:
        return a
    return a.detach().to(device).requires_grad_(a.requires_grad)


def check_bad_input(call, message):
    """`call` raises a ValueError matching `message` before any op runs."""
    with dispatch.record() as calls, pytest.raises(ValueError, match=message):
        call()
    assert calls == []


# ------------------------------------------------------------------------------ dropout


def cpu_keep_mask(seed, p, sequences, heads, rows, cols):
    """The mask the cpu (and cuda) kernels draw for a seed: [sequences, heads, rows, cols] bool."""
    return torch.ops.fastbert_C.dropout_keep(seed, p, sequences, heads, rows, cols)


def seed_tensor(value, device="cpu"):
    return torch.tensor([value], dtype=torch.int64, device=device)


def _within_sigmas(count, n, q, sigmas=5.0):
    """`count` successes of `n` independent trials of probability `q` lie within `sigmas` standard deviations."""
    half = sigmas * math.sqrt(n * q * (1 - q))
    return abs(count - n * q) < half, f"{count} of {n}; expected {n * q:.0f} ({n * q - half:.0f}..{n * q + half:.0f})"


def assert_keep_rate(keep, p):
    """A keep mask keeps 1 - p of its elements, within 5 sigma."""
    ok, where = _within_sigmas(int(keep.sum()), keep.numel(), 1 - p)
    assert ok, f"kept {where} at p={p}"


def assert_independent(a, b, p, what):
    """Two keep masks agree on an element at the chance rate p^2 + (1-p)^2, within 5 sigma."""
    ok, where = _within_sigmas(int((a == b).sum()), a.numel(), p * p + (1 - p) * (1 - p))
    assert ok, f"{what}: elements agree on {where}"


def check_with_mask(out, grads, fn, args, grad, dtype, kind, floor=True):
    """A kernel's dropout output and gradients equal `fn` (the reference with the kernel's mask applied)
    on float64 copies of `args`, within 2x `fn` in `dtype`. `floor`: gradients zero in exact arithmetic
    are held to rounding noise (grad_floor) rather than to a relative bound."""
    truth_in = upcast(*args)
    truth_out = fn(*truth_in)
    truth_grads = torch.autograd.grad(truth_out, truth_in, grad.double())
    naive_in = clones(args)
    naive_out = fn(*naive_in)
    naive_grads = torch.autograd.grad(naive_out, naive_in, grad)
    assert_close(out, truth_out, dtype, kind, naive=naive_out, name="output")
    fl = grad_floor(dtype, truth_grads) if floor else 0.0
    for i, (g, t, n) in enumerate(zip(grads, truth_grads, naive_grads)):
        assert_close(g, t, dtype, "grad", naive=n, name=f"grad of input {i}", floor=fl)


# ------------------------------------------------------------------------------ the tests every op gets
# Built here once, bound to names in each op's file (pytest collects them there).


def parity_tests(*specs):
    """test_parity (the grid: every case x backend x dtype), test_non_contiguous_inputs_work, test_properties
    and test_triton_interpreter_properties for these specs."""
    pairs, ids = grid(*specs)
    layout_pairs, layout_ids = layout_grid(*specs)
    by_op = pytest.mark.parametrize("spec", specs, ids=[s.op for s in specs])

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    @pytest.mark.parametrize("spec,case", pairs, ids=ids)
    def test_parity(spec, case, backend, dtype):
        check_case(spec, case, backend, dtype)

    @pytest.mark.parametrize("layout", ["strided", "transposed", "channels_last"])
    @pytest.mark.parametrize("backend", KERNEL_BACKENDS + ("reference",))
    @pytest.mark.parametrize("spec,case", layout_pairs, ids=layout_ids)
    def test_non_contiguous_inputs_work(spec, case, backend, layout):
        check_layout(spec, case, backend, layout)

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    @by_op
    def test_properties(spec, backend, dtype):
        check_properties(spec, backend, dtype)

    @by_op
    def test_triton_interpreter_properties(spec):
        check_triton_interpreter_properties(spec)

    return test_parity, test_non_contiguous_inputs_work, test_properties, test_triton_interpreter_properties


def variant_parity_test(*specs):
    """test_variant_parity: each of the cpu backend's variants of each spec's op (its own kernel, oneDNN's,
    torch's built-in), forced, on the parity grid: every one that dispatch may pick must equal the reference."""
    pairs = [(spec, case, name) for spec in specs for name in dispatch.variant_names(spec.op, "cpu")
             for case in spec.cases]
    ids = [f"{spec.op}-{case.name}-{name}" for spec, case, name in pairs]

    @pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
    @pytest.mark.parametrize("spec,case,variant", pairs, ids=ids)
    def test_variant_parity(spec, case, variant, dtype):
        device = skip_unless_variant(spec.op, variant, dtype, **case.facts)
        args, kwargs = case.make(dtype, device)
        check_parity(spec, "cpu", dtype, args, kwargs, variant)
        if "prepared" in inspect.signature(spec.public).parameters:
            check_inference_parity(spec, dtype, args, kwargs, variant)

    return test_variant_parity


def opcheck_test(checks):
    @pytest.mark.parametrize("check", checks, ids=opcheck_ids(checks))
    def test_opcheck(check):
        check_opcheck(check)

    return test_opcheck


def bad_input_test(cases):
    """cases: (call, message) pairs."""
    @pytest.mark.parametrize("call,message", cases)
    def test_bad_input(call, message):
        check_bad_input(call, message)

    return test_bad_input
