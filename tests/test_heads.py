"""Task heads give transformers' numbers (logits, losses, every gradient) and load / save HF checkpoints."""
import logging
from dataclasses import fields

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import fastbert
from fastbert.testing import assert_matches, assert_same_gradients
from hf_twins import padded_batch, twins

CONFIG = dict(vocab_size=211, hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128)
LENGTHS = [11, 6, 1, 9]  # unequal lengths in one batch, one single-token sequence
B, S, V = len(LENGTHS), max(LENGTHS), CONFIG["vocab_size"]


def mlm_labels(mask):
    """Token ids to predict at ~30% of real positions (always the first one), -100 elsewhere and at pads."""
    scored = mask.bool() & (torch.rand(mask.shape) < 0.3)
    scored[:, 0] = True
    return torch.where(scored, torch.randint(0, V, mask.shape), -100)


def span_positions(mask):
    """Answer spans inside each sequence, and a start and an end past the input (HF clamps them to S
    and ignores class S)."""
    lengths = mask.sum(1)
    start = (torch.rand(B) * lengths).long()
    end = start + (torch.rand(B) * (lengths - start)).long()
    end[0], start[3] = S + 5, S
    return dict(start_positions=start, end_positions=end)


# name -> (class, config fields, labels for a mask, problem_type the labels must lead to)
CASES = {
    "masked_lm-gelu": ("BertForMaskedLM", dict(hidden_act="gelu"), lambda m: dict(labels=mlm_labels(m)), None),
    "masked_lm-gelu_new": ("BertForMaskedLM", dict(hidden_act="gelu_new"), lambda m: dict(labels=mlm_labels(m)), None),
    "pretraining": ("BertForPreTraining", dict(hidden_act="gelu_pytorch_tanh"),
                    lambda m: dict(labels=mlm_labels(m), next_sentence_label=torch.randint(0, 2, (B,))), None),
    "seq_cls-regression": ("BertForSequenceClassification", dict(num_labels=1),
                           lambda m: dict(labels=torch.randn(B)), "regression"),
    "seq_cls-single_label": ("BertForSequenceClassification", dict(num_labels=3),
                             lambda m: dict(labels=torch.randint(0, 3, (B,))), "single_label_classification"),
    "seq_cls-multi_label": ("BertForSequenceClassification", dict(num_labels=4),
                            lambda m: dict(labels=torch.randint(0, 2, (B, 4)).float()), "multi_label_classification"),
    "token_cls": ("BertForTokenClassification", dict(num_labels=5),
                  lambda m: dict(labels=torch.randint(0, 5, m.shape).masked_fill(m == 0, -100)), None),
    "question_answering": ("BertForQuestionAnswering", dict(), span_positions, None),
    # Labels at pad positions too (not -100): transformers scores the logits of pad tokens run through the encoder.
    "masked_lm-pads_scored": ("BertForMaskedLM", dict(), lambda m: dict(labels=torch.randint(0, V, m.shape)), None),
    "token_cls-pads_scored": ("BertForTokenClassification", dict(num_labels=5),
                              lambda m: dict(labels=torch.randint(0, 5, m.shape)), None),
    # transformers' losses flatten the labels: [B * S] scores the same positions as [B, S].
    "masked_lm-pads_scored-flat": ("BertForMaskedLM", dict(), lambda m: dict(labels=torch.randint(0, V, (m.numel(),))),
                                   None),
    "pretraining-pads_scored-flat": ("BertForPreTraining", dict(), lambda m: dict(
        labels=torch.randint(0, V, (*m.shape, 1)), next_sentence_label=torch.randint(0, 2, (B,))), None),
}


def set_fields(out):
    """(name, value) of the output fields that are set, in order."""
    return [(f.name, getattr(out, f.name)) for f in fields(out) if getattr(out, f.name) is not None]


def assert_same_logits(a, b, mask):
    """Every logits field of fastbert's output `a` equals transformers' `b`: at real positions for
    per-token logits (pad positions differ when fastbert runs padding-free), everywhere otherwise."""
    real = mask.bool()
    compared = 0
    for name, x in set_fields(a):
        if not name.endswith("logits"):
            continue
        y = getattr(b, name)
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} != transformers {tuple(y.shape)}"
        per_token = tuple(x.shape[:2]) == tuple(real.shape)
        if per_token:
            assert_matches(x[real], y[real], name=name)
        else:
            assert_matches(x, y, name=name)
        compared += 1
    assert compared > 0, "no logits compared"


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case):
    model_class, config, make_labels, problem_type = CASES[case]
    ours, theirs = twins(model_class=model_class, **CONFIG, **config)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # strict the other way too
    ids, mask, types = padded_batch(V, LENGTHS)

    # Inference: no labels, no loss.
    a = ours(ids, attention_mask=mask, token_type_ids=types)
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert a.loss is None and b.loss is None
    assert_same_logits(a, b, mask)

    # With labels: the loss, HF's output fields in HF's order, indexing and tuples as HF's.
    labels = make_labels(mask)
    a = ours(ids, attention_mask=mask, token_type_ids=types, **labels)
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types, **labels)
    assert [name for name, _ in set_fields(a)] == list(b.keys())
    assert_same_logits(a, b, mask)
    assert_matches(a.loss, b.loss, name="loss")
    assert a[0] is a.loss and a[1] is set_fields(a)[1][1] and len(a) == len(b)
    as_tuple = ours(ids, attention_mask=mask, token_type_ids=types, return_dict=False, **labels)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(a)
    assert all(torch.equal(x, y) for x, y in zip(as_tuple, a.to_tuple()))
    if problem_type is not None:  # inferred from num_labels and the labels, and kept, as HF does
        assert ours.config.problem_type == theirs.config.problem_type == problem_type

    a.loss.backward()
    b.loss.backward()
    assert_same_gradients(ours, theirs)

    # Word embeddings in place of ids, in transformers' fifth place (before the labels).
    embeds = theirs.bert.embeddings.word_embeddings(ids).detach()
    a = ours(None, mask, types, None, embeds, **labels)
    b = theirs(None, mask, types, None, embeds, **labels)
    assert_same_logits(a, b, mask)
    assert_matches(a.loss, b.loss, name="loss of inputs_embeds")


@pytest.mark.parametrize("model_class", ["BertForPreTraining", "BertForTokenClassification"])
def test_hidden_states_and_attentions_pass_through(model_class):
    ours, theirs = twins(attn_implementation="eager", model_class=model_class, **CONFIG)
    ids, mask, types = padded_batch(V, [7, 3])
    a = ours(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    b = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert [name for name, _ in set_fields(a)] == list(b.keys())
    assert len(a.hidden_states) == len(b.hidden_states) == 3 and len(a.attentions) == len(b.attentions) == 2
    real = mask.bool()
    for i, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states)):
        assert_matches(x[real], y[real], name=f"hidden_states[{i}]")
    for i, (x, y) in enumerate(zip(a.attentions, b.attentions)):
        keep = real[:, None, :, None]  # rows of real queries
        assert_matches(x.masked_select(keep), y.masked_select(keep), name=f"attentions[{i}]")
    assert_same_logits(a, b, mask)


def test_question_answering_inference_runs_padding_free_and_its_loss_does_not():
    # HF's span loss takes a softmax over every position, pads included: with a loss the pad tokens
    # go through the encoder; without one, they need not.
    ours, theirs = twins(model_class="BertForQuestionAnswering", **CONFIG)
    ids, mask, types = padded_batch(V, LENGTHS)
    pads = mask == 0
    if not ours.bert.padding_free(ours.bert.embeddings(ids, types), mask.bool()):
        pytest.skip("no varlen attention kernel here: the encoder never runs padding-free")
    a = ours(ids, attention_mask=mask, token_type_ids=types)
    assert torch.equal(a.start_logits[pads], ours.qa_outputs.bias[0].expand(int(pads.sum())))  # zero hidden states
    a = ours(ids, attention_mask=mask, token_type_ids=types, **span_positions(mask))
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert_matches(a.start_logits, b.start_logits, name="start_logits")
    assert_matches(a.end_logits, b.end_logits, name="end_logits")


# ---------------------------------------------------------------------------------- checkpoints

HEADS = ["BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification", "BertForTokenClassification",
         "BertForQuestionAnswering"]
TIED = {"BertForMaskedLM", "BertForPreTraining"}
# What transformers starts fresh when each head loads a plain BertModel checkpoint (the tied decoder
# weight follows the embeddings; the tied decoder bias is the same Parameter as cls.predictions.bias).
MLM_HEAD = ["cls.predictions.bias", "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias"]
FRESH_HEAD = {
    "BertForMaskedLM": MLM_HEAD,
    "BertForPreTraining": MLM_HEAD + ["cls.seq_relationship.weight", "cls.seq_relationship.bias"],
    "BertForSequenceClassification": ["classifier.weight", "classifier.bias"],
    "BertForTokenClassification": ["classifier.weight", "classifier.bias"],
    "BertForQuestionAnswering": ["qa_outputs.weight", "qa_outputs.bias"],
}
SMALL = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def labels_for(name):
    return dict(num_labels=3) if "Classification" in name else {}


def perturbed(model):
    """Random values in every parameter, so zero-initialized biases and unit LayerNorms can't hide a
    tensor that was never loaded."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def assert_same_outputs(ours, theirs):
    ids, mask, types = padded_batch(SMALL["vocab_size"], [6, 2, 1, 4])
    assert_same_logits(ours(ids, attention_mask=mask, token_type_ids=types),
                       theirs(input_ids=ids, attention_mask=mask, token_type_ids=types), mask)


def assert_tied(model):
    predictions = model.cls.predictions
    assert predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    assert predictions.decoder.bias.data_ptr() == predictions.bias.data_ptr()


def fastbert_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "fastbert" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", HEADS)
def test_loads_hf_head_checkpoint(tmp_path, caplog, name):
    theirs = perturbed(getattr(transformers, name)(transformers.BertConfig(**SMALL, **labels_for(name))))
    theirs.save_pretrained(tmp_path)
    if name in TIED:  # HF writes the tied decoder without its aliases: fastbert must not miss them
        assert "cls.predictions.decoder.weight" not in load_file(tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = getattr(fastbert, name).from_pretrained(tmp_path)
    assert fastbert_warnings(caplog) == []
    assert ours.config.num_labels == theirs.config.num_labels
    assert_same_outputs(ours, theirs)
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    if name in TIED:
        assert_tied(ours)


@pytest.mark.parametrize("name", HEADS)
def test_saved_head_loads_in_transformers(tmp_path, name):
    ours = perturbed(getattr(fastbert, name)(fastbert.BertConfig(**SMALL, **labels_for(name))))
    ours.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    if name in TIED:
        assert "cls.predictions.decoder.weight" not in saved and "cls.predictions.decoder.bias" not in saved
        assert "cls.predictions.bias" in saved and "bert.embeddings.word_embeddings.weight" in saved
    theirs, info = getattr(transformers, name).from_pretrained(tmp_path, output_loading_info=True)
    theirs.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_same_outputs(ours, theirs)
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k


@pytest.mark.parametrize("name", HEADS)
def test_plain_bert_checkpoint_gives_fresh_head_with_a_warning(tmp_path, caplog, name):
    hf = perturbed(transformers.BertModel(transformers.BertConfig(**SMALL, **labels_for(name))))
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = getattr(fastbert, name).from_pretrained(tmp_path)
    fresh = [m for m in fastbert_warnings(caplog) if "freshly initialized" in m and "task head" in m]
    assert len(fresh) == 1 and "\n" not in fresh[0], fastbert_warnings(caplog)
    assert set(fresh[0].rsplit(": ", 1)[1].split(", ")) == set(FRESH_HEAD[name])
    assert not any("pooler is freshly initialized" in m for m in fastbert_warnings(caplog))  # the checkpoint has one
    ids, mask, types = padded_batch(SMALL["vocab_size"], [5, 3])
    a = ours.bert(ids, attention_mask=mask, token_type_ids=types)
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert_matches(a.last_hidden_state[mask.bool()], b.last_hidden_state[mask.bool()], name="last_hidden_state")
    if a.pooler_output is not None:
        assert_matches(a.pooler_output, b.pooler_output, name="pooler_output")
    if name in TIED:
        assert_tied(ours)
        assert torch.equal(ours.cls.predictions.decoder.weight, hf.embeddings.word_embeddings.weight)


def test_missing_encoder_tensor_in_head_checkpoint_is_named(tmp_path):
    transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["bert.encoder.layer.1.output.dense.bias"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors: bert.encoder.layer.1.output.dense.bias$"):
        fastbert.BertForMaskedLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", sorted(TIED))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-saved", "bfloat16"])
def test_tied_weights_stay_tied(tmp_path, name, dtype):
    perturbed(getattr(transformers, name)(transformers.BertConfig(**SMALL))).save_pretrained(tmp_path)
    ours = getattr(fastbert, name).from_pretrained(tmp_path, dtype=dtype)
    assert_tied(ours)
    assert set(ours.tied_weights()) == {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    # One Parameter, so a training step moves both names.
    ours.train()
    ids = torch.randint(1, SMALL["vocab_size"], (2, 5))
    nsp = dict(next_sentence_label=torch.tensor([0, 1])) if name == "BertForPreTraining" else {}
    ours(ids, labels=ids, **nsp).loss.float().backward()
    with torch.no_grad():
        for p in ours.parameters():
            p.sub_(p.grad)
    assert_tied(ours)


def test_an_alias_stored_with_a_value_of_its_own_is_not_tied(tmp_path, caplog):
    perturbed(transformers.BertForMaskedLM(transformers.BertConfig(**SMALL))).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    source = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.decoder.weight"] = torch.randn_like(source)  # sorts after the source: read last
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = fastbert.BertForMaskedLM.from_pretrained(tmp_path)
    assert any("with different values: they are not tied" in r.getMessage() for r in caplog.records)
    theirs = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()  # keeps both, untied
    assert torch.equal(ours.bert.embeddings.word_embeddings.weight, source)
    assert torch.equal(ours.cls.predictions.decoder.weight, state["cls.predictions.decoder.weight"])
    assert set(ours.tied_weights()) == {"cls.predictions.decoder.bias"}
    assert_same_outputs(ours, theirs)


def test_untied_when_config_says_so(tmp_path):
    cfg = fastbert.BertConfig(**SMALL, extra={"tie_word_embeddings": False})
    ours = perturbed(fastbert.BertForMaskedLM(cfg))
    assert ours.tied_weights() == {}
    assert ours.cls.predictions.decoder.weight is not ours.bert.embeddings.word_embeddings.weight
    ours.save_pretrained(tmp_path)
    assert "cls.predictions.decoder.weight" in load_file(tmp_path / "model.safetensors")
    theirs, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_outputs(ours, theirs.eval())
    again = fastbert.BertForMaskedLM.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


@pytest.mark.parametrize("name", HEADS)
def test_head_weight_init_like_transformers(name):
    """Normal(0, initializer_range) weights, zero biases, unit LayerNorms; the shared embedding keeps
    its zero pad row (initializing the tied decoder must not redraw it)."""
    cfg = fastbert.BertConfig.tiny(vocab_size=300, initializer_range=0.02, **labels_for(name))
    model = getattr(fastbert, name)(cfg)
    head = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("bert.")}
    assert head
    for n, p in head.items():
        if n.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), n
        elif "LayerNorm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert abs(float(p.std()) / 0.02 - 1) < 0.2 and abs(float(p.mean())) < 0.01, f"{n}: std {float(p.std()):.3g}"
    assert torch.equal(model.bert.embeddings.word_embeddings.weight[0], torch.zeros(cfg.hidden_size))


# ---------------------------------------------------------------------------------- config

def test_num_labels_and_problem_type_round_trip_with_transformers(tmp_path):
    cfg = fastbert.BertConfig.tiny(num_labels=3, problem_type="multi_label_classification")
    theirs = transformers.BertConfig(**cfg.to_dict())
    assert theirs.num_labels == 3 and theirs.problem_type == "multi_label_classification"
    transformers.BertConfig(id2label={0: "neg", 1: "neutral", 2: "pos", 3: "mixed"}).save_pretrained(tmp_path)
    loaded = fastbert.BertConfig.from_pretrained(tmp_path)
    assert loaded.num_labels == 4 and loaded.extra["id2label"]["2"] == "pos"
    # As transformers reads them: ids as ints (config.json's keys are strings), unnamed classes LABEL_i.
    assert loaded.id2label == transformers.BertConfig.from_pretrained(tmp_path).id2label
    assert loaded.id2label[2] == "pos" and loaded.label2id["pos"] == 2
    assert fastbert.BertConfig.from_dict(loaded.to_dict()) == loaded
    assert fastbert.BertConfig.tiny().num_labels == 2  # transformers' default
    assert fastbert.BertConfig.tiny().id2label == transformers.BertConfig().id2label == {0: "LABEL_0", 1: "LABEL_1"}


@pytest.mark.parametrize("fields,message", [
    (dict(num_labels=3, extra={"id2label": {"0": "a"}}), "num_labels \\(3\\) does not match id2label \\(1 labels\\)"),
    (dict(num_labels=0), "num_labels must be a positive integer"),
    (dict(problem_type="ranking"), "problem_type 'ranking' is not one of"),
    (dict(num_labels=1, problem_type="single_label_classification"), "needs num_labels > 1"),
])
def test_label_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        fastbert.BertConfig.tiny(**fields)


def test_classifier_dropout_and_question_answering_labels():
    cfg = fastbert.BertConfig.tiny(vocab_size=50, hidden_dropout_prob=0.2)
    assert fastbert.BertForSequenceClassification(cfg).dropout.p == 0.2
    assert fastbert.BertForTokenClassification(fastbert.BertConfig.tiny(vocab_size=50, classifier_dropout=0.4)).dropout.p == 0.4
    with pytest.raises(ValueError, match="num_labels == 2"):
        fastbert.BertForQuestionAnswering(fastbert.BertConfig.tiny(vocab_size=50, num_labels=3))


@pytest.mark.parametrize("name,tied", [("BertForMaskedLM", True), ("BertForMaskedLM", False),
                                       ("BertForPreTraining", True), ("BertForSequenceClassification", True)])
def test_resize_token_embeddings_as_transformers(tmp_path, name, tied):
    """Tokens added to a tokenizer: resize_token_embeddings grows the word embeddings, a masked-LM decoder and
    its bias as transformers does (added rows the old rows' mean), keeps ties and Parameters, and the
    model gives transformers' numbers on the new ids, saved and loaded both ways."""
    ours, theirs = twins(model_class=name, vocab_size=99, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                         intermediate_size=64, extra={"tie_word_embeddings": tied})
    with torch.no_grad():  # biases apart from zero, so that their added entries' mean shows
        for key, p in ours.named_parameters():
            p.add_(torch.randn_like(p) * 0.01)
            theirs.get_parameter(key).copy_(p)
    embedding = ours.get_input_embeddings().weight
    assert ours.resize_token_embeddings(105, pad_to_multiple_of=8) is ours.get_input_embeddings()
    theirs.resize_token_embeddings(105, pad_to_multiple_of=8)
    assert ours.get_input_embeddings().weight is embedding and ours.config.vocab_size == 112
    decoder = ours.get_output_embeddings()
    if decoder is not None:
        assert (decoder.weight is embedding) == tied and decoder.out_features == 112
    mine, hf = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == hf.keys()
    for key in mine:  # transformers draws added rows within sqrt(1e-9) of the spread around the mean
        if key == "cls.predictions.bias" and not tied:
            continue  # transformers' resize makes it the decoder's (which the logits add)
        assert mine[key].shape == hf[key].shape and torch.allclose(mine[key], hf[key], atol=1e-5), key
    ours.load_state_dict(hf)  # transformers' draws exactly, for the forward's parity
    assert ours.get_input_embeddings().weight is embedding
    ids, mask, _ = padded_batch(112, [7, 4])
    ids[:, 1] = torch.tensor([111, 100])  # added tokens
    with fastbert.dispatch.record() as calls:
        a = ours(ids, attention_mask=mask)
    assert any(backend != "reference" for _, backend in calls)
    b = theirs(input_ids=ids, attention_mask=mask)
    logits = "logits" if name != "BertForPreTraining" else "prediction_logits"
    assert_matches(a[logits][mask.bool()] if a[logits].dim() == 3 else a[logits],
                   b[logits][mask.bool()] if b[logits].dim() == 3 else b[logits], name=logits)
    ours.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForPreTraining.from_pretrained(tmp_path) if name == "BertForPreTraining" else \
        getattr(transformers, name).from_pretrained(tmp_path)
    assert reloaded.config.vocab_size == 112
    assert torch.equal(reloaded.get_input_embeddings().weight, embedding.detach())
    # Shrinking keeps the first rows; bad sizes are named.
    ours.resize_token_embeddings(50)
    assert ours.get_input_embeddings().weight.shape[0] == ours.config.vocab_size == 50
    assert torch.equal(ours.get_input_embeddings().weight, hf[next(k for k in hf if "word_embeddings" in k)][:50])
    with pytest.raises(ValueError, match="new_num_tokens must be a positive int or None, got 0"):
        ours.resize_token_embeddings(0)
