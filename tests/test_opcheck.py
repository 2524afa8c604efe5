"""torch.library.opcheck on every registered kernel op: schema, fake implementation, autograd, AOT."""
import pytest
import torch

import fastbert  # noqa: F401  (registers the ops)
from fastbert import dispatch


def _rand(*shape, grad=True):
    return torch.randn(*shape).requires_grad_(grad)


def cpu_cases():
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    yield "bias_gelu_cxx", (_rand(3, 16), _rand(16), "none")
    yield "bias_gelu_cxx_backward", (_rand(3, 16, grad=False), _rand(3, 16, grad=False), _rand(16, grad=False), "tanh")
    yield "dense_onednn", (_rand(4, 8), _rand(6, 8), _rand(6), "none")
    yield "dense_onednn", (_rand(2, 3, 8), _rand(6, 8), None, "gelu")
    yield "qkv_projection_onednn", (_rand(2, 3, 8), _rand(24, 8), _rand(24), "none")
    yield "add_layer_norm_cxx", (_rand(4, 24), _rand(4, 24), _rand(24), _rand(24), 1e-5, 0.0, None)
    yield "add_layer_norm_cxx", (_rand(4, 24), _rand(4, 24), _rand(24), _rand(24), 1e-5, 0.25, torch.tensor([3]))
    yield "attention_cxx", (_rand(2, 3, 5, 16), _rand(2, 3, 5, 16), _rand(2, 3, 5, 16), mask, None, 5, 0.25, 0.0, None)
    yield "attention_cxx", (_rand(9, 2, 16), _rand(9, 2, 16), _rand(9, 2, 16), None, cu, 9, 0.25, 0.0, None)
    yield "attention_cxx", (_rand(2, 3, 5, 16), _rand(2, 3, 5, 16), _rand(2, 3, 5, 16), mask, None, 5, 0.25, 0.2,
                            torch.tensor([42]))


CASES = list(cpu_cases())


@pytest.mark.parametrize("name,args", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_opcheck_cpu(name, args):
    if dispatch.machine_reasons("cpu"):
        pytest.skip("; ".join(dispatch.machine_reasons("cpu")))
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, args)


def backward_cases():
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 2:] = False
    q, k, v = (torch.randn(2, 3, 5, 16) for _ in range(3))
    out, lse = torch.ops.fastbert.attention_cxx(q, k, v, mask, None, 5, 0.25, 0.0, None)
    yield "attention_cxx_backward", (torch.randn(2, 3, 5, 16), q, k, v, out, lse, mask, None, 5, 0.25, 0.0, None)
    x, r, w, b = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24), torch.randn(24)
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, 0.0, None)
    yield "add_layer_norm_cxx_backward", (torch.randn(4, 24), x, r, w, mean, rstd, 0.0, None)
    yield "dense_onednn_backward", (torch.randn(7, 6), torch.randn(7, 8), torch.randn(6, 8), torch.randn(6), "none")
    yield "dense_onednn_backward", (torch.randn(2, 3, 6), torch.randn(2, 3, 8), torch.randn(6, 8), None, "gelu_tanh")


@pytest.mark.parametrize("index", range(4))  # the cases need fastbert._C: not built at collection
def test_opcheck_cpu_backward_ops(index):
    if dispatch.machine_reasons("cpu"):
        pytest.skip("; ".join(dispatch.machine_reasons("cpu")))
    name, args = list(backward_cases())[index]
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, args)


# ------------------------------------------------------------------------- triton: bias_gelu, add_layer_norm
# The triton custom ops on CPU tensors run under the Triton interpreter (TRITON_INTERPRET=1, set by
# conftest.py before triton is imported). Odd sizes exercise the masked tails. Arguments are built in
# the test, so collecting this file never launches a kernel.


def _add_layer_norm_triton_backward_args(p):
    x, r, w, b = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24), torch.randn(24)
    seed = torch.tensor([20261130], dtype=torch.int64) if p > 0 else None
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_triton(x, r, w, b, 1e-5, p, seed)
    return torch.randn(4, 24), x, r, w, mean, rstd, p, seed


TRITON_ELEMENTWISE_CASES = [
    ("bias_gelu_triton-erf", lambda: (_rand(3, 20), _rand(20), "none")),
    ("bias_gelu_triton-tanh", lambda: (_rand(2, 3, 16), _rand(16), "tanh")),
    ("bias_gelu_triton_backward-erf", lambda: (torch.randn(3, 20), torch.randn(3, 20), torch.randn(20), "none")),
    ("bias_gelu_triton_backward-tanh", lambda: (torch.randn(3, 20), torch.randn(3, 20), torch.randn(20), "tanh")),
    ("add_layer_norm_triton", lambda: (_rand(4, 24), _rand(4, 24), _rand(24), _rand(24), 1e-5, 0.0, None)),
    ("add_layer_norm_triton-dropout", lambda: (_rand(2, 3, 20), _rand(2, 3, 20), _rand(20), _rand(20), 1e-5, 0.25,
                                               torch.tensor([20261130], dtype=torch.int64))),
    ("add_layer_norm_triton_backward", lambda: _add_layer_norm_triton_backward_args(0.0)),
    ("add_layer_norm_triton_backward-dropout", lambda: _add_layer_norm_triton_backward_args(0.25)),
]


@pytest.mark.parametrize("name,make_args", TRITON_ELEMENTWISE_CASES, ids=[n for n, _ in TRITON_ELEMENTWISE_CASES])
def test_opcheck_triton_elementwise(name, make_args):
    if dispatch.machine_reasons("triton"):
        pytest.skip("; ".join(dispatch.machine_reasons("triton")))
    op = getattr(torch.ops.fastbert, name.split("-")[0]).default
    torch.library.opcheck(op, make_args())


# ------------------------------------------------------------------------------- triton: attention
# fastbert::attention_triton and its backward under the Triton interpreter on CPU tensors: a padded
# batch (q, k, v as strided views of one [B, S, 3, heads, d] buffer, as the QKV projection returns
# them) with a key mask, a packed varlen batch, and dropout with an explicit seed tensor.


def _attention_triton_padded(dropout_p=0.0):
    buf = torch.randn(2, 5, 3, 3, 16)  # [B, S, 3, heads, d]
    q, k, v = (buf[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))  # [B, heads, S, d] views
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    seed = torch.tensor([20261130], dtype=torch.int64) if dropout_p > 0 else None
    return q, k, v, mask, None, 5, 0.25, dropout_p, seed


def _attention_triton_varlen(dropout_p=0.0):
    q, k, v = (_rand(9, 2, 16) for _ in range(3))
    seed = torch.tensor([7], dtype=torch.int64) if dropout_p > 0 else None
    return q, k, v, None, torch.tensor([0, 3, 4, 9], dtype=torch.int32), 5, 0.25, dropout_p, seed


def _attention_triton_backward(make):
    q, k, v, mask, cu, max_seqlen, scale, p, seed = (a.detach() if isinstance(a, torch.Tensor) else a for a in make())
    out, lse = torch.ops.fastbert.attention_triton(q, k, v, mask, cu, max_seqlen, scale, p, seed)
    return torch.randn(q.shape), q, k, v, out, lse, mask, cu, max_seqlen, scale, p, seed


TRITON_ATTENTION_CASES = [
    ("attention_triton-padded", _attention_triton_padded),
    ("attention_triton-varlen", _attention_triton_varlen),
    ("attention_triton-padded-dropout", lambda: _attention_triton_padded(0.3)),
    ("attention_triton-varlen-dropout", lambda: _attention_triton_varlen(0.3)),
    ("attention_triton_backward-padded", lambda: _attention_triton_backward(_attention_triton_padded)),
    ("attention_triton_backward-varlen", lambda: _attention_triton_backward(_attention_triton_varlen)),
    ("attention_triton_backward-padded-dropout",
     lambda: _attention_triton_backward(lambda: _attention_triton_padded(0.3))),
]


@pytest.mark.parametrize("name,make_args", TRITON_ATTENTION_CASES, ids=[n for n, _ in TRITON_ATTENTION_CASES])
def test_opcheck_triton_attention(name, make_args):
    if dispatch.machine_reasons("triton"):
        pytest.skip("; ".join(dispatch.machine_reasons("triton")))
    op = getattr(torch.ops.fastbert, name.split("-")[0]).default
    torch.library.opcheck(op, make_args())


TRITON_GEMM_CASES = [
    ("dense_triton", lambda: (_rand(5, 24), _rand(40, 24), _rand(40), "gelu")),
    ("dense_triton", lambda: (_rand(2, 3, 24), _rand(16, 24), None, "gelu_tanh")),
    ("qkv_projection_triton", lambda: (_rand(2, 5, 32), _rand(96, 32), _rand(96), 4)),
    ("qkv_projection_triton", lambda: (_rand(7, 32), _rand(96, 32), _rand(96), 2)),
    ("qkv_projection_triton_backward", lambda: (torch.randn(3, 2, 5, 4, 8), torch.randn(2, 5, 32), torch.randn(96, 32),
                                                torch.randn(96), 4)),
    ("dense_triton_backward", lambda: (torch.randn(5, 40), torch.randn(5, 24), torch.randn(40, 24), torch.randn(40), "gelu")),
    ("dense_triton_backward", lambda: (torch.randn(6, 16), torch.randn(6, 24), torch.randn(16, 24), None, "none")),
]


@pytest.mark.parametrize("name,make_args", TRITON_GEMM_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TRITON_GEMM_CASES)])
def test_opcheck_triton_gemm(name, make_args):
    if dispatch.machine_reasons("triton"):
        pytest.skip("; ".join(dispatch.machine_reasons("triton")))
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, make_args())
