"""The BERT encoder: HF's module tree and parameter names, every hot path through fastbert.ops.

Which kernel runs is not this file's business (see dispatch.py). Shapes: B batch, S sequence,
H hidden, heads x d = H, I intermediate.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute_in_backward
from torch.utils.hooks import RemovableHandle

from fastbert import checkpoint, dispatch, ops, padding  # checkpoint: HF directories (fastbert/checkpoint.py)
from fastbert import quantization
from fastbert.config import BertConfig
from fastbert.ops import _checks
from fastbert.ops.qkv_projection import head_major
from fastbert.quantization import Int8Linear


class ModelOutput:
    """Base of the output dataclasses. Like transformers' outputs, a mapping of the fields that are set:
    attributes, out["loss"], "loss" in out, keys() / values() / items(), iteration over the names, and
    indexing by position (out[0], out[1])."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def values(self) -> list:
        return [getattr(self, name) for name in self.keys()]

    def items(self) -> list[tuple]:
        return list(zip(self.keys(), self.values()))

    def to_tuple(self) -> tuple:
        return tuple(self.values())

    def __getitem__(self, index):
        if isinstance(index, str):
            if index not in self.keys():
                raise KeyError(index)
            return getattr(self, index)
        return self.to_tuple()[index]

    def __contains__(self, name) -> bool:
        return name in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A pytree node, as transformers' outputs are: DistributedDataParallel (its static_graph's first
        # all-reduce hangs on a hook it attaches to the tensors it finds), FSDP and torch.compile look
        # into outputs through pytree; as one opaque leaf, ranks silently trained apart.
        pytree.register_pytree_node(cls, _output_fields, functools.partial(_output_of_fields, cls),
                                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def _output_fields(out: ModelOutput) -> tuple[list, list[str]]:
    names = [f.name for f in fields(out)]
    return [getattr(out, name) for name in names], names


def _output_of_fields(cls, values, names) -> ModelOutput:
    return cls(**dict(zip(names, values)))


@dataclass
class BertModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    # An encoder has none; empty when attentions are asked for, as transformers' (out[4] of its tuple).
    cross_attentions: tuple[torch.Tensor, ...] | None = None


class BertEmbeddings(nn.Module):
    # Called as modules (their hooks fire); token_type_embeddings' weight is read where no ids are given.
    calls = ("word_embeddings", "position_embeddings", "dropout")

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        """`inputs_embeds` [B, S, H] in place of the word embeddings of `input_ids`, as in transformers."""
        # Given embeddings in the tables' dtype (bf16 ones of an fp32 model: transformers' sums promote them).
        words = (self.word_embeddings(input_ids) if inputs_embeds is None
                 else inputs_embeds.to(self.word_embeddings.weight.dtype))  # [B, S, H]
        if position_ids is None:  # made here, not kept in a buffer: optimize() shares HF's leaf modules
            position_ids = torch.arange(words.shape[1], device=words.device)[None]
        if token_type_ids is None:
            types = self.token_type_embeddings.weight[0]  # type 0 everywhere, without a gather
        else:
            types = self.token_type_embeddings(token_type_ids)
        positions = self.position_embeddings(position_ids)  # [1 or B, S, H]
        # LayerNorm(words + (positions + types)) through the fused residual+LayerNorm op.
        x = ops.add_layer_norm(words, (positions + types).expand_as(words), self.LayerNorm.weight,
                               self.LayerNorm.bias, self.LayerNorm.eps)
        return self.dropout(x)


def embeds_fit(inputs_embeds: torch.Tensor, table: torch.Tensor) -> bool:
    """Given word embeddings the model takes: floats its tables' dtype holds (bf16 ones for an fp32 model)."""
    return inputs_embeds.is_floating_point() and torch.promote_types(inputs_embeds.dtype, table.dtype) == table.dtype


def takes_rows(module) -> bool:
    """Whether `module` is an Int8Linear that takes its input as ops.QuantizedRows."""
    return isinstance(module, Int8Linear) and module.takes_quantized_rows


def linear(module, x, activation="none", approximate="none", prepared=None, quantize_output=False):
    """`module` (an nn.Linear, or an Int8Linear after fastbert.quantize) applied to x, the activation fused;
    `quantize_output`: an Int8Linear returns ops.QuantizedRows for the next Int8Linear."""
    if isinstance(module, Int8Linear):
        return module(x, activation, approximate, quantize_output)
    return ops.dense(x, module.weight, module.bias, activation, approximate, prepared)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        # A module, read at each call as transformers' is: a rate set on it later (disable_dropout, set_dropout)
        # holds, and optimize() shares transformers' own.
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.prepared = ops.PreparedWeights()  # the stacked QKV weight and its packed copy, for inference

    def fused_qkv(self):
        """Q, K, V weights stacked [3H, H] and biases [3H]; kept in `prepared` while no gradient is
        needed, so kernels that prepack weights see the same tensor call after call."""
        params = (self.query.weight, self.key.weight, self.value.weight, self.query.bias, self.key.bias, self.value.bias)
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return torch.cat(params[:3]), torch.cat(params[3:])
        return self.prepared.get("qkv", params, lambda *p: (torch.cat(p[:3]), torch.cat(p[3:])))

    def project(self, x):
        """q, k, v head-major from one GEMM: 3 x [B, heads, S, d] (or [T, heads, d] for x [T, H])."""
        if isinstance(self.query, Int8Linear):
            qkv = quantization.fused((self.query, self.key, self.value), x, self.prepared)
            return head_major(qkv, self.num_attention_heads)
        weight, bias = self.fused_qkv()  # [3H, H], [3H]
        return ops.qkv_projection(x, weight, bias, self.num_attention_heads, self.prepared)

    def forward(self, x, attention_mask=None, need_weights=False, packing=None, x_rows=None):
        """`x_rows`: x as ops.QuantizedRows, for the int8 QKV GEMM (the LayerNorm before made them)."""
        p = self.dropout.p if self.training else 0.0  # this module's mode, not the Dropout's, as in transformers
        gemm_input = x if x_rows is None else x_rows
        if packing is not None:  # x [T, H], packed tokens
            q, k, v = self.project(gemm_input)  # 3 x [T, heads, d]
            context = ops.varlen_attention(q, k, v, packing.cu_seqlens, packing.max_seqlen, dropout_p=p)
            return context.reshape(x.shape), None  # [T, H]
        b, s, h = x.shape
        q, k, v = self.project(gemm_input)  # 3 x [B, heads, S, d]
        out = ops.attention(q, k, v, attention_mask, dropout_p=p, need_weights=need_weights)
        context, probs = out if need_weights else (out, None)
        return context.transpose(1, 2).reshape(b, s, h), probs  # [B, S, H], [B, heads, S, S] or None


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)  # its rate read at each call, as in BertSelfAttention
        self.prepared = ops.PreparedWeights()

    def forward(self, hidden, residual, quantize_output=False):
        """LayerNorm(dense(hidden) + residual); with `quantize_output` (out, out as ops.QuantizedRows)."""
        y = linear(self.dense, hidden, prepared=self.prepared)
        # The Dropout's own mode, as calling it reads it in transformers (Monte Carlo dropout: model.eval()
        # with the Dropouts in train(); or the Dropouts in eval() under a training model).
        p = self.dropout.p if self.dropout.training else 0.0
        return ops.add_layer_norm(y, residual, self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps, p,
                                  quantize_output)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x, attention_mask=None, need_weights=False, packing=None, x_rows=None, quantize_output=False):
        context, probs = self.self(x, attention_mask, need_weights, packing, x_rows)
        return self.output(context, x, quantize_output), probs


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = config.gelu_approximate  # GELU's form: "none" (erf) or "tanh"
        self.prepared = ops.PreparedWeights()

    def forward(self, x, quantize_output=False):
        return linear(self.dense, x, "gelu", self.approximate, self.prepared, quantize_output)  # [B, S, I]


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)


class BertLayer(nn.Module):
    gradient_checkpointing = False  # recomputed in backward (BertPreTrainedModel.activation_checkpointing_enable)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def takes_quantized_rows(self) -> bool:
        """Whether its input may come as ops.QuantizedRows too (its QKV GEMM is dynamic int8)."""
        attention = self.attention.self
        return not self.training and all(takes_rows(m) for m in (attention.query, attention.key, attention.value))

    def forward(self, x, attention_mask=None, need_weights=False, packing=None, x_rows=None, quantize_output=False):
        """-> (out, attention probabilities or None, out as ops.QuantizedRows or None). `x_rows`: x quantized,
        from the layer before; `quantize_output`: the next layer takes its input quantized."""
        with dispatch.block(self, ops.encoder_layer.program) as one_call:  # replaying a plan: its kernels at once
            if one_call is not None and not need_weights:
                return one_call(x, attention_mask, packing, x_rows, quantize_output)
            return self.ops_forward(x, attention_mask, need_weights, packing, x_rows, quantize_output)

    def ops_forward(self, x, attention_mask=None, need_weights=False, packing=None, x_rows=None, quantize_output=False):
        """forward, op by op."""
        # Dynamic int8: each GEMM's input arrives quantized from the kernel before it (LayerNorm or GELU),
        # never as a float tensor read again to quantize it.
        ffn_rows = not self.training and takes_rows(self.intermediate.dense)
        out, probs = self.attention(x, attention_mask, need_weights, packing, x_rows, ffn_rows)
        x, x_rows = out if ffn_rows else (out, None)
        hidden = self.intermediate(x if x_rows is None else x_rows, quantize_output=takes_rows(self.output.dense))
        out, out_rows = self.output(hidden, x, quantize_output) if quantize_output else (self.output(hidden, x), None)
        return out, probs, out_rows


def _checkpoint(fn, *args, use_reentrant=False, offload=False, **options):
    """torch.utils.checkpoint's checkpoint; `offload`: the inputs it keeps go to host memory meanwhile."""
    if offload:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return recompute_in_backward(fn, *args, use_reentrant=use_reentrant, **options)
    return recompute_in_backward(fn, *args, use_reentrant=use_reentrant, **options)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # How a layer marked gradient_checkpointing runs (fn, layer, *inputs): torch.utils.checkpoint's
        # checkpoint with its options, as transformers' _gradient_checkpointing_func; None: non-reentrant.
        self.recompute_with = None

    def forward(self, x, attention_mask=None, output_hidden_states=False, output_attentions=False, packing=None):
        """x [B, S, H] with attention_mask, or packed [T, H] with `packing` (then states come back padded)."""
        restore = (lambda t: padding.pad(t, packing)) if packing is not None else (lambda t: t)
        hidden_states, attentions = [restore(x)] if output_hidden_states else None, [] if output_attentions else None
        # A checkpointed layer keeps only its input for backward and runs again there (dropout masks too:
        # checkpoint restores the RNG state). Pointless without a backward.
        recompute = self.training and torch.is_grad_enabled()
        rows = None  # x as ops.QuantizedRows, where the layer that made x quantized it for the next one
        for i, layer in enumerate(self.layer):
            if recompute and layer.gradient_checkpointing:
                if not x.requires_grad:  # frozen embeddings: reentrant checkpoint would pass no gradient on
                    x = x.detach().requires_grad_()
                x, probs, rows = (self.recompute_with or _checkpoint)(layer, x, attention_mask, output_attentions, packing)
            else:
                quantize = i + 1 < len(self.layer) and self.layer[i + 1].takes_quantized_rows()
                x, probs, rows = layer(x, attention_mask, output_attentions, packing, rows, quantize)
            if output_hidden_states:
                hidden_states.append(restore(x))
            if output_attentions:
                attentions.append(probs)
        return restore(x), hidden_states, attentions


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.prepared = ops.PreparedWeights()

    def forward(self, x):
        return torch.tanh(ops.dense(x[:, 0], self.dense.weight, self.dense.bias, prepared=self.prepared))  # [B, H]


class BertPreTrainedModel(nn.Module):
    """Weight init as HF does it, and loading / saving HF directories (fastbert/checkpoint.py)."""

    config_class = BertConfig
    base_model_prefix = "bert"
    # {parameter name: the parameter it shares}, as transformers declares them. checkpoint.py saves only the
    # shared one (safetensors stores one name per storage) and never asks a checkpoint for the alias.
    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: BertConfig):
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a fastbert.BertConfig, got {type(config).__name__}")
        config.validate()
        self.config = config

    def init_weights(self, root: nn.Module | None = None) -> None:
        """HF's initialization for every module under `root` (default: the whole model)."""
        std = self.config.initializer_range
        for module in (self if root is None else root).modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
                if module.padding_idx is not None:
                    with torch.no_grad():
                        module.weight[module.padding_idx].zero_()
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """Make each name in _tied_weights_keys an alias of its source Parameter (config.tie_word_embeddings,
        as in transformers, turns all of them off)."""
        if not self.config.extra.get("tie_word_embeddings", True):
            return
        for target, source in self._tied_weights_keys.items():
            module, _, name = target.rpartition(".")
            setattr(self.get_submodule(module), name, self.get_parameter(source))

    def tied_weights(self) -> dict[str, str]:
        """The entries of _tied_weights_keys that are tied in this model right now."""
        return {t: s for t, s in self._tied_weights_keys.items() if self.get_parameter(t) is self.get_parameter(s)}

    def get_input_embeddings(self) -> nn.Embedding:
        return getattr(self, self.base_model_prefix, self).embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        getattr(self, self.base_model_prefix, self).embeddings.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear | None:
        """The masked-LM decoder where the model has one (its weight the input embeddings', when tied)."""
        predictions = getattr(getattr(self, "cls", None), "predictions", None)
        return None if predictions is None else predictions.decoder

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """As transformers': the word embeddings get new_num_tokens rows (rounded up to a multiple of
        pad_to_multiple_of), the first ones kept; added rows are the old rows' mean (mean_resizing;
        transformers draws them within 1e-9 of the covariance around it) or drawn as at init. A masked-LM
        decoder and its bias follow, and config.vocab_size. The Parameters stay the same objects (ties and
        optimizers keep them). Returns the input embeddings."""
        embeddings = self.get_input_embeddings()
        for name, value in (("new_num_tokens", new_num_tokens), ("pad_to_multiple_of", pad_to_multiple_of)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        rows = embeddings.num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of:
            rows = -(-rows // pad_to_multiple_of) * pad_to_multiple_of
        resized = [embeddings.weight]
        decoder = self.get_output_embeddings()
        if decoder is not None:
            decoder.out_features = rows
            resized += [decoder.weight, self.cls.predictions.bias, decoder.bias]
        tied = decoder is not None and decoder.weight is embeddings.weight
        for param in {id(p): p for p in resized}.values():  # a tied Parameter once
            # transformers pads a tied decoder's bias with zeros (an untied one's with the mean)
            _resize_rows(param, rows, mean_resizing and not (tied and param.dim() == 1), self.config.initializer_range)
        embeddings.num_embeddings = rows
        if embeddings.padding_idx is not None and embeddings.padding_idx >= rows:
            embeddings.padding_idx = None
        self.config.vocab_size = rows
        self.clear_prepared_weights()
        return embeddings

    def clear_prepared_weights(self) -> None:
        """Forget every prepared (stacked, packed) weight and inference plan: after writing parameters
        through `.data`, which the version counter does not see. Moves (.to(), .cuda(), dtype changes) do
        it themselves."""
        for module in self.modules():
            for kept in (getattr(module, "prepared", None), getattr(module, "plans", None)):
                if isinstance(kept, (ops.PreparedWeights, dispatch.Plans)):
                    kept.clear()

    def _apply(self, fn, *args, **kwargs):
        self.clear_prepared_weights()  # a stale entry would keep the old storage alive until its next call
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode: bool = True):
        # Where a training loop's evaluation starts, forget what was prepared: weights written in between
        # by what moves no version counter (dist.broadcast / all_reduce of parameters, model averaging)
        # would otherwise be served from before.
        if mode != self.training:
            self.clear_prepared_weights()
        return super().train(mode)

    supports_gradient_checkpointing = True  # what sentence-transformers asks before enabling it

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Trade compute for memory in training: encoder layers 0, n, 2n, ... (n = every_n_layers) keep only
        their input for backward and run again there, through torch.utils.checkpoint.checkpoint with
        `activation_checkpointing_kwargs` (use_reentrant=False unless given); `offload` keeps those inputs in
        host memory. As transformers' method of the same name (its Trainer calls it)."""
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
        options = dict(activation_checkpointing_kwargs or {})
        for encoder in (m for m in self.modules() if isinstance(m, BertEncoder)):
            encoder.recompute_with = functools.partial(_checkpoint, offload=bool(offload), **options)
            for i, layer in enumerate(encoder.layer):
                layer.gradient_checkpointing = i % every_n_layers == 0

    def activation_checkpointing_disable(self) -> None:
        for layer in self.modules():
            if isinstance(layer, BertLayer):
                layer.gradient_checkpointing = False

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(isinstance(m, BertLayer) and m.gradient_checkpointing for m in self.modules())

    # transformers 4's names
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    gradient_checkpointing_disable = activation_checkpointing_disable
    is_gradient_checkpointing = is_activation_checkpointing

    @classmethod
    def from_pretrained(cls, directory, dtype: torch.dtype | str | None = None, **kwargs):
        return checkpoint.from_pretrained(cls, directory, dtype=dtype, **kwargs)

    def save_pretrained(self, directory) -> None:
        checkpoint.save_pretrained(self, directory)


def _resize_rows(param: nn.Parameter, rows: int, mean_resizing: bool, std: float) -> None:
    """`param` with `rows` rows in place: the first ones kept; added ones the mean of the old (mean_resizing),
    else a bias's zeros and a weight's normal(0, std) draws, as at init."""
    with torch.no_grad():
        old = param.data
        new = old.new_empty((rows, *old.shape[1:]))
        kept = min(rows, old.shape[0])
        new[:kept] = old[:kept]
        if mean_resizing:
            new[kept:] = old.float().mean(0).to(old.dtype)
        elif old.dim() == 1:
            new[kept:] = 0
        else:
            new[kept:].normal_(std=std)
        param.data = new


MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")  # a Module's hook dicts


# The layers whose weights (or rate) the kernels read: their hooks are skipped unless the owner `calls` them.
_READ_NOT_CALLED = (nn.Linear, nn.LayerNorm, nn.Dropout, nn.Embedding)
_ASSIGNED = [0]  # modules assigned to a module anywhere: a module hooked elsewhere takes no new handle


def _count_assignment(*_) -> None:
    _ASSIGNED[0] += 1


def refuse_skipped_hooks(model: nn.Module) -> None:
    """Raise where a Linear, LayerNorm, Dropout or Embedding of `model` has hooks and its owner does not call it
    (`calls`): fastbert's kernels read its weights or rate, so a hook would be skipped (torch.nn.utils.prune's recomputes the
    weight: stale numbers in inference, a crash in training's second step). Every hook registered takes a
    handle number and every module assigned is counted: with neither since a look found nothing, nothing
    is walked."""
    if torch.compiler.is_compiling():
        return
    if not _ASSIGNED[0]:
        _ASSIGNED[0] = 1
        torch.nn.modules.module.register_module_module_registration_hook(_count_assignment)
    seen = (RemovableHandle.next_id, _ASSIGNED[0])
    if model.__dict__.get("_no_hooks_at") == seen:
        return
    for owner_name, owner in model.named_modules():
        for name, module in owner.named_children():
            if (isinstance(module, _READ_NOT_CALLED) and name not in getattr(owner, "calls", ())
                    and any(getattr(module, hooks) for hooks in MODULE_HOOKS)):
                raise RuntimeError(f"{owner_name + '.' if owner_name else ''}{name} has hooks (forward, backward, or "
                                   "torch.nn.utils.prune's / weight_norm's): fastbert's kernels read its weight without "
                                   "calling it and would skip them; remove them (prune.remove(module, 'weight') keeps "
                                   "a pruning), or run transformers' model")
    model.__dict__["_no_hooks_at"] = seen


def selected_states(hidden_states, flag):
    """transformers 5 takes output_hidden_states as an index or a list of them and leaves the other
    states None (an index out of range selects nothing)."""
    if hidden_states is None or isinstance(flag, bool) or not isinstance(flag, (int, list, tuple)):
        return hidden_states
    n = len(hidden_states)
    keep = {i % n for i in ([flag] if isinstance(flag, int) else flag) if -n <= i < n}
    return tuple(h if i in keep else None for i, h in enumerate(hidden_states))


class BertModel(BertPreTrainedModel):
    base_model_prefix = ""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.plans = dispatch.Plans()  # eager inference forwards, replayed without their checks (dispatch.py)
        self.init_weights()

    def check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds=None) -> None:
        """Clear errors before any compute. Value checks (ids in range) run eagerly, not under compile."""
        refuse_skipped_hooks(self)
        if torch.jit.is_tracing():
            raise RuntimeError("torch.jit.trace (and torch.onnx.export with dynamo=False, which traces with it) "
                               "cannot record fastbert's kernels: use torch.compile or torch.export")
        order = " (inputs_embeds is the fifth argument, as in transformers: pass the others by name)"
        if inputs_embeds is not None and not isinstance(inputs_embeds, torch.Tensor):
            raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}{order}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass input_ids or inputs_embeds" + (f", not both{order}" if input_ids is not None
                                                                  else ": neither was given"))
        name, given = ("input_ids", input_ids) if inputs_embeds is None else ("inputs_embeds", inputs_embeds)
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(given).__name__}")
        weights = self.embeddings.word_embeddings.weight
        if inputs_embeds is None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)}")
        if inputs_embeds is None and input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 or int32 token ids, got dtype {input_ids.dtype}")
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[2] != weights.shape[1]
                                          or not embeds_fit(inputs_embeds, weights)):
            raise ValueError(f"inputs_embeds must be [batch, seq, hidden_size={weights.shape[1]}] floats of the "
                             f"model's {weights.dtype} or narrower, got shape {tuple(inputs_embeds.shape)} of "
                             f"{inputs_embeds.dtype}")
        b, s = given.shape[:2]
        if s == 0 or b == 0:
            raise ValueError(f"{name} is empty: shape {tuple(given.shape)}")
        if given.device != weights.device:
            raise ValueError(f"{name} is on {given.device} but the model's parameters are on {weights.device}")
        # The tables' sizes, not the config's: a table swapped in (set_input_embeddings on a transformers
        # model, which leaves config.vocab_size) serves every id it has rows for.
        tables = self.embeddings
        positions = tables.position_embeddings.num_embeddings
        if s > positions and position_ids is None:  # given ids are checked by value below
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings ({positions})"
                             " (pass position_ids for sequences packed in one row)")
        shape_of = name if inputs_embeds is None else "inputs_embeds' first two dimensions"
        for other, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{other} must be a torch.Tensor, got {type(t).__name__}")
            # ids shared by the batch too; sizes compared one by one (symbolic under torch.compile: a set of
            # shapes pinned B and S, one graph per shape)
            rows_ok = t.shape[0] == b or (other != "attention_mask" and t.shape[0] == 1)
            if t.dim() != 2 or not rows_ok or t.shape[1] != s:
                raise ValueError(f"{other} must have the shape of {shape_of} {(b, s)}"
                                 f"{'' if other == 'attention_mask' else f' or {(1, s)}'}, got {tuple(t.shape)}")
            if t.device != given.device:
                raise ValueError(f"{other} is on {t.device} but {name} is on {given.device}")
            if other != "attention_mask" and t.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{other} must be int64 or int32, got dtype {t.dtype}")
            if other == "attention_mask" and t.is_complex():
                raise ValueError(f"attention_mask must be bool, integer or float 0/1, got dtype {t.dtype}")
        if torch.compiler.is_compiling():
            return
        limits = (("input_ids", input_ids, tables.word_embeddings.num_embeddings, "vocab_size"),
                  ("token_type_ids", token_type_ids, tables.token_type_embeddings.num_embeddings, "type_vocab_size"),
                  ("position_ids", position_ids, positions, "max_position_embeddings"))
        for ids, t, limit, field_name in limits:
            if t is not None:
                lo, hi = int(t.min()), int(t.max())
                if lo < 0 or hi >= limit:
                    raise ValueError(f"{ids} must lie in [0, {field_name}={limit}), got values from {lo} to {hi}")
        if attention_mask is not None:
            _checks.padding_mask_values(attention_mask)

    def padding_free(self, x, attention_mask) -> bool:
        """Run the encoder on packed tokens? When there is padding and a varlen kernel can serve."""
        # Each self-attention's own mode (a list, not max(generator, default=): torch.compile traces this); in
        # eval none is looked at (a self-attention put in train() under an eval model finds its kernel itself).
        dropout_p = max([0.0] + [layer.attention.self.dropout.p for layer in self.encoder.layer
                                 if layer.attention.self.training]) if self.training else 0.0
        return dispatch.prefers_varlen(x, self.config.head_dim, dropout_p) and padding.worth_unpadding(attention_mask)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states: bool | int | list[int] | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, allow_unpadding: bool = True):
        """Outputs as transformers' BertModel. With padding and a varlen kernel, the encoder runs on
        packed tokens and last_hidden_state (and hidden_states) hold zeros at pad positions;
        allow_unpadding=False runs pad tokens through the encoder, for callers that read those positions.
        output_hidden_states: True, or (as transformers 5 takes it) an index or a list of them.
        inputs_embeds [B, S, H]: word embeddings given in place of input_ids (as transformers takes them)."""
        self.check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        setting = self.config.output_setting  # None: config.json's, as in transformers
        output_hidden_states = setting("output_hidden_states", output_hidden_states)
        output_attentions, return_dict = setting("output_attentions", output_attentions), setting("return_dict", return_dict)
        selection, output_hidden_states = output_hidden_states, bool(output_hidden_states)  # 0: none, as there
        if attention_mask is not None:
            attention_mask = attention_mask.bool()  # [B, S], True = token
        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # [B, S, H]
        packing = None
        if attention_mask is not None and allow_unpadding and not output_attentions and self.padding_free(x, attention_mask):
            packing = padding.packing(attention_mask)
            x = padding.unpad(x, packing)  # [T, H]: pad tokens never enter the encoder
        # The inputs were checked above; what the ops inside would check follows from these facts.
        # Packed, the varlen kernels' choice also depends on the longest sequence (its size class).
        packed = None if packing is None else dispatch.size_class(packing.max_seqlen)
        key = dispatch.Plans.key(self, tuple(x.shape), x.dtype, x.device, None if attention_mask is None else (
            tuple(attention_mask.shape), packed), output_hidden_states, output_attentions)
        with self.plans.run(self, key):
            x, hidden_states, attentions = self.encoder(x, attention_mask, output_hidden_states, output_attentions,
                                                        packing)
            pooled = self.pooler(x) if self.pooler is not None else None
        out = BertModelOutput(
            last_hidden_state=x,
            pooler_output=pooled,
            hidden_states=selected_states(tuple(hidden_states), selection) if hidden_states is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
            cross_attentions=() if output_attentions else None,
        )
        return out if return_dict else out.to_tuple()
