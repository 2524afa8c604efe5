"""Bad input to the model raises a ValueError that names the problem, before any compute (each op's own:
tests/ops/test_<op>.py)."""
import pytest
import torch

import fastbert
from fastbert import dispatch


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
