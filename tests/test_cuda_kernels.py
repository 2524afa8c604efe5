"""The CUDA kernels of add_layer_norm and bias_gelu (csrc/cuda) beyond the parity grid: every row-length
regime (warp per row up to 256, block per row up to 8192), the 8192 limit's message, and dropout masks
that are the CPU kernel's to the bit (the same hash of seed and position, csrc/cpu/dropout.h).
Runs only where fastbert._C was built with CUDA and a GPU is present; skips with the reason elsewhere."""
import pytest
import torch

from fastbert import dispatch
from fastbert.ops import reference
from fastbert.testing import assert_close, upcast

REASONS = dispatch.machine_reasons("cuda") or (() if torch.cuda.is_available() else ("no CUDA GPU",))
pytestmark = pytest.mark.skipif(bool(REASONS), reason="cuda unavailable: " + "; ".join(REASONS))

SIZES = [(1, 3), (7, 32), (5, 200), (3, 256), (9, 257), (4, 768), (33, 1000), (2, 4096), (3, 8192), (1000, 384)]


def _aln(x, r, w, b, p, seed):
    seed_t = torch.tensor([seed]) if p > 0 else None
    return torch.ops.fastbert.add_layer_norm_cpu(x, r, w, b, 1e-5, p, seed_t)


@pytest.mark.parametrize("rows,n", SIZES)
def test_cuda_add_layer_norm_every_row_length_matches_reference(rows, n):
    g = torch.Generator().manual_seed(rows * 10007 + n)
    x, r, gr = (torch.randn(rows, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dev = [t.cuda().requires_grad_() for t in (x, r, w, b)]
    with dispatch.poison_outputs():
        out, mean, rstd = _aln(*dev, 0.0, 0)
    grads = torch.autograd.grad(out, dev, gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, r, w, b)]
    truth = reference.add_layer_norm(*truth_in, 1e-5, 0.0)
    t_grads = torch.autograd.grad(truth, truth_in, gr.double())
    assert_close(out.cpu(), truth, torch.float32, "elementwise")
    for name, got, want in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), grads, t_grads):
        assert_close(got.cpu(), want, torch.float32, "grad", name=name)
    h = (x + r).double()
    assert torch.allclose(mean.cpu().double(), h.mean(-1), atol=1e-5)


@pytest.mark.parametrize("n", [200, 768, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_add_layer_norm_dropout_matches_the_cpu_kernel(n, dtype):
    """Same seed, same kept elements as the CPU kernel: outputs and all gradients agree to rounding."""
    rows, p, seed = 37, 0.3, 12345
    g = torch.Generator().manual_seed(n)
    x, r, gr = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(3))
    w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        ins = [t.to(device).requires_grad_() for t in (x, r, w, b)]
        out = _aln(*ins, p, seed)[0]
        results.append([out, *torch.autograd.grad(out, ins, gr.to(device))])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        assert_close(got.cpu().float(), want.double(), dtype, "elementwise" if i == 0 else "grad", name=f"result {i}")
    # The dropped elements: grad_x is exactly zero where the mask dropped, on both devices.
    assert torch.equal(results[1][1].cpu() == 0, results[0][1] == 0)


def test_cuda_add_layer_norm_rejects_rows_over_8192_clearly():
    x = torch.randn(2, 8193, device="cuda")
    w = torch.ones(8193, device="cuda")
    with pytest.raises(RuntimeError, match="at most 8192"):
        _aln(x, x, w, w, 0.0, 0)


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 17), (70000, 8), (64, 3072)])
@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_cuda_bias_gelu_shapes_and_dtypes(rows, n, tanh, dtype):
    g = torch.Generator().manual_seed(rows + n)
    x, gr = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    xs, bs = x.cuda().requires_grad_(), b.cuda().requires_grad_()
    with dispatch.poison_outputs():
        out = torch.ops.fastbert.bias_gelu_cpu(xs, bs, tanh)
    gx, gb = torch.autograd.grad(out, (xs, bs), gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, b)]
    truth = reference.bias_gelu(*truth_in, "tanh" if tanh else "none")
    t_gx, t_gb = torch.autograd.grad(truth, truth_in, gr.double())
    assert_close(out.cpu(), truth, dtype, "elementwise")
    assert_close(gx.cpu(), t_gx, dtype, "grad", name="grad_x")
    assert_close(gb.cpu(), t_gb, dtype, "grad", name="grad_bias")


def _opcheck_cases():
    def rnd(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, dtype=dtype, device="cuda").requires_grad_(grad)

    seed = torch.tensor([3])
    yield "bias_gelu_cpu", (rnd(3, 16), rnd(16), False)
    yield "bias_gelu_cpu", (rnd(3, 16, dtype=torch.float16), rnd(16, dtype=torch.float16), True)
    yield "bias_gelu_cpu_backward", (rnd(3, 16, grad=False), rnd(3, 16, grad=False), rnd(16, grad=False), True)
    yield "add_layer_norm_cpu", (rnd(4, 24), rnd(4, 24), rnd(24), rnd(24), 1e-5, 0.0, None)
    yield "add_layer_norm_cpu", (rnd(4, 300), rnd(4, 300), rnd(300), rnd(300), 1e-5, 0.25, seed)
    x, r, w, b = (rnd(4, 24, grad=False), rnd(4, 24, grad=False), rnd(24, grad=False), rnd(24, grad=False))
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_cpu(x, r, w, b, 1e-5, 0.25, seed)
    yield "add_layer_norm_cpu_backward", (rnd(4, 24, grad=False), x, r, w, mean, rstd, 0.25, seed)


@pytest.mark.parametrize("index", range(6))
def test_cuda_opcheck(index):
    """The custom ops that the cuda backend shares with cpu, on CUDA tensors (fake, schema, autograd)."""
    name, args = list(_opcheck_cases())[index]
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, args)
