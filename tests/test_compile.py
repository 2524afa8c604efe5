"""torch.compile(model, fullgraph=True): no graph break, same numbers as eager, forward and backward,
in inference (no_grad, eval: temporaries die inside the graph and their buffers are reused) and in
training, on every layer count where one layer's state could be served to another."""
import pytest
import torch

import fastbert
from fastbert.testing import assert_close, assert_same_gradients
from grids import skip_unless_runnable
from hf_twins import padded_batch

VOCAB = 97


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles new models; the recompile limit counts per code object
    yield


def small_model(layers: int) -> fastbert.BertModel:
    cfg = fastbert.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
    return fastbert.BertModel(cfg)


def batch(padded: bool):
    ids, mask, types = padded_batch(VOCAB, [7, 3, 5] if padded else [6, 6, 6])
    return ids, (mask if padded else None), types


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_compile_inference_equals_eager(backend, layers):
    """The bug this pins: the compiled graph reused the buffer of one layer's stacked QKV weight for the
    next, and a cache keyed by tensor identity served the later layer the earlier one's packed weight."""
    for op in ("dense", "qkv_projection", "attention", "add_layer_norm"):
        skip_unless_runnable(op, backend, torch.float32)
    model = small_model(layers).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with fastbert.use_backend(backend):
        for padded in (False, True):
            ids, mask, types = batch(padded)
            real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
            with torch.no_grad():
                eager = model(ids, attention_mask=mask, token_type_ids=types)
                for _ in range(2):  # the second call runs on the graph's reused buffers
                    out = compiled(ids, attention_mask=mask, token_type_ids=types)
                    assert_close(out.last_hidden_state[real], eager.last_hidden_state[real], torch.float32, "elementwise",
                                 name=f"{layers} layers, padded={padded}: last_hidden_state")
                    assert_close(out.pooler_output, eager.pooler_output, torch.float32, "elementwise", name="pooler_output")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_compile_training_equals_eager_forward_and_backward(backend, layers):
    for op in ("dense", "qkv_projection", "attention", "add_layer_norm"):
        skip_unless_runnable(op, backend, torch.float32)
    model = small_model(layers).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)  # raises on any graph break
    with fastbert.use_backend(backend):
        for padded in (False, True):
            ids, mask, types = batch(padded)
            real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
            weights = torch.randn(*ids.shape, model.config.hidden_size)

            def step(m):
                model.zero_grad()
                out = m(ids, attention_mask=mask, token_type_ids=types)
                ((out.last_hidden_state * weights)[real].sum() + out.pooler_output.sum()).backward()
                return out, {n: p.grad.clone() for n, p in model.named_parameters()}

            eager_out, eager_grads = step(model)
            with fastbert.dispatch.record() as calls:
                out, grads = step(compiled)
            assert calls == [], "dispatch records nothing while compiled code runs (choices were made at trace time)"
            assert_close(out.last_hidden_state[real], eager_out.last_hidden_state[real], torch.float32, "elementwise",
                         name=f"{layers} layers, padded={padded}: last_hidden_state")
            assert_close(out.pooler_output, eager_out.pooler_output, torch.float32, "elementwise", name="pooler_output")
            assert_same_gradients(grads, eager_grads)


@pytest.mark.parametrize("training", [False, True])
def test_one_graph_serves_every_batch_size_and_length(training):
    """dynamic=True: one graph for every batch size and sequence length, eager forwards in between. Shapes
    checked as members of a set, the attention op's `int max_seqlen` and the plans' thread state each made
    graphs per shape (fullgraph=True failed at the ninth length; without it the model ran eager for good)."""
    skip_unless_runnable("attention", "cpu", torch.float32)
    model = small_model(2).train(training)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(recompile_limit=1), torch.set_grad_enabled(training):  # a recompile raises
        for lengths in ([5, 3], [9, 9, 4], [12, 7, 2, 12], [16, 1]):
            ids, mask, types = padded_batch(VOCAB, lengths)
            real = mask.bool()
            eager = model(ids, attention_mask=mask, token_type_ids=types)
            out = compiled(ids, attention_mask=mask, token_type_ids=types)
            assert_close(out.last_hidden_state[real], eager.last_hidden_state[real], torch.float32, "elementwise",
                         name=f"lengths {lengths}: last_hidden_state")
            if training:
                out.pooler_output.sum().backward()


def test_export_with_dynamic_batch_and_length():
    """torch.export with dynamic dims (what ONNX's dynamo export builds on): the shape checks took the sizes
    as a set's members (unhashable symbols) and pinned them."""
    skip_unless_runnable("attention", "cpu", torch.float32)
    from torch.export import Dim

    model = small_model(2).eval()
    ids, mask, _ = padded_batch(VOCAB, [7, 3, 5])
    dims = {0: Dim("batch", min=2, max=64), 1: Dim("length", min=2, max=16)}
    with torch.no_grad():
        exported = torch.export.export(model, (), dict(input_ids=ids, attention_mask=mask),
                                       dynamic_shapes=dict(input_ids=dims, attention_mask=dims)).module()
        for lengths in ([9, 4], [16, 2, 11, 16]):
            ids, mask, _ = padded_batch(VOCAB, lengths)
            real = mask.bool()
            assert_close(exported(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                         model(ids, attention_mask=mask).last_hidden_state[real], torch.float32, "elementwise",
                         name=f"lengths {lengths}")


def test_jit_trace_is_refused_by_name():
    """It failed on a shape check that printed two equal shapes, then on a kernel probe's bool output."""
    model = small_model(1).eval()
    with pytest.raises(RuntimeError, match="torch.jit.trace .* use torch.compile or torch.export"):
        torch.jit.trace(model, (torch.randint(0, VOCAB, (2, 6)),), strict=False)
