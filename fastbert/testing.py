"""The one tolerance table, and the assertions every parity test uses.

rel err = ||out - ref|| / ||ref||, with `ref` computed in float64 on upcast inputs. A kernel must be
within the table's bound for its dtype and, where the same-dtype naive computation is given, within
2x that computation's own error (plus a small floor: a tenth of the bound, or one rounding step of the
dtype, whichever is larger), so a kernel is never allowed to be much worse than plain PyTorch. That
comparison needs a result of at least NAIVE_MIN_ELEMENTS elements: over fewer, an error norm is one or
two rounding draws, and one lucky summation order in plain PyTorch can be 10x closer to the truth than
another, equally valid one. Where
plain PyTorch in that dtype is itself beyond the table's bound (an ill-conditioned result: bf16 terms
that cancel in a short sum), the 2x-of-PyTorch bar is the one that applies. NaN never passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastbert.dispatch import poison_outputs  # noqa: F401  (re-exported for tests)


@dataclass(frozen=True)
class Tolerance:
    elementwise: float  # forward of elementwise / normalization ops
    matmul: float  # forward of attention and GEMMs
    grad: float  # every gradient


TOLERANCES = {
    torch.float32: Tolerance(elementwise=1e-5, matmul=1e-4, grad=1e-4),
    torch.float16: Tolerance(elementwise=2e-3, matmul=2e-3, grad=1e-2),
    torch.bfloat16: Tolerance(elementwise=1e-2, matmul=1e-2, grad=2e-2),
}
KINDS = ("elementwise", "matmul", "grad")
GRAD_FLOOR = 1e-2  # x the largest gradient norm of the same call: the floor for an all-zero true gradient
NAIVE_FACTOR = 2.0  # a kernel may be at most this much worse than same-dtype PyTorch ...
NAIVE_FLOOR = 0.1  # ... plus this fraction of the table's bound or one rounding step (eps) of the dtype,
# whichever is larger: two correct implementations may round a single-element result one ulp apart.
NAIVE_MIN_ELEMENTS = 16  # ... on results this large or larger. Measured: the x gradient of dense with k=1
# is one 768-term sum; 20 orders of its terms, all valid fp32, land 8.8e-7 to 1.8e-5 from the truth.


def tolerance(dtype: torch.dtype, kind: str) -> float:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return getattr(TOLERANCES[dtype], kind)


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor). `floor` matters only for a reference that is exactly zero in
    exact arithmetic (e.g. the q gradient of attention over one key), where rounding noise is all there is."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / max(float(ref.norm()), floor, 1e-300))


def _where(out: torch.Tensor, ref: torch.Tensor, tol: float) -> str:
    out, ref = out.detach(), ref.detach()
    diff = (out.double() - ref.double()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    idx = torch.unravel_index(diff.argmax(), diff.shape) if diff.dim() else ()
    idx = tuple(int(i) for i in idx)
    # An element "fails" when it is off by more than tol relative to the tensor's RMS.
    rms = float(ref.double().pow(2).mean().sqrt()) if ref.numel() else 0.0
    failing = int((diff > tol * max(rms, 1e-30)).sum())
    return (f"largest difference {float(diff.max()):.3g} at index {idx} "
            f"(out {float(out[idx]) if idx or not out.dim() else float(out):.6g}, ref {float(ref[idx]):.6g}); "
            f"{failing} of {diff.numel()} elements off by more than {tol:g} x RMS(ref)")


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, kind: str,
                 naive: torch.Tensor | None = None, name: str = "output", floor: float = 0.0) -> float:
    """Assert `out` (computed in `dtype`) matches the float64 `ref`; returns the rel err.

    `naive`, if given, is the same quantity from plain PyTorch in `dtype`: `out` may be at most
    NAIVE_FACTOR x its error (+ the larger of NAIVE_FLOOR x the bound and the dtype's eps) where it has
    NAIVE_MIN_ELEMENTS elements or more, and may exceed the bound only where `naive` exceeds it too.
    """
    assert isinstance(out, torch.Tensor), f"{name}: expected a tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    tol = tolerance(dtype, kind)
    if not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise AssertionError(f"{name}: {bad} non-finite elements (NaN/inf) of {out.numel()}; " + _where(out, ref, tol))
    err = rel_err(out, ref, floor)
    # Against a reference below the floor (a gradient that is zero in exact arithmetic) both sides are
    # rounding noise, and same-dtype PyTorch may cancel exactly: only the table's bound applies.
    naive_err = None
    if naive is not None and float(ref.detach().double().norm()) >= floor:
        naive_err = rel_err(naive, ref, floor)
    ill_conditioned = naive_err is not None and naive_err > tol and err <= NAIVE_FACTOR * naive_err
    if err > tol and not ill_conditioned:
        raise AssertionError(f"{name}: rel err {err:.3g} > {tol:g} ({dtype}, {kind}); " + _where(out, ref, tol))
    if naive_err is not None and ref.numel() >= NAIVE_MIN_ELEMENTS:
        bound = NAIVE_FACTOR * naive_err + max(NAIVE_FLOOR * tol, torch.finfo(dtype).eps)
        if err > bound:
            raise AssertionError(
                f"{name}: rel err {err:.3g} is worse than {NAIVE_FACTOR:g} x same-dtype PyTorch's {naive_err:.3g} "
                f"(+ max({NAIVE_FLOOR:g} x {tol:g}, eps {torch.finfo(dtype).eps:.3g})); " + _where(out, ref, tol)
            )
    return err


def assert_ran(calls, op: str, backend: str) -> None:
    """Assert `backend` ran `op` inside a `fastbert.dispatch.record()` block (and nothing else ran it)."""
    ran = [c[1] for c in calls if c[0] == op]
    assert ran, f"{op} never ran (calls: {list(calls)})"
    assert set(ran) == {backend}, f"{op} ran on {sorted(set(ran))}, expected only {backend!r}"


def upcast(*tensors):
    """float64 leaf copies (requiring grad where the original does) for the ground-truth reference."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().double().requires_grad_(t.requires_grad)
        out.append(t)
    return out


def gradients(model_or_grads) -> dict:
    if isinstance(model_or_grads, dict):
        return model_or_grads
    return {n: p.grad for n, p in model_or_grads.named_parameters()}


def assert_same_gradients(ours, reference, dtype: torch.dtype = torch.float32, noise: float = 1e-6) -> None:
    """Every parameter gradient of `ours` equals `reference`'s (rel err within the table's grad bound).

    Either argument is a model or a {name: gradient} dict. A gradient that is zero in exact arithmetic
    (the attention key bias: softmax ignores a shift shared by a whole row) is rounding noise on both
    sides: it must be noise-sized (noise x the largest gradient norm) on both."""
    ours, reference = gradients(ours), gradients(reference)
    assert set(ours) == set(reference), f"parameters differ: {sorted(set(ours) ^ set(reference))}"
    floor = noise * max(float(g.norm()) for g in reference.values() if g is not None)
    tol = tolerance(dtype, "grad")
    for name, ref in reference.items():
        got = ours[name]
        assert got is not None and ref is not None, f"{name}: no gradient"
        if float(ref.norm()) <= floor:
            assert float(got.norm()) <= floor, f"{name}: gradient should be ~0, norm {float(got.norm()):.3g}"
            continue
        err = rel_err(got, ref)
        assert err <= tol, f"{name}: grad rel err {err:.3g} > {tol:g}"
