"""Dropout inside the cpu kernels (attention probabilities, residual + LayerNorm): seeded, regenerated
in backward, right keep rate, and equal to the reference applied with the very same mask (forward and
every gradient)."""
import math

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference
from fastbert.testing import assert_close, poison_outputs, upcast

pytestmark = pytest.mark.skipif(bool(dispatch.machine_reasons("cpu")), reason="fastbert._C not built")
P = 0.3


def keep_mask(seed, sequences, heads, rows, cols):
    return torch.ops.fastbert_C.dropout_keep(seed, P, sequences, heads, rows, cols)


def test_keep_rate_within_statistical_bounds_and_seeded():
    keep = keep_mask(1234, 4, 12, 64, 64)
    n = keep.numel()
    rate = keep.float().mean().item()
    assert abs(rate - (1 - P)) < 5 * math.sqrt(P * (1 - P) / n)
    assert torch.equal(keep, keep_mask(1234, 4, 12, 64, 64))
    assert not torch.equal(keep, keep_mask(1235, 4, 12, 64, 64))


def test_same_torch_seed_same_output_different_seed_different_output():
    q, k, v = (torch.randn(2, 3, 9, 16) for _ in range(3))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        with dispatch.use_backend("cpu", op="attention"):
            runs.append(ops.attention(q, k, v, dropout_p=P))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def reference_with_mask(q, k, v, key_mask, keep, scale):
    """softmax over kept keys, then the kernel's dropout mask, then @ v: the naive computation."""
    probs = reference.attention(q, k, v, key_mask, 0.0, scale, need_weights=True)[1]
    return (probs * keep.to(probs.dtype) / (1 - P)) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_padded_attention_dropout_equals_reference_with_the_same_mask(dtype):
    b, h, s, d, seed = 3, 2, 37, 32, 99
    q, k, v = (torch.randn(b, h, s, d).to(dtype).requires_grad_() for _ in range(3))
    key_mask = torch.arange(s)[None] < torch.tensor([s, 20, 1])[:, None]
    scale = d**-0.5
    with poison_outputs():
        out, _ = torch.ops.fastbert.attention_cxx(q, k, v, key_mask, None, q.shape[2], scale, P, torch.tensor(seed))
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    keep = keep_mask(seed, b, h, s, s)
    truth_in = upcast(q, k, v)
    truth = reference_with_mask(*truth_in, key_mask, keep, scale)
    t_grads = torch.autograd.grad(truth, truth_in, grad.double())
    naive_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive = reference_with_mask(*naive_in, key_mask, keep, scale)
    n_grads = torch.autograd.grad(naive, naive_in, grad)
    assert_close(out, truth, dtype, "matmul", naive=naive, name="output")
    for name, g, t, n in zip("qkv", (dq, dk, dv), t_grads, n_grads):
        assert_close(g, t, dtype, "grad", naive=n, name=f"d{name}")


def test_varlen_attention_dropout_equals_reference_with_the_same_mask():
    lengths, h, d, seed = [5, 1, 12], 2, 16, 5
    cu = torch.tensor([0, 5, 6, 18], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, d, dtype=torch.float64).float().requires_grad_() for _ in range(3))
    out, _ = torch.ops.fastbert.attention_cxx(q, k, v, None, cu, max(lengths), d**-0.5, P, torch.tensor(seed))
    keep = keep_mask(seed, len(lengths), h, max(lengths), max(lengths))
    expected = []
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        qi, ki, vi = (t[start:start + n].transpose(0, 1)[None].double() for t in (q, k, v))  # [1, h, n, d]
        expected.append(reference_with_mask(qi, ki, vi, None, keep[i:i + 1, :, :n, :n], d**-0.5)[0].transpose(0, 1))
    assert_close(out, torch.cat(expected), torch.float32, "matmul", name="varlen output")


def test_model_trains_on_the_cpu_kernel_with_attention_dropout():
    import fastbert

    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50, attention_probs_dropout_prob=0.1)).train()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with dispatch.record() as calls:
        model(ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert ("varlen_attention", "cpu") in calls and ("varlen_attention.backward", "cpu") in calls
    model.eval()
    assert torch.equal(model(ids)[0], model(ids)[0])  # eval mode: no dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_add_layer_norm_dropout_equals_reference_with_the_same_mask(dtype):
    rows, n, seed = 7, 100, 2024
    x, r = (torch.randn(rows, n).to(dtype).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(n)).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_()
    with poison_outputs():
        out = torch.ops.fastbert.add_layer_norm_cxx(x, r, w, b, 1e-5, P, torch.tensor([seed]))[0]
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, r, w, b), grad)
    keep = keep_mask(seed, 1, 1, rows, n)[0, 0]
    assert 0 < int(keep.sum()) < keep.numel()

    def naive(x, r, w, b):
        return reference.add_layer_norm(x * keep.to(x.dtype) / (1 - P), r, w, b, 1e-5)

    truth_in = upcast(x, r, w, b)
    truth = naive(*truth_in)
    t_grads = torch.autograd.grad(truth, truth_in, grad.double())
    same_in = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    same = naive(*same_in)
    s_grads = torch.autograd.grad(same, same_in, grad)
    assert_close(out, truth, dtype, "elementwise", naive=same, name="output")
    for name, g, t, n_ in zip(("x", "residual", "weight", "bias"), grads, t_grads, s_grads):
        assert_close(g, t, dtype, "grad", naive=n_, name=f"d{name}")


def test_add_layer_norm_dropout_seeded_through_torch():
    x, r, w, b = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64), torch.zeros(64)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        with dispatch.use_backend("cpu", op="add_layer_norm"):
            runs.append(ops.add_layer_norm(x, r, w, b, 1e-5, dropout_p=P))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
