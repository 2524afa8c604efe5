"""The comparison every parity test relies on (fastbert.testing.assert_close) fails where it must."""
import pytest
import torch

from fastbert.testing import (ILL_CONDITIONED_MAX, NAIVE_MIN_ELEMENTS, assert_close, assert_same_gradients, grad_floor,
                              tolerance)

REF = torch.linspace(-2.0, 3.0, NAIVE_MIN_ELEMENTS, dtype=torch.float64)


def off_by(rel: float, ref: torch.Tensor = REF) -> torch.Tensor:
    """`ref` moved by `rel` of its norm, all in its first element (float64 carries it exactly)."""
    out = ref.clone()
    out[0] += rel * ref.norm()
    return out


def test_within_the_table_passes_and_beyond_it_fails():
    tol = tolerance(torch.bfloat16, "grad")
    assert_close(off_by(0.5 * tol), REF, torch.bfloat16, "grad")
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(2 * tol), REF, torch.bfloat16, "grad")


def test_nan_never_passes():
    out = REF.clone()
    out[1] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(out, REF, torch.float32, "grad")


def test_much_worse_than_same_dtype_pytorch_fails_even_inside_the_table():
    tol = tolerance(torch.bfloat16, "grad")
    with pytest.raises(AssertionError, match="worse than 2 x same-dtype PyTorch"):
        assert_close(off_by(0.9 * tol), REF, torch.bfloat16, "grad", naive=off_by(0.1 * tol))


def test_the_result_rounded_once_passes_beside_an_exact_pytorch():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rounded = ref.to(torch.bfloat16).double()
    assert_close(rounded, ref, torch.bfloat16, "matmul", naive=ref)
    with pytest.raises(AssertionError, match="worse than 2 x same-dtype PyTorch"):  # rounded 4x as coarsely
        assert_close(ref + 4 * (rounded - ref), ref, torch.bfloat16, "matmul", naive=ref)


def test_a_bfloat16_forward_4x_worse_than_pytorch_fails_inside_the_table():
    """The 2x check binds in bfloat16's forward too (its slack was once one rounding step, 78% of the bound)."""
    tol = tolerance(torch.bfloat16, "matmul")
    with pytest.raises(AssertionError, match="worse than 2 x same-dtype PyTorch"):
        assert_close(off_by(0.8 * tol), REF, torch.bfloat16, "matmul", naive=off_by(0.2 * tol))


def test_beyond_the_table_only_where_pytorch_is_too_and_within_2x_of_it():
    tol = tolerance(torch.bfloat16, "grad")
    assert_close(off_by(1.5 * tol), REF, torch.bfloat16, "grad", naive=off_by(1.2 * tol))  # ill-conditioned
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(1.5 * tol), REF, torch.bfloat16, "grad", naive=off_by(0.5 * tol))
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(3 * tol), REF, torch.bfloat16, "grad", naive=off_by(1.2 * tol))


def test_tiny_results_are_held_to_the_table_not_to_a_lucky_pytorch_order():
    """A one-element fp32 result 1.6e-5 off passes though plain PyTorch happened to be 2e-6 off: over
    so few elements the comparison is a draw of summation order (the case a property run found)."""
    one = torch.tensor([0.431622], dtype=torch.float64)
    assert_close(off_by(1.6e-5, one), one, torch.float32, "grad", naive=off_by(2e-6, one))
    with pytest.raises(AssertionError, match="rel err"):  # the table still holds
        assert_close(off_by(2e-4, one), one, torch.float32, "grad", naive=off_by(2e-6, one))


# ------------------------------------------------------------- issue 15: where the old rule let wrong numbers pass


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_reference_fails_and_says_it_is_the_reference(bad):
    """NaN > tol is False: a reference broken by NaN or inf must not turn every comparison into a pass."""
    ref = REF.clone()
    ref[3] = bad
    with pytest.raises(AssertionError, match="the REFERENCE .not the kernel's output. has 1 non-finite"):
        assert_close(REF.clone(), ref, torch.float32, "grad")


def test_the_ill_conditioned_escape_is_bounded():
    """Where same-dtype PyTorch misses the table too, `out` may be at most ILL_CONDITIONED_MAX x the bound
    off, and an all-zeros `out` never passes: under the old rule both passed beside a PyTorch 60% off."""
    tol = tolerance(torch.bfloat16, "grad")
    way_off = off_by(0.6)  # plain PyTorch 60% off
    with pytest.raises(AssertionError, match="all zeros"):
        assert_close(torch.zeros_like(REF), REF, torch.bfloat16, "grad", naive=way_off)
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(0.5), REF, torch.bfloat16, "grad", naive=way_off)
    cap = ILL_CONDITIONED_MAX * tol
    with pytest.raises(AssertionError, match="rel err"):  # within 2x PyTorch, but past the cap
        assert_close(off_by(1.25 * cap), REF, torch.bfloat16, "grad", naive=off_by(0.75 * cap))
    assert_close(off_by(0.9 * cap), REF, torch.bfloat16, "grad", naive=off_by(0.75 * cap))


def test_a_plain_pytorch_that_overflowed_widens_nothing():
    """A same-dtype PyTorch with an inf or NaN says nothing of the conditioning: the table holds (an inf once
    widened the bound to its cap, a NaN switched the 2x check off); one of another shape is the test's error."""
    tol = tolerance(torch.float32, "elementwise")
    for bad in (float("inf"), float("nan")):
        naive = REF.clone()
        naive[3] = bad
        with pytest.raises(AssertionError, match="rel err"):
            assert_close(off_by(3 * tol), REF, torch.float32, "elementwise", naive=naive)
    with pytest.raises(AssertionError, match="naive has shape"):
        assert_close(REF, REF, torch.float32, "elementwise", naive=REF[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_small_gradient_is_held_to_the_table_relative_to_its_own_norm(dtype):
    """A gradient 1e-3 of the call's largest is not rounding noise: 5x the table off (relative to its own
    norm) fails, in bfloat16 too, where 1e-3 is below eps x the largest norm (an x gradient beside a weight
    gradient summed over many rows is that small, and bf16 kernels, accumulating in fp32, resolve it). The
    old floor (1e-2 x the largest norm) held it to an absolute bound that let it pass."""
    tol = tolerance(dtype, "grad")
    large, small = 1000 * REF, REF
    floor = grad_floor(dtype, [large, small])
    assert_close(off_by(0.5 * tol, small), small, dtype, "grad", floor=floor)
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(5 * tol, small), small, dtype, "grad", floor=floor)


def test_a_gradient_zero_in_exact_arithmetic_must_be_noise_sized():
    """The attention key bias's gradient: the float64 reference is ~1e-17 of the others, a correct float32
    kernel returns noise of about eps x their scale; a value far above that noise fails."""
    large = 10 * REF
    exact_zero = 1e-17 * torch.linspace(1.0, -1.0, REF.numel(), dtype=torch.float64)
    floor = grad_floor(torch.float32, [large, exact_zero])
    eps = torch.finfo(torch.float32).eps
    noise = torch.linspace(-1.0, 1.0, REF.numel(), dtype=torch.float64)
    noise *= eps * float(large.norm()) / float(noise.norm())  # one eps of the largest norm
    assert_close(noise, exact_zero, torch.float32, "grad", floor=floor)
    with pytest.raises(AssertionError, match="zero in exact arithmetic"):
        assert_close(1000 * noise, exact_zero, torch.float32, "grad", floor=floor)


def test_one_element_far_off_inside_an_acceptable_norm_fails():
    """Half the bound norm-wise, all of it in one of 10^4 elements (~12x the bound x max|ref|): fails. An
    error of 0.9x the bound spread like rounding over every element passes."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(10_000, generator=g, dtype=torch.float64)
    tol = tolerance(torch.float32, "matmul")
    with pytest.raises(AssertionError, match="elementwise error"):
        assert_close(off_by(0.5 * tol, ref), ref, torch.float32, "matmul")
    noise = torch.randn(10_000, generator=g, dtype=torch.float64)
    assert_close(ref + noise * (0.9 * tol * float(ref.norm()) / float(noise.norm())), ref, torch.float32, "matmul")


def test_same_gradients_hold_every_gradient_to_the_table_and_noise_to_the_floor():
    """assert_same_gradients: the same rule as assert_close. A key-bias-like gradient that is noise on both
    sides passes; one element of a weight gradient far off inside an acceptable norm fails."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 64, generator=g)
    eps = torch.finfo(torch.float32).eps
    theirs = {"w": weight, "key.bias": eps * float(weight.norm()) * torch.randn(64, generator=g) / 8}
    ours = {"w": weight.clone(), "key.bias": eps * float(weight.norm()) * torch.randn(64, generator=g) / 8}
    assert_same_gradients(ours, theirs)
    ours["w"][5, 7] += 0.9 * tolerance(torch.float32, "grad") * float(weight.norm())
    with pytest.raises(AssertionError, match="w: elementwise error"):
        assert_same_gradients(ours, theirs)


def test_small_rows_beside_large_ones_are_held_to_their_own_norm():
    """An attention output where one sequence of one token carries most of the norm (98%): rows averaged
    over 97 keys, each 5x the bound off its own norm, pass the whole-tensor checks and fail the per-row one;
    rounding-sized errors in every row pass, and so do rows as far off as plain PyTorch's (ill-conditioned)."""
    g = torch.Generator().manual_seed(2)
    tol = tolerance(torch.bfloat16, "matmul")
    ref = torch.randn(98, 32, generator=g, dtype=torch.float64)
    ref[1:] /= 97 ** 0.5 * 8  # averages over 97 keys
    noise = torch.randn(98, 32, generator=g, dtype=torch.float64)
    rounding = noise * (0.5 * tol) * ref.norm(dim=1, keepdim=True) / noise.norm(dim=1, keepdim=True)
    assert_close(ref + rounding, ref, torch.bfloat16, "matmul")
    far_off = ref.clone()
    far_off[1:] += 10 * rounding[1:]
    with pytest.raises(AssertionError, match="row .* is off by"):
        assert_close(far_off, ref, torch.bfloat16, "matmul")
    assert_close(far_off, ref, torch.bfloat16, "matmul", naive=ref + 6 * rounding)


def test_one_feature_off_for_every_row_fails():
    """One output column (a wrong bias element, a bad tail tile) 0.06 of its spread off in every row: inside
    the whole tensor's bound and every row's, and caught column by column."""
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(256, 64, generator=g, dtype=torch.float64)
    out = ref.clone()
    out[:, 17] += 0.06 * ref[:, 17].std()
    with pytest.raises(AssertionError, match="column 17 .* is off by"):
        assert_close(out, ref, torch.bfloat16, "matmul")
