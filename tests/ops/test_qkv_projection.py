"""qkv_projection: one GEMM for q, k and v, returned head-major, on every backend against the float64
reference."""
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from grids import skip_unless_runnable
from harness import (SEEDS, Case, OpCheck, Spec, bad_input_test, opcheck_test, parity_tests, randn, st,
                     variant_parity_test)


def params(draw, small=False):
    heads = draw(st.integers(1, 2 if small else 4))
    head_dim = draw(st.sampled_from((16,) if small else (16, 32, 64)))
    if draw(st.booleans()):
        shape = [draw(st.integers(1, 2 if small else 3)), draw(st.integers(1, 4 if small else 20))]
    else:
        shape = [draw(st.integers(1, 6 if small else 40))]
    return dict(shape=shape, heads=heads, head_dim=head_dim, bias=draw(st.booleans()), seed=draw(SEEDS))


def build(p, dtype, device):
    hidden = p["heads"] * p["head_dim"]
    bias = randn(3 * hidden, dtype=dtype, device=device) if p["bias"] else None
    return (randn(*p["shape"], hidden, dtype=dtype, device=device),
            randn(3 * hidden, hidden, dtype=dtype, device=device, scale=hidden**-0.5), bias, p["heads"]), {}


def _case(shape, hidden, heads):
    p = dict(shape=shape, heads=heads, head_dim=hidden // heads, bias=True)
    return Case(f"{shape}-h{hidden}/{heads}", lambda dt, dev: build(p, dt, dev))


SPEC = Spec("qkv_projection", ops.qkv_projection, reference.qkv_projection, "matmul", [
    _case(*c) for c in (((2, 7), 64, 2), ((3, 5), 768, 12), ((11,), 384, 12), ((1, 1), 128, 4), ((2, 3), 1024, 16))
], build=build, params=params)

# Parity on the grid (every case x backend x dtype, forward and every gradient), non-contiguous inputs,
# and hypothesis-drawn properties: harness.py.
test_parity, test_non_contiguous_inputs_work, test_properties, test_triton_interpreter_properties = parity_tests(SPEC)
test_variant_parity = variant_parity_test(SPEC)


def _rand(*shape):
    return torch.randn(*shape).requires_grad_()


OPCHECKS = [
    OpCheck("cpu", "qkv_projection_onednn", lambda: (_rand(2, 3, 8), _rand(24, 8), _rand(24), "none")),
    OpCheck("cpu", "qkv_projection_fastbert", lambda: (_rand(2, 3, 8), _rand(24, 8), _rand(24), "none")),
    OpCheck("cpu", "qkv_projection_onednn_torch_bwd", lambda: (_rand(2, 3, 8), _rand(24, 8), _rand(24), "none")),
    OpCheck("triton", "qkv_projection_triton", lambda: (_rand(2, 5, 32), _rand(96, 32), _rand(96), 4)),
    OpCheck("triton", "qkv_projection_triton", lambda: (_rand(7, 32), _rand(96, 32), _rand(96), 2)),
    OpCheck("triton", "qkv_projection_triton_backward",
            lambda: (torch.randn(3, 2, 5, 4, 8), torch.randn(2, 5, 32), torch.randn(96, 32), torch.randn(96), 4)),
]
test_opcheck = opcheck_test(OPCHECKS)

test_bad_input = bad_input_test([
    (lambda: ops.qkv_projection(torch.randn(2, 8), torch.randn(24, 8), torch.randn(24), True), "num_heads must be a positive int dividing"),
    (lambda: ops.qkv_projection(torch.randn(2, 8), torch.randn(24, 8), torch.ones(24, dtype=torch.long), 2),
     "bias has dtype torch.int64 but x has dtype torch.float32"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24), 3), "num_heads must be a positive int dividing"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24), 2.0),
     "num_heads must be a positive int dividing the hidden size 8, got 2.0"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(24), 2), "weight must have shape \\(24, 8\\)"),
    # Tensors on different devices ("meta" stands in for a second device on a machine without a GPU).
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24, device="meta"), 2),
     "bias is on meta but x is on cpu"),
])


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (0, 3, 64)], ids=str)
def test_triton_backward_without_tokens(shape):
    """The backward's reshape to [..., -1] had nothing to infer -1 from (the forward was fine)."""
    device = skip_unless_runnable("qkv_projection", "triton", torch.float32)
    x = torch.randn(*shape, device=device, requires_grad=True)
    weight, bias = (torch.randn(*s, device=device, requires_grad=True) for s in ((192, 64), (192,)))
    with dispatch.use_backend("triton", op="qkv_projection"), dispatch.record() as calls:
        grads = torch.autograd.grad([t.sum() for t in ops.qkv_projection(x, weight, bias, 2)], (x, weight, bias))
    assert {c.backend for c in calls} == {"triton"}
    assert grads[0].shape == x.shape and not grads[1].any() and not grads[2].any()
