"""Padding-free encoder: pad tokens removed once, restored once; same numbers as the padded path."""
import pytest
import torch

import fastbert
from fastbert import dispatch, padding
from fastbert.testing import assert_matches, assert_same_gradients
from hf_twins import padded_batch


def model_and_batch():
    cfg = fastbert.BertConfig.tiny(vocab_size=97, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fastbert.BertModel(cfg).eval()
    return model, padded_batch(97, [13, 5, 1, 9])


def run(model, ids, mask, types, **overrides):
    with dispatch.record() as calls:
        out = model(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    return out, {c.op for c in calls}


def test_pack_unpad_pad_round_trip():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    p = padding.packing(mask)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 7] and p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == 3
    x = torch.randn(3, 4, 5)
    packed = padding.unpad(x, p)
    assert packed.shape == (7, 5)
    back = padding.pad(packed, p)
    assert torch.equal(back[mask], x[mask]) and torch.equal(back[~mask], torch.zeros_like(back[~mask]))


def test_padding_free_equals_padded_path_outputs_and_gradients():
    if dispatch.prefers_varlen(torch.zeros(1, dtype=torch.float32), 64, 0.0) is False:
        pytest.skip("no varlen kernel on this machine: the model always runs padded")
    model, (ids, mask, types) = model_and_batch()
    real = mask.bool()
    packed_out, packed_ops = run(model, ids, mask, types)
    assert "varlen_attention" in packed_ops and "attention" not in packed_ops
    with fastbert.use_backend("reference", op="varlen_attention"):  # no varlen kernel -> padded path
        padded_out, padded_ops = run(model, ids, mask, types)
    assert "attention" in padded_ops and "varlen_attention" not in padded_ops

    assert_matches(packed_out.last_hidden_state[real], padded_out.last_hidden_state[real], name="last_hidden_state")
    assert torch.equal(packed_out.last_hidden_state[~real], torch.zeros_like(packed_out.last_hidden_state[~real]))
    assert_matches(packed_out.pooler_output, padded_out.pooler_output, name="pooler_output")
    for i, (a, b) in enumerate(zip(packed_out.hidden_states, padded_out.hidden_states)):
        assert_matches(a[real], b[real], name=f"hidden_states[{i}]")

    w = torch.randn_like(packed_out.last_hidden_state)
    grads = []
    for use_varlen in (True, False):
        model.zero_grad()
        if use_varlen:
            out = model(ids, attention_mask=mask, token_type_ids=types)
        else:
            with fastbert.use_backend("reference", op="varlen_attention"):
                out = model(ids, attention_mask=mask, token_type_ids=types)
        ((out.last_hidden_state * w)[real].sum() + out.pooler_output.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same_gradients(grads[0], grads[1])


def test_no_padding_or_left_padding_stays_padded():
    model, (ids, mask, types) = model_and_batch()
    _, ops_used = run(model, ids, torch.ones_like(mask), types)
    assert "varlen_attention" not in ops_used  # nothing to remove
    left = mask.flip(1)  # first token is padding for some rows: the pooler needs it computed
    _, ops_used = run(model, ids, left, types)
    assert "varlen_attention" not in ops_used


def test_output_attentions_needs_the_padded_layout():
    model, (ids, mask, types) = model_and_batch()
    with dispatch.record() as calls:
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert {c.op for c in calls} >= {"attention"} and out.attentions[0].shape == (4, 2, 13, 13)
