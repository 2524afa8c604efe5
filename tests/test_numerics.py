"""Stress numerics of the cpu kernels against the float64 reference: scores that overflow a naive
fp16 softmax, inputs of magnitude 1e4, a LayerNorm row with zero variance, a LayerNorm of one feature.

Same rules as the parity grid: one tolerance table, poisoned outputs, the backend asserted to have run.
Attention under huge scores is checked forward only: with q.k ~ 1e4 the fp32 rounding of the scores
themselves (~1e-3 absolute) already moves the softmax gradients beyond the table for plain PyTorch.
"""
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs, tolerance, upcast
from grids import skip_unless_runnable

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["float32", "bfloat16"]


def _grads(outs, inputs, grad_out):
    return torch.autograd.grad(outs, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad], grad_out)


def run_cpu(op, fn, args, kwargs=None, grad_out=None):
    """The op on the cpu backend (asserted to have run, forward and backward), with poisoned outputs."""
    skip_unless_runnable(op, "cpu", args[0].dtype)
    kwargs = kwargs or {}
    with dispatch.use_backend("cpu", op=op), poison_outputs(), dispatch.record() as calls:
        out = fn(*args, **kwargs)
        grads = _grads(out, args, grad_out.to(out.dtype)) if grad_out is not None else None
    assert_ran([c for c in calls if c[0] == op], op, "cpu")
    if grad_out is not None:
        assert {c[1] for c in calls if c[0].endswith(".backward")} == {"cpu"}, f"backward calls: {list(calls)}"
    return out, grads


def truth(ref, args, kwargs=None, grad_out=None):
    args = upcast(*args)
    out = ref(*args, **(kwargs or {}))
    grads = _grads(out, args, grad_out.double()) if grad_out is not None else None
    return out, grads


def naive(ref, args, kwargs=None, grad_out=None):
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    out = ref(*args, **(kwargs or {}))
    grads = _grads(out, args, grad_out.to(out.dtype)) if grad_out is not None else None
    return out, grads


def compare(op, ref, args, kind, kwargs=None, backward=True):
    """The cpu kernel vs the float64 reference (and same-dtype PyTorch), forward and, if asked, backward."""
    dtype = args[0].dtype
    grad_out = None
    if backward:
        grad_out = torch.randn(ref(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                                   **(kwargs or {})).shape).to(dtype)
    out, grads = run_cpu(op, getattr(ops, op), args, kwargs, grad_out)
    t_out, t_grads = truth(ref, args, kwargs, grad_out)
    n_out, n_grads = naive(ref, args, kwargs, grad_out)
    assert_close(out, t_out, dtype, kind, naive=n_out, name=f"{op} output")
    if backward:
        floor = grad_floor(dtype, t_grads)
        for i, (g, t, n) in enumerate(zip(grads, t_grads, n_grads)):
            assert_close(g, t, dtype, "grad", naive=n, name=f"{op} grad of input {i}", floor=floor)
    return out, t_out


def leaf(t, dtype):
    return t.to(dtype).requires_grad_()


def _huge(t):
    """t x 100, integer-valued: with head_dim 64 every score is then exact in float32 (integer dot products far
    below 2^24, scale 1/8), so only the softmax rounds. Real-valued q and k this large put single outputs of
    any float32 computation past the elementwise bound on 1 draw in 20-30 (plain PyTorch's as far as the
    kernel's): a test of rounded scores, not of the overflow these tests are about."""
    return (t * 100).round()


# ------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_huge_scores(dtype, masked):
    """q.k ~ 1e4 after scaling: exp overflows in a softmax without the max subtracted (in fp16 already
    at 11, in fp32 at 88). A kernel with a running max stays finite and equals the reference."""
    b, h, s, d = 2, 2, 67, 64
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    q, k = _huge(q), _huge(k)  # scores (q.k / sqrt(d)) ~ 1e4
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    assert float(scores.abs().max()) > 1e4
    # These inputs do break a naive softmax: exp of the raw scores overflows to inf (fp16 and fp32).
    assert not bool(torch.isfinite(torch.exp(scores.half())).all())
    assert not bool(torch.isfinite(torch.exp(scores)).all())
    mask = None
    if masked:
        mask = torch.ones(b, s, dtype=torch.bool)
        mask[0, 40:] = False
        mask[1, 1:] = False
    out, _ = compare("attention", reference.attention, [leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)], "matmul",
                         {"attention_mask": mask}, backward=False)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_huge_negative_scores(dtype):
    """Every score of a row ~ -1e4 (keys pointing away from the query): exp underflows to 0 for all keys
    in a softmax without the max subtracted, 0/0. The row must still be a proper average of v."""
    b, h, s, d = 1, 2, 33, 32
    u = torch.randn(b, h, 1, d)  # one direction per head: queries along it, keys against it
    q = 20 * u + torch.randn(b, h, s, d)
    k = -20 * u + torch.randn(b, h, s, d)
    v = torch.randn(b, h, s, d)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    assert float(scores.amax(dim=-1).max()) < -100  # every row's best score underflows exp
    out, _ = compare("attention", reference.attention, [leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)], "matmul",
                     backward=False)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_varlen_attention_huge_scores(dtype):
    lengths = [5, 130, 1, 64]
    t, h, d = sum(lengths), 2, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _huge(torch.randn(t, h, d)), _huge(torch.randn(t, h, d)), torch.randn(t, h, d)
    out, _ = compare("varlen_attention", reference.varlen_attention,
                     [leaf(q, dtype), leaf(k, dtype), leaf(v, dtype), cu, max(lengths)], "matmul", backward=False)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_across_key_blocks(dtype):
    """Sequences longer than the cpu kernel's key block (512): the online softmax rescales across
    blocks, a row's first block can be all padding (its running max stays -inf until a later block),
    and the last kept block can end in padding. Forward and backward."""
    b, h, s, d = 3, 2, 1100, 32
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :600] = False  # nothing kept in the first key block
    mask[0, 600:] = torch.rand(s - 600) < 0.5
    mask[1, 1030:] = False  # trailing padding inside the third block
    mask[2, 512:] = False  # exactly one block kept
    out, _ = compare("attention", reference.attention, [leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)], "matmul",
                     {"attention_mask": mask})
    assert bool(torch.isfinite(out).all())
    lengths = [1100, 3, 513]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    compare("varlen_attention", reference.varlen_attention,
            [leaf(q, dtype), leaf(k, dtype), leaf(v, dtype), cu, max(lengths)], "matmul")


# ------------------------------------------------------------------------------ bias_gelu


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bias_gelu_magnitude_1e4(dtype, approximate):
    """|x| up to ~5e4: gelu is x or 0 there, erf/tanh saturate; x^3 (tanh form) is ~1e14, and a tanh
    written as (e^2u - 1)/(e^2u + 1) would give inf/inf = NaN."""
    n = 1000
    x = torch.randn(7, n) * 1e4
    bias = torch.randn(n) * 1e4
    out, _ = compare("bias_gelu", reference.bias_gelu, [leaf(x, dtype), leaf(bias, dtype)], "elementwise",
                     {"approximate": approximate})
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bias_gelu_every_regime_of_erf(dtype, approximate):
    """x swept densely over [-12, 12] (the kernel's erf is a rational fit clamped at |x| = 3.92):
    every element, not just a norm, within the table's bound of the float64 GELU and its derivative."""
    x = torch.linspace(-12, 12, 24003).reshape(3, -1)
    args = [leaf(x, dtype), leaf(torch.zeros(x.shape[1]), dtype)]
    kwargs = {"approximate": approximate}
    compare("bias_gelu", reference.bias_gelu, args, "elementwise", kwargs)
    # With a gradient of ones, grad_x is gelu'(x) itself: checked element by element too.
    ones = torch.ones(x.shape, dtype=dtype)
    out, (grad_x, _) = run_cpu("bias_gelu", ops.bias_gelu, args, kwargs, ones)
    t_out, (t_grad_x, _) = truth(reference.bias_gelu, args, kwargs, ones)
    for name, got, want, kind in (("output", out, t_out, "elementwise"), ("gelu'", grad_x, t_grad_x, "grad")):
        worst = float(((got.detach().double() - want.detach()).abs() / want.detach().abs().clamp_min(1.0)).max())
        assert worst <= tolerance(dtype, kind), f"{name}: largest elementwise error {worst:.3g} > {tolerance(dtype, kind):g}"


# ------------------------------------------------------------------------------ add_layer_norm


def ln_args(x, residual, dtype, n, eps=1e-12):
    weight = 1 + 0.1 * torch.randn(n)
    bias = torch.randn(n)
    return [leaf(x, dtype), leaf(residual, dtype), leaf(weight, dtype), leaf(bias, dtype), eps]


@pytest.mark.parametrize("n", [7, 768, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_layer_norm_magnitude_1e4(dtype, n):
    """x and residual of magnitude 1e4: the sum of squares (~1e11 a row) is far from fp16 range, and the
    variance must still be right."""
    x, residual = torch.randn(5, n) * 1e4, torch.randn(5, n) * 1e4
    out, _ = compare("add_layer_norm", reference.add_layer_norm, ln_args(x, residual, dtype, n), "elementwise")
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("constant", [3.0, -2.5, 0.1, 1e4])
@pytest.mark.parametrize("n", [7, 768, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_layer_norm_constant_row(dtype, n, constant):
    """A row whose x + residual is constant has zero variance: the output is finite and equals the
    reference, which gives bias there (the mean is subtracted exactly, whatever eps)."""
    x = torch.full((3, n), float(constant))
    residual = torch.zeros(3, n)
    x[1] = torch.randn(n)  # one ordinary row between constant ones
    residual[1] = torch.randn(n)
    residual[2] = -float(constant) / 2  # a second constant row with another value
    args = ln_args(x, residual, dtype, n)
    out, _ = compare("add_layer_norm", reference.add_layer_norm, args, "elementwise", backward=False)
    bias = args[3].detach()
    for row in (0, 2):
        assert bool(torch.isfinite(out[row]).all())
        assert_close(out[row], bias.double(), dtype, "elementwise", name=f"constant row {row} (expected bias)")


@pytest.mark.parametrize("n", [7, 40, 768, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_layer_norm_offset_rows(dtype, n):
    """Rows where a one-pass variance (E[d^2] - E[d]^2) would cancel: a common offset 1e3 times the
    spread, and rows whose first 32 elements (around whose mean the cpu kernel takes its sums) sit far
    from the rest. Where n is more than twice the kernel's block (768, 4096) such rows send it down its
    corrected second pass (without it, the mean of such a row is off by 1e-6 of its spread: inside the
    table, 4x plain PyTorch's error); 7 and 40 check the single-pass path on the same rows."""
    x = torch.randn(4, n)
    x[0] += 1e3  # offset: spread 1, mean 1000
    x[1, :32] += 1e3  # the first block far above the rest
    x[2, :32] -= 50.0
    x[3, 32:] += 1e3  # the rest far above the first block
    residual = 0.1 * torch.randn(4, n)
    out, _ = compare("add_layer_norm", reference.add_layer_norm, ln_args(x, residual, dtype, n), "elementwise")
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_layer_norm_single_feature(dtype):
    """A LayerNorm over one feature: the output is bias whatever x is, so the gradients of x, residual and
    weight are zero in exact arithmetic; the kernel's must be rounding-noise sized (below the grad floor)."""
    x, residual = torch.randn(6, 1), torch.randn(6, 1)
    out, _ = compare("add_layer_norm", reference.add_layer_norm, ln_args(x, residual, dtype, 1), "elementwise")
    assert bool(torch.isfinite(out).all())



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpu_attention_nan_key_gives_nan_not_zeros(dtype):
    """A NaN in one key reaches every query of its (sequence, head) as NaN: the row maximum must not
    drop it and take the row for all padding, which would give zeros."""
    if dispatch.machine_reasons("cpu"):
        pytest.skip("; ".join(dispatch.machine_reasons("cpu")))
    q, k, v = (torch.randn(2, 2, 40, 64).to(dtype) for _ in range(3))
    k[0, 1, 17, 5] = float("nan")
    with dispatch.use_backend("cpu", op="attention"):
        out = ops.attention(q, k, v)
    assert bool(out[0, 1].isnan().all()), f"{int(out[0, 1].isnan().sum())} of {out[0, 1].numel()} outputs are NaN"
    assert bool(out[0, 0].isfinite().all() and out[1].isfinite().all())
