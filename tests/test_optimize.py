"""fastbert.optimize() on transformers and sentence-transformers models, and attn_implementation="fastbert"."""
import copy
import inspect

import pytest
import torch
import transformers

import fastbert
from fastbert.apps.demo import SENTENCES, minilm_dir
from fastbert.testing import assert_close, assert_matches, assert_same_gradients
from hf_twins import padded_batch

SMALL = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def ran_fastbert(calls) -> bool:
    """fastbert's attention ran on one of its kernels (the reference, a fallback, does not count)."""
    return any(op in ("attention", "varlen_attention") and backend != "reference" for op, backend in calls)


def test_optimize_bert_model_same_numbers_shared_weights():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    params_before = {n: p.data_ptr() for n, p in hf.named_parameters()}
    keys_before = list(hf.state_dict())
    assert fastbert.optimize(hf) is hf
    assert {n: p.data_ptr() for n, p in hf.named_parameters()} == params_before  # shared, not copied
    assert list(hf.state_dict()) == keys_before
    ids, mask, types = padded_batch(120, [9, 4, 1])
    with fastbert.dispatch.record() as calls:
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    b = plain(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert ran_fastbert(calls)
    real = mask.bool()
    assert_matches(a.last_hidden_state[real], b.last_hidden_state[real], name="last_hidden_state")
    assert_matches(a.pooler_output, b.pooler_output, name="pooler_output")
    assert isinstance(a, type(b)) and torch.equal(a[0], a.last_hidden_state)


def test_optimize_sequence_classification_logits_loss_and_gradients():
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=3)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, types = padded_batch(120, [9, 4, 1])
    labels = torch.tensor([0, 2, 1])
    a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    b = plain(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    assert_matches(a.logits, b.logits, name="logits")
    assert_matches(a.loss, b.loss, name="loss")
    a.loss.backward()
    b.loss.backward()
    assert_same_gradients(hf, plain)


def _span(batch):
    return dict(start_positions=torch.tensor([1, 2, 0]), end_positions=torch.tensor([3, 4, 1]))


def _labels_everywhere(batch):  # labels=input_ids: pads scored too, as a careless MLM collator does
    return dict(labels=batch[0])


def _token_labels(batch):
    return dict(labels=torch.randint(0, 2, batch[0].shape))


@pytest.mark.parametrize("head,labels", [
    (transformers.BertForQuestionAnswering, _span), (transformers.BertForMaskedLM, _labels_everywhere),
    (transformers.BertForTokenClassification, _token_labels)], ids=["qa", "mlm", "token"])
def test_losses_that_read_pad_positions_equal_transformers(head, labels):
    """The span loss (a softmax over every position) and labels scored at pads read the encoder's output
    at pad positions: fastbert runs the pads through its encoder for such calls, as transformers does
    (padding-free, they would be zeros). Positional arguments and the signature are transformers'."""
    hf = head(transformers.BertConfig(**SMALL)).train()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    assert inspect.signature(hf.forward) == inspect.signature(plain.forward)  # the Trainer's columns
    batch = padded_batch(120, [12, 7, 3])
    ids, mask, _ = batch
    given = labels(batch)
    with fastbert.dispatch.record() as calls:
        a = hf(ids, mask, **given)
    b = plain(ids, mask, **given)
    assert ran_fastbert(calls)
    assert_matches(a.loss, b.loss, name="loss")
    a.loss.backward()
    b.loss.backward()
    assert_same_gradients(hf, plain)
    hf.bert = copy.deepcopy(hf.bert)  # an optimized encoder put in after optimize(): its pads are read too
    with fastbert.dispatch.record() as calls:
        again = hf(ids, mask, **given)
    assert ran_fastbert(calls)
    assert_matches(again.loss, b.loss, name="loss with the encoder replaced")


@pytest.mark.parametrize("head", [transformers.BertForSequenceClassification, transformers.BertForMaskedLM])
def test_the_trainers_num_items_in_batch_leaves_fastbert_running(head):
    """transformers' Trainer passes num_items_in_batch to every call of a model whose forward takes
    **kwargs (a loss argument: the masked-LM loss divides its sum by it); the encoder passes it on unread,
    so it must not send the call to transformers' forward (the Trainer ran none of fastbert's kernels)."""
    hf = head(transformers.BertConfig(**SMALL, num_labels=3)).train()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, types = padded_batch(120, [9, 4, 1])
    labels = torch.tensor([0, 2, 1]) if head is transformers.BertForSequenceClassification else \
        torch.where(mask.bool() & (torch.rand(ids.shape) < 0.5), ids, -100)
    given = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                 num_items_in_batch=torch.tensor(7))
    with fastbert.dispatch.record() as calls:
        a = hf(**given)
    b = plain(**given)
    assert ran_fastbert(calls)
    assert_matches(a.loss, b.loss, name="loss")
    a.loss.backward()
    b.loss.backward()
    assert_same_gradients(hf, plain)


def test_a_transformers_trainer_trains_on_fastbert_as_on_transformers(tmp_path):
    """transformers' Trainer (a few SGD steps on padded batches, then predict) on an optimized model: its
    kernels run in training and prediction, and loss and logits are the plain model's."""
    accelerate = pytest.importorskip("accelerate")  # noqa: F841 (the Trainer needs it)
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=3))
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, types = padded_batch(120, [12, 9, 4, 1, 7, 12, 3, 5])
    rows = [dict(input_ids=i, attention_mask=m, token_type_ids=t, labels=int(l))
            for i, m, t, l in zip(ids, mask, types, torch.randint(0, 3, (8,)))]
    results = []
    for model in (hf, plain):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(len(results))), max_steps=3,
                                              per_device_train_batch_size=4, optim="sgd", learning_rate=0.1,
                                              report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                              disable_tqdm=True, logging_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
        with fastbert.dispatch.record() as calls:
            loss = trainer.train().training_loss
            logits = trainer.predict(rows).predictions
        results.append((torch.tensor(loss), torch.as_tensor(logits), ran_fastbert(calls)))
    (loss, logits, ran), (plain_loss, plain_logits, plain_ran) = results
    assert ran and not plain_ran
    assert_matches(loss, plain_loss, name="training loss")
    assert_matches(logits, plain_logits, name="logits after training")


def test_optimize_follows_device_dtype_and_train_mode():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf).to(torch.bfloat16)
    truth = copy.deepcopy(plain).double()  # the bf16 weights, exactly, run in float64
    fastbert.optimize(hf).to(torch.bfloat16)  # shared parameters move with the transformers model
    ids = torch.randint(1, 120, (2, 6))
    a, b = hf(input_ids=ids).last_hidden_state, plain(input_ids=ids).last_hidden_state
    assert a.dtype == torch.bfloat16
    # Against float64 (two bf16 models against each other would carry both one's errors), and within 2x
    # of plain transformers in bf16.
    assert_close(a, truth(input_ids=ids).last_hidden_state, torch.bfloat16, "matmul", naive=b, name="last_hidden_state")
    hf.train()
    hf(input_ids=ids)
    assert hf._fastbert_encoder.training  # the encoder follows train() / eval() of the model it serves
    hf.eval()
    hf(input_ids=ids)
    assert not hf._fastbert_encoder.training


def test_bfloat16_model_with_float32_layer_norms():
    """"LayerNorms kept in float32" in a bfloat16 model, which transformers runs (torch's layer_norm takes
    float32 parameters for bf16 rows): fastbert runs it too, op by op and when its plans replay, and trains
    the float32 parameters."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval().to(torch.bfloat16)
    for module in hf.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.float()
    plain, truth = copy.deepcopy(hf), copy.deepcopy(hf).double()
    fastbert.optimize(hf)
    ids, mask, _ = padded_batch(120, [9, 4, 1])
    real = mask.bool()
    want, naive = (m(input_ids=ids, attention_mask=mask).last_hidden_state[real] for m in (truth, plain))
    with torch.no_grad(), fastbert.dispatch.record() as calls:
        outs = [hf(input_ids=ids, attention_mask=mask).last_hidden_state[real] for _ in range(4)]  # plans replay
    assert ran_fastbert(calls)
    for out in outs:
        assert_close(out, want, torch.bfloat16, "matmul", naive=naive, name="last_hidden_state")
    hf(input_ids=ids, attention_mask=mask).last_hidden_state.float().pow(2).sum().backward()
    norm = hf.encoder.layer[0].output.LayerNorm
    assert norm.weight.grad.dtype == torch.float32 and norm.weight.grad.abs().sum() > 0


def test_unsupported_models_raise_and_stay_untouched():
    relative = transformers.BertModel(transformers.BertConfig(**SMALL, position_embedding_type="relative_key"))
    forward = relative.forward
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        fastbert.optimize(relative)
    assert relative.forward == forward and not hasattr(relative, "_fastbert_encoder")
    gpt = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match="fastbert.optimize supports transformers BertModel"):
        fastbert.optimize(gpt)


def test_inputs_embeds_run_on_fastbert_and_other_arguments_on_transformers():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, _ = padded_batch(120, [5, 3])
    embeds, w = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    outs, grads = [], []
    for model in (hf, plain):
        given = embeds.clone().requires_grad_()
        with fastbert.dispatch.record() as calls:
            out = model(inputs_embeds=given, attention_mask=mask).last_hidden_state[mask.bool()]
            (out * w[mask.bool()]).sum().backward()  # (a plain sum of LayerNorm's rows has no gradient)
        assert ran_fastbert(calls) == (model is hf) or fastbert.dispatch.machine_reasons("cpu")
        outs.append(out)
        grads.append(given.grad[mask.bool()])
    assert_matches(outs[0], outs[1], name="last_hidden_state")
    assert_matches(grads[0], grads[1], name="grad of inputs_embeds")
    narrow = embeds.bfloat16()  # transformers' sums promote them to the tables' float32
    assert_matches(hf(inputs_embeds=narrow, attention_mask=mask).last_hidden_state[mask.bool()],
                   plain(inputs_embeds=narrow, attention_mask=mask).last_hidden_state[mask.bool()], name="bf16 embeds")
    with fastbert.dispatch.record() as calls:
        a = hf(ids, attention_mask=mask, use_cache=True).last_hidden_state  # (an encoder's cache: transformers')
    assert not ran_fastbert(calls)
    assert_matches(a, plain(ids, attention_mask=mask, use_cache=True).last_hidden_state, name="last_hidden_state")
    # An input embedding without a table (a factorized one): transformers runs the embeddings given.
    for model in (hf, plain):
        model.set_input_embeddings(torch.nn.Sequential(torch.nn.Embedding(120, 16), torch.nn.Linear(16, 64)))
    assert_matches(hf(inputs_embeds=embeds).last_hidden_state, plain(inputs_embeds=embeds).last_hidden_state,
                   name="last_hidden_state")


@pytest.mark.parametrize("kind", ["mask of 2 and 0.5", "mask of -1", "1-D ids"])
def test_inputs_read_as_transformers_reads_them(kind):
    """transformers takes a 2-D mask as `mask != 0` and broadcasts ids given for one sequence: the same
    numbers from fastbert's kernels, not an error."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, types = padded_batch(120, [9, 4, 6])
    inputs = dict(input_ids=ids, attention_mask=mask)
    if kind == "mask of 2 and 0.5":
        inputs["attention_mask"] = mask * torch.tensor([2.0, 0.5, 1.0])[:, None]
    elif kind == "mask of -1":
        inputs["attention_mask"] = -mask
    else:
        inputs.update(token_type_ids=types[0], position_ids=torch.randperm(ids.shape[1]))
    with fastbert.dispatch.record() as calls:
        a = hf(**inputs)
    b = plain(**inputs)
    assert ran_fastbert(calls)
    real = mask.bool()
    assert_matches(a.last_hidden_state[real], b.last_hidden_state[real], name="last_hidden_state")
    assert_matches(a.pooler_output, b.pooler_output, name="pooler_output")


def test_output_settings_of_the_config_are_transformers_defaults_after_optimize():
    """A config saying return_dict=False (and asking for every hidden state) gives transformers' tuple, on
    fastbert's kernels (fastbert's encoder read the same settings and gave a tuple where an object was read)."""
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=3)).eval()
    hf.config.return_dict, hf.config.output_hidden_states = False, True
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, types = padded_batch(120, [9, 4, 1])
    with fastbert.dispatch.record() as calls:
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    b = plain(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert ran_fastbert(calls) and isinstance(a, tuple) and len(a) == len(b) == 2
    assert_matches(a[0], b[0], name="logits")
    assert len(a[1]) == len(b[1]) == SMALL["num_hidden_layers"] + 1


def test_attn_implementation_fastbert_matches_sdpa():
    name = fastbert.register_attention()
    cfg = transformers.BertConfig(**SMALL)
    sdpa = transformers.BertModel._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = transformers.BertModel._from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
    ours.load_state_dict(sdpa.state_dict())
    ids, mask, types = padded_batch(120, [9, 4, 1])
    with fastbert.dispatch.record() as calls:
        a = ours(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    b = sdpa(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert [op for op, _ in calls] == ["attention"] * SMALL["num_hidden_layers"]
    real = mask.bool()
    assert_matches(a[real], b[real], name="last_hidden_state")
    # Asked for, in the call or in the config, the attention probabilities come back as eager's (they were an
    # empty tuple).
    eager = transformers.BertModel._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    for asked in ("call", "config"):
        if asked == "config":  # (transformers takes it only from the config's constructor for these)
            config = transformers.BertConfig(**SMALL, output_attentions=True)
            ours = transformers.BertModel._from_config(copy.deepcopy(config), attn_implementation=name).eval()
            eager = transformers.BertModel._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
            eager.load_state_dict(ours.state_dict())
        options = dict(output_attentions=True) if asked == "call" else {}
        a = ours(input_ids=ids, attention_mask=mask, **options).attentions
        b = eager(input_ids=ids, attention_mask=mask, **options).attentions
        assert len(a) == len(b) == SMALL["num_hidden_layers"], asked
        for x, y in zip(a, b):
            keys = real[:, None, None, :].expand_as(y)  # (eager gives pad keys ~1e-38, fastbert 0: both nothing)
            assert_matches(x[keys], y[keys], name="attentions")


@pytest.fixture(scope="module")
def sentence_models():
    st = pytest.importorskip("sentence_transformers")
    plain = st.SentenceTransformer(minilm_dir(), device="cpu")
    optimized = fastbert.optimize(st.SentenceTransformer(minilm_dir(), device="cpu"))
    return plain, optimized


def test_attn_implementation_fastbert_refuses_what_is_not_a_padding_mask():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fastbert.register_attention()
    config = transformers.BertConfig(**SMALL, is_decoder=True)
    decoder = transformers.BertModel._from_config(copy.deepcopy(config), attn_implementation="fastbert").eval()
    with pytest.raises(ValueError, match="this layer is causal"):
        decoder(input_ids=torch.randint(1, 120, (2, 6)))
    encoder = transformers.BertModel._from_config(transformers.BertConfig(**SMALL), attn_implementation="fastbert")
    attention = encoder.encoder.layer[0].attention.self
    q = torch.randn(1, 2, 4, 32)
    causal = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="padding masks only"):
        ALL_ATTENTION_FUNCTIONS["fastbert"](attention, q, q, q, causal)


def test_sentence_transformers_encode_unchanged(sentence_models):
    plain, optimized = sentence_models
    with fastbert.dispatch.record() as calls:
        ours = optimized.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
    theirs = plain.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
    assert ran_fastbert(calls)
    assert_matches(ours, theirs, name="sentence embeddings")
    sim = ours @ ours.T  # related pairs score above unrelated ones
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[2, 3] > sim[2, 4] + 0.2


def test_cross_encoder_predicts_as_before(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**SMALL, "vocab_size": 30522}, num_labels=1)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(tmp_path)
    plain, optimized = (st.CrossEncoder(str(tmp_path), device="cpu") for _ in range(2))
    assert fastbert.optimize(optimized) is optimized
    pairs = [("how old are you", "I am 5 years old"), ("what", ""), ("a longer query", "Lisbon is sunny in winter " * 3)]
    with fastbert.dispatch.record() as calls:
        got = optimized.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert ran_fastbert(calls)
    assert_matches(got, plain.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True), name="logits")


def test_config_defaults_for_outputs_hold_as_in_transformers():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL, output_hidden_states=True)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids = torch.randint(1, 120, (2, 7))
    with fastbert.dispatch.record() as calls:
        a = hf(ids)
    assert ran_fastbert(calls)
    b = plain(ids)
    assert a.hidden_states is not None and len(a.hidden_states) == len(b.hidden_states) == 3
    for i, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states)):
        assert_matches(x, y, name=f"hidden_states[{i}]")
    hf.config.return_dict = plain.config.return_dict = False
    assert isinstance(hf(ids), tuple) and isinstance(plain(ids), tuple)


def test_outputs_have_transformers_fields_and_selected_hidden_states():
    """The same fields (a tuple of the same length) and, for output_hidden_states given as indices, the
    same states left None."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids = torch.randint(1, 120, (2, 7))
    for kwargs in (dict(output_attentions=True), dict(output_attentions=True, return_dict=False),
                   dict(output_hidden_states=-2), dict(output_hidden_states=[0, -1, 7]), dict(output_hidden_states=1),
                   dict(output_hidden_states=0)):
        with fastbert.dispatch.record() as calls:
            a = hf(ids, **kwargs)
        b = plain(ids, **kwargs)
        assert any(backend != "reference" for _, backend in calls), kwargs  # fastbert's encoder ran
        a, b = (a, b) if isinstance(b, tuple) else (a.to_tuple(), b.to_tuple())
        assert len(a) == len(b), kwargs
        for x, y in zip(a, b):
            if isinstance(y, tuple) and any(t is not None for t in y) and "output_hidden_states" in kwargs:
                assert [t is None for t in x] == [t is None for t in y], kwargs
                for i, (p, q) in enumerate(zip(x, y)):
                    if q is not None:
                        assert_matches(p, q, name=f"hidden_states[{i}] of {kwargs}")


def test_dropout_rates_set_on_modules_later_hold():
    """Rates set on the dropout modules (as TRL's disable_dropout does) hold, not the config's."""
    hf = transformers.BertModel(transformers.BertConfig(**{**SMALL, "hidden_dropout_prob": 0.3,
                                                           "attention_probs_dropout_prob": 0.3})).train()
    plain = copy.deepcopy(hf)
    ours = fastbert.BertModel(fastbert.BertConfig(**{**SMALL, "hidden_dropout_prob": 0.3,
                                                     "attention_probs_dropout_prob": 0.3})).train()
    fastbert.optimize(hf)
    for model in (hf, plain, ours):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    ids = torch.randint(1, 120, (2, 7))
    with fastbert.dispatch.record() as calls:
        a = hf(ids).last_hidden_state
    assert ran_fastbert(calls)
    assert_matches(a, plain(ids).last_hidden_state, name="optimized, dropout off")
    assert_matches(ours(ids).last_hidden_state, ours.eval()(ids).last_hidden_state, name="fastbert, dropout off")


class LowRankAdapter(torch.nn.Module):
    """A LoRA-style wrapper: the Linear plus a low-rank term (has .weight, as peft's wrappers do)."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.down, self.up = torch.nn.Linear(base.in_features, 2, bias=False), torch.nn.Linear(2, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_tables_larger_than_the_config_serve_all_their_ids():
    """transformers runs every id a table has rows for, whatever the config says (set_input_embeddings leaves
    config.vocab_size; a token-type or position table grown by hand): the optimized model did not, its range
    checks read the config ("input_ids must lie in [0, vocab_size=...)")."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    embeddings = hf.embeddings
    torch.manual_seed(0)
    hf.set_input_embeddings(torch.nn.Embedding(embeddings.word_embeddings.num_embeddings + 10, 64, padding_idx=0))
    embeddings.token_type_embeddings = torch.nn.Embedding(4, 64)
    embeddings.position_embeddings = torch.nn.Embedding(embeddings.position_embeddings.num_embeddings + 8, 64)
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    vocab, positions = hf.config.vocab_size, hf.config.max_position_embeddings
    ids = torch.tensor([[5, vocab + 9, 7, vocab + 1], [3, 4, vocab, 2]])  # past the config's vocabulary
    given = dict(attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), token_type_ids=torch.full_like(ids, 3),
                 position_ids=torch.arange(positions + 4, positions + 8)[None])
    with fastbert.dispatch.record() as calls:
        a = hf(ids, **given).last_hidden_state
    assert ran_fastbert(calls)
    real = given["attention_mask"].bool()
    assert_matches(a[real], plain(ids, **given).last_hidden_state[real], name="ids past the config's table sizes")


def test_modules_swapped_in_later_are_followed():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    for model in (hf, plain):
        model.resize_token_embeddings(130)
    plain.embeddings.word_embeddings.weight.data.copy_(hf.embeddings.word_embeddings.weight.data)
    ids = torch.tensor([[5, 125, 7, 129], [3, 4, 128, 2]])  # ids past the old vocabulary
    with fastbert.dispatch.record() as calls:
        a = hf(ids).last_hidden_state
    assert ran_fastbert(calls)
    assert_matches(a, plain(ids).last_hidden_state, name="after resize_token_embeddings")
    new = torch.nn.Embedding(130, 64)
    hf.set_input_embeddings(new)
    plain.set_input_embeddings(copy.deepcopy(new))
    assert_matches(hf(ids).last_hidden_state, plain(ids).last_hidden_state, name="after set_input_embeddings")
    # An adapter fastbert's kernels would skip: transformers' forward runs the model, with a warning.
    for model in (hf, plain):
        layer = model.encoder.layer[0].attention.self
        torch.manual_seed(1)
        layer.query = LowRankAdapter(layer.query)
    with pytest.warns(UserWarning, match=r"query is a [\w.]*LowRankAdapter, not a plain torch.nn.Linear"):
        with fastbert.dispatch.record() as calls:
            a = hf(ids).last_hidden_state
    assert not ran_fastbert(calls)
    assert_matches(a, plain(ids).last_hidden_state, name="with an adapter")
    # optimize() on a model that has one already refuses it, and leaves the model as it was.
    adapted = copy.deepcopy(plain)
    forward = adapted.forward
    with pytest.raises(TypeError, match="encoder.layer.0.attention.self.query is a test_optimize.LowRankAdapter"):
        fastbert.optimize(adapted)
    assert adapted.forward == forward


def test_layers_added_or_removed_later_are_run_as_transformers_runs_them():
    """transformers runs the layers its ModuleList holds, whatever config.num_hidden_layers says."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids, mask, _ = padded_batch(120, [9, 4, 1])
    hf(ids, attention_mask=mask)  # the encoder is built on two layers
    extra = copy.deepcopy(hf.encoder.layer[0])
    with torch.no_grad():
        for p in extra.parameters():
            p.add_(0.1 * torch.randn_like(p))
    changes = {"a layer appended": lambda m: m.encoder.layer.append(copy.deepcopy(extra)),
               "a layer inserted first": lambda m: m.encoder.layer.insert(0, copy.deepcopy(extra)),
               "two layers removed": lambda m: setattr(m.encoder, "layer", m.encoder.layer[2:])}
    real = mask.bool()
    for change, apply in changes.items():
        for model in (hf, plain):
            apply(model)
        with fastbert.dispatch.record() as calls:
            a = hf(ids, attention_mask=mask).last_hidden_state
        assert ran_fastbert(calls), change
        assert_matches(a[real], plain(ids, attention_mask=mask).last_hidden_state[real], name=change)


def test_activation_checkpointing_reaches_the_encoder():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).train()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    hf.activation_checkpointing_enable(every_n_layers=2)  # layer 0 of 2; as transformers' Trainer calls it
    runs = [0, 0]
    for i, layer in enumerate(hf._fastbert_encoder.encoder.layer):
        layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    ids = torch.randint(1, 120, (2, 7))
    for model in (hf, plain):
        out = model(ids)
        (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
    assert runs == [2, 1]  # layer 0: the forward and its recomputation in backward; layer 1 once
    assert_same_gradients(hf, plain)
    hf.activation_checkpointing_disable()
    hf(ids).last_hidden_state.sum().backward()
    assert runs == [3, 2]


def test_a_4d_mask_goes_to_transformers():
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    ids = torch.randint(1, 120, (2, 6))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()  # causal: not a padding mask
    with fastbert.dispatch.record() as calls:
        a = hf(ids, attention_mask=mask).last_hidden_state
    assert not ran_fastbert(calls)
    assert_matches(a, plain(ids, attention_mask=mask).last_hidden_state, name="4-D mask")


def _runs_as_transformers(hf, plain, change, fastbert_runs=False):
    """Both models changed by `change(model)`: the optimized one gives transformers' numbers, on fastbert's
    kernels (fastbert_runs) or, where fastbert would skip what the change does, on transformers' forward
    with a warning that names the change."""
    for model in (hf, plain):
        change(model)
    ids, mask, _ = padded_batch(120, [9, 4, 1])
    with fastbert.dispatch.record() as calls, __import__("warnings").catch_warnings(record=True) as warned:
        __import__("warnings").simplefilter("always")
        a = hf(ids, attention_mask=mask).last_hidden_state
    assert ran_fastbert(calls) == fastbert_runs
    assert bool(warned) != fastbert_runs, [str(w.message) for w in warned]
    real = mask.bool()
    assert_matches(a[real], plain(ids, attention_mask=mask).last_hidden_state[real], name="after the change")
    return [str(w.message) for w in warned]


def test_hooks_on_submodules_fire_as_in_transformers():
    """fastbert's encoder calls transformers' weights, not its modules: while a submodule has a hook (or a
    forward of its own, as accelerate's offloading sets), transformers' forward runs the model."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    seen = {id(hf): [], id(plain): []}
    handles = []

    def hook(model):
        def scaled(module, args, output):  # records, and changes the output
            seen[id(model)].append(output.sum().item())
            return output * 1.5
        handles.append(model.encoder.layer[0].output.register_forward_hook(scaled))

    messages = _runs_as_transformers(hf, plain, hook)
    assert "encoder.layer.0.output has hooks" in messages[0]
    assert len(seen[id(hf)]) == 1 and seen[id(hf)] == pytest.approx(seen[id(plain)], rel=1e-5)
    for handle in handles:
        handle.remove()
    _runs_as_transformers(hf, plain, lambda model: None, fastbert_runs=True)  # hooks removed: fastbert again

    def pre_hook(model):
        handles.append(model.embeddings.LayerNorm.register_forward_pre_hook(lambda m, args: (args[0] * 2,)))

    assert "embeddings.LayerNorm has hooks" in _runs_as_transformers(hf, plain, pre_hook)[0]
    for handle in handles:
        handle.remove()

    def own_forward(model):
        dense = model.encoder.layer[1].output.dense
        dense.forward = lambda x: torch.nn.functional.linear(x, dense.weight, dense.bias) * 0.5

    assert "encoder.layer.1.output.dense has a forward of its own" in _runs_as_transformers(hf, plain, own_forward)[0]
    for model in (hf, plain):
        del model.encoder.layer[1].output.dense.forward

    class Halved(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    def own_class(model):  # a class of its own, set on the instance
        model.encoder.layer[1].output.dense.__class__ = Halved

    assert "encoder.layer.1.output.dense is a test_optimize.Halved" in _runs_as_transformers(hf, plain, own_class)[0]
    for model in (hf, plain):
        model.encoder.layer[1].output.dense.__class__ = torch.nn.Linear
    # A copy's modules are its own: a hook on the copy's counts, and only there.
    hf, plain = copy.deepcopy(hf), copy.deepcopy(plain)
    _runs_as_transformers(hf, plain, lambda model: None, fastbert_runs=True)
    assert "encoder.layer.1.attention has hooks" in _runs_as_transformers(
        hf, plain, lambda m: handles.append(m.encoder.layer[1].attention.register_forward_hook(lambda *_: None)))[0]
    for handle in handles:
        handle.remove()
    handles.append(torch.nn.modules.module.register_module_forward_hook(lambda *_: None))
    try:
        assert "registered globally" in _runs_as_transformers(hf, plain, lambda model: None)[0]
    finally:
        handles[-1].remove()


def test_transformers_own_output_capturing_hooks_leave_fastbert_running():
    """transformers 5 leaves (inert) output-capturing hooks on its layers after its forward has recorded
    hidden states or attentions once: before optimize(), or on a call it served after."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    ids = torch.randint(1, 120, (2, 7))
    hf(ids, output_hidden_states=True)
    fastbert.optimize(hf)
    _runs_as_transformers(hf, plain, lambda model: None, fastbert_runs=True)
    hf(inputs_embeds=hf.embeddings.word_embeddings(ids), output_attentions=True)  # transformers' forward serves it
    assert any(layer._forward_hooks for layer in hf.encoder.layer)
    _runs_as_transformers(hf, plain, lambda model: None, fastbert_runs=True)
    with fastbert.dispatch.record() as calls:
        a = hf(ids, output_hidden_states=True, output_attentions=True)
    b = plain(ids, output_hidden_states=True, output_attentions=True)
    assert any(backend != "reference" for _, backend in calls)  # (the probabilities come from the reference attention)
    for k, (x, y) in enumerate(zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions)):
        assert_matches(x, y, name=f"hidden state / attention {k}")


def test_what_transformers_reads_from_its_modules_holds_not_the_config():
    """transformers' layers keep the activation and the head count they were built with (a config edited
    later changes neither), and read config.is_decoder at each forward."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    plain = copy.deepcopy(hf)
    fastbert.optimize(hf)
    _runs_as_transformers(hf, plain, lambda m: setattr(m.config, "num_attention_heads", 4), fastbert_runs=True)
    _runs_as_transformers(hf, plain, lambda m: setattr(m.config, "hidden_act", "gelu_new"), fastbert_runs=True)
    hf.resize_token_embeddings(120)  # rebuilt on a config that says 4 heads and gelu_new: the modules hold 2 and gelu
    _runs_as_transformers(hf, plain, lambda m: None, fastbert_runs=True)

    def gelu_tanh(model):
        for layer in model.encoder.layer:
            layer.intermediate.intermediate_act_fn = transformers.activations.NewGELUActivation()

    _runs_as_transformers(hf, plain, gelu_tanh, fastbert_runs=True)

    def relu(model):
        model.encoder.layer[1].intermediate.intermediate_act_fn = torch.nn.ReLU()

    assert "encoder.layer.1.intermediate.intermediate_act_fn is a ReLU" in _runs_as_transformers(hf, plain, relu)[0]
    for model in (hf, plain):
        gelu_tanh(model)
    assert "is_decoder" in _runs_as_transformers(hf, plain, lambda m: setattr(m.config, "is_decoder", True))[0]
    _runs_as_transformers(hf, plain, lambda m: setattr(m.config, "is_decoder", False), fastbert_runs=True)


class _DoubledOutput(transformers.models.bert.modeling_bert.BertSelfOutput):
    def forward(self, hidden_states, input_tensor):  # a residual changed: what fastbert's encoder would skip
        return super().forward(2 * hidden_states, input_tensor)


def test_modules_that_compute_other_than_transformers_bert_are_run_by_transformers(monkeypatch):
    """Only the leaves were checked: a module above them with a forward of its own (a subclass, a forward
    patched on transformers' class) or an attention scaling set apart ran on fastbert's encoder, without
    what it changes (rel err 7e-4 to 0.5)."""
    def pair():
        hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
        plain = copy.deepcopy(hf)
        fastbert.optimize(hf)
        return hf, plain

    def doubled(model):
        model.encoder.layer[1].attention.output.__class__ = _DoubledOutput

    assert "encoder.layer.1.attention.output (_DoubledOutput) runs a forward of its own" in \
        _runs_as_transformers(*pair(), doubled)[0]
    assert "encoder.layer.0.attention.self.scaling is 1.0" in \
        _runs_as_transformers(*pair(), lambda m: setattr(m.encoder.layer[0].attention.self, "scaling", 1.0))[0]
    # A causal self-attention (transformers' sdpa attends causally there; rel err 6.8e-3 it was).
    assert "encoder.layer.1.attention.self.is_causal is set" in \
        _runs_as_transformers(*pair(), lambda m: setattr(m.encoder.layer[1].attention.self, "is_causal", True))[0]
    built_as_decoder = transformers.BertModel(transformers.BertConfig(**SMALL, is_decoder=True)).eval()
    built_as_decoder.config.is_decoder = False  # its layers keep is_causal
    with pytest.raises(TypeError, match="attention.self.is_causal is set"):
        fastbert.optimize(built_as_decoder)
    hf, plain = pair()
    hf(torch.tensor([[5, 6, 7]]))  # the encoder is built before the class changes
    intermediate = transformers.models.bert.modeling_bert.BertIntermediate
    halved = lambda self, x, forward=intermediate.forward: 0.5 * forward(self, x)  # noqa: E731
    monkeypatch.setattr(intermediate, "forward", halved)
    assert "(BertIntermediate) runs a forward of its own" in _runs_as_transformers(hf, plain, lambda m: None)[0]


class _ScaledBert(transformers.BertModel):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.last_hidden_state = 2 * out.last_hidden_state
        return out


@pytest.mark.parametrize("change,message", [
    (None, "_ScaledBert \\(_ScaledBert\\) runs a forward of its own"),
    (lambda m: setattr(m.encoder.layer[0].attention.self, "key", torch.nn.Linear(64, 64, bias=False)),
     "encoder.layer.0.attention.self.key is a Linear without a bias"),
    (lambda m: setattr(m.encoder.layer[1].output, "LayerNorm", torch.nn.LayerNorm(64, elementwise_affine=False)),
     "encoder.layer.1.output.LayerNorm is a LayerNorm without a weight or a bias"),
], ids=["model-forward", "bias-free-linear", "plain-layer-norm"])
def test_optimize_refuses_what_its_encoder_would_not_compute(change, message):
    """A BertModel subclass's forward was never run (optimize sets the instance's); bias-free linears and
    LayerNorms passed optimize() and then failed every forward with a bare TypeError."""
    model = (transformers.BertModel if change else _ScaledBert)(transformers.BertConfig(**SMALL)).eval()
    if change:
        change(model)
    with pytest.raises(TypeError, match=message):
        fastbert.optimize(model)
    assert "forward" not in model.__dict__
    model(torch.tensor([[5, 6, 7]]))  # transformers runs it as before


@pytest.mark.parametrize("kind", ["fastbert.BertModel", "optimize"])
@pytest.mark.parametrize("dropout", ["hidden", "attention"])
def test_each_dropout_keeps_the_mode_set_on_it(kind, dropout):
    """Hidden dropout follows its Dropout module's own mode, attention dropout its self-attention's, as in
    transformers: Monte Carlo dropout (model.eval(), the Dropouts train()) drew no mask, and a training model
    with its Dropouts in eval() drew them; optimize()'s forward put every shared Dropout back in train()."""
    rates = {"hidden_dropout_prob": 0.3 if dropout == "hidden" else 0.0,
             "attention_probs_dropout_prob": 0.3 if dropout == "attention" else 0.0}
    hf = transformers.BertModel(transformers.BertConfig(**{**SMALL, **rates})).eval()
    model = copy.deepcopy(hf)
    if kind == "optimize":
        fastbert.optimize(model)
    else:
        model = fastbert.BertModel(fastbert.BertConfig.from_dict(hf.config.to_dict())).eval()
        model.load_state_dict(hf.state_dict())
    ids, mask, _ = padded_batch(120, [9, 5])
    real = mask.bool()
    # What decides each dropout in transformers: the Dropout modules, the self-attention modules.
    dropouts = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) if dropout == "hidden"] + \
        [layer.attention.self for layer in model.encoder.layer if dropout == "attention"]
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state[real]
        for d in dropouts:  # Monte Carlo dropout
            d.train()
        with fastbert.dispatch.record() as calls:
            drawn = [model(ids, attention_mask=mask).last_hidden_state[real] for _ in range(2)]
        assert ran_fastbert(calls)
        assert all(d.training for d in dropouts) and not model.training
        assert not torch.allclose(drawn[0], plain, atol=1e-3) and not torch.allclose(drawn[0], drawn[1], atol=1e-3)
        model.train()  # a training model whose dropouts are off (the other kind's rate is 0): the eval() numbers
        for d in dropouts:
            d.eval()
        assert_matches(model(ids, attention_mask=mask).last_hidden_state[real], plain, name="dropouts in eval()")
        assert not any(d.training for d in dropouts) and model.training


def test_an_optimized_model_is_freed_when_dropped():
    """The record of the hooks a model had (kept outside it) held the model: every optimized model that had run
    a forward stayed in memory for good (200 small ones: +741 MB)."""
    import gc
    import weakref

    hf = fastbert.optimize(transformers.BertModel(transformers.BertConfig(**SMALL)).eval())
    with torch.no_grad():
        hf(torch.randint(1, 120, (2, 7)))
    gone = weakref.ref(hf)
    del hf
    gc.collect()
    assert gone() is None


def test_a_moved_model_lets_go_of_what_was_prepared_from_its_old_weights():
    """transformers' .to() / .double() does not reach fastbert's encoder (kept outside the module tree): its
    prepared forms of the float32 weights stayed alive after a move (70 MiB for a 50 MiB model)."""
    import gc
    import weakref

    hf = fastbert.optimize(transformers.BertModel(transformers.BertConfig(**SMALL)).eval())
    ids = torch.randint(1, 120, (2, 7))
    with torch.no_grad():
        hf(ids)
        hf(ids)
    before = weakref.ref(hf.__dict__["_fastbert_encoder"])
    hf.double()
    with torch.no_grad():
        assert hf(ids).last_hidden_state.dtype == torch.float64
    gc.collect()
    assert before() is None


def test_a_parametrized_linear_is_named_as_such():
    """A LoRA made with torch.nn.utils.parametrize was refused as "parametrizations (ModuleDict) runs a forward
    of its own (..._forward_unimplemented)"."""
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    query = hf.encoder.layer[0].attention.self.query
    torch.nn.utils.parametrize.register_parametrization(query, "weight", torch.nn.Identity())
    with pytest.raises(TypeError, match="encoder.layer.0.attention.self.query is parametrized"):
        fastbert.optimize(hf)
    from fastbert.integrations.transformers import OptimizedForward

    assert not isinstance(hf.forward, OptimizedForward)  # left untouched


def test_a_query_without_a_weight_swapped_in_runs_on_transformers():
    """torch's quantize_dynamic after optimize() (or an adapter without .weight) replaces the queries: the
    per-call check read query.weight and raised AttributeError where transformers' forward should run."""
    hf = fastbert.optimize(transformers.BertModel(transformers.BertConfig(**SMALL)).eval())
    ids = torch.randint(1, 120, (2, 7))
    with torch.no_grad():
        hf(ids)
        torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, inplace=True)
        with pytest.warns(UserWarning, match="transformers' own forward runs this model"):
            assert torch.isfinite(hf(ids).last_hidden_state).all()
