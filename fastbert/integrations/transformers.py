"""fastbert inside transformers and sentence-transformers models: `optimize()` runs a transformers BERT
encoder on fastbert's kernels in place, sharing its weights; `register_attention()` makes
`attn_implementation="fastbert"` run transformers' own BERT attention on fastbert.ops.attention.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import operator
import threading
import warnings
import weakref

import torch
from torch.utils.hooks import RemovableHandle

from fastbert.config import HIDDEN_ACTS, BertConfig
from fastbert.heads import scores_pads
from fastbert.model import MODULE_HOOKS, BertModel, BertPreTrainedModel, embeds_fit
from fastbert.quantization import quantize as fastbert_quantize

# HF BertModel.forward arguments fastbert's encoder serves; anything else (cross attention, caches) goes to
# transformers' own forward. num_items_in_batch is the loss's (transformers' Trainer passes it to every call
# of a model whose forward takes **kwargs): the encoder passes it on unread.
_SERVED = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds", "output_hidden_states",
           "output_attentions", "return_dict", "num_items_in_batch"}


@functools.cache
def _cross_with_self() -> bool:
    """transformers 5 returns cross_attentions=() (none to record) whenever attentions are asked for; 4 gave None."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _hf_bert_of(model):
    """The transformers BertModel inside `model` (itself, BertFor*.bert, or a SentenceTransformer's or
    CrossEncoder's: its first module's BertModel or BertFor*)."""
    import transformers

    if isinstance(model, transformers.BertModel):
        return model
    if isinstance(model, transformers.BertPreTrainedModel) and isinstance(getattr(model, "bert", None), transformers.BertModel):
        return model.bert
    first = model[0] if isinstance(model, torch.nn.Sequential) and len(model) else None  # SentenceTransformer
    auto = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if isinstance(auto, transformers.BertModel):
        return auto
    if isinstance(auto, transformers.BertPreTrainedModel) and isinstance(getattr(auto, "bert", None), transformers.BertModel):
        return auto.bert  # a CrossEncoder's BertForSequenceClassification
    raise TypeError(
        f"fastbert.optimize supports transformers BertModel / BertFor* and SentenceTransformer models whose "
        f"transformer is BERT; got {type(model).__name__}" + (f" wrapping {type(auto).__name__}" if auto is not None else "")
    )


_LEAVES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Dropout)


def _plain(module) -> bool:
    """Whether `module` computes what its torch.nn class does: an adapter wrapped around a Linear (LoRA) or
    a subclass with a forward of its own does not, and fastbert's kernels would skip what it adds."""
    kind = next((c for c in _LEAVES if isinstance(module, c)), None)
    return kind is not None and type(module).forward is kind.forward


@functools.cache
def _activation_names() -> dict:
    """transformers' activation module type -> the hidden_act name fastbert computes it as."""
    from transformers.activations import ACT2FN

    names = {}
    for name in HIDDEN_ACTS:  # the first name of a type (gelu_python's module is gelu's class)
        names.setdefault(type(ACT2FN[name]), name)
    return names


def _built_with(hf_bert) -> dict:
    """What transformers' layers were built with and keep, whatever the config says now: as many layers as
    the ModuleList holds, their head count and their activation module (a config edited later changes
    neither). A layer whose activation fastbert does not compute (swapped for a ReLU) raises."""
    layers, activations = hf_bert.encoder.layer, set()
    for index, layer in enumerate(layers):
        activation = type(layer.intermediate.intermediate_act_fn)
        if activation not in _activation_names():
            raise TypeError(f"fastbert.optimize: encoder.layer.{index}.intermediate.intermediate_act_fn is a "
                            f"{activation.__name__}, which fastbert's kernels do not compute (they compute "
                            f"{', '.join(HIDDEN_ACTS)})")
        activations.add(_activation_names()[activation])
    found = {"num_hidden_layers": len(layers)}
    for name, values in (("num_attention_heads", {layer.attention.self.num_attention_heads for layer in layers}),
                         ("hidden_act", activations)):
        if len(values) > 1:
            raise TypeError(f"fastbert.optimize: the layers differ in {name} ({', '.join(map(str, sorted(values)))})")
        found.update({name: values.pop()} if values else {})
    if hf_bert.pooler is not None and type(hf_bert.pooler.activation) is not torch.nn.Tanh:
        raise TypeError(f"fastbert.optimize: pooler.activation is a {type(hf_bert.pooler.activation).__name__}, not Tanh")
    return found


def _runs_bert_code(hf_bert) -> None:
    """Raise where a module above the leaves would compute other than transformers' BERT, which fastbert's
    encoder computes in its place: one whose forward (its class's, or one patched on the class) is not
    transformers' own (a subclass changing attention or a residual: fastbert would skip it), an attention
    scaling set apart from 1/sqrt(head size), a bias-free linear or LayerNorm (the kernels take biases)."""
    from transformers.models.bert import modeling_bert

    for name, module in hf_bert.named_modules():
        where = f"fastbert.optimize: {name or type(hf_bert).__name__}"
        if isinstance(module, torch.nn.Linear) and module.bias is None and name.startswith(("encoder.", "embeddings.")):
            raise TypeError(f"{where} is a Linear without a bias, which fastbert's kernels do not run")
        if isinstance(module, torch.nn.LayerNorm) and (module.weight is None or module.bias is None):
            raise TypeError(f"{where} is a LayerNorm without a weight or a bias, which fastbert's kernels do not run")
        if isinstance(module, (*_LEAVES, torch.nn.ModuleList, torch.nn.Tanh)) or type(module) in _activation_names():
            continue  # checked by _plain and _built_with
        owner = next(c for c in type(module).__mro__ if "forward" in vars(c))
        forward = vars(owner)["forward"]
        if owner.__module__ != modeling_bert.__name__ or getattr(forward, "__qualname__", None) != f"{owner.__name__}.forward":
            raise TypeError(f"{where} ({type(module).__name__}) runs a forward of its own "
                            f"({getattr(forward, '__module__', '?')}.{getattr(forward, '__qualname__', '?')}), "
                            "which fastbert's encoder would not run")
        scaling = module.__dict__.get("scaling")
        if isinstance(module, modeling_bert.BertSelfAttention) and scaling not in (None, module.attention_head_size**-0.5):
            raise TypeError(f"{where}.scaling is {scaling}, not 1/sqrt(head size); fastbert's attention scales by that")
        if isinstance(module, modeling_bert.BertSelfAttention) and module.__dict__.get("is_causal"):
            # Built as a decoder (is_decoder=True) and kept: transformers' sdpa attends causally there.
            raise TypeError(f"{where}.is_causal is set (a decoder's attention); fastbert's attention is "
                            "bidirectional, as an encoder's")


def _encoder_sharing(hf_bert):
    """A fastbert BertModel whose leaf modules are `hf_bert`'s own: the same parameters, not copies."""
    config = BertConfig.from_dict({**hf_bert.config.to_dict(), **_built_with(hf_bert)})
    with torch.device("meta"):  # built without allocating: every leaf is replaced below
        ours = BertModel(config, add_pooling_layer=hf_bert.pooler is not None)
    for name, module in list(ours.named_modules()):
        if isinstance(module, _LEAVES):
            theirs = hf_bert.get_submodule(name)
            if torch.nn.utils.parametrize.is_parametrized(theirs):
                raise TypeError(f"fastbert.optimize: {name} is parametrized (torch.nn.utils.parametrize): merge the "
                                "parametrization into the weight first (parametrize.remove_parametrizations)")
            if not _plain(theirs):
                raise TypeError(f"fastbert.optimize: {name} is a {type(theirs).__module__}.{type(theirs).__name__}, "
                                f"not a plain torch.nn.{type(module).__name__} (merge adapters into the weights: fastbert's kernels read plain weights)")
            parent_name, _, leaf = name.rpartition(".")
            parent = ours.get_submodule(parent_name) if parent_name else ours
            setattr(parent, leaf, theirs)
    _runs_bert_code(hf_bert)  # after the leaves' and activations' checks, which name what they find more closely
    # Parameters this model has but transformers' lacks would be meta tensors: refuse rather than run.
    hf_params = {id(p) for p in hf_bert.parameters()}
    strangers = [n for n, p in ours.named_parameters() if id(p) not in hf_params]
    if strangers:
        raise TypeError(f"fastbert.optimize: {', '.join(strangers)} have no counterpart in the transformers model")
    return ours


def _encoder_for(hf_bert, quantized: bool):
    """_encoder_sharing's encoder, its linears as int8 copies where the model was optimized with quantize:
    new int8 modules in fastbert's encoder; transformers' own stay float, and their parameters as they were
    (not frozen): run the model under torch.no_grad() or torch.inference_mode()."""
    ours = _encoder_sharing(hf_bert)
    if quantized:
        fastbert_quantize(ours, freeze=False)
    ours.mode_sources = _mode_sources(hf_bert, ours)
    return ours


def _mode_sources(hf_bert, ours) -> tuple:
    """(fastbert's module, transformers' module whose train / eval mode it takes: the one of its name, else the
    model) for each module of fastbert's encoder that is not one of transformers' leaves it shares. Each
    mode as the user set it: one set on a submodule (a self-attention in eval under a training model) holds,
    and ours.train() would have reset the shared Dropouts' own (Monte Carlo dropout)."""
    sources = []
    for name, mine in ours.named_modules():
        try:
            theirs = hf_bert.get_submodule(name)
        except AttributeError:
            theirs = hf_bert
        if mine is not theirs:
            sources.append((mine, theirs))
    return tuple(sources)


def _settings(config, attentions, classes) -> tuple:
    """What transformers' forward reads at each call besides the modules: from the config the table sizes
    (resize_token_embeddings changes a table in place, and the config) and is_decoder (a causal mask); the
    self-attentions' scaling and is_causal attributes (transformers 5's); the modules' classes' forwards (one
    patched on its class): these two add ~2 us a forward (BERT-base). Also the weights' dtype and device: after
    a move (.double(), .half(), .to(device)) the encoder is made again, its prepared forms of the old weights
    freed (transformers' .to() does not reach the encoder, kept outside the module tree)."""
    return (config.vocab_size, config.type_vocab_size, config.max_position_embeddings, config.is_decoder,
            tuple((w.dtype, w.device) for a in attentions[:1] if isinstance(w := getattr(a.query, "weight", None), torch.Tensor)),
            tuple((a.__dict__.get("scaling"), a.__dict__.get("is_causal")) for a in attentions),
            tuple(c.forward for c in classes))


def _tree(hf_bert, quantized: bool) -> tuple:
    """What the encoder was built on: each submodule's children (parent, its (name, child) pairs) and
    _settings (with what they read: the self-attentions, the modules' classes); with int8 copies, also the
    linears' parameters with their storage and version (the copies are made from their values); last a
    _Mark, by which _skipped knows the tree without holding it (nor the model in it)."""
    parents = tuple((parent, dict(parent._modules), type(parent)) for parent in hf_bert.modules())
    linears = (m for m in hf_bert.encoder.modules() if isinstance(m, torch.nn.Linear)) if quantized else ()
    weights = tuple((m, name, p, p.data_ptr(), p._version) for m in linears for name, p in m._parameters.items()
                    if p is not None)
    reads = tuple(layer.attention.self for layer in hf_bert.encoder.layer), tuple({kind for *_, kind in parents})
    return parents, _settings(hf_bert.config, *reads), weights, reads, _Mark()


class _Mark:
    __slots__ = ("__weakref__",)


def _unchanged(hf_bert, tree: tuple) -> bool:
    """`hf_bert` is still what `tree` recorded. A module added anywhere is a child more of a recorded
    parent, so comparing the recorded parents' children (and classes: a __class__ set to a subclass with
    a forward of its own) finds it (dicts of modules compare by identity,
    in C: ~35 us a forward for BERT-base's 228 modules)."""
    parents, settings, weights, reads, _ = tree
    return (settings == _settings(hf_bert.config, *reads)
            and all(parent._modules == children and type(parent) is kind for parent, children, kind in parents)
            and all(m._parameters.get(name) is p and p.data_ptr() == ptr and p._version == version
                    for m, name, p, ptr, version in weights))


def _encoder_for_now(hf_bert):
    """fastbert's encoder on `hf_bert`'s modules as they are now, or None where fastbert cannot serve them
    (transformers' forward runs then). A module swapped in, added or removed since (set_input_embeddings,
    resize_token_embeddings, an adapter, a layer), and for int8 copies a weight changed since, rebuilds the
    encoder on what is there now."""
    state = hf_bert.__dict__
    quantized = state["_fastbert_quantized"]
    if _unchanged(hf_bert, state["_fastbert_tree"]):
        return state["_fastbert_encoder"]
    if state["_fastbert_encoder"] is not None:  # in reference cycles: let go of its prepared weights now, not at gc
        state["_fastbert_encoder"].clear_prepared_weights()
    try:
        ours = _encoder_for(hf_bert, quantized)
    except (TypeError, ValueError, AttributeError) as e:
        warnings.warn(f"{e}; transformers' own forward runs this model from now on", stacklevel=3)
        ours = None
    state["_fastbert_encoder"], state["_fastbert_tree"] = ours, _tree(hf_bert, quantized)
    return ours


# model -> [its tree's _Mark (weakly: a value holding the model kept it alive for good), its submodules'
# __dict__s, RemovableHandle.next_id when it last had no hooks]: every hook registered anywhere takes a
# handle, so an unchanged count means none since. Kept outside the model (never pickled or copied with it):
# a copy's modules are its own.
_WATCHED = weakref.WeakKeyDictionary()


def _needless(hook) -> bool:
    """A hook of transformers' own that fastbert's encoder does without: gradient_checkpointing_enable()'s
    on the input embeddings, whose output it makes require grad so that reentrant checkpointing of frozen
    layers passes gradients back (fastbert's checkpointing is not reentrant); the output-capturing hooks
    transformers 5 leaves on its layers after a forward with output_hidden_states / output_attentions, inert
    outside that forward's own recording (fastbert returns those outputs itself)."""
    name = getattr(hook, "__qualname__", "")
    return (name.endswith("enable_input_require_grads.<locals>.make_inputs_require_grads")
            or (getattr(hook, "__module__", "") == "transformers.utils.output_capturing"
                and getattr(hook, "__name__", "") == "output_capturing_hook"))


def _skipped(hf_bert) -> str | None:
    """What fastbert's encoder would skip, calling transformers' weights rather than its modules: a forward
    set on a submodule's instance (accelerate's offloading sets one), hooks on a submodule (the model's
    own run: its __call__ is transformers'), hooks registered for every module; None if nothing. ~5 us a
    forward for BERT-base's 227 submodules (in C: map over their __dict__s)."""
    tree = hf_bert.__dict__["_fastbert_tree"]
    watched = _WATCHED.get(hf_bert)
    if watched is None or watched[0]() is not tree[-1]:
        watched = _WATCHED[hf_bert] = [weakref.ref(tree[-1]), [vars(parent) for parent, *_ in tree[0][1:]], None]
    states, count = watched[1], RemovableHandle.next_id
    if any(map(operator.contains, states, itertools.repeat("forward"))):
        return next(f"{name} has a forward of its own" for name, m in hf_bert.named_modules()
                    if m is not hf_bert and "forward" in m.__dict__)
    if watched[2] == count:
        return None
    if any(map(any, map(operator.itemgetter(*MODULE_HOOKS), states))):
        hooked = next((name for name, m in hf_bert.named_modules() if m is not hf_bert and not all(
            map(_needless, itertools.chain.from_iterable(getattr(m, hooks).values() for hooks in MODULE_HOOKS)))), None)
        if hooked is not None:
            return f"{hooked} has hooks"
    if any(getattr(torch.nn.modules.module, "_global" + hooks) for hooks in MODULE_HOOKS):
        return "module hooks are registered globally (torch.nn.modules.module.register_module_forward_hook, ...)"
    watched[2] = count
    return None


def clear_prepared_weights(model: torch.nn.Module) -> None:
    """Forget what fastbert made from the weights of every fastbert model inside `model` (prepared forms,
    plans, int8 copies): after writing parameters through `.data` or by collectives, which no version counter
    sees. `model`: any module (DistributedDataParallel, a wrapper) holding fastbert models, or transformers /
    sentence-transformers models after optimize() (their encoders are rebuilt on the next call)."""
    for module in model.modules():
        if isinstance(module, BertPreTrainedModel):
            module.clear_prepared_weights()
        elif "_fastbert_tree" in module.__dict__:
            module.__dict__["_fastbert_tree"] = ((), None, (), ((), ()), _Mark())  # no model's settings are None: rebuilt next call


def follow_checkpointing(hf_bert, ours) -> None:
    """transformers' activation_checkpointing_enable() marks its layers (every one, or every n-th) and gives
    them its checkpoint function (kwargs, offload): fastbert's layers take the same marks and function."""
    function, encoder = None, ours.encoder
    for mine, theirs in zip(encoder.layer, hf_bert.encoder.layer):
        marked = bool(getattr(theirs, "gradient_checkpointing", False))
        if mine.gradient_checkpointing != marked:  # a Module's setattr costs ~1 us: once per change
            mine.gradient_checkpointing = marked
        function = function or (marked and getattr(theirs, "_gradient_checkpointing_func", None))
    if encoder.recompute_with is not (function or None):
        encoder.recompute_with = function or None


class OptimizedForward:
    """`forward` of a transformers BertModel after optimize(): an object that holds only the model it
    serves and finds fastbert's encoder on it at call time. No closure: deepcopy and pickling copy
    the model, this object and the encoder together, so a copy runs its own weights."""

    def __init__(self, hf_bert):
        self.hf_bert = hf_bert

    @property
    def __signature__(self):  # transformers' (what callers inspect: the Trainer's columns, accepted kwargs)
        return inspect.signature(type(self.hf_bert).forward.__get__(self.hf_bert))

    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

        hf_bert = self.hf_bert
        passed = {k for k, v in kwargs.items() if v is not None and v is not False}
        # transformers' forward serves what fastbert's does not: other arguments, 3-D / 4-D masks.
        ours, embeds = None, kwargs.get("inputs_embeds")
        if ((input_ids is None) != (embeds is None) and not args and not passed - _SERVED
                and (attention_mask is None or attention_mask.dim() == 2) and (embeds is None or (
                    isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and isinstance(
                        table := getattr(hf_bert.embeddings.word_embeddings, "weight", None), torch.Tensor)
                    and embeds_fit(embeds, table)))):
            ours = _encoder_for_now(hf_bert)
        if ours is not None and (skipped := _skipped(hf_bert)):
            warnings.warn(f"fastbert.optimize: {skipped}, which fastbert's kernels would skip; transformers' own "
                          "forward runs this model while it has", stacklevel=2)
            ours = None
        if ours is None:
            return type(hf_bert).forward(hf_bert, input_ids, attention_mask, token_type_ids, position_ids, *args, **kwargs)
        config = hf_bert.config

        def raw_setting(name, default):  # the call's, else the config's (as transformers' forward decides)
            value = kwargs.get(name)
            return getattr(config, name, default) if value is None else value

        def setting(name, default):
            return bool(raw_setting(name, default))

        if ours.training != hf_bert.training:
            ours.clear_prepared_weights()  # as train() / eval() of a fastbert model does
        for mine, theirs in ours.mode_sources:  # ~8 us a forward for BERT-base: Module.__setattr__ on a change only
            if mine.training != theirs.training:
                mine.training = theirs.training
        padded = id(hf_bert) in getattr(_reading_pads, "models", ())
        follow_checkpointing(hf_bert, ours)
        # As transformers reads them: a 2-D mask as `mask != 0` (so 2 or 0.5 is a token), ids of one
        # sequence shared by the batch (its embedding adds broadcast).
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask != 0
        token_type_ids, position_ids = (t.unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 1 else t
                                        for t in (token_type_ids, position_ids))
        out = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                   inputs_embeds=embeds, output_hidden_states=raw_setting("output_hidden_states", False),
                   output_attentions=setting("output_attentions", False), return_dict=True, allow_unpadding=not padded)
        result = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=out.last_hidden_state, pooler_output=out.pooler_output,
            hidden_states=out.hidden_states,
            attentions=out.attentions, cross_attentions=() if out.attentions is not None and _cross_with_self() else None)
        return result if setting("return_dict", True) else result.to_tuple()


_SIGNATURES: dict = {}  # a plain dict, not functools.cache: torch.compile warned at every compile of a call to one


def _signature(cls) -> inspect.Signature:
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    return _SIGNATURES[cls]


_reading_pads = threading.local()  # .models: ids of the encoders whose head's loss, in this thread's call, reads pads


class HeadForward:
    """`forward` of a transformers BertFor* model after optimize(). fastbert's encoder leaves pad positions
    zero (padding-free); a loss that reads them runs the pads through it, as transformers does: the span
    loss of question answering (a softmax over every position), labels scored at pads (not -100)."""

    def __init__(self, model):
        self.model = model  # its encoder is read at each call: model.bert may be replaced after optimize()

    @property
    def __signature__(self):  # the head's own (transformers' Trainer keeps the dataset columns it names)
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        model = self.model
        given = _signature(type(model)).bind_partial(model, *args, **kwargs).arguments
        reads_pads = given.get("start_positions") is not None or scores_pads(given.get("labels"), given.get("attention_mask"))
        models, encoder = _reading_pads.__dict__.setdefault("models", set()), id(model.bert)
        if not reads_pads or encoder in models:
            return type(model).forward(model, *args, **kwargs)
        models.add(encoder)
        try:
            return type(model).forward(model, *args, **kwargs)
        finally:
            models.discard(encoder)


def optimize(model, quantize: str | None = None):
    """Run a transformers BERT (BertModel, BertFor*, or a SentenceTransformer on BERT) on fastbert's
    kernels, in place: the encoder's forward is replaced, the weights are shared, not copied. Returns
    `model`. Anything unsupported raises a clear error and leaves the model untouched. Modules swapped in
    later (resized embeddings, adapters) are followed: the encoder is rebuilt on them, or, where they are
    not plain torch modules, transformers' own forward runs (with a warning).

    With padding in a batch the encoder runs padding-free, so the pad positions of last_hidden_state and
    hidden_states hold zeros where transformers computes values no mask lets count. The BertFor* heads'
    losses that read pad positions (labels at pads, the span loss) run the pads through the encoder, as
    transformers does; code of your own that reads them (pooling without the mask) gets other numbers.

    quantize="int8": the encoder's linears run as int8 copies (fastbert.quantize, dynamic per-token
    activations), for inference only; transformers' own float weights stay in place (its forward still
    serves what fastbert's does not), and the copies are made again when they change (after a write through
    `.data`, which no version counter sees: call fastbert.clear_prepared_weights(model))."""
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    hf_bert = _hf_bert_of(model)
    if "_fastbert_tree" in hf_bert.__dict__:
        if quantize and not hf_bert.__dict__["_fastbert_quantized"]:
            raise ValueError("this model was optimized without quantize: optimize a fresh copy with quantize='int8'")
    else:
        ours = _encoder_for(hf_bert, bool(quantize))
        # Plain attributes, outside the module tree: state_dict, parameters() and .to() stay HF's, and the
        # encoder's leaf modules are HF's own, so dtype / device moves and loads reach it.
        hf_bert.__dict__.update(_fastbert_encoder=ours, _fastbert_tree=_tree(hf_bert, bool(quantize)),
                                _fastbert_quantized=bool(quantize))
        hf_bert.forward = OptimizedForward(hf_bert)
    if model is not hf_bert and getattr(model, "bert", None) is hf_bert and not isinstance(model.forward, HeadForward):
        model.forward = HeadForward(model)
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
        if kwargs.get("is_causal", getattr(module, "is_causal", False)):
            raise ValueError("fastbert attention is an encoder's (every query sees every kept key); this layer is "
                             "causal (a decoder): use attn_implementation='sdpa' for it")
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
                raise ValueError(f"fastbert attention expects transformers' boolean [B, 1, S, S] mask, got "
                                 f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
            keys = attention_mask[:, 0].any(dim=1)  # [B, S]: keys some query may see
            # A padding mask shows every query the same keys; any other (causal, ...) would be lost here.
            if not torch.compiler.is_compiling() and not bool((attention_mask[:, 0] == keys[:, None]).all()):
                raise ValueError("fastbert attention takes padding masks only (every query sees the same keys); "
                                 "this mask differs between queries: use attn_implementation='sdpa'")
            attention_mask = keys
        asked = kwargs.get("output_attentions")  # the call's, else config.json's (transformers passes only the call's)
        if asked or asked is None and getattr(module.config, "output_attentions", False):  # as eager returns them
            out, weights = ops.attention(query, key, value, attention_mask, dropout_p=dropout, scale=scaling,
                                         need_weights=True)
            return out.transpose(1, 2), weights
        out = ops.attention(query, key, value, attention_mask, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
