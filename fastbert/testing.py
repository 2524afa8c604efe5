"""The one tolerance table, and the assertions every parity test uses.

rel err = ||out - ref|| / ||ref||, with `ref` computed in float64 on upcast inputs. A kernel must be
within the table's bound for its dtype, norm-wise and element by element (max|out - ref| within
ELEMENT_FACTOR x the bound x max|ref|: one region far off cannot hide inside an acceptable norm), row by
row and column by column (ROW_FACTOR x the bound of a typical row's or column's norm: small rows beside
large ones and one wrong output feature are seen), and,
where the same-dtype naive computation is given, within 2x that computation's own error (plus a small
floor: a tenth of the bound, or the error of rounding the exact result to the dtype), so a kernel is never
allowed to be much worse than plain PyTorch. That comparison needs a result of at least NAIVE_MIN_ELEMENTS
elements: over fewer, an error norm is one or two rounding draws, and one lucky summation order in plain
PyTorch can be 10x closer to the truth than another, equally valid one. Where plain PyTorch in that dtype
is itself beyond the table's bound (an ill-conditioned result: bf16 terms that cancel in a short sum), the
2x-of-PyTorch bar applies, up to ILL_CONDITIONED_MAX x the bound and never to an all-zeros output.
Gradients are each held relative to their own norm; only one that is zero in exact arithmetic is held to
rounding noise (grad_floor). NaN never passes, in the output or (a broken test) in the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastbert.ops._alloc import poison_outputs  # noqa: F401  (re-exported for tests)


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


@dataclass(frozen=True)
class Int8Tolerance:
    """int8 inference (fastbert.quantize) against the same model in float32. The quantized kernels
    themselves are held to the float rows above, against a reference fed the same quantized bytes."""

    sentence_cosine: float  # each sentence's mean-pooled embedding: cosine(int8, float32), the smallest
    spearman: float  # rank correlation of all pairwise cosine similarities, int8 vs float32
    hidden_rel_err: float  # rel err of last_hidden_state of a random-weight BERT-base (measured ~0.02)
    checkpoint_rel_err: float  # the same on a trained checkpoint, where a few outlier dimensions carry most of
    # the norm (all-MiniLM-L6-v2, measured: fastbert 0.061, OpenVINO's NNCF int8 0.10-0.11, ONNX Runtime's
    # dynamic int8 0.19-0.20). What `bench` asks of every int8 model before timing it: past it the
    # quantization is broken, not merely coarse.


INT8 = Int8Tolerance(sentence_cosine=0.99, spearman=0.995, hidden_rel_err=0.03, checkpoint_rel_err=0.25)
NAIVE_FACTOR = 2.0  # a kernel may be at most this much worse than same-dtype PyTorch ...
NAIVE_FLOOR = 0.1  # ... plus this fraction of the table's bound or the error of rounding the exact result to
# the dtype, whichever is larger: a kernel that rounds its result once is never failed for it, even beside a
# PyTorch that happens to be exact. (One rounding step of the dtype, the floor before, is 78% of bfloat16's
# forward bound: beside it the 2x check could never fail a bfloat16 forward. Measured over the whole suite:
# no kernel's error needed any floor above 2x plain PyTorch's.)
NAIVE_MIN_ELEMENTS = 16  # ... on results this large or larger. Measured: the x gradient of dense with k=1
# is one 768-term sum; 20 orders of its terms, all valid fp32, land 8.8e-7 to 1.8e-5 from the truth.
ILL_CONDITIONED_MAX = 4.0  # x the table's bound: the most an ill-conditioned result (same-dtype PyTorch
# beyond the bound too) may be off, whatever PyTorch does. The escape is for inputs whose conditioning puts
# every implementation in the dtype past the bound; the worst in the suite: float32 LayerNorm on rows offset
# 1e3 x their spread, where rounding x + residual to float32 alone costs ~u x 1e3 of the spread (plain
# PyTorch 3.4e-5, 3.4x the bound). Past 4x the bound a test's inputs ask for more digits than the dtype
# has, or the result is wrong; and an all-wrong result (rel err ~1) fails even beside a PyTorch that is too.
ELEMENT_FACTOR = 6.0  # max|out - ref| <= this x the bound x max|ref|. An error that passes the norm check
# has RMS <= bound x RMS(ref) <= bound x max|ref|; spread like independent roundings over N elements, its
# largest element is about sqrt(2 ln N) x its RMS, and sqrt(2 ln N) <= 6 up to N = 6.5e7 (BERT-base's
# word-embedding gradient has 2.3e7 elements). So noise-like errors pass even on a flat reference at the
# norm bound; one element far off inside an acceptable norm does not.
ROW_FACTOR = 4.0  # each row (the last dimension: a token's features, a head's output) and each column (one feature
# over all rows: a wrong bias element or tail tile) within this x the bound of
ROW_FLOOR = 0.1  # its own norm, or of this fraction of the typical (RMS) row norm where its own is smaller. The
# norm and elementwise checks scale with the whole tensor: rows of a small norm beside a few large ones (an
# attention output over 97 keys beside a one-token sequence's, which carries ~80% of the norm) could be 5x
# off the table unseen. Measured over the whole suite: one op's worst row is 1.7x the bound (a bfloat16
# weight gradient over 5 input rows; plain PyTorch's own 1.5x), a whole bfloat16 model's 3.5x (a value
# weight's gradient row; plain PyTorch's worst row 4.0x), most under 0.3x.
GRAD_NOISE = 4.0  # x eps x the largest gradient norm of the call: rounding noise. A gradient that is zero in
# exact arithmetic (the attention key bias's: softmax ignores a shift shared by a row; q's over one key) comes
# out of any implementation as a sum of rounded terms that cancel: noise of about eps x the terms' scale, which
# the call's largest gradient bounds; below a few eps x that norm no implementation in the precision resolves
# a gradient. Applied at two precisions. At the REFERENCE's eps it says what is zero in exact arithmetic (for
# a float64 reference ~1e-15 of the largest norm: only an exact zero is below it); such a reference needs
# `out` within the same rule at `out`'s eps (grad_floor). Every other gradient, however small, is held to
# the table relative to its own norm: at `out`'s eps, zero and small could not be told apart (bf16 eps x the
# largest norm is above gradients bf16 kernels resolve: an x gradient beside a weight gradient summed over
# many rows sat at 0.03 x the largest norm, 2.5e-3 off). Measured noise: the key-bias gradient of the tests'
# models, 1e-4 to 1e-3 x eps x the largest norm in float32 and 3e-5 in bfloat16.


def tolerance(dtype: torch.dtype, kind: str) -> float:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return getattr(TOLERANCES[dtype], kind)


def grad_floor(dtype: torch.dtype, grads) -> float:
    """GRAD_NOISE x eps(dtype) x the largest norm among `grads` (the reference gradients of one call:
    tensors, or a {name: tensor} dict): the `floor` to pass assert_close for gradients computed in `dtype`."""
    grads = grads.values() if isinstance(grads, dict) else grads
    norms = [float(g.detach().double().norm()) for g in grads if g is not None]
    return GRAD_NOISE * torch.finfo(dtype).eps * max(norms, default=0.0)


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor)."""
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
    """Assert `out` (computed in `dtype`) matches the reference `ref`; returns the rel err.

    `ref` is float64 on upcast inputs (or, comparing two implementations, the other one's result).
    Norm-wise: rel err <= the table's bound. Elementwise: max|out - ref| <= ELEMENT_FACTOR x that bound x
    max|ref|. `naive`, if given, is the same quantity from plain PyTorch in `dtype`: `out` may be at most
    NAIVE_FACTOR x its error (+ the larger of NAIVE_FLOOR x the bound and the exact result's rounding) where it has
    NAIVE_MIN_ELEMENTS elements or more, and may exceed the bound only where `naive` exceeds it too, and
    then by ILL_CONDITIONED_MAX x the bound at most. `floor` (see grad_floor) is rounding noise in `dtype`:
    a reference that is zero in exact arithmetic (below the floor taken at the reference's own eps) needs
    `out` within `floor` of it, absolutely; every other reference is held relative to its own norm.
    """
    assert isinstance(out, torch.Tensor), f"{name}: expected a tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype in (dtype, torch.float64), (  # float64: a result built to carry an exact error (tests)
        f"{name}: out is {out.dtype}, not the {dtype} it is held to (a kernel that returned another dtype?)")
    tol = tolerance(dtype, kind)
    if not bool(torch.isfinite(ref).all()):
        bad = int((~torch.isfinite(ref)).sum())
        raise AssertionError(f"{name}: the REFERENCE (not the kernel's output) has {bad} non-finite elements "
                             f"(NaN/inf) of {ref.numel()}: the test's reference or its inputs are broken")
    if not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise AssertionError(f"{name}: {bad} non-finite elements (NaN/inf) of {out.numel()}; " + _where(out, ref, tol))
    o, r = out.detach().double(), ref.detach().double()
    ref_norm, diff_norm = float(r.norm()), float((o - r).norm())
    # The floor is noise at `out`'s precision; the same rule at the reference's precision says whether the
    # reference is zero in exact arithmetic (then both sides are rounding noise, and out's must be noise-sized).
    zero = floor * torch.finfo(ref.dtype).eps / torch.finfo(dtype).eps if ref.is_floating_point() else 0.0
    if ref_norm <= zero and floor > 0:
        if diff_norm > floor:
            raise AssertionError(
                f"{name}: the reference is zero in exact arithmetic (norm {ref_norm:.3g}: rounding noise in "
                f"{ref.dtype}) but out is off by {diff_norm:.3g}, more than rounding noise in {dtype} "
                f"(floor {floor:.3g}); " + _where(out, ref, tol))
        return diff_norm / floor
    err = diff_norm / max(ref_norm, 1e-300)
    if ref_norm > 0 and not bool(o.any()):
        raise AssertionError(f"{name}: out is all zeros, the reference is not (norm {ref_norm:.3g})")
    if naive is not None:
        assert naive.shape == ref.shape, f"{name}: naive has shape {tuple(naive.shape)}, the reference {tuple(ref.shape)}"
        if not bool(torch.isfinite(naive).all()):
            naive = None  # plain PyTorch overflowed: it says nothing of the conditioning, and widens nothing
    naive_err = rel_err(naive, ref) if naive is not None else None
    bound = tol
    if naive_err is not None and naive_err > tol:  # ill-conditioned: plain PyTorch misses the table too
        bound = min(NAIVE_FACTOR * naive_err, ILL_CONDITIONED_MAX * tol)
    if err > bound:
        why = "" if bound == tol else (f" (ill-conditioned: same-dtype PyTorch is off by {naive_err:.3g}, so "
                                       f"min({NAIVE_FACTOR:g} x that, {ILL_CONDITIONED_MAX:g} x {tol:g}) applies)")
        raise AssertionError(f"{name}: rel err {err:.3g} > {bound:.3g}{why} ({dtype}, {kind}); "
                             + _where(out, ref, tol))
    if naive_err is not None and ref.numel() >= NAIVE_MIN_ELEMENTS:
        rounding = rel_err(ref.to(dtype), ref)  # the result itself rounded to `dtype`
        naive_bound = NAIVE_FACTOR * naive_err + max(NAIVE_FLOOR * tol, rounding)
        if err > naive_bound:
            raise AssertionError(
                f"{name}: rel err {err:.3g} is worse than {NAIVE_FACTOR:g} x same-dtype PyTorch's {naive_err:.3g} "
                f"(+ max({NAIVE_FLOOR:g} x {tol:g}, the reference rounded to {dtype}: {rounding:.3g})); "
                + _where(out, ref, tol))
    worst, scale = float((o - r).abs().max()), float(r.abs().max())
    if worst > ELEMENT_FACTOR * bound * scale:
        raise AssertionError(
            f"{name}: elementwise error {worst:.3g} > {ELEMENT_FACTOR:g} x {bound:.3g} x max|ref| {scale:.3g} "
            f"(rel err {err:.3g} is within the bound; one region is off); " + _where(out, ref, tol))
    _assert_rows_close(o, r, naive, bound, name, lambda: _where(out, ref, tol))
    return err


def _assert_rows_close(o: torch.Tensor, r: torch.Tensor, naive: torch.Tensor | None, bound: float, name: str,
                       where) -> None:
    """Every row (the last dimension: a token's features) of `o` within ROW_FACTOR x `bound` of its own norm
    in `r`, or of ROW_FLOOR x the typical row norm where its own is smaller; every column (one feature over
    all rows) within ROW_FACTOR x `bound` of the typical column norm, or of its own where larger (a column's
    elements carry their rows' rounding: beside one dominant row, a column near zero there has no smaller
    error). One where same-dtype PyTorch misses that too (ill-conditioned: a bfloat16 weight gradient's
    terms that cancel) may be NAIVE_FACTOR x PyTorch's error off, up to ILL_CONDITIONED_MAX x that bound."""
    if o.dim() < 2 or o.shape[-1] < 2 or o.numel() < 2 * o.shape[-1]:
        return  # one row, or rows of one number: the norm and elementwise checks say it all
    as_rows = [t if t is None else t.detach().double().reshape(-1, t.shape[-1]) for t in (o, r, naive)]
    as_columns = [t if t is None else t.T for t in as_rows]
    for what, floor, (o2, r2, n2) in (("row", ROW_FLOOR, as_rows), ("column", 1.0, as_columns)):
        norm = r2.norm(dim=1)
        held_to = norm.clamp_min(floor * float(norm.pow(2).mean().sqrt())).clamp_min(1e-300)
        relative = lambda t: torch.where((t - r2).norm(dim=1) > 0, (t - r2).norm(dim=1) / held_to, 0.0)  # noqa: E731
        ratio, allowed = relative(o2), torch.full_like(held_to, ROW_FACTOR * bound)
        if n2 is not None:
            allowed = allowed.maximum((NAIVE_FACTOR * relative(n2)).clamp_max(ILL_CONDITIONED_MAX * allowed))
        off = ratio > allowed
        if bool(off.any()):
            worst = int((ratio / allowed).argmax())
            raise AssertionError(
                f"{name}: {what} {worst} (of {o2.shape[0]} {what}s of {o2.shape[1]}) is off by "
                f"{float(ratio[worst]):.3g} of its norm {float(norm[worst]):.3g}, more than "
                f"{float(allowed[worst]):.3g} ({int(off.sum())} {what}s are; small {what}s beside large ones can "
                f"be off inside the whole tensor's bound); " + where())


def assert_matches(out: torch.Tensor, other: torch.Tensor, dtype: torch.dtype = torch.float32,
                   name: str = "output", kind: str = "elementwise") -> float:
    """Two implementations' results in one `dtype` agree within the table (norm-wise and elementwise),
    `other` standing in for the float64 reference. Fair where `dtype`'s own error is far below its bound
    (float32: ~1e-7 a step against a bound of 1e-5); a low-precision result should instead be compared
    with a float64 run of the same model (assert_close, with the other one as `naive`)."""
    return assert_close(out, other, dtype, kind, name=name)


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


def assert_same_gradients(ours, reference, dtype: torch.dtype = torch.float32) -> None:
    """Every parameter gradient of `ours` equals `reference`'s (assert_close, kind "grad").

    Either argument is a model or a {name: gradient} dict. A gradient that is zero in exact arithmetic
    (the attention key bias: softmax ignores a shift shared by a whole row) is rounding noise on both
    sides: below grad_floor(dtype, reference) both must be noise-sized, as in assert_close."""
    ours, reference = gradients(ours), gradients(reference)
    assert set(ours) == set(reference), f"parameters differ: {sorted(set(ours) ^ set(reference))}"
    for name, ref in reference.items():
        assert ours[name] is not None and ref is not None, f"{name}: no gradient"
    floor = grad_floor(dtype, reference)
    for name, ref in reference.items():
        assert_close(ours[name], ref, dtype, "grad", name=name, floor=floor)
