"""bias_gelu: gelu(x + bias), erf or tanh form, on every backend against the float64 reference."""
import emulated_cuda
import pytest
import torch

from fastbert import ops
from fastbert.ops import reference
from fastbert.testing import assert_close, poison_outputs, tolerance, upcast
from grids import KERNEL_BACKENDS, skip_unless_runnable
from harness import (CPU_DTYPES, HIDDEN, SEEDS, SMALL_HIDDEN, Case, OpCheck, Spec, bad_input_test, check_parity,
                     compare_cpu, compare_with_reference, dtype_id, emulated_cuda_parity_test, forward_backward, leaf,
                     needs_cuda, opcheck_test, parity_tests, randn, run_cpu, st, truth)


def params(draw, small=False):
    lead = draw(st.lists(st.integers(1, 3 if small else 9), min_size=1, max_size=2))
    return dict(lead=lead, n=draw(SMALL_HIDDEN if small else HIDDEN),
                approximate=draw(st.sampled_from(["none", "tanh"])),
                scale=draw(st.sampled_from([0.5, 2.0, 6.0])), seed=draw(SEEDS))


def build(p, dtype, device):
    x = randn(*p["lead"], p["n"], dtype=dtype, device=device, scale=p["scale"])
    return (x, randn(p["n"], dtype=dtype, device=device)), {"approximate": p["approximate"]}


def _case(lead, n, approximate="none", scale=1.0):
    p = dict(lead=lead, n=n, approximate=approximate, scale=scale)
    return Case(f"{'x'.join(map(str, lead))}x{n}-{approximate}", lambda dt, dev: build(p, dt, dev))


SPEC = Spec("bias_gelu", ops.bias_gelu, reference.bias_gelu, "elementwise", [
    _case([rows], n, a, scale=2) for rows, n in ((1, 7), (13, 97), (8, 768), (3, 1000)) for a in ("none", "tanh")
] + [_case([4, 5], 3072)], build=build, params=params)

# Parity on the grid (every case x backend x dtype, forward and every gradient), non-contiguous inputs,
# and hypothesis-drawn properties: harness.py.
test_parity, test_non_contiguous_inputs_work, test_properties, test_triton_interpreter_properties = parity_tests(SPEC)


def _rand(*shape, grad=True, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


# Odd sizes exercise the kernels' masked tails; the triton ones run under the interpreter on CPU tensors.
OPCHECKS = [
    OpCheck("cpu", "bias_gelu_cxx", lambda: (_rand(3, 16), _rand(16), "none")),
    OpCheck("cpu", "bias_gelu_cxx_backward",
            lambda: (_rand(3, 16, grad=False), _rand(3, 16, grad=False), _rand(16, grad=False), "tanh")),
    OpCheck("triton", "bias_gelu_triton-erf", lambda: (_rand(3, 20), _rand(20), "none")),
    OpCheck("triton", "bias_gelu_triton-tanh", lambda: (_rand(2, 3, 16), _rand(16), "tanh")),
    OpCheck("triton", "bias_gelu_triton_backward-erf",
            lambda: (torch.randn(3, 20), torch.randn(3, 20), torch.randn(20), "none")),
    OpCheck("triton", "bias_gelu_triton_backward-tanh",
            lambda: (torch.randn(3, 20), torch.randn(3, 20), torch.randn(20), "tanh")),
    OpCheck("cuda", "bias_gelu_cxx", lambda: (_rand(3, 16, device="cuda"), _rand(16, device="cuda"), "none")),
    OpCheck("cuda", "bias_gelu_cxx", lambda: (_rand(3, 16, device="cuda", dtype=torch.float16),
                                              _rand(16, device="cuda", dtype=torch.float16), "tanh")),
    OpCheck("cuda", "bias_gelu_cxx_backward", lambda: (_rand(3, 16, grad=False, device="cuda"),
                                                       _rand(3, 16, grad=False, device="cuda"),
                                                       _rand(16, grad=False, device="cuda"), "tanh")),
]
test_opcheck = opcheck_test(OPCHECKS)

test_bad_input = bad_input_test([
    (lambda: ops.bias_gelu(torch.randn(2, 0), torch.randn(0)), "x has a last dimension of 0"),
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(5)), "bias must have shape \\(4,\\)"),
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4, dtype=torch.float64)), "bias has dtype torch.float64 but x has dtype torch.float32"),
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4), approximate="sigmoid"), "approximate must be one of"),
    (lambda: ops.bias_gelu(torch.ones(2, 4, dtype=torch.long), torch.ones(4, dtype=torch.long)), "x must be a floating-point tensor"),
    # Tensors on different devices ("meta" stands in for a second device on a machine without a GPU).
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4, device="meta")), "bias is on meta but x is on cpu"),
])


# ------------------------------------------------------------------------------ numerics (cpu)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_magnitude_1e4(dtype, approximate):
    """|x| up to ~5e4: gelu is x or 0 there, erf/tanh saturate; x^3 (tanh form) is ~1e14, and a tanh
    written as (e^2u - 1)/(e^2u + 1) would give inf/inf = NaN."""
    n = 1000
    x = torch.randn(7, n) * 1e4
    bias = torch.randn(n) * 1e4
    out, _ = compare_cpu(SPEC, [leaf(x, dtype), leaf(bias, dtype)], {"approximate": approximate})
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_every_regime_of_erf(dtype, approximate):
    """x swept densely over [-12, 12] (the kernel's erf is a rational fit clamped at |x| = 3.92):
    every element, not just a norm, within the table's bound of the float64 GELU and its derivative."""
    x = torch.linspace(-12, 12, 24003).reshape(3, -1)
    args = [leaf(x, dtype), leaf(torch.zeros(x.shape[1]), dtype)]
    kwargs = {"approximate": approximate}
    compare_cpu(SPEC, args, kwargs)
    # With a gradient of ones, grad_x is gelu'(x) itself: checked element by element too.
    ones = torch.ones(x.shape, dtype=dtype)
    out, (grad_x, _) = run_cpu(SPEC, args, kwargs, ones)
    t_out, (t_grad_x, _) = truth(SPEC, args, kwargs, ones)
    for name, got, want, kind in (("output", out, t_out, "elementwise"), ("gelu'", grad_x, t_grad_x, "grad")):
        worst = float(((got.detach().double() - want.detach()).abs() / want.detach().abs().clamp_min(1.0)).max())
        assert worst <= tolerance(dtype, kind), f"{name}: largest elementwise error {worst:.3g} > {tolerance(dtype, kind):g}"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_far_below_zero_gelu_is_zero_from_below(dtype, approximate):
    """Below x = -6 GELU and its derivative are 0 to within 1e-7, however far (the bfloat16 erf, passing
    -1 past its clamp, once made GELU(-1e6) = +8.56)."""
    x = -torch.cat([torch.tensor([6, 7, 10, 100, 1e4, 1e5, 1e6]), torch.rand(249) * 1e3 + 6])
    args = [leaf(x.reshape(2, -1), dtype), leaf(torch.zeros(128), dtype)]
    out, (grad_x, _) = run_cpu(SPEC, args, {"approximate": approximate}, torch.ones(2, 128, dtype=dtype))
    assert bool((out <= 0).all()) and float(out.abs().max()) <= 1e-7, out[out.abs() > 1e-7]
    assert float(grad_x.abs().max()) <= 1e-7, grad_x[grad_x.abs() > 1e-7]


HUGE = [2e19, 1e30, 3e38]  # x^2 (the tanh form's derivative) overflows fp32 from ~1.8e19


def huge_inputs(dtype, device="cpu"):
    """Finite x where GELU is x or 0 and its derivative 1 or 0, between ordinary ones (float16 cannot hold
    them): the tanh form's derivative was 0.5 x (1 - t^2) x^2-ish = 0 * inf = NaN there (as PyTorch's is)."""
    x = torch.randn(2, 64)
    x[0, :6] = torch.tensor(HUGE + [-h for h in HUGE])
    return [leaf(x, dtype).to(device), leaf(torch.randn(64), dtype).to(device)]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_huge_finite_inputs_give_finite_gradients(backend, dtype, approximate):
    device = skip_unless_runnable("bias_gelu", backend, dtype)
    outs = check_parity(SPEC, backend, dtype, huge_inputs(dtype, device), {"approximate": approximate})
    assert bool(torch.isfinite(outs[0]).all())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_emulated_cuda_huge_finite_inputs_give_finite_gradients(emulated_cuda_library, dtype, approximate):
    args, kwargs = huge_inputs(dtype), {"approximate": approximate}
    outs, grads, grad_outs = forward_backward(emulated_cuda.bias_gelu_function(emulated_cuda_library), args, kwargs)
    compare_with_reference(SPEC, dtype, args, kwargs, outs, grads, grad_outs)


# ------------------------------------------------------------------------------ cuda (csrc/cuda)


@needs_cuda
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 17), (70000, 8), (64, 3072)])
@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_cuda_shapes_and_dtypes(rows, n, tanh, dtype):
    g = torch.Generator().manual_seed(rows + n)
    x, gr = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    xs, bs = x.cuda().requires_grad_(), b.cuda().requires_grad_()
    with poison_outputs():
        out = torch.ops.fastbert.bias_gelu_cxx(xs, bs, "tanh" if tanh else "none")
    gx, gb = torch.autograd.grad(out, (xs, bs), gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, b)]
    truth_out = reference.bias_gelu(*truth_in, "tanh" if tanh else "none")
    t_gx, t_gb = torch.autograd.grad(truth_out, truth_in, gr.double())
    assert_close(out.cpu(), truth_out, dtype, "elementwise")
    assert_close(gx.cpu(), t_gx, dtype, "grad", name="grad_x")
    assert_close(gb.cpu(), t_gb, dtype, "grad", name="grad_bias")


# csrc/cuda/bias_gelu.cu under the CPU emulator (tests/emulated_cuda.py): its logic on every machine.
test_emulated_cuda_parity = emulated_cuda_parity_test((SPEC,), lambda library, spec: emulated_cuda.bias_gelu_function(library))
