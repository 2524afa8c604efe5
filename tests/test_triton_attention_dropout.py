"""Dropout inside the Triton attention kernels: the mask is right, reproducible, and shared by backward.

The mask is read back from the kernel itself: with q = k = 0 every kept key of a row has probability
1 / L, and with v[j] = e_j (one-hot, d >= L) the output row i is keep[i, :] / (L * (1 - p)). The mask
depends only on the seed and the positions (sequence, head, row, key), so a second call with the same
torch seed on random q, k, v must equal the float64 reference computed with that mask, forward and
every gradient (which proves backward regenerates the same mask).
"""
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.testing import assert_close, assert_ran, grad_floor, poison_outputs, upcast
from grids import skip_unless_runnable

SEED = 1234
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def _masked_dropout_attention(q, k, v, key_mask, keep, p, scale):
    """softmax(q k^T * scale) over kept keys (a row with none: zeros), times keep / (1 - p), @ v.
    q, k, v [B, heads, S, d]; key_mask [B, S] bool or None; keep [B, heads, S, S] bool."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if key_mask is not None:
        allowed = key_mask[:, None, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        any_kept = allowed.any(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs * keep / (1 - p)) @ v


def _probe_padded(b, h, s, d, p, dtype, device):
    """The kernel's keep mask [b, h, s, s] for torch seed SEED (needs d >= s)."""
    zeros = torch.zeros(b, h, s, d, dtype=dtype, device=device)
    onehot = torch.eye(s, d, dtype=dtype, device=device).expand(b, h, s, d)
    torch.manual_seed(SEED)
    with dispatch.use_backend("triton", op="attention"):
        out = ops.attention(zeros, zeros, onehot, dropout_p=p)
    scaled = out[..., :s].float() * (s * (1 - p))  # 1 where kept, 0 where dropped
    keep = scaled.round()
    assert bool(((keep == 0) | (keep == 1)).all()) and float((scaled - keep).abs().max()) < 1e-2, scaled
    return keep.bool()


def _probe_varlen(lengths, h, d, p, dtype, device):
    """The kernel's keep masks, one [h, L, L] per sequence, for torch seed SEED (needs d >= max length)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = sum(lengths)
    zeros = torch.zeros(total, h, d, dtype=dtype, device=device)
    onehot = torch.cat([torch.eye(n, d, dtype=dtype, device=device) for n in lengths])[:, None].expand(total, h, d)
    torch.manual_seed(SEED)
    with dispatch.use_backend("triton", op="varlen_attention"):
        out = ops.varlen_attention(zeros, zeros, onehot, cu, max(lengths), dropout_p=p)
    keeps = []
    for start, n in zip(cu[:-1].tolist(), lengths):
        scaled = out[start:start + n, :, :n].float().transpose(0, 1) * (n * (1 - p))  # [h, L, L]
        keep = scaled.round()
        assert bool(((keep == 0) | (keep == 1)).all()) and float((scaled - keep).abs().max()) < 1e-2
        keeps.append(keep.bool())
    return cu, keeps


def _check_against(outs, grads, truth_fn, naive_fn, args, g, dtype):
    truth_args = upcast(*args)
    truth = truth_fn(*truth_args)
    truth_grads = torch.autograd.grad(truth, truth_args, g.double())
    naive_args = [a.detach().clone().requires_grad_() for a in args]
    naive = naive_fn(*naive_args)
    naive_grads = torch.autograd.grad(naive, naive_args, g)
    assert_close(outs, truth, dtype, "matmul", naive=naive, name="attention output")
    floor = grad_floor(dtype, truth_grads)
    for i, (a, t, n) in enumerate(zip(grads, truth_grads, naive_grads)):
        assert_close(a, t, dtype, "grad", naive=n, name=f"grad of input {i}", floor=floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_padded_dropout_equals_reference_with_the_kernels_mask(dtype):
    device = skip_unless_runnable("attention", "triton", dtype)
    b, h, s, d, p = 3, 2, 100, 128, 0.3  # s spans several key and query blocks, with a tail
    keep = _probe_padded(b, h, s, d, p, dtype, device)
    key_mask = torch.ones(b, s, dtype=torch.bool, device=device)
    key_mask[1, 61:] = False
    key_mask[2] = False  # no kept key at all: zeros, zero gradients
    q, k, v = (torch.randn(b, h, s, d, device=device).to(dtype).requires_grad_() for _ in range(3))
    g = torch.randn(b, h, s, d, device=device).to(dtype)
    torch.manual_seed(SEED)
    with dispatch.use_backend("triton", op="attention"), poison_outputs(), dispatch.record() as calls:
        out = ops.attention(q, k, v, key_mask, dropout_p=p)
        grads = torch.autograd.grad(out, (q, k, v), g)
    assert_ran(calls, "attention", "triton")
    assert_ran(calls, "attention.backward", "triton")
    assert bool((out[2] == 0).all()) and all(bool((x[2] == 0).all()) for x in grads)
    fn = lambda q, k, v: _masked_dropout_attention(q, k, v, key_mask, keep, p, d**-0.5)  # noqa: E731
    _check_against(out, grads, fn, fn, (q, k, v), g, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_dropout_equals_reference_with_the_kernels_mask(dtype):
    device = skip_unless_runnable("varlen_attention", "triton", dtype)
    lengths, h, d, p = [70, 1, 33], 2, 128, 0.25
    cu, keeps = _probe_varlen(lengths, h, d, p, dtype, device)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device=device).to(dtype).requires_grad_() for _ in range(3))
    g = torch.randn(total, h, d, device=device).to(dtype)
    torch.manual_seed(SEED)
    with dispatch.use_backend("triton", op="varlen_attention"), poison_outputs(), dispatch.record() as calls:
        out = ops.varlen_attention(q, k, v, cu, max(lengths), dropout_p=p)
        grads = torch.autograd.grad(out, (q, k, v), g)
    assert_ran(calls, "varlen_attention", "triton")
    assert_ran(calls, "varlen_attention.backward", "triton")

    def fn(q, k, v):
        outs = []
        for start, n, keep in zip(cu[:-1].tolist(), lengths, keeps):
            qi, ki, vi = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))  # [1, h, n, d]
            outs.append(_masked_dropout_attention(qi, ki, vi, None, keep[None], p, d**-0.5)[0].transpose(0, 1))
        return torch.cat(outs)

    _check_against(out, grads, fn, fn, (q, k, v), g, dtype)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_independence(p):
    device = skip_unless_runnable("attention", "triton", torch.float32)
    b, h, s = 2, 4, 64
    keep = _probe_padded(b, h, s, 64, p, torch.float32, device).float()  # [b, h, s, s]
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    rate = float(keep.mean())
    assert abs(rate - (1 - p)) <= 5 * sigma, f"keep rate {rate:.4f}, expected {1 - p} +- {5 * sigma:.4f}"
    # Masks of different heads, sequences and rows are independent: they agree at the chance rate.
    agree = p * p + (1 - p) ** 2
    for x, y in ((keep[:, 0], keep[:, 1]), (keep[0], keep[1]), (keep[:, :, 0], keep[:, :, 1])):
        both = float((x == y).float().mean())
        bound = 5 * (agree * (1 - agree) / x.numel()) ** 0.5
        assert abs(both - agree) <= bound, f"masks agree on {both:.4f}, chance is {agree:.4f} +- {bound:.4f}"


def test_same_seed_same_result_other_seed_other_result():
    device = skip_unless_runnable("attention", "triton", torch.float32)
    q, k, v = (torch.randn(2, 2, 37, 32, device=device, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 2, 37, 32, device=device)

    def run(seed):
        torch.manual_seed(seed)
        with dispatch.use_backend("triton", op="attention"):
            out = ops.attention(q, k, v, dropout_p=0.2)
            return (out, *torch.autograd.grad(out, (q, k, v), g))

    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(first, again)), "same seed, different result"
    assert not torch.equal(first[0], other[0]), "a different seed gave the same dropout"
    with dispatch.use_backend("triton", op="attention"):
        plain = ops.attention(q, k, v)
    assert not torch.equal(first[0], plain), "dropout_p=0.2 changed nothing"
