"""The comparison every parity test relies on (fastbert.testing.assert_close) fails where it must."""
import pytest
import torch

from fastbert.testing import NAIVE_MIN_ELEMENTS, assert_close, tolerance

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


def test_one_rounding_step_apart_from_pytorch_passes():
    eps = torch.finfo(torch.bfloat16).eps
    assert_close(off_by(eps), REF, torch.bfloat16, "grad", naive=REF)


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
