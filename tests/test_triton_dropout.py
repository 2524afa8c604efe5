"""The triton add_layer_norm's fused dropout: deterministic for a seed, the right keep rate, and forward
and backward equal to the reference computed with the very same mask.

The kernel saves no mask (the backward regenerates it from the seed), so the tests recover it twice,
independently: from the forward (invert the LayerNorm with the saved mean and rstd: h - residual is
x / (1 - p) where kept and 0 where dropped) and from the backward (dx is dresidual / (1 - p) where kept
and exactly 0 where dropped). The two must agree element for element.
"""
import math

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs
from grids import DTYPES, skip_unless_runnable

EPS = 1e-5


def _inputs(shape, dtype, device):
    """x bounded away from 0 (|x| in [0.5, 1.5]) and weight too, so a dropped element is unmistakable."""
    n = shape[-1]
    x = (torch.rand(shape, device=device) + 0.5) * torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    residual = torch.randn(shape, device=device)
    weight = torch.rand(n, device=device) + 0.5
    bias = torch.randn(n, device=device)
    return [t.to(dtype).requires_grad_() for t in (x, residual, weight, bias)]


def _seed(value, device):
    return torch.tensor([value], dtype=torch.int64, device=device)


def _forward(x, residual, weight, bias, p, seed):
    return torch.ops.fastbert.add_layer_norm_triton(x, residual, weight, bias, EPS, p, seed)


def _mask_from_forward(out, mean, rstd, x, residual, weight, bias, p):
    """Invert the LayerNorm; every element must read clearly as kept (x / (1 - p)) or dropped (0)."""
    out, x, residual, weight, bias = (t.detach().double() for t in (out, x, residual, weight, bias))
    h = (out - bias) / weight / rstd.double().reshape(*out.shape[:-1], 1) + mean.double().reshape(*out.shape[:-1], 1)
    dropped_x = h - residual
    scaled = x / (1 - p)
    kept = (dropped_x - scaled).abs() < 0.5 * scaled.abs()
    dropped = dropped_x.abs() < 0.5 * scaled.abs()
    assert bool((kept ^ dropped).all()), f"{int((~(kept ^ dropped)).sum())} elements are neither kept nor dropped"
    return kept


def _keep_rate_bounds(n, q, sigmas=5.0):
    half = sigmas * math.sqrt(n * q * (1 - q))
    return n * q - half, n * q + half


def _device():
    return skip_unless_runnable("add_layer_norm", "triton", torch.float32)


def test_same_seed_same_result_forward_and_backward():
    device = _device()
    x, residual, weight, bias = _inputs((6, 97), torch.float32, device)
    grad = torch.randn(6, 97, device=device)

    def run(seed_value):
        outs = _forward(x, residual, weight, bias, 0.3, _seed(seed_value, device))
        return list(outs) + list(torch.autograd.grad(outs[0], (x, residual, weight, bias), grad))

    first, again, other = run(1234), run(1234), run(4321)
    for i, (a, b) in enumerate(zip(first, again)):
        assert torch.equal(a, b), f"tensor {i} differs between two runs with the same seed"
    assert not torch.equal(first[0], other[0]), "a different seed gave the same output"


def test_public_op_reproducible_under_manual_seed_and_runs_triton():
    device = _device()
    x, residual, weight, bias = _inputs((4, 64), torch.float32, device)

    def run():
        with dispatch.use_backend("triton", op="add_layer_norm"), dispatch.record() as calls:
            out = ops.add_layer_norm(x, residual, weight, bias, EPS, dropout_p=0.25)
            grads = torch.autograd.grad(out.sum(), (x, residual))
        assert_ran(calls, "add_layer_norm", "triton")
        assert_ran(calls, "add_layer_norm.backward", "triton")
        return out, grads

    torch.manual_seed(7)
    out1, grads1 = run()
    out2, _ = run()  # the generator moved on: a fresh mask
    torch.manual_seed(7)
    out3, grads3 = run()
    assert torch.equal(out1, out3) and all(torch.equal(a, b) for a, b in zip(grads1, grads3))
    assert not torch.equal(out1, out2), "two calls without reseeding drew the same mask"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_independence(p):
    device = _device()
    rows, n = 64, 300
    x, residual, weight, bias = (t.detach() for t in _inputs((rows, n), torch.float32, device))
    masks = [_mask_from_forward(*_forward(x, residual, weight, bias, p, _seed(s, device)), x, residual, weight, bias, p)
             for s in (11, 12)]
    for mask in masks:
        kept = int(mask.sum())
        lo, hi = _keep_rate_bounds(rows * n, 1 - p)
        assert lo <= kept <= hi, f"kept {kept} of {rows * n} at p={p}; expected {rows * n * (1 - p):.0f} (5 sigma: {lo:.0f}..{hi:.0f})"
    # Independent masks agree on an element with probability p^2 + (1-p)^2: across seeds, and across
    # rows of one mask (disjoint row pairs, so the trials are independent).
    agree = p * p + (1 - p) * (1 - p)
    for what, a, b in (("two seeds", masks[0], masks[1]), ("row pairs", masks[0][0::2], masks[0][1::2])):
        same = int((a == b).sum())
        lo, hi = _keep_rate_bounds(a.numel(), agree)
        assert lo <= same <= hi, f"{what}: {same} of {a.numel()} elements agree; expected {a.numel() * agree:.0f} ({lo:.0f}..{hi:.0f})"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", [(2, 5, 97), (3, 384)], ids=["2x5x97", "3x384"])
def test_forward_and_backward_equal_reference_with_the_same_mask(shape, dtype):
    device = skip_unless_runnable("add_layer_norm", "triton", dtype)
    p = 0.2
    args = _inputs(shape, dtype, device)
    grad = torch.randn(shape, device=device).to(dtype)
    with poison_outputs():
        out, mean, rstd = _forward(*args, p, _seed(2026, device))
        grads = torch.autograd.grad(out, args, grad)

    mask = _mask_from_forward(out, mean, rstd, *args, p)
    mask_bwd = grads[0] != 0  # dropped elements get exactly 0
    assert torch.equal(mask, mask_bwd), f"forward and backward masks differ in {int((mask != mask_bwd).sum())} elements"
    assert 0 < int(mask.sum()) < mask.numel()

    def with_mask(x, residual, weight, bias):  # dropout(x) with the kernel's mask, then the naive op
        return reference.add_layer_norm(x * mask.to(x.dtype) * (1.0 / (1 - p)), residual, weight, bias, EPS)

    def run(tensors, g):
        o = with_mask(*tensors)
        return o, torch.autograd.grad(o, tensors, g)

    truth, truth_grads = run([t.detach().double().requires_grad_() for t in args], grad.double())
    naive, naive_grads = run([t.detach().clone().requires_grad_() for t in args], grad)
    assert_close(out, truth, dtype, "elementwise", naive=naive, name="add_layer_norm output")
    floor = grad_floor(dtype, truth_grads)
    for name, g, t, nv in zip(("x", "residual", "weight", "bias"), grads, truth_grads, naive_grads):
        assert_close(g, t, dtype, "grad", naive=nv, name=f"grad of {name}", floor=floor)


def test_compiled_graph_draws_a_fresh_mask_per_call():
    """The seed is a tensor drawn inside the graph, not a constant baked in while tracing."""
    device = _device()
    x, residual, weight, bias = _inputs((3, 40), torch.float32, device)

    def f(x, residual, weight, bias):
        return ops.add_layer_norm(x, residual, weight, bias, EPS, dropout_p=0.3)

    with dispatch.use_backend("triton", op="add_layer_norm"):
        compiled = torch.compile(f, fullgraph=True)
        torch.manual_seed(3)
        first, second = compiled(x, residual, weight, bias), compiled(x, residual, weight, bias)
        torch.manual_seed(3)
        again = compiled(x, residual, weight, bias)
        torch.autograd.grad(again.sum(), (x, weight))
    assert not torch.equal(first, second), "two compiled calls applied the same mask"
    assert torch.equal(first, again), "the same torch seed gave a different mask"
