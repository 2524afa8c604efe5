"""BertConfig: HF config.json field names and defaults, presets, validation with clear errors."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# hidden_act -> the GELU approximation fastbert's kernels compute (the tanh forms are one formula).
HIDDEN_ACTS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
               "gelu_python": "none", "gelu_python_tanh": "tanh"}  # the last two: the same formulas in Python

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    classifier_dropout: float | None = None
    # Task heads. As in transformers, id2label (kept in `extra`) decides num_labels when it is given;
    # problem_type None lets BertForSequenceClassification infer it from num_labels and the labels.
    num_labels: int | None = None
    problem_type: str | None = None
    # Fields fastbert does not use but must write back unchanged (architectures, id2label, ...).
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.num_labels is None:
            self.num_labels = len(self.extra["id2label"]) if self.extra.get("id2label") else 2
        self.validate()

    def output_setting(self, name: str, value):
        """A forward's output_hidden_states / output_attentions / return_dict: the call's, else config.json's
        (transformers reads the config where the call says None), else transformers' default."""
        return value if value is not None else self.extra.get(name, name == "return_dict")

    @property
    def id2label(self) -> dict[int, str]:
        """Class names by id, as transformers gives them: int keys (config.json's are strings), LABEL_i unnamed."""
        named = self.extra.get("id2label") or {}
        return {int(k): v for k, v in named.items()} or {i: f"LABEL_{i}" for i in range(self.num_labels)}

    @id2label.setter
    def id2label(self, names: dict[int, str]) -> None:  # as config.json keeps them; num_labels follows
        self.extra["id2label"] = {str(int(i)): name for i, name in names.items()}
        self.extra["label2id"] = {name: int(i) for i, name in names.items()}
        self.num_labels = len(names)

    @property
    def label2id(self) -> dict[str, int]:
        named = self.extra.get("label2id")
        return {k: int(v) for k, v in named.items()} if named else {name: i for i, name in self.id2label.items()}

    @label2id.setter
    def label2id(self, ids: dict[str, int]) -> None:
        self.extra["label2id"] = {name: int(i) for name, i in ids.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        return HIDDEN_ACTS[self.hidden_act]

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"BertConfig.hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {value!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(f"BertConfig.layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels <= 0:
            raise ValueError(f"BertConfig.num_labels must be a positive integer, got {self.num_labels!r}")
        id2label = self.extra.get("id2label")
        if id2label and len(id2label) != self.num_labels:
            raise ValueError(f"BertConfig.num_labels ({self.num_labels}) does not match id2label ({len(id2label)} labels)")
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"BertConfig.problem_type {self.problem_type!r} is not one of {PROBLEM_TYPES}")
        if self.problem_type == "single_label_classification" and self.num_labels == 1:
            raise ValueError("BertConfig.problem_type 'single_label_classification' needs num_labels > 1 "
                             "(use num_labels=2 for binary, or problem_type 'regression')")
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"BertConfig.position_embedding_type {self.position_embedding_type!r} is not supported (only 'absolute')"
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"BertConfig.pad_token_id ({self.pad_token_id}) must be in [0, vocab_size={self.vocab_size})")
        if self.extra.get("is_decoder") or self.extra.get("add_cross_attention"):
            raise ValueError("BertConfig: decoder / cross-attention BERT (is_decoder, add_cross_attention) is not supported")
        model_type = self.extra.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"BertConfig: model_type {model_type!r} is not BERT")

    # ---------------------------------------------------------------- presets and (de)serialization

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "BertConfig":
        return cls.preset("tiny", **overrides)

    @classmethod
    def base(cls, **overrides) -> "BertConfig":
        return cls.preset("base", **overrides)

    @classmethod
    def large(cls, **overrides) -> "BertConfig":
        return cls.preset("large", **overrides)

    @classmethod
    def from_dict(cls, d: dict) -> "BertConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        return {"model_type": "bert", **self.extra, **d}

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "BertConfig":
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {directory}")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
        return cls.from_dict(d)

    def save_pretrained(self, directory: str | os.PathLike, **overrides) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**self.to_dict(), **overrides}, f, indent=2, sort_keys=True)
            f.write("\n")
