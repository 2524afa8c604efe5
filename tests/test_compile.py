"""torch.compile(model, fullgraph=True): no graph break, same numbers as eager, forward and backward."""
import torch

import fastbert
from fastbert.testing import assert_same_gradients, rel_err
from hf_twins import padded_batch


def test_compile_fullgraph_equals_eager_forward_and_backward():
    cfg = fastbert.BertConfig.tiny(vocab_size=97, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fastbert.BertModel(cfg)
    ids, mask, types = padded_batch(97, [7, 3, 5])
    real = mask.bool()
    weights = torch.randn(*ids.shape, cfg.hidden_size)

    def step(m):
        model.zero_grad()
        out = m(ids, attention_mask=mask, token_type_ids=types)
        ((out.last_hidden_state * weights)[real].sum() + out.pooler_output.sum()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_out, eager_grads = step(model)
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    with fastbert.dispatch.record() as calls:
        out, grads = step(compiled)
    assert calls == [], "dispatch records nothing while compiled code runs (choices were made at trace time)"
    assert rel_err(out.last_hidden_state[real], eager_out.last_hidden_state[real]) <= 1e-5
    assert rel_err(out.pooler_output, eager_out.pooler_output) <= 1e-5
    assert_same_gradients(grads, eager_grads)
