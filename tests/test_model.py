"""BertModel gives transformers' numbers: outputs at real positions and every parameter gradient."""
import contextlib
import copy
import json

import pytest
import torch

import fastbert
from fastbert.testing import assert_matches, assert_same_gradients
from hf_twins import padded_batch, twins

CONFIGS = {
    "d32-1layer-gelu": dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=128, hidden_act="gelu"),
    "d64-3layers-gelu_new": dict(hidden_size=128, num_attention_heads=2, num_hidden_layers=3, intermediate_size=256, hidden_act="gelu_new"),
    "d32-3layers-tanh": dict(hidden_size=96, num_attention_heads=3, num_hidden_layers=3, intermediate_size=384, hidden_act="gelu_pytorch_tanh"),
    "d64-1layer-gelu": dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=512, hidden_act="gelu"),
    # transformers' Python forms of the two GELUs (refused as "not supported" before)
    "d32-1layer-gelu_python": dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=96, hidden_act="gelu_python"),
    "d32-1layer-gelu_python_tanh": dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=96, hidden_act="gelu_python_tanh"),
}
LENGTHS = [11, 6, 1, 9]  # unequal lengths in one batch, one single-token sequence


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(name):
    ours, theirs = twins(vocab_size=211, **CONFIGS[name])
    ids, mask, types = padded_batch(211, LENGTHS)
    with fastbert.dispatch.record() as calls:
        a = ours(ids, attention_mask=mask, token_type_ids=types)
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if not fastbert.dispatch.machine_reasons("cpu"):  # the kernels are built: no op fell back to the reference
        assert calls and all(backend == "cpu" for _, backend in calls), list(calls)
    real = mask.bool()
    assert_matches(a.last_hidden_state[real], b.last_hidden_state[real], name="last_hidden_state")
    assert_matches(a.pooler_output, b.pooler_output, name="pooler_output")
    assert torch.equal(a[0], a.last_hidden_state) and torch.equal(a[1], a.pooler_output)

    # A loss over real positions only; every parameter's gradient must match.
    w = torch.randn_like(a.last_hidden_state)
    p = torch.randn_like(a.pooler_output)
    loss_a = (a.last_hidden_state * w)[real].sum() + (a.pooler_output * p).sum()
    loss_b = (b.last_hidden_state * w)[real].sum() + (b.pooler_output * p).sum()
    loss_a.backward()
    loss_b.backward()
    assert_same_gradients(ours, theirs)


def test_ids_shared_by_the_batch_match_transformers():
    """token_type_ids and position_ids of shape (1, S) stand for every row, as in transformers."""
    ours, theirs = twins(vocab_size=211, **CONFIGS["d32-1layer-gelu"])
    ids, mask, _ = padded_batch(211, LENGTHS)
    shared = dict(token_type_ids=torch.randint(0, 2, (1, ids.shape[1])), position_ids=torch.randperm(ids.shape[1])[None])
    a, b = ours(ids, attention_mask=mask, **shared), theirs(input_ids=ids, attention_mask=mask, **shared)
    real = mask.bool()
    assert_matches(a.last_hidden_state[real], b.last_hidden_state[real], name="last_hidden_state")


def test_inputs_embeds_match_transformers_with_their_gradient():
    """Word embeddings given in place of ids (prompt tuning, attribution, adversarial training), in the fifth
    place as in transformers: the outputs and the gradient that reaches them."""
    ours, theirs = twins(vocab_size=211, **CONFIGS["d32-1layer-gelu"])
    ids, mask, types = padded_batch(211, LENGTHS)
    embeds = theirs.embeddings.word_embeddings(ids).detach() + 0.1 * torch.randn(*ids.shape, 64)
    real = mask.bool()
    w = torch.randn(*ids.shape, 64)
    outs, grads = [], []
    for model in (ours, theirs):
        given = embeds.clone().requires_grad_()
        with fastbert.dispatch.record() as calls:
            out = model(None, mask, types, None, given).last_hidden_state
            (out * w)[real].sum().backward()
        outs.append(out[real])
        grads.append(given.grad[real])
        if model is ours and not fastbert.dispatch.machine_reasons("cpu"):  # the kernels ran, forward and backward
            assert {c.backend for c in calls} == {"cpu"} and ("add_layer_norm.backward", "cpu") in calls, list(calls)
    assert_matches(outs[0], outs[1], name="last_hidden_state")
    assert_matches(grads[0], grads[1], name="grad of inputs_embeds")
    head = fastbert.BertForSequenceClassification(ours.config).eval()
    words = head.bert.embeddings.word_embeddings(ids).detach()
    assert_matches(head(attention_mask=mask, inputs_embeds=words).logits, head(ids, attention_mask=mask).logits,
                   name="logits of the ids' own embeddings")
    for bad, message in ((dict(input_ids=ids, inputs_embeds=embeds), "not both"), ({}, "neither was given"),
                         (dict(inputs_embeds=embeds.double()), "of the model's torch.float32 or narrower, got shape .* of torch.float64"),
                         (dict(inputs_embeds=embeds[..., :8]), "hidden_size=64"),
                         (dict(inputs_embeds=embeds, attention_mask=mask[:, :3]), "the shape of inputs_embeds' first two")):
        with pytest.raises(ValueError, match=message):
            ours(**bad)
    with pytest.raises(TypeError, match="inputs_embeds is the fifth argument, as in transformers"):
        ours(ids, mask, None, None, True)  # output_hidden_states where it stood before
    # Narrower floats are taken in the tables' dtype, as transformers' sums promote them.
    narrow = embeds.bfloat16()
    assert torch.equal(ours(inputs_embeds=narrow, attention_mask=mask).last_hidden_state,
                       ours(inputs_embeds=narrow.float(), attention_mask=mask).last_hidden_state)


def test_a_row_without_tokens_and_rows_past_the_positions_match_transformers():
    """A row whose mask is all 0 attends no position, as in transformers' default (sdpa: its attention
    outputs are zeros; eager's are a uniform average); a row longer than max_position_embeddings runs
    where position_ids are given (sequences packed in a row)."""
    ours, theirs = twins(vocab_size=211, max_position_embeddings=16, **CONFIGS["d32-1layer-gelu"])
    ids, mask, types = padded_batch(211, [11, 6, 1])
    mask[1] = 0
    with fastbert.dispatch.record() as calls:
        a = ours(ids, attention_mask=mask, token_type_ids=types)
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert calls and all(backend != "reference" for _, backend in calls) or fastbert.dispatch.machine_reasons("cpu")
    real = mask.bool()
    real[1] = True
    assert_matches(a.last_hidden_state[real], b.last_hidden_state[real], name="last_hidden_state")
    assert_matches(a.pooler_output, b.pooler_output, name="pooler_output")

    packed = torch.randint(1, 211, (2, 24))
    positions = torch.cat([torch.arange(12), torch.arange(12)])[None]
    a, b = ours(packed, position_ids=positions), theirs(input_ids=packed, position_ids=positions)
    assert_matches(a.last_hidden_state, b.last_hidden_state, name="last_hidden_state")
    with pytest.raises(ValueError, match="sequence length 24 exceeds max_position_embeddings \\(16\\)"):
        ours(packed)


def test_hidden_states_and_attentions_match_transformers():
    ours, theirs = twins(attn_implementation="eager", vocab_size=99, **CONFIGS["d32-3layers-tanh"])
    ids, mask, types = padded_batch(99, [7, 3])
    with fastbert.dispatch.record() as calls:
        a = ours(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    b = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert len(a.hidden_states) == len(b.hidden_states) == 4
    assert len(a.attentions) == len(b.attentions) == 3
    real = mask.bool()
    for i, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states)):
        assert_matches(x[real], y[real], name=f"hidden_states[{i}]")
    for i, (x, y) in enumerate(zip(a.attentions, b.attentions)):
        keep = real[:, None, :, None]  # rows of real queries; probabilities over all keys
        assert_matches(x.masked_select(keep), y.masked_select(keep), name=f"attentions[{i}]")
    # output_attentions routed attention to a backend that materializes probabilities, and says why.
    attention_calls = [c for c in calls if c.op == "attention"]
    assert {c.backend for c in attention_calls} == {"reference"}
    for c in attention_calls:
        for backend, reasons in c.skipped.items():
            if fastbert.dispatch.implementations("attention").get(backend) and not fastbert.dispatch.machine_reasons(backend):
                assert any("probabilities" in r for r in reasons)
    # The mapping and the tuple keep transformers' fields and positions (an empty cross_attentions last).
    assert list(a.keys()) == list(b.keys()) and a[2] is a.hidden_states and a[3] is a.attentions
    assert [type(x) for x in a.to_tuple()] == [type(y) for y in b.to_tuple()] and a[4] == b[4] == ()


@pytest.mark.parametrize("selection", [-1, [0, 2, 9], 1, [-4]])
def test_hidden_states_selected_by_index_as_in_transformers(selection):
    """transformers 5 takes output_hidden_states as an index or a list of them and leaves the other states
    None."""
    ours, theirs = twins(vocab_size=99, **CONFIGS["d32-3layers-tanh"])
    ids, mask, _ = padded_batch(99, [7, 3])
    a = ours(ids, attention_mask=mask, output_hidden_states=selection).hidden_states
    b = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=selection).hidden_states
    assert [x is None for x in a] == [y is None for y in b] and any(y is not None for y in b)
    real = mask.bool()
    for i, (x, y) in enumerate(zip(a, b)):
        if y is not None:
            assert_matches(x[real], y[real], name=f"hidden_states[{i}]")


@pytest.mark.parametrize("model_class", ["BertModel", "BertForSequenceClassification"])
def test_output_settings_of_config_json_are_the_defaults_as_in_transformers(model_class, tmp_path):
    """output_hidden_states, output_attentions and return_dict in config.json decide where the call does not."""
    _, theirs = twins("eager", vocab_size=99, model_class=model_class, **CONFIGS["d32-1layer-gelu"])
    settings = dict(output_hidden_states=True, output_attentions=True, return_dict=False)
    for name, value in settings.items():
        setattr(theirs.config, name, value)
    theirs.save_pretrained(tmp_path)
    assert settings.items() <= json.loads((tmp_path / "config.json").read_text()).items()
    ours = getattr(fastbert, model_class).from_pretrained(tmp_path).eval()
    ids, mask, _ = padded_batch(99, [7, 3])
    a, b = ours(ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask)
    assert isinstance(a, tuple) and isinstance(b, tuple)
    assert len(a) == len(b)  # BertModel's tuple ends in transformers' empty cross_attentions
    states, probabilities = (2, 3) if model_class == "BertModel" else (-2, -1)
    assert len(a[states]) == len(b[states]) == 2
    assert_matches(a[states][1][mask.bool()], b[states][1][mask.bool()], name="hidden_states[1]")
    assert_matches(a[probabilities][0], b[probabilities][0], name="attentions[0]")
    # The call's own settings win.
    out = ours(ids, attention_mask=mask, output_hidden_states=False, output_attentions=False, return_dict=True)
    assert out.hidden_states is None and out.attentions is None


def test_state_dict_round_trip_strict_both_ways():
    ours, theirs = twins(vocab_size=50, **CONFIGS["d32-1layer-gelu"])
    assert list(ours.state_dict()) == list(theirs.state_dict())
    fresh = fastbert.BertModel(ours.config)
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(fresh.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, theirs.state_dict()[k]), k


def test_no_pooler_and_tuple_outputs():
    cfg = fastbert.BertConfig.tiny(vocab_size=100)
    model = fastbert.BertModel(cfg, add_pooling_layer=False).eval()
    ids = torch.randint(0, 100, (2, 5))
    out = model(ids)
    assert out.pooler_output is None and len(out) == 1
    t = model(ids, return_dict=False)
    assert isinstance(t, tuple) and torch.equal(t[0], out.last_hidden_state)
    assert not any(k.startswith("pooler") for k in model.state_dict())


def test_outputs_are_mappings_of_the_fields_set_as_in_transformers():
    cfg = fastbert.BertConfig.tiny(vocab_size=100)
    ids = torch.randint(0, 100, (2, 5))
    out = fastbert.BertForMaskedLM(cfg).eval()(ids, labels=ids)
    assert "loss" in out and "hidden_states" not in out
    assert list(out) == out.keys() == ["loss", "logits"] and len(out) == 2
    assert out["loss"] is out.loss and out[0] is out.loss and dict(out.items())["logits"] is out.logits
    with pytest.raises(KeyError):
        out["hidden_states"]


def test_attentions_in_training_are_the_probabilities_after_dropout():
    """As transformers' eager attention returns them: zeros where dropped, the kept ones scaled by 1 / (1 - p)."""
    cfg = fastbert.BertConfig.tiny(vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5)
    model = fastbert.BertModel(cfg)
    ids = torch.randint(0, 100, (2, 12))
    first = model.eval()(ids, output_attentions=True).attentions[0]  # layer 0 sees the same input either way
    dropped = model.train()(ids, output_attentions=True).attentions[0]
    kept = dropped != 0
    assert 0.3 < float(kept.float().mean()) < 0.7
    assert_matches(dropped[kept], 2 * first[kept], name="kept probabilities")


def test_training_mode_applies_dropout_eval_does_not():
    cfg = fastbert.BertConfig.tiny(vocab_size=100)
    model = fastbert.BertModel(cfg)
    ids = torch.randint(0, 100, (2, 6))
    model.eval()
    e1, e2 = model(ids)[0], model(ids)[0]
    assert torch.equal(e1, e2)
    model.train()
    assert not torch.equal(model(ids)[0], model(ids)[0])


@pytest.mark.skipif(bool(fastbert.dispatch.machine_reasons("cpu")), reason="fastbert._C not built")
def test_model_trains_on_the_cpu_kernel_with_attention_dropout():
    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50, attention_probs_dropout_prob=0.1)).train()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with fastbert.dispatch.record() as calls:
        model(ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert ("varlen_attention", "cpu") in calls and ("varlen_attention.backward", "cpu") in calls
    model.eval()
    assert torch.equal(model(ids)[0], model(ids)[0])  # eval mode: no dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_kernel_backend_matches_reference_model(backend, dtype):
    """The whole model on one kernel backend equals the float64 reference: output and every gradient."""
    import copy

    from fastbert.testing import assert_close, grad_floor
    from grids import skip_unless_runnable

    # Each op on `backend` (cuda's GEMMs are cuBLAS's, through torch).
    backends = {op: backend for op in fastbert.dispatch.OPS if op != "quantized_dense"}  # int8 models only
    device = "cpu"
    for op, serving in backends.items():
        if op != "varlen_attention":
            device = skip_unless_runnable(op, serving, dtype)
    cfg = fastbert.BertConfig.tiny(vocab_size=97, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fastbert.BertModel(cfg).eval()
    truth_model = copy.deepcopy(model).double()
    naive_model = copy.deepcopy(model).to(dtype)
    model = model.to(device, dtype)
    ids, mask, types = padded_batch(97, [9, 4, 1])
    weights = torch.randn(*ids.shape, cfg.hidden_size, dtype=torch.float64)

    def run(m, use, dev):
        with contextlib.ExitStack() as forced, fastbert.dispatch.record() as calls:
            for op, serving in use.items():
                forced.enter_context(fastbert.use_backend(serving, op))
            out = m(ids.to(dev), attention_mask=mask.to(dev), token_type_ids=types.to(dev))
            hidden = out.last_hidden_state
            loss = (hidden.double() * weights.to(dev))[mask.bool().to(dev)].sum() + out.pooler_output.double().sum()
            loss.backward()
        return hidden, {n: p.grad for n, p in m.named_parameters()}, calls

    hidden, grads, calls = run(model, backends, device)
    reference = dict.fromkeys(backends, "reference")
    truth, truth_grads, _ = run(truth_model, reference, "cpu")
    naive, naive_grads, _ = run(naive_model, reference, "cpu")
    wrong = {c for c in calls if c.backend != backends[c.op.removesuffix(".backward")]}
    assert calls and not wrong, f"calls not on their forced backend: {wrong}"
    real = mask.bool()
    assert_close(hidden.cpu()[real], truth[real], dtype, "matmul", naive=naive[real], name="last_hidden_state")
    floor = grad_floor(dtype, truth_grads)
    for name, g in grads.items():
        assert_close(g.cpu(), truth_grads[name], dtype, "grad", naive=naive_grads[name], name=name, floor=floor)


def test_second_derivatives_are_refused_by_name_and_run_on_the_reference():
    """fastbert's kernels have no second derivative: a gradient penalty (create_graph=True) or torch.func.grad
    names the way out (torch's message told the user to register an autograd formula), which gives
    transformers' numbers (eager's: torch's CPU flash attention under sdpa has no second derivative either)."""
    ours, theirs = twins("eager", vocab_size=211, **CONFIGS["d32-1layer-gelu"])
    ids, mask, _ = padded_batch(211, LENGTHS)

    def penalty(model, **inputs):
        out = model(input_ids=ids, attention_mask=mask, **inputs).pooler_output
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.pow(2).sum(), params, create_graph=True, allow_unused=True)
        return sum(g.pow(2).sum() for g in grads if g is not None)

    with pytest.raises(RuntimeError, match="no second derivative .* fastbert.use_backend\\('reference'\\)"):
        penalty(ours)
    params = dict(ours.named_parameters())
    with pytest.raises(RuntimeError, match="cannot be differentiated by torch.func"):
        torch.func.grad(lambda p: torch.func.functional_call(ours, p, (ids, mask)).pooler_output.sum())(params)
    with fastbert.use_backend("reference"):
        a = penalty(ours)
        a.backward()
    b = penalty(theirs)
    b.backward()
    assert_matches(a, b, name="gradient penalty")
    assert_same_gradients(ours, theirs)


def test_hooks_the_kernels_would_skip_are_refused():
    """fastbert's kernels read a Linear's or a LayerNorm's weight without calling it: a hook there (here
    torch.nn.utils.prune's, which recomputes the weight) was skipped, stale numbers in inference and a crash in
    training's second step. Refused, naming the module; with the pruning made permanent, transformers' numbers."""
    from torch.nn.utils import prune

    ours, theirs = twins(vocab_size=99, **CONFIGS["d32-1layer-gelu"])
    ids, mask, _ = padded_batch(99, [7, 3])
    ours(ids, attention_mask=mask)  # a look that found no hooks is remembered until a handle is taken
    for model in (ours, theirs):
        prune.l1_unstructured(model.encoder.layer[0].attention.self.query, "weight", amount=0.5)
    with pytest.raises(RuntimeError, match="encoder.layer.0.attention.self.query has hooks"):
        ours(ids, attention_mask=mask)
    prune.remove(ours.encoder.layer[0].attention.self.query, "weight")
    with fastbert.dispatch.record() as calls:
        a = ours(ids, attention_mask=mask).last_hidden_state
    assert any(backend != "reference" for _, backend in calls)
    assert_matches(a[mask.bool()], theirs(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()],
                   name="pruned")
    head = fastbert.BertForSequenceClassification(ours.config).eval()
    head.classifier.register_forward_hook(lambda module, args, out: out * 0)
    with pytest.raises(RuntimeError, match="^classifier has hooks"):
        head(ids, attention_mask=mask)
    # A module hooked elsewhere and then assigned in takes no new hook handle: refused all the same.
    spare = copy.deepcopy(ours.encoder.layer[0].attention.self.key)
    prune.l1_unstructured(spare, "weight", amount=0.5)
    ours(ids, attention_mask=mask)
    ours.encoder.layer[0].attention.self.key = spare
    with pytest.raises(RuntimeError, match="encoder.layer.0.attention.self.key has hooks"):
        ours(ids, attention_mask=mask)
    # A layer fastbert calls as a module keeps its hooks, which fire.
    lm = fastbert.BertForMaskedLM(ours.config).eval()
    fired = []
    lm.cls.predictions.transform.LayerNorm.register_forward_hook(lambda *_: fired.append(1))
    lm.bert.embeddings.dropout.register_forward_hook(lambda *_: fired.append(2))
    lm(ids, attention_mask=mask)
    assert sorted(fired) == [1, 2]
    lm.bert.encoder.layer[0].output.dropout.register_forward_hook(lambda *_: fired.append(3))  # its rate is read
    with pytest.raises(RuntimeError, match="encoder.layer.0.output.dropout has hooks"):
        lm(ids, attention_mask=mask)
