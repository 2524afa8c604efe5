"""fastbert inside transformers and sentence-transformers models: `optimize()` runs a transformers BERT
encoder on fastbert's kernels in place, sharing its weights; `register_attention()` makes
`attn_implementation="fastbert"` run transformers' own BERT attention on fastbert.ops.attention.
"""
from __future__ import annotations

import torch

from fastbert.config import BertConfig
from fastbert.model import BertModel
from fastbert.quantization import is_quantized
from fastbert.quantization import quantize as fastbert_quantize

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


def optimize(model, quantize: str | None = None):
    """Run a transformers BERT (BertModel, BertFor*, or a SentenceTransformer on BERT) on fastbert's
    kernels, in place: the encoder's forward is replaced, the weights are shared, not copied. Returns
    `model`. Anything unsupported raises a clear error and leaves the model untouched.

    quantize="int8": the encoder's linears run as int8 copies (fastbert.quantize, dynamic per-token
    activations), for inference only; transformers' own float weights stay in place (its forward still
    serves what fastbert's does not), and are not updated into the int8 copies if they change later."""
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    hf_bert = _hf_bert_of(model)
    ours = hf_bert.__dict__.get("_fastbert_encoder")
    if ours is not None:
        if quantize and not is_quantized(ours):
            raise ValueError("this model was optimized without quantize: optimize a fresh copy with quantize='int8'")
        return model  # already optimized
    ours = _encoder_sharing(hf_bert)
    if quantize:
        # New int8 modules in fastbert's encoder; transformers' own stay float, and their parameters as they
        # were (not frozen): run the model under torch.no_grad() or torch.inference_mode().
        fastbert_quantize(ours, freeze=False)
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
