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
    yield "bias_gelu_cpu", (_rand(3, 16), _rand(16), False)
    yield "bias_gelu_cpu_backward", (_rand(3, 16, grad=False), _rand(3, 16, grad=False), _rand(16, grad=False), True)
    yield "dense_cpu", (_rand(4, 8), _rand(6, 8), _rand(6), "none")
    yield "dense_cpu", (_rand(2, 3, 8), _rand(6, 8), None, "gelu")
    yield "add_layer_norm_cpu", (_rand(4, 24), _rand(4, 24), _rand(24), _rand(24), 1e-5)
    yield "attention_cpu", (_rand(2, 3, 5, 16), _rand(2, 3, 5, 16), _rand(2, 3, 5, 16), mask, None, 0.25)
    yield "attention_cpu", (_rand(9, 2, 16), _rand(9, 2, 16), _rand(9, 2, 16), None, cu, 0.25)


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
    out, lse = torch.ops.fastbert.attention_cpu(q, k, v, mask, None, 0.25)
    yield "attention_cpu_backward", (torch.randn(2, 3, 5, 16), q, k, v, out, lse, mask, None, 0.25)
    x, r, w, b = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24), torch.randn(24)
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_cpu(x, r, w, b, 1e-5)
    yield "add_layer_norm_cpu_backward", (torch.randn(4, 24), x, r, w, mean, rstd)


@pytest.mark.parametrize("index", range(2))
def test_opcheck_cpu_backward_ops(index):
    if dispatch.machine_reasons("cpu"):
        pytest.skip("; ".join(dispatch.machine_reasons("cpu")))
    name, args = list(backward_cases())[index]
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, args)
