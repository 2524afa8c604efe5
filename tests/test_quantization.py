"""fastbert.quantize: int8 encoder linears, accuracy against the float model on real sentences (the
tolerance table's int8 row), the drop-in paths, saving and loading."""
import copy

import pytest
import torch
import transformers

import fastbert
from fastbert import dispatch
from fastbert.apps.demo import mean_pool, minilm_dir
from fastbert.quantization import Int8Linear
from fastbert.testing import INT8, assert_matches, assert_ran, rel_err
from grids import skip_unless_runnable
from pathlib import Path

SENTENCES = [line for line in (Path(__file__).parent / "data" / "sentences.txt").read_text("utf-8").split("\n") if line]


def small_config(**kw):
    return fastbert.BertConfig(vocab_size=500, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=512, max_position_embeddings=64, **kw)


def spearman(a, b):
    rank = lambda v: v.argsort().argsort().double()  # noqa: E731 (no ties among similarities of distinct texts)
    return float(torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1])


@pytest.fixture(scope="module")
def minilm():
    path = minilm_dir()
    return transformers.AutoTokenizer.from_pretrained(path), fastbert.BertModel.from_pretrained(path)


def test_minilm_int8_embeddings_rank_like_float32(minilm):
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=128, return_tensors="pt")
    assert len(SENTENCES) >= 300 and int((batch["attention_mask"] == 0).sum()) > 0
    quantized = fastbert.quantize(copy.deepcopy(model))
    with torch.inference_mode():
        ref = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
        with dispatch.record() as calls:
            out = mean_pool(quantized(**batch).last_hidden_state, batch["attention_mask"])
    assert_ran(calls, "quantized_dense", "cpu")
    ops_run = [c[0] for c in calls]
    # Four int8 GEMMs a layer (fused QKV, attention output, FFN in, FFN out); the float pooler once.
    assert ops_run.count("quantized_dense") == 4 * model.config.num_hidden_layers and ops_run.count("dense") == 1
    cosine = (out * ref).sum(-1)
    assert torch.isfinite(out).all()
    assert float(cosine.min()) >= INT8.sentence_cosine, f"worst sentence cosine {float(cosine.min()):.4f}"
    upper = torch.triu_indices(len(SENTENCES), len(SENTENCES), 1)
    rho = spearman((ref @ ref.T)[upper[0], upper[1]], (out @ out.T)[upper[0], upper[1]])
    assert rho >= INT8.spearman, f"Spearman of pairwise similarities {rho:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_random_bert_base_last_hidden_state_close_to_float(dtype, padded):
    skip_unless_runnable("quantized_dense", "cpu", dtype)
    model = fastbert.BertModel(fastbert.BertConfig()).eval()  # BERT-base: 12 layers of 768
    ids = torch.randint(5, 30000, (3, 40))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 25:], mask[2, 3:] = 0, 0
    quantized = fastbert.quantize(copy.deepcopy(model)).to(dtype)
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask).last_hidden_state.double()
        with dispatch.record() as calls:
            out = quantized(ids, attention_mask=mask).last_hidden_state
    assert_ran(calls, "quantized_dense", "cpu")
    assert out.dtype == dtype
    real = mask.bool()
    err = rel_err(out[real].double(), ref[real])
    assert err <= INT8.hidden_rel_err, f"rel err {err:.4f}"


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_gemm_inputs_arrive_quantized_and_change_nothing(padded, monkeypatch):
    """Each int8 GEMM but the attention output's takes its input as QuantizedRows from the kernel before
    (LayerNorm or the GELU epilogue); the result is bit-equal to quantizing float inputs in the GEMM."""
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    config = small_config()
    model = fastbert.quantize(fastbert.BertModel(config))
    ids = torch.randint(5, config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 9:] = 0
    inputs = []
    real = fastbert.quantization.ops.quantized_dense
    monkeypatch.setattr(fastbert.quantization.ops, "quantized_dense",
                        lambda x, *a, **k: inputs.append(isinstance(x, fastbert.ops.QuantizedRows)) or real(x, *a, **k))
    with torch.inference_mode():
        fused = model(ids, attention_mask=mask).last_hidden_state
        quantized_inputs = sum(inputs)
        monkeypatch.setattr(fastbert.model, "takes_rows", lambda module: False)
        monkeypatch.setattr(fastbert.model.BertLayer, "takes_quantized_rows", lambda self: False)
        inputs.clear()
        separate = model(ids, attention_mask=mask).last_hidden_state
    # Per layer QKV (not the first layer's: the embeddings' LayerNorm does not quantize), FFN in, FFN out.
    assert quantized_inputs == 3 * config.num_hidden_layers - 1 and sum(inputs) == 0
    assert torch.equal(fused, separate)


def test_quantize_replaces_every_encoder_linear_and_freezes():
    model = fastbert.BertForSequenceClassification(small_config(num_labels=3))
    fastbert.quantize(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 6 and not model.training
    assert isinstance(model.bert.pooler.dense, torch.nn.Linear) and isinstance(model.classifier, torch.nn.Linear)
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.randint(5, 500, (2, 9))).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


def test_cast_keeps_scales_float32():
    model = fastbert.quantize(fastbert.BertModel(small_config()))
    before = model.encoder.layer[0].intermediate.dense.weight_scale.clone()
    model.to(torch.bfloat16)
    layer = model.encoder.layer[0].intermediate.dense
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, before) and layer.bias.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_an_int8_model_in_a_dtype_the_kernels_lack_runs_on_the_reference(dtype):
    """Its GEMMs' inputs arrive as QuantizedRows, which hold no tensor of the dtype they stand for: the
    dispatch must still see it (the cpu kernel took them and raised on its float16 output)."""
    model = fastbert.quantize(fastbert.BertModel(small_config()))
    ids = torch.randint(1, 100, (2, 9))
    with torch.inference_mode():
        want = model(ids).last_hidden_state
        with fastbert.dispatch.record() as calls:
            out = model.to(dtype)(ids).last_hidden_state
    assert out.dtype == dtype and ("quantized_dense", "reference") in calls
    assert rel_err(out.float(), want) <= INT8.hidden_rel_err  # the same int8 model, another float rounding


def test_save_and_load_keep_the_int8_weights(tmp_path):
    model = fastbert.quantize(fastbert.BertModel(small_config()))
    model.save_pretrained(tmp_path)
    loaded = fastbert.BertModel.from_pretrained(tmp_path)
    assert isinstance(loaded.encoder.layer[1].output.dense, Int8Linear)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.randint(5, 500, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, loaded(ids).last_hidden_state)


def test_an_int8_save_is_refused_by_transformers_not_loaded_as_floats(tmp_path):
    """transformers ignores a quantization config it does not know: int8 weights of the usual shape
    would load as float weights holding the int8 values (wrong numbers, no error)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    model = fastbert.quantize(fastbert.BertModel(small_config()))
    model.save_pretrained(tmp_path)
    for cls in (transformers.AutoModel, transformers.BertModel):
        with pytest.raises(Exception, match="mismatch"):
            cls.from_pretrained(tmp_path)
    # A save from before the weights went flat (int8 [out, in]) still loads in fastbert.
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    assert all(v.dim() == 1 for v in state.values() if v.dtype == torch.int8)
    expected = model.state_dict()
    save_file({k: v.view(expected[k].shape) if v.dtype == torch.int8 else v for k, v in state.items()}, path)
    loaded = fastbert.BertModel.from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_quantizing_leaves_a_shared_config_and_a_failed_calibration_as_they_were(tmp_path):
    config = small_config()
    a, b = fastbert.BertModel(config), fastbert.BertModel(config)
    fastbert.quantize(a)
    assert "fastbert_quantization" in a.config.extra and "fastbert_quantization" not in b.config.extra
    b.save_pretrained(tmp_path)
    assert isinstance(fastbert.BertModel.from_pretrained(tmp_path).encoder.layer[0].output.dense, torch.nn.Linear)
    model = fastbert.BertForSequenceClassification(small_config(num_labels=2)).train()
    ids = torch.randint(5, 500, (2, 8))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        fastbert.quantize(model, mode="static", calibration=[ids, torch.full((2, 8), 10 ** 6)])
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    assert "fastbert_quantization" not in model.config.extra and model.bert.config is model.config
    assert model.training and all(p.requires_grad for p in model.parameters())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        fastbert.quantize(fastbert.BertModel(small_config()), mode="fp4")
    with pytest.raises(TypeError, match="needs a fastbert BertModel"):
        fastbert.quantize(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    model = fastbert.quantize(fastbert.BertModel(small_config()))
    model.requires_grad_(True)  # someone tries to train it
    with pytest.raises(ValueError, match="is for inference"):
        model(torch.randint(5, 500, (1, 4)))


def test_optimize_sentence_transformer_int8(minilm):
    st = pytest.importorskip("sentence_transformers")
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    plain = st.SentenceTransformer(minilm_dir(), device="cpu")
    optimized = fastbert.optimize(st.SentenceTransformer(minilm_dir(), device="cpu"), quantize="int8")
    hf = optimized[0].auto_model
    assert all(p.requires_grad for p in hf.parameters())  # the user's model is not frozen by optimize
    sentences = SENTENCES[:64]
    with dispatch.record() as calls:
        ours = optimized.encode(sentences, convert_to_tensor=True, normalize_embeddings=True)
    theirs = plain.encode(sentences, convert_to_tensor=True, normalize_embeddings=True)
    assert_ran(calls, "quantized_dense", "cpu")
    assert float((ours * theirs).sum(-1).min()) >= INT8.sentence_cosine
    with pytest.raises(ValueError, match="quantize must be None or 'int8'"):
        fastbert.optimize(plain, quantize="int4")
    fastbert.optimize(plain)
    with pytest.raises(ValueError, match="optimized without quantize"):
        fastbert.optimize(plain, quantize="int8")


def test_optimize_int8_copies_follow_later_weight_changes():
    """The int8 copies of an optimize(quantize="int8") model are made again from weights loaded, stepped or
    (with fastbert.clear_prepared_weights) written through .data after its first call."""
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    config = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128)
    hf = fastbert.optimize(transformers.BertModel(config).eval(), quantize="int8")
    ids = torch.randint(0, 120, (3, 11))
    with torch.inference_mode():
        hf(ids)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    changes = {"load_state_dict": lambda: hf.load_state_dict(new),
               "load_state_dict(assign=True)": lambda: hf.load_state_dict({k: 1.1 * v for k, v in new.items()},
                                                                          assign=True),
               "written through .data": lambda: ([p.data.mul_(1.5) for p in hf.parameters()],
                                                 fastbert.clear_prepared_weights(hf))}
    for change, apply in changes.items():
        apply()
        fresh = transformers.BertModel(config).eval()
        fresh.load_state_dict(hf.state_dict())
        fastbert.optimize(fresh, quantize="int8")
        with torch.inference_mode(), dispatch.record() as calls:
            ours = hf(ids).last_hidden_state
            theirs = fresh(ids).last_hidden_state
        assert_ran(calls, "quantized_dense", "cpu")
        assert_matches(ours, theirs, name=f"after {change}")


def test_minilm_static_int8_is_calibrated_and_close(minilm):
    skip_unless_runnable("quantized_dense", "cpu", torch.float32)
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES[:96], padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    calibration = [(ids[i::6][:8], mask[i::6][:8]) for i in range(3)]
    quantized = fastbert.quantize(copy.deepcopy(model), "static", calibration=calibration)
    layer = quantized.encoder.layer[2].intermediate.dense
    assert layer.static and float(layer.input_scale) > 0 and layer.observer is None
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask).last_hidden_state
        with dispatch.record() as calls:
            out = quantized(ids, attention_mask=mask).last_hidden_state
    assert_ran(calls, "quantized_dense", "cpu")
    real = mask.bool()
    err = rel_err(out[real].double(), ref[real].double())
    assert err <= INT8.checkpoint_rel_err, f"static int8 rel err {err:.4f}"


def test_static_needs_calibration_and_saves_its_scales(tmp_path):
    with pytest.raises(ValueError, match="needs calibration"):
        fastbert.quantize(fastbert.BertModel(small_config()), "static")
    with pytest.raises(ValueError, match="calibration is for mode='static'"):
        fastbert.quantize(fastbert.BertModel(small_config()), calibration=[torch.ones(1, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match="observer='percentile' is for mode='static'"):  # it was ignored
        fastbert.quantize(fastbert.BertModel(small_config()), observer="percentile")
    model = fastbert.quantize(fastbert.BertModel(small_config()), "static",
                              calibration=[torch.randint(5, 500, (2, 16)) for _ in range(2)], observer="percentile")
    model.save_pretrained(tmp_path)
    loaded = fastbert.BertModel.from_pretrained(tmp_path)
    assert loaded.encoder.layer[0].output.dense.static
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.randint(5, 500, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, loaded(ids).last_hidden_state)


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_compiled_int8_model_runs_its_gemms_eagerly_and_equals_eager(mode):
    """The bug this pins: without fullgraph, Dynamo compiled the frames that quantized_dense called (its raise
    only broke the graph), and inductor failed on oneDNN's qlinear with a bare AssertionError."""
    torch._dynamo.reset()
    calibration = [torch.randint(5, 500, (2, 16)) for _ in range(2)] if mode == "static" else None
    model = fastbert.quantize(fastbert.BertModel(small_config()).eval(), mode, calibration=calibration)
    compiled = torch.compile(model, dynamic=False)
    ids = torch.randint(5, 500, (2, 9))
    with torch.no_grad():
        eager = model(ids).last_hidden_state
        for _ in range(2):
            assert torch.equal(compiled(ids).last_hidden_state, eager)


def test_compile_says_int8_runs_eagerly():
    model = fastbert.quantize(fastbert.BertModel(small_config()))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="int8 models run eagerly"):
        compiled(torch.randint(5, 500, (1, 6)))
