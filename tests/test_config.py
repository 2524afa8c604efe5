import json

import pytest

import fastbert


def test_presets():
    assert fastbert.BertConfig.base().hidden_size == 768
    assert fastbert.BertConfig.large().num_hidden_layers == 24
    assert fastbert.BertConfig.tiny(vocab_size=10).vocab_size == 10
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        fastbert.BertConfig.preset("huge")


@pytest.mark.parametrize("fields,message", [
    (dict(hidden_size=100, num_attention_heads=12), "hidden_size \\(100\\) must be divisible by num_attention_heads \\(12\\)"),
    (dict(hidden_act="swish"), "hidden_act 'swish' is not supported"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (dict(vocab_size=3.5), "vocab_size must be a positive integer"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob must be in \\[0, 1\\)"),
    (dict(layer_norm_eps=0), "layer_norm_eps must be positive"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key' is not supported"),
    (dict(pad_token_id=40000), "pad_token_id \\(40000\\)"),
])
def test_validation_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        fastbert.BertConfig(**fields)


def test_from_pretrained_round_trip_keeps_unknown_fields(tmp_path):
    d = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 99, "architectures": ["BertForMaskedLM"], "id2label": {"0": "a"}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = fastbert.BertConfig.from_pretrained(tmp_path)
    assert cfg.hidden_size == 64 and cfg.head_dim == 16 and cfg.extra["id2label"] == {"0": "a"}
    cfg.save_pretrained(tmp_path / "out")
    again = json.loads((tmp_path / "out" / "config.json").read_text())
    assert again["architectures"] == ["BertForMaskedLM"] and again["hidden_size"] == 64


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        fastbert.BertConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        fastbert.BertConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(ValueError, match="model_type 'roberta' is not BERT"):
        fastbert.BertConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 770}))
    with pytest.raises(ValueError, match="divisible"):
        fastbert.BertConfig.from_pretrained(tmp_path)
