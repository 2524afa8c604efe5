"""Every kernel equals its naive reference, forward and every gradient, within the tolerance table.

Truth is the reference on float64 copies; the kernel must also stay within 2x the error of the
same-dtype reference. Outputs are poisoned (NaN) before the kernel runs, and each test asserts that
the backend under test ran, forward and backward.
"""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs, upcast
from grids import DTYPES, KERNEL_BACKENDS, skip_unless_runnable


def randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32, device=device) * scale).to(dtype).requires_grad_()


def padding_mask(batch, seq, device):
    """Unequal lengths, one sequence of a single token, one full-length."""
    lengths = torch.randint(1, seq + 1, (batch,))
    lengths[0], lengths[-1] = seq, 1
    return (torch.arange(seq)[None] < lengths[:, None]).to(device)


@dataclass
class Case:
    name: str
    make: Callable  # (dtype, device) -> (args, kwargs); float tensor args require grad
    kind: str  # tolerance column for the forward


@dataclass
class Spec:
    op: str
    public: Callable
    ref: Callable
    cases: list


SPECS = [
    Spec("bias_gelu", ops.bias_gelu, reference.bias_gelu, [
        Case(f"{rows}x{n}-{a}", (lambda rows, n, a: lambda dt, dev: (
            (randn(rows, n, dtype=dt, device=dev, scale=2), randn(n, dtype=dt, device=dev)), {"approximate": a}))(rows, n, a),
            "elementwise")
        for rows, n in ((1, 7), (13, 97), (8, 768), (3, 1000)) for a in ("none", "tanh")
    ] + [Case("3d-4x5x3072", lambda dt, dev: ((randn(4, 5, 3072, dtype=dt, device=dev), randn(3072, dtype=dt, device=dev)), {}),
              "elementwise")]),
    Spec("add_layer_norm", ops.add_layer_norm, reference.add_layer_norm, [
        Case(f"{rows}x{n}", (lambda rows, n: lambda dt, dev: ((
            randn(rows, n, dtype=dt, device=dev), randn(rows, n, dtype=dt, device=dev, scale=3),
            (1 + 0.1 * torch.randn(n, device=dev)).to(dt).requires_grad_(), randn(n, dtype=dt, device=dev), 1e-12), {}))(rows, n),
            "elementwise")
        for rows, n in ((1, 7), (13, 384), (6, 768), (3, 1000), (2, 1024))
    ]),
    Spec("dense", ops.dense, reference.dense, [
        Case(f"{rows}x{k}->{n}-{act}-{approx}", (lambda rows, k, n, act, approx: lambda dt, dev: ((
            randn(rows, k, dtype=dt, device=dev), randn(n, k, dtype=dt, device=dev, scale=k**-0.5),
            randn(n, dtype=dt, device=dev)), {"activation": act, "approximate": approx}))(rows, k, n, act, approx),
            "matmul")
        for rows, k, n, act, approx in ((1, 64, 64, "none", "none"), (17, 96, 384, "gelu", "none"),
                                        (9, 128, 256, "gelu", "tanh"), (33, 768, 768, "none", "none"),
                                        (5, 1000, 1000, "gelu", "none"))
    ]),
    Spec("qkv_projection", ops.qkv_projection, reference.qkv_projection, [
        Case(f"{shape}-h{hidden}/{heads}", (lambda shape, hidden, heads: lambda dt, dev: ((
            randn(*shape, hidden, dtype=dt, device=dev), randn(3 * hidden, hidden, dtype=dt, device=dev, scale=hidden**-0.5),
            randn(3 * hidden, dtype=dt, device=dev), heads), {}))(shape, hidden, heads),
            "matmul")
        for shape, hidden, heads in (((2, 7), 64, 2), ((3, 5), 768, 12), ((11,), 384, 12), ((1, 1), 128, 4),
                                     ((2, 3), 1024, 16))
    ]),
    Spec("attention", ops.attention, reference.attention, [
        Case(f"b{b}h{h}s{s}d{d}-{'mask' if masked else 'nomask'}", (lambda b, h, s, d, masked: lambda dt, dev: (
            tuple(randn(b, h, s, d, dtype=dt, device=dev) for _ in range(3)),
            {"attention_mask": padding_mask(b, s, dev) if masked else None}))(b, h, s, d, masked),
            "matmul")
        for b, h, s, d, masked in ((2, 2, 1, 32, False), (3, 2, 7, 64, True), (2, 3, 97, 32, True), (3, 2, 130, 64, True),
                                   (1, 12, 16, 64, False), (2, 2, 33, 48, True))
    ]),
]


def varlen_case(lengths, h, d):
    def make(dt, dev):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        return tuple(randn(total, h, d, dtype=dt, device=dev) for _ in range(3)) + (cu, max(lengths)), {}
    return Case(f"lens{'-'.join(map(str, lengths))}h{h}d{d}", make, "matmul")


SPECS.append(Spec("varlen_attention", ops.varlen_attention, reference.varlen_attention, [
    varlen_case([1], 2, 32), varlen_case([7, 1, 13], 2, 64), varlen_case([97, 30, 1, 64], 3, 32),
]))

GRID = [(spec, case) for spec in SPECS for case in spec.cases]


def _float_tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad]


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _forward_backward(fn, args, kwargs, grad_outs=None):
    outs = _outputs(fn(*args, **kwargs))
    if grad_outs is None:
        grad_outs = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
    inputs = _float_tensors(args)
    grads = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(grad_outs, outs)])
    return outs, list(grads), grad_outs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("spec,case", GRID, ids=[f"{s.op}-{c.name}" for s, c in GRID])
def test_parity(spec, case, backend, dtype):
    device = skip_unless_runnable(spec.op, backend, dtype)
    args, kwargs = case.make(dtype, device)
    with dispatch.use_backend(backend, op=spec.op), poison_outputs(), dispatch.record() as calls:
        outs, grads, grad_outs = _forward_backward(spec.public, args, kwargs)
    assert_ran([c for c in calls if c[0] == spec.op], spec.op, backend)
    # Backward runs on the forward's backend (a composite kernel may record its parts' backwards).
    backwards = [c for c in calls if c[0].endswith(".backward")]
    assert backwards and {c[1] for c in backwards} == {backend}, f"backward calls: {backwards}"
    assert spec.op + ".backward" in {c[0] for c in backwards}, f"{spec.op}'s backward not recorded: {backwards}"

    truth_args = upcast(*args)
    truth_kwargs = {k: v for k, v in kwargs.items()}
    truth_outs, truth_grads, _ = _forward_backward(spec.ref, truth_args, truth_kwargs, [g.double() for g in grad_outs])
    naive_args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    naive_outs, naive_grads, _ = _forward_backward(spec.ref, naive_args, kwargs, grad_outs)

    for i, (o, t, n) in enumerate(zip(outs, truth_outs, naive_outs)):
        assert_close(o, t, dtype, case.kind, naive=n, name=f"{spec.op} output {i}")
    floor = grad_floor(dtype, truth_grads)
    for i, (g, t, n) in enumerate(zip(grads, truth_grads, naive_grads)):
        assert_close(g, t, dtype, "grad", naive=n, name=f"{spec.op} grad of input {i}", floor=floor)


ATTENTION_GRID = [(s, c) for s, c in GRID if s.op in ("attention", "varlen_attention")]


@pytest.mark.parametrize("path", ["micro-kernel", "micro-kernel-fp32-copies", "blas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec,case", ATTENTION_GRID, ids=[f"{s.op}-{c.name}" for s, c in ATTENTION_GRID])
def test_cpu_attention_each_gemm(spec, case, dtype, path, monkeypatch):
    """The cpu attention kernel forced onto each of its GEMMs, forward and backward: its own micro-kernel
    (the forward's default with AVX-512, and all of it where torch has no BLAS; bfloat16 on bf16 dot
    products where the build has avx512_bf16, or on fp32 copies as builds without it) and torch's BLAS."""
    if path == "micro-kernel-fp32-copies" and dtype != torch.bfloat16:
        pytest.skip("float32 has no bf16 products to turn off")
    monkeypatch.setenv("FASTBERT_CPU_BLAS", "1" if path == "blas" else "0")
    monkeypatch.setenv("FASTBERT_CPU_BF16_DOT", "0" if path == "micro-kernel-fp32-copies" else "1")
    test_parity(spec, case, "cpu", dtype)


def test_cpu_attention_bf16_multiplies_bf16_pairs(monkeypatch):
    """Where the build has avx512_bf16, bfloat16 attention on the micro-kernel multiplies bfloat16 pairs
    (P rounded to bfloat16 for P V); FASTBERT_CPU_BF16_DOT=0 runs the same micro-kernel on fp32 copies.
    Only P's rounding differs between the two, so equal outputs would mean the pairs never ran. Both
    paths are held to the table by test_cpu_attention_each_gemm."""
    from fastbert import _C

    if not _C.AVX512_BF16:
        pytest.skip("fastbert._C was built without avx512_bf16")
    q, k, v = (torch.randn(2, 3, 97, 64).to(torch.bfloat16) for _ in range(3))
    mask = padding_mask(2, 97, "cpu")
    monkeypatch.setenv("FASTBERT_CPU_BLAS", "0")
    outs = {}
    for dot in ("1", "0"):
        monkeypatch.setenv("FASTBERT_CPU_BF16_DOT", dot)
        with dispatch.use_backend("cpu"), dispatch.record() as calls:
            outs[dot] = ops.attention(q, k, v, mask)
        assert_ran(calls, "attention", "cpu")
    assert not torch.equal(outs["1"], outs["0"])


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


LAYOUT_GRID = [(spec, case) for spec in SPECS for case in [c for c in spec.cases if _relayable(c)][:2]]


@pytest.mark.parametrize("layout", ["strided", "transposed", "channels_last"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS + ("reference",))
@pytest.mark.parametrize("spec,case", LAYOUT_GRID, ids=[f"{s.op}-{c.name}" for s, c in LAYOUT_GRID])
def test_non_contiguous_inputs_work(spec, case, backend, layout):
    """Non-contiguous, transposed and channels-last inputs and output gradients give the contiguous
    inputs' results (same backend, float32)."""
    device = "cpu" if backend == "reference" else skip_unless_runnable(spec.op, backend, torch.float32)
    args, kwargs = case.make(torch.float32, device)
    with dispatch.use_backend(backend, op=spec.op):
        outs, grads, grad_outs = _forward_backward(spec.public, args, kwargs)
        relaid = [_relaid(a, layout) for a in args]
        assert any(isinstance(a, torch.Tensor) and a.is_floating_point() and not a.is_contiguous() for a in relaid)
        with poison_outputs(), dispatch.record() as calls:
            got, got_grads, _ = _forward_backward(spec.public, relaid, kwargs, [_relaid(g, layout) for g in grad_outs])
            with torch.no_grad():  # inference may take other paths (fused epilogues)
                inferred = _outputs(spec.public(*relaid, **kwargs))
    assert_ran([c for c in calls if c[0] == spec.op], spec.op, backend)
    for i, (o, want) in enumerate(zip(inferred, outs)):
        assert_close(o, want, torch.float32, case.kind, name=f"{spec.op} {layout} no-grad output {i}")
    for i, (o, want) in enumerate(zip(got, outs)):
        assert_close(o, want, torch.float32, case.kind, name=f"{spec.op} {layout} output {i}")
    for i, (g, want) in enumerate(zip(got_grads, grads)):
        assert_close(g, want, torch.float32, "grad", name=f"{spec.op} {layout} grad of input {i}")
