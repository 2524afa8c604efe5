"""The CUDA kernels of add_layer_norm, attention and bias_gelu (csrc/cuda) beyond the parity grid: every
row-length regime of add_layer_norm (warp per row up to 256, block per row up to 8192) and its 8192 limit;
attention over head dims 32/64/128, lengths from 1 to 512 across tile edges, padding, a sequence with no
kept key, varlen batches with an empty sequence; and dropout masks that are the CPU kernels' to the bit
(the same hash of seed and position, csrc/cpu/dropout.h).
Runs only where fastbert._C was built with CUDA and a GPU is present; skips with the reason elsewhere."""
import pytest
import torch

from fastbert import BackendUnavailable, dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, grad_floor, poison_outputs, upcast

REASONS = dispatch.machine_reasons("cuda") or (() if torch.cuda.is_available() else ("no CUDA GPU",))
pytestmark = pytest.mark.skipif(bool(REASONS), reason="cuda unavailable: " + "; ".join(REASONS))

SIZES = [(1, 3), (7, 32), (5, 200), (3, 256), (9, 257), (4, 768), (33, 1000), (2, 4096), (3, 8192), (1000, 384)]


def _aln(x, r, w, b, p, seed):
    seed_t = torch.tensor([seed]) if p > 0 else None
    return torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, p, seed_t)


@pytest.mark.parametrize("rows,n", SIZES)
def test_cuda_add_layer_norm_every_row_length_matches_reference(rows, n):
    g = torch.Generator().manual_seed(rows * 10007 + n)
    x, r, gr = (torch.randn(rows, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dev = [t.cuda().requires_grad_() for t in (x, r, w, b)]
    with poison_outputs():
        out, mean, rstd = _aln(*dev, 0.0, 0)
    grads = torch.autograd.grad(out, dev, gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, r, w, b)]
    truth = reference.add_layer_norm(*truth_in, 1e-5, 0.0)
    t_grads = torch.autograd.grad(truth, truth_in, gr.double())
    assert_close(out.cpu(), truth, torch.float32, "elementwise")
    for name, got, want in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), grads, t_grads):
        assert_close(got.cpu(), want, torch.float32, "grad", name=name)
    h = (x + r).double()
    assert_close(mean.cpu(), h.mean(-1), torch.float32, "elementwise", name="saved mean")


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
    with poison_outputs():
        out = torch.ops.fastbert.bias_gelu_cxx(xs, bs, "tanh" if tanh else "none")
    gx, gb = torch.autograd.grad(out, (xs, bs), gr.cuda())
    truth_in = [t.clone().requires_grad_() for t in upcast(x, b)]
    truth = reference.bias_gelu(*truth_in, "tanh" if tanh else "none")
    t_gx, t_gb = torch.autograd.grad(truth, truth_in, gr.double())
    assert_close(out.cpu(), truth, dtype, "elementwise")
    assert_close(gx.cpu(), t_gx, dtype, "grad", name="grad_x")
    assert_close(gb.cpu(), t_gb, dtype, "grad", name="grad_bias")


# ---------------------------------------------------------------------------------------------- attention
# Through the public ops with the backend forced, so a silent fallback fails the test.

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def _attention(fn, inputs, args, grad, backend, **kwargs):
    """fn(*inputs, *args, **kwargs) and the gradients of `inputs`, asserting `backend` ran both ways."""
    with dispatch.use_backend(backend), poison_outputs(), dispatch.record() as calls:
        out = fn(*inputs, *args, **kwargs)
        grads = torch.autograd.grad(out, inputs, grad)
    assert calls and {c[1] for c in calls} == {backend}, calls
    assert any(c[0].endswith(".backward") for c in calls), calls
    return out, grads


def _assert_matches_reference(fn, ref, q, k, v, grad, args, dtype):
    """The cuda kernel against ref in float64, and within 2x same-dtype ref on the GPU (the naive error)."""
    inputs = [t.cuda().requires_grad_() for t in (q, k, v)]
    out, grads = _attention(fn, inputs, [a.cuda() if isinstance(a, torch.Tensor) else a for a in args], grad.cuda(),
                            "cuda")
    truth_in = [t.clone().requires_grad_() for t in upcast(q, k, v)]
    truth = ref(*truth_in, *args)
    truth_grads = torch.autograd.grad(truth, truth_in, grad.double())
    naive_in = [t.cuda().requires_grad_() for t in (q, k, v)]
    naive = ref(*naive_in, *[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    naive_grads = torch.autograd.grad(naive, naive_in, grad.cuda())
    assert_close(out.cpu(), truth, dtype, "matmul", naive=naive.cpu())
    floor = grad_floor(dtype, truth_grads)
    for name, got, want, nv in zip(("dq", "dk", "dv"), grads, truth_grads, naive_grads):
        assert_close(got.cpu(), want, dtype, "grad", naive=nv.cpu(), name=name, floor=floor)
    return out, grads


@pytest.mark.parametrize("seq", [1, 7, 97, 130, 512])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_attention_matches_reference(seq, head_dim, dtype):
    """Sequence 0 keeps every key, 1 is padded (and has a hole), 2 keeps none: zero output, zero gradients."""
    g = torch.Generator().manual_seed(seq * 1000 + head_dim)
    q, k, v, grad = (torch.randn(3, 2, seq, head_dim, generator=g).to(dtype) for _ in range(4))
    mask = torch.ones(3, seq, dtype=torch.bool)
    mask[1, seq // 2 + 1:] = False
    if seq > 2:
        mask[1, 0] = False
    mask[2] = False
    out, grads = _assert_matches_reference(ops.attention, reference.attention, q, k, v, grad, [mask], dtype)
    assert not out[2].any() and not any(gr[2].any() for gr in grads)


@pytest.mark.parametrize("lengths", [[5, 0, 70, 1, 64], [130, 0], [0, 512, 3]], ids=lambda ls: "-".join(map(str, ls)))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_varlen_attention_matches_reference(lengths, head_dim, dtype):
    g = torch.Generator().manual_seed(sum(lengths) + head_dim)
    q, k, v, grad = (torch.randn(sum(lengths), 2, head_dim, generator=g).to(dtype) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    _assert_matches_reference(ops.varlen_attention, reference.varlen_attention, q, k, v, grad, [cu, max(lengths)],
                              dtype)


def test_cuda_attention_single_key_gives_exactly_zero_q_and_k_gradients():
    """Softmax over one kept key is constant, as on CPU: dq and dk are exact zeros, not rounding noise."""
    q, k, v, grad = (torch.randn(2, 2, 9, 64, device="cuda") for _ in range(4))
    mask = torch.zeros(2, 9, dtype=torch.bool, device="cuda")
    mask[0, 4] = mask[1, 8] = True
    inputs = [t.requires_grad_() for t in (q, k, v)]
    _, (dq, dk, dv) = _attention(ops.attention, inputs, [mask], grad, "cuda")
    assert not dq.any() and not dk.any() and dv.any()


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cuda_attention_dropout_matches_the_cpu_kernel(varlen, head_dim):
    """One seed (torch.manual_seed), the same kept probabilities as the cpu backend: float32 outputs and
    gradients agree to rounding (a different mask would be off by tens of percent)."""
    g = torch.Generator().manual_seed(head_dim)
    if varlen:
        lengths = [70, 0, 1, 130]
        q, k, v, grad = (torch.randn(sum(lengths), 2, head_dim, generator=g) for _ in range(4))
        args = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32), max(lengths)]
        fn = ops.varlen_attention
    else:
        q, k, v, grad = (torch.randn(2, 3, 97, head_dim, generator=g) for _ in range(4))
        mask = torch.ones(2, 97, dtype=torch.bool)
        mask[1, 60:] = False
        args, fn = [mask], ops.attention
    results = []
    for backend in ("cpu", "cuda"):
        inputs = [t.to(backend).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1234)
        out, grads = _attention(fn, inputs, [a.to(backend) if isinstance(a, torch.Tensor) else a for a in args],
                                grad.to(backend), backend, dropout_p=0.3)
        results.append([out.detach().cpu(), *(gr.cpu() for gr in grads)])
    floor = grad_floor(torch.float32, results[0][1:])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        assert_close(got, want.double(), torch.float32, "matmul" if i == 0 else "grad", name=f"result {i}",
                     floor=floor if i else 0.0)


def test_cuda_attention_rejects_head_dims_over_128_clearly():
    q = torch.randn(1, 1, 4, 160, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 1 to 128, got head_dim 160"):
        torch.ops.fastbert.attention_cxx(q, q, q, None, None, q.shape[2], 0.1, 0.0, None)
    with pytest.raises(BackendUnavailable, match=r"head_dim 160 \(supported: 1 to 128\)"):
        with dispatch.use_backend("cuda"):
            ops.attention(q, q, q)


def _opcheck_cases():
    def rnd(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, dtype=dtype, device="cuda").requires_grad_(grad)

    seed = torch.tensor([3])
    yield "bias_gelu_cxx", (rnd(3, 16), rnd(16), "none")
    yield "bias_gelu_cxx", (rnd(3, 16, dtype=torch.float16), rnd(16, dtype=torch.float16), "tanh")
    yield "bias_gelu_cxx_backward", (rnd(3, 16, grad=False), rnd(3, 16, grad=False), rnd(16, grad=False), "tanh")
    yield "add_layer_norm_cxx", (rnd(4, 24), rnd(4, 24), rnd(24), rnd(24), 1e-5, 0.0, None)
    yield "add_layer_norm_cxx", (rnd(4, 300), rnd(4, 300), rnd(300), rnd(300), 1e-5, 0.25, seed)
    x, r, w, b = (rnd(4, 24, grad=False), rnd(4, 24, grad=False), rnd(24, grad=False), rnd(24, grad=False))
    _, mean, rstd = torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, 0.25, seed)
    yield "add_layer_norm_cxx_backward", (rnd(4, 24, grad=False), x, r, w, mean, rstd, 0.25, seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool, device="cuda")
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device="cuda")
    yield "attention_cxx", (rnd(2, 3, 5, 16), rnd(2, 3, 5, 16), rnd(2, 3, 5, 16), mask, None, 5, 0.25, 0.0, None)
    yield "attention_cxx", (rnd(9, 2, 16), rnd(9, 2, 16), rnd(9, 2, 16), None, cu, 9, 0.25, 0.2, seed)
    q, k, v = (rnd(2, 3, 5, 16, grad=False) for _ in range(3))
    out, lse = torch.ops.fastbert.attention_cxx(q, k, v, mask, None, 5, 0.25, 0.2, seed)
    yield "attention_cxx_backward", (rnd(2, 3, 5, 16, grad=False), q, k, v, out, lse, mask, None, 5, 0.25, 0.2, seed)


@pytest.mark.parametrize("index", range(9))
def test_cuda_opcheck(index):
    """The custom ops that the cuda backends share with cpu, on CUDA tensors (fake, schema, autograd)."""
    name, args = list(_opcheck_cases())[index]
    torch.library.opcheck(getattr(torch.ops.fastbert, name).default, args)
