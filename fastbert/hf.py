"""Hugging Face directories: load (safetensors first; .bin only with weights_only) and save.

Parameter names are HF's, so a checkpoint maps onto a fastbert model by name alone: the only
translations are the base-model prefix (`bert.`), which BertFor* checkpoints carry and BertModel ones
don't, and the old TF-converted LayerNorm names (gamma / beta).
"""
from __future__ import annotations

import json
import logging
import os

import torch

from fastbert.config import BertConfig

logger = logging.getLogger("fastbert")

SAFETENSORS, SAFETENSORS_INDEX, PICKLE = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
# Tensors a checkpoint may carry that no fastbert module owns and nobody needs to hear about.
_SILENT = ("embeddings.position_ids", "embeddings.token_type_ids")


def read_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors. Never unpickles arbitrary objects."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def load_safetensors(path):
        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {e}") from None

    path = os.path.join(directory, SAFETENSORS)
    if os.path.isfile(path):
        return load_safetensors(path)
    path = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_safetensors(os.path.join(directory, shard)))
        return state
    path = os.path.join(directory, PICKLE)
    if os.path.isfile(path):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise ValueError(f"{path} was refused: it holds more than tensors (fastbert never unpickles code): {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path} must hold a dict of tensors")
        return state
    raise FileNotFoundError(f"no weights in {directory}: expected {SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLE}")


def _canonical(key: str) -> str:
    if key.endswith("LayerNorm.gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith("LayerNorm.beta"):
        return key[: -len("beta")] + "bias"
    return key


def map_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str = "bert."):
    """Match checkpoint names to `model`'s: returns (mapped state, ignored checkpoint keys)."""
    expected = model.state_dict()
    mapped, ignored = {}, []
    for key, value in state.items():
        key = _canonical(key)
        for candidate in (key, key[len(prefix):] if key.startswith(prefix) else None, prefix + key):
            if candidate is not None and candidate in expected:
                mapped[candidate] = value
                break
        else:
            if not key.removeprefix(prefix) in _SILENT:
                ignored.append(key)
    return mapped, ignored


def from_pretrained(cls, directory, dtype: torch.dtype | None = None, **kwargs):
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory (fastbert loads local HF directories)")
    config = BertConfig.from_pretrained(directory)
    model = cls(config, **kwargs)
    state = read_state_dict(directory)
    mapped, ignored = map_state_dict(model, state)
    expected = model.state_dict()
    tied = model.tied_weights()  # aliases follow their source; HF checkpoints leave them out
    missing = [k for k in expected if k not in mapped and k not in tied]
    # Checkpoints saved from heads without a pooler (e.g. BertForMaskedLM) are common: HF starts
    # that pooler fresh, and so does fastbert, saying so.
    fresh_pooler = [k for k in missing if k.removeprefix("bert.").startswith("pooler.")]
    # Likewise a task head (anything outside the encoder) missing from the checkpoint, e.g. a
    # classifier on a plain BertModel checkpoint: fresh, and named in a warning.
    prefix = model.base_model_prefix + "." if model.base_model_prefix else ""
    fresh_head = [k for k in missing if prefix and not k.startswith(prefix)]
    missing = [k for k in missing if k not in fresh_pooler and k not in fresh_head]
    misshaped = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)}"
                 for k, v in mapped.items() if v.shape != expected[k].shape]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise ValueError(f"cannot load {directory} into {cls.__name__}: " + " | ".join(problems))
    model.load_state_dict(mapped, strict=False)
    if ignored:
        logger.warning("fastbert: %s ignored %d checkpoint tensors it has no module for: %s",
                       cls.__name__, len(ignored), ", ".join(ignored))
    if fresh_head:
        logger.warning("fastbert: %s: %d tensors of the task head are not in %s and are freshly initialized "
                       "(train the model before using it): %s", cls.__name__, len(fresh_head), directory,
                       ", ".join(fresh_head))
    if fresh_pooler:
        logger.warning("fastbert: %s has no pooler weights; the pooler is freshly initialized "
                       "(pass add_pooling_layer=False to leave it out)", directory)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def save_pretrained(model: torch.nn.Module, directory) -> None:
    """config.json + model.safetensors, in the layout transformers reads."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    model.config.save_pretrained(directory, architectures=[type(model).__name__])
    # safetensors stores one name per storage: tied aliases are left out, as transformers does (it ties
    # them again on load).
    tied = model.tied_weights()
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in tied}
    save_file(state, os.path.join(directory, SAFETENSORS), metadata={"format": "pt"})


# ------------------------------------------------------------------ transformers and sentence-transformers

# HF BertModel.forward arguments fastbert's encoder serves; anything else (inputs_embeds, cross
# attention, caches) goes to transformers' own forward.
_SERVED = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "output_hidden_states",
           "output_attentions", "return_dict"}


def _hf_bert_of(model):
    """The transformers BertModel inside `model` (itself, BertFor*.bert, or a SentenceTransformer's)."""
    import transformers

    if isinstance(model, transformers.BertModel):
        return model
    if isinstance(model, transformers.BertPreTrainedModel) and isinstance(getattr(model, "bert", None), transformers.BertModel):
        return model.bert
    first = model[0] if isinstance(model, torch.nn.Sequential) and len(model) else None  # SentenceTransformer
    auto = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if isinstance(auto, transformers.BertModel):
        return auto
    raise TypeError(
        f"fastbert.optimize supports transformers BertModel / BertFor* and SentenceTransformer models whose "
        f"transformer is BERT; got {type(model).__name__}" + (f" wrapping {type(auto).__name__}" if auto is not None else "")
    )


def _encoder_sharing(hf_bert):
    """A fastbert BertModel whose leaf modules are `hf_bert`'s own: the same parameters, not copies."""
    from fastbert.model import BertModel

    config = BertConfig.from_dict(hf_bert.config.to_dict())  # raises on what fastbert cannot run
    with torch.device("meta"):  # built without allocating: every leaf is replaced below
        ours = BertModel(config, add_pooling_layer=hf_bert.pooler is not None)
    for name, module in list(ours.named_modules()):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Dropout)):
            parent_name, _, leaf = name.rpartition(".")
            parent = ours.get_submodule(parent_name) if parent_name else ours
            setattr(parent, leaf, hf_bert.get_submodule(name))
    # Parameters this model has but transformers' lacks would be meta tensors: refuse rather than run.
    hf_params = {id(p) for p in hf_bert.parameters()}
    strangers = [n for n, p in ours.named_parameters() if id(p) not in hf_params]
    if strangers:
        raise TypeError(f"fastbert.optimize: {', '.join(strangers)} have no counterpart in the transformers model")
    return ours


class OptimizedForward:
    """`forward` of a transformers BertModel after optimize(): an object that holds only the model it
    serves and finds fastbert's encoder on it at call time. No closure: deepcopy and pickling copy
    the model, this object and the encoder together, so a copy runs its own weights."""

    def __init__(self, hf_bert):
        self.hf_bert = hf_bert

    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

        hf_bert = self.hf_bert
        passed = {k for k, v in kwargs.items() if v is not None and v is not False}
        if input_ids is None or passed - _SERVED:
            return type(hf_bert).forward(hf_bert, input_ids=input_ids, attention_mask=attention_mask,
                                         token_type_ids=token_type_ids, position_ids=position_ids, **kwargs)
        ours = hf_bert.__dict__["_fastbert_encoder"]
        ours.train(hf_bert.training)
        out = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                   output_hidden_states=bool(kwargs.get("output_hidden_states")),
                   output_attentions=bool(kwargs.get("output_attentions")))
        result = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=out.last_hidden_state, pooler_output=out.pooler_output,
            hidden_states=out.hidden_states, attentions=out.attentions)
        return result if kwargs.get("return_dict", True) is not False else result.to_tuple()


def optimize(model):
    """Run a transformers BERT (BertModel, BertFor*, or a SentenceTransformer on BERT) on fastbert's
    kernels, in place: the encoder's forward is replaced, the weights are shared, not copied. Returns
    `model`. Anything unsupported raises a clear error and leaves the model untouched."""
    hf_bert = _hf_bert_of(model)
    if getattr(hf_bert, "_fastbert_encoder", None) is not None:
        return model  # already optimized
    ours = _encoder_sharing(hf_bert)
    # Both outside the module tree (plain attributes): state_dict, parameters() and .to() stay HF's, and
    # the encoder's leaf modules are HF's own, so dtype / device moves and loads reach it.
    hf_bert.__dict__["_fastbert_encoder"] = ours
    hf_bert.forward = OptimizedForward(hf_bert)
    return model


def register_attention(name: str = "fastbert") -> str:
    """Make `attn_implementation="fastbert"` run transformers' BERT attention on fastbert.ops.attention.

    transformers passes the padding mask only to implementations that also register a mask builder,
    so both are registered: the sdpa-style boolean mask [B, 1, S, S] comes in, fastbert keeps its key
    column mask [B, S]."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from fastbert import ops

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # query, key, value: [B, heads, S, d]; returns [B, S, heads, d] as transformers expects.
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
                raise ValueError(f"fastbert attention expects transformers' boolean [B, 1, S, S] mask, got "
                                 f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
            attention_mask = attention_mask[:, 0].any(dim=1)  # [B, S]: keys some query may see (padding only)
        out = ops.attention(query, key, value, attention_mask, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
