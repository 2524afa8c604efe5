"""The comparison every parity test relies on (fastbert.testing.assert_close) fails where it must."""
import pytest
import torch

from fastbert.testing import assert_close, tolerance

REF = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)


def off_by(rel: float) -> torch.Tensor:
    """REF moved by `rel` of its norm (in one direction), as bfloat16 would carry it: exactly."""
    return REF + rel * REF.norm() * torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)


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
    assert_close(off_by(1.5 * tol), REF, torch.bfloat16, "grad", naive=off_by(1.0 * tol))  # ill-conditioned
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(1.5 * tol), REF, torch.bfloat16, "grad", naive=off_by(0.5 * tol))
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(off_by(3 * tol), REF, torch.bfloat16, "grad", naive=off_by(1.2 * tol))
