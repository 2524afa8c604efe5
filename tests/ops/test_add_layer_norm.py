"""add_layer_norm: layer_norm(dropout(x) + residual), on every backend against the float64 reference;
its fused dropout on cpu, triton and cuda."""
import emulated_cuda
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs, upcast
from grids import DTYPES, KERNEL_BACKENDS, device_for, skip_unless_runnable
from harness import (CPU_DTYPES, HIDDEN, NEARLY_ONE, SEEDS, SMALL_HIDDEN, Case, OpCheck, Spec, assert_independent,
                     assert_keep_rate, bad_input_test, check_parity, check_with_mask, compare_cpu, cpu_keep_mask, dtype_id,
                     compare_with_reference, emulated_cuda_parity_test, forward_backward, leaf,
                     needs_cpu_kernels, needs_cuda, opcheck_test, parity_tests, randn, seed_tensor, st)


def params(draw, small=False):
    # One feature (n = 1) has its own test: test_single_feature.
    n = draw(SMALL_HIDDEN if small else HIDDEN)
    return dict(rows=draw(st.integers(1, 3 if small else 17)), n=n,
                eps=draw(st.sampled_from([1e-12, 1e-5])), residual_scale=draw(st.sampled_from([0.1, 1.0, 3.0])),
                seed=draw(SEEDS))


def _weight(n, dtype, device):
    return (1 + 0.1 * torch.randn(n)).to(device=device, dtype=dtype).requires_grad_()


def build(p, dtype, device):
    r, n = p["rows"], p["n"]
    return (randn(r, n, dtype=dtype, device=device), randn(r, n, dtype=dtype, device=device, scale=p["residual_scale"]),
            _weight(n, dtype, device), randn(n, dtype=dtype, device=device), p["eps"]), {}


def _case(rows, n):
    return Case(f"{rows}x{n}", lambda dt, dev: build(dict(rows=rows, n=n, residual_scale=3, eps=1e-12), dt, dev))


SPEC = Spec("add_layer_norm", ops.add_layer_norm, reference.add_layer_norm, "elementwise",
            [_case(rows, n) for rows, n in ((1, 7), (13, 384), (6, 768), (3, 1000), (2, 1024))],
            build=build, params=params)

# Parity on the grid (every case x backend x dtype, forward and every gradient), non-contiguous inputs,
# and hypothesis-drawn properties: harness.py.
test_parity, test_non_contiguous_inputs_work, test_properties, test_triton_interpreter_properties = parity_tests(SPEC)


def _rand(*shape, grad=True, device="cpu"):
    return torch.randn(*shape, device=device).requires_grad_(grad)


def _triton_backward_args(p):
    # The forward runs here, on the device the opcheck runs on (with a GPU, Triton takes no CPU tensors).
    device = device_for("triton")
    x, r, w, b = (torch.randn(*shape).to(device) for shape in ((4, 24), (4, 24), (24,), (24,)))
    seed = torch.tensor([20261130], dtype=torch.int64).to(device) if p > 0 else None
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_triton(x, r, w, b, 1e-5, p, seed)
    return torch.randn(4, 24).to(device), x, r, w, mean, rstd, p, seed


def _cxx_backward_args(p, device):
    x, r, w, b = (_rand(4, 24, grad=False, device=device), _rand(4, 24, grad=False, device=device),
                  _rand(24, grad=False, device=device), _rand(24, grad=False, device=device))
    seed = torch.tensor([3]) if p > 0 else None
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, p, seed)
    return _rand(4, 24, grad=False, device=device), x, r, w, mean, rstd, p, seed


def _cxx_args(rows, n, p, seed, device):
    return (_rand(rows, n, device=device), _rand(rows, n, device=device), _rand(n, device=device),
            _rand(n, device=device), 1e-5, p, seed)


OPCHECKS = [
    OpCheck("cpu", "add_layer_norm_cxx", lambda: _cxx_args(4, 24, 0.0, None, "cpu")),
    OpCheck("cpu", "add_layer_norm_cxx", lambda: _cxx_args(4, 24, 0.25, torch.tensor([3]), "cpu")),
    OpCheck("cpu", "add_layer_norm_cxx_backward", lambda: _cxx_backward_args(0.0, "cpu")),
    OpCheck("triton", "add_layer_norm_triton", lambda: _cxx_args(4, 24, 0.0, None, "cpu")),
    OpCheck("triton", "add_layer_norm_triton-dropout",
            lambda: (_rand(2, 3, 20), _rand(2, 3, 20), _rand(20), _rand(20), 1e-5, 0.25, seed_tensor(20261130))),
    OpCheck("triton", "add_layer_norm_triton_backward", lambda: _triton_backward_args(0.0)),
    OpCheck("triton", "add_layer_norm_triton_backward-dropout", lambda: _triton_backward_args(0.25)),
    OpCheck("cuda", "add_layer_norm_cxx", lambda: _cxx_args(4, 24, 0.0, None, "cuda")),
    OpCheck("cuda", "add_layer_norm_cxx", lambda: _cxx_args(4, 300, 0.25, torch.tensor([3]), "cuda")),
    OpCheck("cuda", "add_layer_norm_cxx_backward", lambda: _cxx_backward_args(0.25, "cuda")),
]
test_opcheck = opcheck_test(OPCHECKS)

test_bad_input = bad_input_test([
    (lambda: ops.add_layer_norm(torch.randn(2, 0), torch.randn(2, 0), torch.randn(0), torch.randn(0), 1e-5), "x has a last dimension of 0"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 5), torch.randn(4), torch.randn(4), 1e-5), "residual must have shape \\(2, 4\\)"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4), torch.randn(4), 0.0), "eps must be positive"),
    # Tensors on different devices ("meta" stands in for a second device on a machine without a GPU).
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, device="meta"), torch.randn(4), 1e-5),
     "weight is on meta but x is on cpu"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4).bfloat16(), torch.randn(2, 4), torch.randn(4), torch.randn(4), 1e-5),
     "residual has dtype torch.float32 but x has dtype torch.bfloat16"),
])


def test_missing_bias_is_named():
    with pytest.raises(TypeError, match="bias must be a torch.Tensor, got NoneType"):
        ops.add_layer_norm(torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16(), torch.randn(4), None, 1e-5)


# ------------------------------------------------------------------------------ numerics (cpu)


def ln_args(x, residual, dtype, n, eps=1e-12):
    weight = 1 + 0.1 * torch.randn(n)
    bias = torch.randn(n)
    return [leaf(x, dtype), leaf(residual, dtype), leaf(weight, dtype), leaf(bias, dtype), eps]


@pytest.mark.parametrize("n", [7, 768, 1000])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_magnitude_1e4(dtype, n):
    """x and residual of magnitude 1e4: the sum of squares (~1e11 a row) is far from fp16 range, and the
    variance must still be right."""
    x, residual = torch.randn(5, n) * 1e4, torch.randn(5, n) * 1e4
    out, _ = compare_cpu(SPEC, ln_args(x, residual, dtype, n))
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("constant", [3.0, -2.5, 0.1, 1e4])
@pytest.mark.parametrize("n", [7, 768, 1000])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_constant_row(dtype, n, constant):
    """A row whose x + residual is constant has zero variance: the output is finite and equals the
    reference, which gives bias there (the mean is subtracted exactly, whatever eps)."""
    x = torch.full((3, n), float(constant))
    residual = torch.zeros(3, n)
    x[1] = torch.randn(n)  # one ordinary row between constant ones
    residual[1] = torch.randn(n)
    residual[2] = -float(constant) / 2  # a second constant row with another value
    args = ln_args(x, residual, dtype, n)
    out, _ = compare_cpu(SPEC, args, backward=False)
    bias = args[3].detach()
    for row in (0, 2):
        assert bool(torch.isfinite(out[row]).all())
        assert_close(out[row], bias.double(), dtype, "elementwise", name=f"constant row {row} (expected bias)")


@pytest.mark.parametrize("n", [7, 40, 768, 4096])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_offset_rows(dtype, n):
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
    out, _ = compare_cpu(SPEC, ln_args(x, residual, dtype, n))
    assert bool(torch.isfinite(out).all())


def huge_rows(dtype, device="cpu", n=768):
    """LayerNorm is scale-invariant, so rows of huge but finite values have an ordinary answer; their
    squared deviations pass float32's range (3.4e38) from ~1e17 in a row of 768: one element at 1e21 (the
    cpu kernel's variance came out inf - inf, the row and the batch's grad_weight NaN), a row scaled by
    1e18 (variance inf, rstd 0: the cpu, Triton and CUDA kernels returned the bias alone), a first element
    (the cpu kernel's shift) far from the rest, a row of ~1e36 whose sum leaves float range. Float32 and bfloat16 (float16 cannot hold them)."""
    x, residual = torch.randn(5, n), torch.randn(5, n)
    x[1, 7] = 1e21
    x[2] *= 1e18
    residual[2] *= 1e18
    x[3, 0] = -3e37
    x[4] = (x[4].abs() + 1) * 1e36  # the row's sum itself past float range (Triton's and CUDA's mean was inf: the row NaN)
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in ln_args(x, residual, dtype, n)]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_rows_whose_squares_leave_float_range(backend, dtype):
    device = skip_unless_runnable("add_layer_norm", backend, dtype)
    outs = check_parity(SPEC, backend, dtype, huge_rows(dtype, device), {})
    assert bool(torch.isfinite(outs[0]).all())


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_single_feature(dtype):
    """A LayerNorm over one feature: the output is bias whatever x is, so the gradients of x, residual and
    weight are zero in exact arithmetic; the kernel's must be rounding-noise sized (below the grad floor)."""
    x, residual = torch.randn(6, 1), torch.randn(6, 1)
    out, _ = compare_cpu(SPEC, ln_args(x, residual, dtype, 1))
    assert bool(torch.isfinite(out).all())


# ------------------------------------------------------------------------------ dropout: cpu
P = 0.3  # the cpu tests' drop probability


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_float32_parameters_with_bfloat16_rows(backend):
    """weight and bias in float32 with bf16 x and residual, as torch's layer_norm allows: the op runs in
    bf16 (its parameters rounded once) and their gradients come back in float32."""
    dtype = torch.bfloat16
    skip_unless_runnable("add_layer_norm", backend, dtype)
    x, residual = randn(13, 384, dtype=dtype, device="cpu"), randn(13, 384, dtype=dtype, device="cpu", scale=3)
    weight, bias = _weight(384, torch.float32, "cpu"), randn(384, dtype=torch.float32, device="cpu")
    args = (x, residual, weight, bias, 1e-12)
    grad_out = torch.randn(13, 384).to(dtype)
    with dispatch.use_backend(backend, op="add_layer_norm"), poison_outputs(), dispatch.record() as calls:
        out = ops.add_layer_norm(*args)
        grads = torch.autograd.grad(out, args[:4], grad_out)
    assert_ran(calls, "add_layer_norm", backend)
    assert out.dtype == dtype and [g.dtype for g in grads] == [dtype, dtype, torch.float32, torch.float32]
    want = upcast(*args[:4])
    t_out = reference.add_layer_norm(*want, 1e-12)
    t_grads = torch.autograd.grad(t_out, want, grad_out.double())
    naive = torch.nn.functional.layer_norm(x + residual, (384,), weight, bias, 1e-12)  # torch's own, mixed
    assert_close(out, t_out, dtype, "elementwise", naive=naive, name="output")
    for i, (g, t) in enumerate(zip(grads, t_grads)):
        assert_close(g.to(dtype), t, dtype, "grad", name=f"grad of input {i}", floor=grad_floor(dtype, t_grads))


def _with_mask(keep, p, eps):
    """dropout(x) with a kernel's mask (1 = kept), then the naive op."""
    def fn(x, residual, weight, bias):
        return reference.add_layer_norm(x * keep.to(x.dtype) * (1.0 / (1 - p)), residual, weight, bias, eps)
    return fn


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_cpu_dropout_equals_reference_with_the_same_mask(dtype):
    rows, n, seed = 7, 100, 2024
    x, r = (torch.randn(rows, n).to(dtype).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(n)).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_()
    with poison_outputs():
        out = torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, P, torch.tensor([seed]))[0]
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, r, w, b), grad)
    keep = cpu_keep_mask(seed, P, 1, 1, rows, n)[0, 0]
    assert 0 < int(keep.sum()) < keep.numel()
    check_with_mask(out, grads, _with_mask(keep, P, 1e-5), (x, r, w, b), grad, dtype, "elementwise", floor=False)


@needs_cpu_kernels
def test_cpu_dropout_seeded_through_torch():
    x, r, w, b = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64), torch.zeros(64)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        with dispatch.use_backend("cpu", op="add_layer_norm"):
            runs.append(ops.add_layer_norm(x, r, w, b, 1e-5, dropout_p=P))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


# ------------------------------------------------------------------------------ dropout: triton
# The kernel saves no mask (the backward regenerates it from the seed), so the tests recover it twice,
# independently: from the forward (invert the LayerNorm with the saved mean and rstd: h - residual is
# x / (1 - p) where kept and 0 where dropped) and from the backward (dx is dresidual / (1 - p) where kept
# and exactly 0 where dropped). The two must agree element for element.
EPS = 1e-5


def _dropout_inputs(shape, dtype, device):
    """x bounded away from 0 (|x| in [0.5, 1.5]) and weight too, so a dropped element is unmistakable."""
    n = shape[-1]
    x = (torch.rand(shape, device=device) + 0.5) * torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    residual = torch.randn(shape, device=device)
    weight = torch.rand(n, device=device) + 0.5
    bias = torch.randn(n, device=device)
    return [t.to(dtype).requires_grad_() for t in (x, residual, weight, bias)]


def _triton_forward(x, residual, weight, bias, p, seed):
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


def _triton_device():
    return skip_unless_runnable("add_layer_norm", "triton", torch.float32)


def test_triton_dropout_same_seed_same_result_forward_and_backward():
    device = _triton_device()
    x, residual, weight, bias = _dropout_inputs((6, 97), torch.float32, device)
    grad = torch.randn(6, 97, device=device)

    def run(seed_value):
        outs = _triton_forward(x, residual, weight, bias, 0.3, seed_tensor(seed_value, device))
        return list(outs) + list(torch.autograd.grad(outs[0], (x, residual, weight, bias), grad))

    first, again, other = run(1234), run(1234), run(4321)
    for i, (a, b) in enumerate(zip(first, again)):
        assert torch.equal(a, b), f"tensor {i} differs between two runs with the same seed"
    assert not torch.equal(first[0], other[0]), "a different seed gave the same output"


def test_triton_dropout_reproducible_under_manual_seed_through_the_public_op():
    device = _triton_device()
    x, residual, weight, bias = _dropout_inputs((4, 64), torch.float32, device)

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
def test_triton_dropout_keep_rate_and_independence(p):
    device = _triton_device()
    rows, n = 64, 300
    x, residual, weight, bias = (t.detach() for t in _dropout_inputs((rows, n), torch.float32, device))
    masks = [_mask_from_forward(*_triton_forward(x, residual, weight, bias, p, seed_tensor(s, device)),
                                x, residual, weight, bias, p)
             for s in (11, 12)]
    for mask in masks:
        assert_keep_rate(mask, p)
    # Across seeds, and across rows of one mask (disjoint row pairs, so the trials are independent).
    assert_independent(masks[0], masks[1], p, "two seeds")
    assert_independent(masks[0][0::2], masks[0][1::2], p, "row pairs")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(2, 5, 97), (3, 384)], ids=["2x5x97", "3x384"])
def test_triton_dropout_equals_reference_with_the_same_mask(shape, dtype):
    device = skip_unless_runnable("add_layer_norm", "triton", dtype)
    p = 0.2
    args = _dropout_inputs(shape, dtype, device)
    grad = torch.randn(shape, device=device).to(dtype)
    with poison_outputs():
        out, mean, rstd = _triton_forward(*args, p, seed_tensor(2026, device))
        grads = torch.autograd.grad(out, args, grad)

    mask = _mask_from_forward(out, mean, rstd, *args, p)
    mask_bwd = grads[0] != 0  # dropped elements get exactly 0
    assert torch.equal(mask, mask_bwd), f"forward and backward masks differ in {int((mask != mask_bwd).sum())} elements"
    assert 0 < int(mask.sum()) < mask.numel()
    check_with_mask(out, grads, _with_mask(mask, p, EPS), args, grad, dtype, "elementwise")


def test_triton_dropout_compiled_graph_draws_a_fresh_mask_per_call():
    """The seed is a tensor drawn inside the graph, not a constant baked in while tracing."""
    device = _triton_device()
    x, residual, weight, bias = _dropout_inputs((3, 40), torch.float32, device)

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


# ------------------------------------------------------------------------------ cuda (csrc/cuda)
# Every row-length regime (warp per row up to 256, block per row up to 8192) and the 8192 limit; dropout
# masks that are the cpu kernel's to the bit (the same hash of seed and position, csrc/cpu/dropout.h).
SIZES = [(1, 3), (7, 32), (5, 200), (3, 256), (9, 257), (4, 768), (33, 1000), (2, 4096), (3, 8192), (1000, 384)]


def _cxx(x, r, w, b, p, seed):
    seed_t = torch.tensor([seed]) if p > 0 else None
    return torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, p, seed_t)


@needs_cuda
@pytest.mark.parametrize("rows,n", SIZES)
def test_cuda_every_row_length_matches_reference(rows, n):
    g = torch.Generator().manual_seed(rows * 10007 + n)
    x, r, gr = (torch.randn(rows, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dev = [t.cuda().requires_grad_() for t in (x, r, w, b)]
    with poison_outputs():
        out, mean, rstd = _cxx(*dev, 0.0, 0)
    grads = torch.autograd.grad(out, dev, gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, r, w, b)]
    truth = reference.add_layer_norm(*truth_in, 1e-5, 0.0)
    t_grads = torch.autograd.grad(truth, truth_in, gr.double())
    assert_close(out.cpu(), truth, torch.float32, "elementwise")
    for name, got, want in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), grads, t_grads):
        assert_close(got.cpu(), want, torch.float32, "grad", name=name)
    h = (x + r).double()
    assert_close(mean.cpu(), h.mean(-1), torch.float32, "elementwise", name="saved mean")


@needs_cuda
@pytest.mark.parametrize("n", [200, 768, 8192])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_cuda_dropout_matches_the_cpu_kernel(n, dtype):
    """Same seed, same kept elements as the CPU kernel: outputs and all gradients agree to rounding."""
    rows, p, seed = 37, 0.3, 12345
    g = torch.Generator().manual_seed(n)
    x, r, gr = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(3))
    w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        ins = [t.to(device).requires_grad_() for t in (x, r, w, b)]
        out = _cxx(*ins, p, seed)[0]
        results.append([out, *torch.autograd.grad(out, ins, gr.to(device))])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        assert_close(got.cpu(), want.double(), dtype, "elementwise" if i == 0 else "grad", name=f"result {i}")
    # The dropped elements: grad_x is exactly zero where the mask dropped, on both devices.
    assert torch.equal(results[1][1].cpu() == 0, results[0][1] == 0)


@needs_cuda
def test_cuda_rejects_rows_over_8192_clearly():
    x = torch.randn(2, 8193, device="cuda")
    w = torch.ones(8193, device="cuda")
    with pytest.raises(RuntimeError, match="at most 8192"):
        _cxx(x, x, w, w, 0.0, 0)


# ------------------------------------------------------------------------------ quantize_output (int8 models)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 7), (13, 384), (2, 9, 768), (3, 1000)], ids=str)
def test_quantized_output_is_the_output_quantized_per_row(shape, dtype, backend):
    skip_unless_runnable("add_layer_norm", backend, dtype)
    n = shape[-1]
    x, residual = torch.randn(shape).to(dtype), (torch.randn(shape) * 3 + torch.randn(*shape[:-1], 1)).to(dtype)
    weight, bias = (1 + 0.1 * torch.randn(n)).to(dtype), torch.randn(n).to(dtype)
    with torch.no_grad(), dispatch.use_backend(backend, op="add_layer_norm"), poison_outputs(), \
            dispatch.record() as calls:
        out, rows = ops.add_layer_norm(x, residual, weight, bias, 1e-12, quantize_output=True)
        plain = ops.add_layer_norm(x, residual, weight, bias, 1e-12)
    assert_ran(calls, "add_layer_norm", backend)
    assert torch.equal(out, plain)  # the same output, whether or not it is quantized too
    assert isinstance(rows, ops.QuantizedRows) and rows.dtype == dtype and rows.values.shape == shape
    q, scale, zero_point = reference.quantize_rows(out.reshape(-1, n))
    assert torch.equal(rows.values.reshape(-1, n), q)  # exactly quantize_rows' bytes
    assert torch.equal(rows.scale, scale) and torch.equal(rows.zero_point, zero_point)


def test_quantized_output_refuses_training():
    x, residual, weight, bias = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="quantize_output is for inference"):
        ops.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p=0.1, quantize_output=True)
    with pytest.raises(ValueError, match="quantize_output is for inference"):
        ops.add_layer_norm(x, residual, weight.requires_grad_(), bias, 1e-5, quantize_output=True)


def test_quantized_output_is_not_served_by_triton():
    skip_unless_runnable("add_layer_norm", "triton", torch.float32)
    reasons = dispatch.not_supported_reasons("add_layer_norm", "triton", {
        "tensors": (torch.randn(2, 8),), "quantize_output": True}, forced=True)
    assert reasons == ["quantize_output (this backend cannot return its output as QuantizedRows)"]


def _emulated_public(library, spec):
    """ops.add_layer_norm's signature (no dropout) on csrc/cuda/add_layer_norm.cu under the CPU emulator."""
    function = emulated_cuda.add_layer_norm_function(library)

    def add_layer_norm(x, residual, weight, bias, eps):
        n = x.shape[-1]
        return function(x.reshape(-1, n), residual.reshape(-1, n), weight, bias, eps, 0.0, 0).reshape(x.shape)

    return add_layer_norm


# csrc/cuda/add_layer_norm.cu under the CPU emulator (tests/emulated_cuda.py): its logic on every machine.
test_emulated_cuda_parity = emulated_cuda_parity_test((SPEC,), _emulated_public)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_emulated_cuda_rows_whose_squares_leave_float_range(emulated_cuda_library, dtype):
    args = huge_rows(dtype)
    outs, grads, grad_outs = forward_backward(_emulated_public(emulated_cuda_library, SPEC), args, {})
    compare_with_reference(SPEC, dtype, args, {}, outs, grads, grad_outs)


@pytest.mark.parametrize("p", [0.25, NEARLY_ONE], ids=["p0.25", "p-1-in-float"])
@pytest.mark.parametrize("n", [24, 768, 1000])
def test_emulated_cuda_dropout_matches_the_cpu_kernel(emulated_cuda_library, n, p):
    """One seed, the same kept elements as the cpu kernel (csrc/cpu/dropout.h on both sides): float32 output
    and every gradient agree to rounding (a different mask would be off by tens of percent). A p that is 1
    in float drops everything (CUDA refused it with a bare error)."""
    if dispatch.machine_reasons("cpu"):
        pytest.skip("; ".join(dispatch.machine_reasons("cpu")))
    function = emulated_cuda.add_layer_norm_function(emulated_cuda_library)
    g = torch.Generator().manual_seed(n)
    x, r, w, b, grad = (torch.randn(*shape, generator=g) for shape in ((6, n), (6, n), (n,), (n,), (6, n)))
    seed = 77
    results = []
    for kernel in (lambda *a: torch.ops.fastbert.add_layer_norm_cxx(*a, 1e-5, p, torch.tensor([seed]))[0],
                   lambda *a: function(*a, 1e-5, p, seed)):
        inputs = [t.clone().requires_grad_() for t in (x, r, w, b)]
        with poison_outputs():
            out = kernel(*inputs)
            results.append([out.detach(), *torch.autograd.grad(out, inputs, grad)])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        assert_close(got, want.double(), torch.float32, "elementwise" if i == 0 else "grad", name=f"result {i}")
    assert results[1][1].any() == (p < NEARLY_ONE)  # x's gradient: zero where every element is dropped
