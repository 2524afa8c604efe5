"""Bad input raises a ValueError that names the problem, before any compute."""
import pytest
import torch

import fastbert
from fastbert import dispatch, ops


@pytest.fixture(scope="module")
def model():
    return fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50, max_position_embeddings=16)).eval()


def ids(b=2, s=5, high=50):
    return torch.randint(0, high, (b, s))


@pytest.mark.parametrize("make_kwargs,message", [
    (lambda: dict(input_ids=ids(high=50) + 50), "input_ids must lie in \\[0, vocab_size=50\\)"),
    (lambda: dict(input_ids=-ids() - 1), "input_ids must lie in"),
    (lambda: dict(input_ids=ids(s=17)), "sequence length 17 exceeds max_position_embeddings \\(16\\)"),
    (lambda: dict(input_ids=ids(), attention_mask=torch.ones(2, 4)), "attention_mask must have the shape of input_ids \\(2, 5\\)"),
    (lambda: dict(input_ids=ids(), token_type_ids=torch.zeros(3, 5, dtype=torch.long)), "token_type_ids must have the shape"),
    (lambda: dict(input_ids=ids(), token_type_ids=torch.full((2, 5), 2)), "token_type_ids must lie in \\[0, type_vocab_size=2\\)"),
    (lambda: dict(input_ids=ids(), token_type_ids=torch.zeros(2, 5)), "token_type_ids must be int64 or int32"),
    (lambda: dict(input_ids=ids().float()), "input_ids must be int64 or int32"),
    (lambda: dict(input_ids=ids()[0]), "input_ids must be 2-D"),
    (lambda: dict(input_ids=ids(), attention_mask=torch.full((2, 5), 2)), "attention_mask must hold only 0"),
    (lambda: dict(input_ids=ids(), position_ids=torch.full((2, 5), 16)), "position_ids must lie in"),
    # A second device without a GPU: "meta" tensors have a device and a shape but no data.
    (lambda: dict(input_ids=ids().to("meta")), "input_ids is on meta but the model's parameters are on cpu"),
    (lambda: dict(input_ids=ids(), attention_mask=torch.ones(2, 5, device="meta")), "attention_mask is on meta but input_ids is on cpu"),
])
def test_model_bad_input(model, make_kwargs, message):
    with dispatch.record() as calls, pytest.raises(ValueError, match=message):
        model(**make_kwargs())
    assert calls == [], "an op ran before the input was checked"


def test_model_accepts_int32_bool_and_float_masks(model):
    x = ids()
    ref = model(x, attention_mask=torch.ones(2, 5, dtype=torch.long))[0]
    for mask in (torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 5), torch.ones(2, 5, dtype=torch.int32)):
        assert torch.equal(model(x.int(), attention_mask=mask)[0], ref)


@pytest.mark.parametrize("call,message", [
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(5)), "bias must have shape \\(4,\\)"),
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4, dtype=torch.float64)), "bias has dtype torch.float64 but x has dtype torch.float32"),
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4), approximate="sigmoid"), "approximate must be one of"),
    (lambda: ops.bias_gelu(torch.ones(2, 4, dtype=torch.long), torch.ones(4, dtype=torch.long)), "x must be a floating-point tensor"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 5)), "weight must have shape \\[N, 4\\]"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4)), "bias must have shape \\(3,\\)"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 4), activation="relu"), "activation must be one of"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 4), activation="gelu", approximate="sigmoid"),
     "approximate must be one of"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 4), approximate="tanh"), "it needs activation='gelu'"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24), 3), "num_heads must be a positive divisor"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(24), 2), "weight must have shape \\(24, 8\\)"),
    (lambda: ops.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 3, 4)), "q, k and v must have the same shape"),
    (lambda: ops.attention(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)), "q must be 4-D"),
    (lambda: ops.attention(*(torch.randn(2, 1, 3, 4) for _ in range(3)), attention_mask=torch.ones(2, 4)), "attention_mask must have shape \\(2, 3\\)"),
    (lambda: ops.attention(*(torch.randn(2, 1, 3, 4) for _ in range(3)), dropout_p=1.0), "dropout_p must be in \\[0, 1\\)"),
    (lambda: ops.varlen_attention(*(torch.randn(5, 1, 4) for _ in range(3)), torch.tensor([0, 3, 2, 5], dtype=torch.int32), 3),
     "cu_seqlens must rise from 0 to the token count 5"),
    (lambda: ops.varlen_attention(*(torch.randn(5, 1, 4) for _ in range(3)), torch.tensor([0, 3, 4], dtype=torch.int32), 3),
     "cu_seqlens must rise from 0 to the token count 5"),
    (lambda: ops.varlen_attention(*(torch.randn(5, 1, 4) for _ in range(3)), torch.tensor([0, 5], dtype=torch.int32), 3),
     "max_seqlen=3 is below the longest sequence \\(5\\)"),
    (lambda: ops.varlen_attention(*(torch.randn(5, 1, 4) for _ in range(3)), torch.tensor([0.0, 5.0]), 5), "cu_seqlens must be int32"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 5), torch.randn(4), torch.randn(4), 1e-5), "residual must have shape \\(2, 4\\)"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4), torch.randn(4), 0.0), "eps must be positive"),
    # Tensors on different devices ("meta" stands in for a second device on a machine without a GPU).
    (lambda: ops.bias_gelu(torch.randn(2, 4), torch.randn(4, device="meta")), "bias is on meta but x is on cpu"),
    (lambda: ops.dense(torch.randn(2, 4), torch.randn(3, 4, device="meta")), "weight is on meta but x is on cpu"),
    (lambda: ops.qkv_projection(torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24, device="meta"), 2),
     "bias is on meta but x is on cpu"),
    (lambda: ops.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4, device="meta"), torch.randn(1, 2, 3, 4)),
     "k is on meta but q is on cpu"),
    (lambda: ops.attention(*(torch.randn(1, 2, 3, 4) for _ in range(3)), attention_mask=torch.ones(1, 3, device="meta")),
     "attention_mask is on meta but q is on cpu"),
    (lambda: ops.varlen_attention(*(torch.randn(5, 1, 4) for _ in range(3)), torch.tensor([0, 5], dtype=torch.int32, device="meta"), 5),
     "cu_seqlens is on meta but q is on cpu"),
    (lambda: ops.add_layer_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, device="meta"), torch.randn(4), 1e-5),
     "weight is on meta but x is on cpu"),
])
def test_op_bad_input(call, message):
    with dispatch.record() as calls, pytest.raises(ValueError, match=message):
        call()
    assert calls == []

