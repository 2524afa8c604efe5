"""HF directories in and out: safetensors, weights-only .bin, BertFor* prefixes, clear errors."""
import json
import logging
import os
import pickle
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import fastbert
from fastbert.testing import assert_matches, rel_err
from hf_twins import padded_batch

SMALL = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def hf_saved(tmp_path, cls=transformers.BertModel, safe=True, **extra):
    model = cls(transformers.BertConfig(**SMALL, **extra)).eval()
    model.save_pretrained(tmp_path, safe_serialization=safe)
    return model


def encoder_of(hf_model):
    return hf_model if isinstance(hf_model, transformers.BertModel) else hf_model.bert


def assert_same_states(ours, hf_model):
    ids, mask, types = padded_batch(SMALL["vocab_size"], [6, 2, 4])
    a = ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    b = encoder_of(hf_model)(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert_matches(a[mask.bool()], b[mask.bool()], name="last_hidden_state")


def test_loads_hf_bert_model_safetensors(tmp_path):
    hf = hf_saved(tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors")
    ours = fastbert.BertModel.from_pretrained(tmp_path)
    assert not ours.training
    assert_same_states(ours, hf)
    assert_matches(ours(torch.tensor([[5, 6, 7]]))[1], hf(torch.tensor([[5, 6, 7]]))[1], name="pooler_output")


def test_loads_weights_only_bin(tmp_path):
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert_same_states(fastbert.BertModel.from_pretrained(tmp_path), hf)


def test_loads_sharded_weights_only_bin(tmp_path):
    import json

    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    hf.config.save_pretrained(tmp_path)
    state = hf.state_dict()
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same_states(fastbert.BertModel.from_pretrained(tmp_path), hf)


@pytest.mark.parametrize("index,message", [
    ('{"metadata": {}}', "has no weight_map"), ('["a list"]', "has no weight_map"),
    ('{"weight_map": {"x": 3}}', "has no weight_map"), ('{"weight_map": ', "is not a shard index: not JSON")])
def test_a_shard_index_without_its_map_is_a_clear_error(tmp_path, index, message):
    transformers.BertConfig(**SMALL).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=f"model.safetensors.index.json {message}"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_truncated_bin_is_a_clear_error(tmp_path):
    hf = transformers.BertModel(transformers.BertConfig(**SMALL))
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="pytorch_model.bin is not a readable PyTorch file \\(truncated or corrupted"):
        fastbert.BertModel.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="\\(truncated or corrupted\\?\\): EOFError"):  # not an empty reason
        fastbert.BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("content,message", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4242\n", "a git-lfs pointer: fetch the file itself"),
    (b"<!DOCTYPE html><html>", "it starts with b'<!DOCTYPE html>")])
def test_a_bin_that_is_no_checkpoint_is_named_so(tmp_path, content, message):
    """A git-lfs pointer or a saved web page under the checkpoint's name was "refused: it holds more than
    tensors (fastbert never unpickles code)", as if it were a malicious pickle."""
    transformers.BertConfig(**SMALL).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(ValueError, match=f"pytorch_model.bin is not a PyTorch checkpoint.*{re.escape(message)}"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_bert_for_masked_lm_checkpoint_prefix_and_ignored_heads(tmp_path, caplog):
    hf = hf_saved(tmp_path, transformers.BertForMaskedLM)
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = fastbert.BertModel.from_pretrained(tmp_path)
    assert_same_states(ours, hf)
    messages = [r.getMessage() for r in caplog.records]
    ignored = [m for m in messages if "ignored" in m]
    assert len(ignored) == 1 and "\n" not in ignored[0]
    assert "cls.predictions.transform.dense.weight" in ignored[0]
    assert any("pooler is freshly initialized" in m for m in messages)  # MLM checkpoints have no pooler


def test_a_masked_lm_bias_saved_under_its_decoder_name_loads_without_a_fresh_warning(tmp_path, caplog):
    """Some MLM checkpoints keep only cls.predictions.decoder.bias, the alias of cls.predictions.bias:
    it loads through the alias, and nothing is called freshly initialized."""
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)).eval()
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "cls.predictions.bias"}
    state.pop("cls.predictions.decoder.weight", None)  # tied to the word embeddings
    save_file(state, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = fastbert.BertForMaskedLM.from_pretrained(tmp_path)
    assert not [r.getMessage() for r in caplog.records if "freshly" in r.getMessage()]
    assert torch.equal(ours.cls.predictions.bias, hf.cls.predictions.bias)


def test_sequence_classification_checkpoint_ignores_classifier(tmp_path, caplog):
    hf = hf_saved(tmp_path, transformers.BertForSequenceClassification, num_labels=3)
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        ours = fastbert.BertModel.from_pretrained(tmp_path)
    assert_same_states(ours, hf)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and "classifier.weight" in ignored[0] and "classifier.bias" in ignored[0]
    assert rel_err(ours.pooler.dense.weight, hf.bert.pooler.dense.weight) == 0


def test_old_gamma_beta_names(tmp_path):
    hf = hf_saved(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    assert_same_states(fastbert.BertModel.from_pretrained(tmp_path), hf)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    hf_saved(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["encoder.layer.1.output.dense.bias"]
    state["embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"][:-1]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        fastbert.BertModel.from_pretrained(tmp_path)
    text = str(e.value)
    assert "missing tensors: encoder.layer.1.output.dense.bias" in text
    assert "embeddings.word_embeddings.weight: checkpoint (119, 64), model (120, 64)" in text


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    hf_saved(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_corrupted_safetensors_header_is_a_clear_error(tmp_path):
    hf_saved(tmp_path)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"}not json at all"  # the JSON header right after its 8-byte length
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        fastbert.BertModel.from_pretrained(tmp_path)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_pickled_code_in_bin_is_refused_and_never_runs(tmp_path):
    transformers.BertConfig(**SMALL).save_pretrained(tmp_path)
    _Exploit.marker = str(tmp_path / "pwned")
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"embeddings.word_embeddings.weight": _Exploit()}, f)
    with pytest.raises(ValueError, match="refused"):
        fastbert.BertModel.from_pretrained(tmp_path)
    assert not os.path.exists(_Exploit.marker)


def test_no_weights_and_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        fastbert.BertModel.from_pretrained(tmp_path / "nope")
    transformers.BertConfig(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights in"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_save_pretrained_loads_in_transformers(tmp_path):
    ours = fastbert.BertModel(fastbert.BertConfig(**SMALL)).eval()
    ours.save_pretrained(tmp_path)
    hf = transformers.BertModel.from_pretrained(tmp_path).eval()
    assert_same_states(ours, hf)
    again = fastbert.BertModel.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k])


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_save_pretrained_writes_the_dtype_of_its_weights(tmp_path, key):
    """A config read from a bf16 save says bfloat16; the model loaded float32 and saved must not (transformers
    loads by the config's dtype: float32 weights read as bf16, rel err 5.7e-3 and no warning)."""
    config = {**SMALL, key: "bfloat16"}
    ours = fastbert.BertModel(fastbert.BertConfig.from_dict(config)).eval()
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dtype"] == "float32" and saved.get(key) == "float32"
    hf = transformers.BertModel.from_pretrained(tmp_path, dtype="auto").eval()
    assert hf.embeddings.word_embeddings.weight.dtype == torch.float32
    ours.to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_dtype_argument(tmp_path):
    hf_saved(tmp_path)
    ours = fastbert.BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    out = ours(torch.tensor([[3, 4, 5]]))[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # As transformers takes it: a name, its older keyword, "auto" (the checkpoint's dtype).
    for given in (dict(dtype="bfloat16"), dict(torch_dtype=torch.bfloat16), dict(torch_dtype="bfloat16")):
        assert {p.dtype for p in fastbert.BertModel.from_pretrained(tmp_path, **given).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fastbert.BertModel.from_pretrained(tmp_path, dtype="auto").parameters()} == {torch.float32}
    fastbert.BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in fastbert.BertModel.from_pretrained(tmp_path / "bf16", dtype="auto").parameters()} == {torch.bfloat16}
    # Not given: the checkpoint's, as transformers 5 loads it (float32 before: another model's numbers).
    hf_default = transformers.BertModel.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in fastbert.BertModel.from_pretrained(tmp_path / "bf16").parameters()} \
        == {p.dtype for p in hf_default.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype, its name \\('bfloat16'\\) or 'auto', got 'int8'"):
        fastbert.BertModel.from_pretrained(tmp_path, dtype="int8")
    assert fastbert.BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16, torch_dtype="bfloat16").pooler.dense.weight.dtype \
        == torch.bfloat16  # the same dtype, named two ways
    with pytest.raises(ValueError, match="disagree"):
        fastbert.BertModel.from_pretrained(tmp_path, dtype=torch.float16, torch_dtype=torch.bfloat16)


def test_config_settings_and_a_config_as_arguments(tmp_path):
    """Keyword arguments the model does not take are config settings, as in transformers; config= replaces
    config.json; anything else is named."""
    hf_saved(tmp_path, transformers.BertForSequenceClassification, num_labels=3)
    cls = fastbert.BertForSequenceClassification
    model = cls.from_pretrained(tmp_path, problem_type="multi_label_classification", output_hidden_states=True)
    assert model.config.problem_type == "multi_label_classification" and model.config.num_labels == 3
    assert len(model(torch.tensor([[3, 4, 5]]), return_dict=True).hidden_states) == SMALL["num_hidden_layers"] + 1
    named = cls.from_pretrained(tmp_path, id2label={0: "a", 1: "b", 2: "c"})
    assert named.config.num_labels == 3 and named.config.extra["id2label"] == {0: "a", 1: "b", 2: "c"}
    with pytest.raises(ValueError, match="mis-shaped tensors: .*classifier.weight: checkpoint \\(3, 64\\), model \\(5, 64\\)"):
        cls.from_pretrained(tmp_path, num_labels=5)  # the checkpoint's head has 3 classes
    own = fastbert.BertConfig.from_pretrained(tmp_path)
    own.hidden_dropout_prob = 0.3
    assert cls.from_pretrained(tmp_path, config=own).config.hidden_dropout_prob == 0.3
    theirs = transformers.BertConfig.from_pretrained(tmp_path)
    assert cls.from_pretrained(tmp_path, config=theirs).config.num_labels == 3
    assert not fastbert.BertModel.from_pretrained(tmp_path, add_pooling_layer=False).pooler  # the model's own argument
    with pytest.raises(TypeError, match="attn_implementation is neither an argument of BertForSequenceClassification "
                                        "nor a BertConfig setting \\(fastbert runs its own attention kernels\\)"):
        cls.from_pretrained(tmp_path, attn_implementation="sdpa")
