"""encoder_layer: an encoder layer of an eager inference forward as one C++ call.

At a batch of one the Python between a layer's seven kernel calls (modules, the ops' wrappers, dispatch,
output allocation) costs as much as the kernels (benchmarks/RESULTS.md); on a GPU it is what the GPU waits
on at every BERT batch size (an H200 ran BERT-base's encoder at 8 x 128 bf16 in 1.11 ms as a CUDA graph
against 5.64 ms issued op by op). A plan (dispatch.Plans) records
which implementation each op call of a layer ran. Where each one is an implementation that
csrc/cpu/encoder_layer.cpp knows how to call, `program` builds a LayerProgram, and the plan's later
forwards run the layer as one call that makes those same kernel calls in the same order: its output
equals the layer's, op by op, bit for bit (tests/test_encoder_layer.py). Nothing is chosen here: what
runs is what the plan recorded; anything else (another variant, static int8, dropout, attention
probabilities) runs op by op.
"""
from __future__ import annotations

import importlib

import torch
from torch.nn.utils.parametrize import is_parametrized

from fastbert import dispatch
from fastbert.ops import _alloc
from fastbert.ops.reference import QuantizedRows

# The module (in fastbert.ops that name is its function): the one call's blocks of rows are its rows_per_block's.
_quantized_dense = importlib.import_module("fastbert.ops.quantized_dense")

ATTENTION = {"fastbert": 0, "brgemm": 1, "torch": 2, "amx": 3}  # attention / varlen_attention variants -> Attention
# The backends whose kernels the C++ layer reaches through fastbert_C's ops and ATen, which dispatch on the
# tensors' device: the cpu backend's (csrc/cpu) and the cuda backend's (csrc/cuda; its linears are torch's
# F.linear on cuBLAS, its one attention kernel is fastbert's, recorded without a variant name).
BACKENDS = ("cpu", "cuda")
LINEARS = {"onednn": 0, "onednn+bias_gelu": 1, "torch": 2, "fastbert": 3, "onednn-rows": 4,
           "onednn+torch_backward": 0}  # (inference: onednn's calls)  # dense's (and qkv_projection's) variants -> Linear
INT8_GEMMS = {"fastbert": 0, "onednn": 1}  # quantized_dense's variants -> Int8Gemm
ACTIVATIONS = {("gelu", "none"): 1, ("gelu", "tanh"): 2}
PACKED = {"onednn": "onednn", "onednn+bias_gelu": "onednn", "fastbert": "own_packed", "onednn-rows": "onednn",
          "onednn+torch_backward": "onednn"}  # a Linear's prepared copy


class _NotKept(LookupError):
    """A prepared weight the layer's own calls did not keep (then no program yet)."""


def _kept(prepared, name, sources):
    """The value `prepared` keeps under `name` for `sources`: the very tensor the layer's op calls use."""
    def missing(*_):
        raise _NotKept(name)

    try:
        return prepared.get(name, sources, missing)
    except _NotKept:
        return None


class LayerProgram:
    """One BertLayer's arguments to fastbert_C::encoder_layer: its weights as its op calls use them, and the
    codes of the implementations they ran. Serves while the tensors it was made from are unwritten and the
    layer's settings unchanged (`current`)."""

    def __init__(self, settings: Settings, weights, codes, eps, sources):
        self.weights, self.codes, self.eps = weights, codes, eps
        self.poisoned_codes = [*codes[:-1], 1]  # the C++ side NaN-fills its outputs, as _alloc does
        self.sources = sources
        self.versions = [t._version for t in sources]
        self.settings, self.recorded = settings, settings()

    def current(self) -> bool:
        """Whether no source was written in place since (the packed copies would be stale) and the layer's
        plain attributes are as they were (no hook sees them change; op by op, the ops' flags would)."""
        return self.settings() == self.recorded and [t._version for t in self.sources] == self.versions

    def __call__(self, x, attention_mask, packing, x_rows, quantize_output):
        """BertLayer.forward's (out, None, out as QuantizedRows or None) for its arguments."""
        if packing is not None:
            batch, seq, key_mask, cu_seqlens = 0, 0, None, packing.cu_seqlens
        else:
            batch, seq = x.shape[0], x.shape[1]
            key_mask = None if attention_mask is None else attention_mask.bool().contiguous()
            cu_seqlens = None
        rows = (None, None, None) if x_rows is None else x_rows[:3]
        codes = self.poisoned_codes if _alloc._poisoning[0] else self.codes
        x = x.contiguous()  # a hook may hand a layer a strided view; the C++ call reads rows in place
        out = torch.ops.fastbert_C.encoder_layer(x.view(-1, x.shape[-1]), *rows, key_mask, cu_seqlens, batch, seq,
                                                 self.weights, codes, self.eps, quantize_output)
        y = out[0].view(x.shape)
        return y, None, QuantizedRows(out[1].view(x.shape), out[2], out[3], x.dtype) if quantize_output else None


def linear_modules(layer) -> tuple:
    """A BertLayer's six linears: query, key, value, attention output, FFN in, FFN out."""
    attention = layer.attention.self
    return (attention.query, attention.key, attention.value, layer.attention.output.dense, layer.intermediate.dense,
            layer.output.dense)


class Settings:
    """What a BertLayer's forward depends on beyond its tensors and its plan, none of which a plan notices
    change: GELU's form, heads and LayerNorm eps (plain attributes), and for every module inside the layer
    its training flag, its forward hooks and an instance's own forward (the one call runs none of them), and
    in an int8 layer whether a linear is calibrating. The modules are found once (assigning another one
    drops every plan)."""

    def __init__(self, layer):
        attention = layer.attention.self
        self.holders = (layer.intermediate, attention, layer.attention.output.LayerNorm, layer.output.LayerNorm)
        self.inside = tuple(layer.modules())[1:]
        self.int8_linears = tuple(m for m in linear_modules(layer) if type(m) is not torch.nn.Linear)

    def __call__(self) -> tuple:
        intermediate, attention, norm1, norm2 = self.holders
        return (intermediate.approximate, attention.num_attention_heads, norm1.eps, norm2.eps,
                [m.observer is None for m in self.int8_linears], self.runs_plainly())

    def runs_plainly(self) -> bool:
        """No module inside is training, hooked or given its own forward, and no global forward hook is set."""
        hooks = torch.nn.modules.module
        return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks or any(
            m.training or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in self.inside))


def program(layer, calls) -> LayerProgram | None:
    """The one-call program of `layer` (a fastbert BertLayer) whose forward made `calls` (a plan's records:
    (signature, fn, backend, skipped, variant); a signature is (op, first tensor's shape, dtype, *the op's
    trusted() flags)); None where a call is not one the C++ layer makes, or the layer is not one it can run;
    dispatch.RETRY where it cannot now: a packed weight the layer's calls keep is missing (written since:
    the next forward op by op packs it again), or a module inside is hooked or training."""
    if len(calls) != 7 or len({c[2] for c in calls}) != 1 or calls[0][2] not in BACKENDS:
        return None
    signatures = [c[0] for c in calls]
    variants = [c[4] or ("fastbert" if c[2] == "cuda" else None) for c in calls]  # (cuda's unnamed: its one kernel)
    attention = signatures[1]
    if attention[0] == "attention":
        if attention[3:] != (attention[3], 0.0, None, False):  # (mask is None, dropout_p, scale, need_weights)
            return None
    elif attention[0] != "varlen_attention" or attention[3:] != (0.0, None):
        return None
    if variants[1] not in ATTENTION:
        return None
    norms = signatures[3], signatures[6]  # (op, shape, dtype, eps, dropout_p, quantize_output)
    if any(s[0] != "add_layer_norm" or s[4] != 0.0 for s in norms):
        return None
    self_attention, attention_out, ffn_out = layer.attention.self, layer.attention.output, layer.output
    if norms[0][3] != attention_out.LayerNorm.eps or norms[1][3] != ffn_out.LayerNorm.eps or norms[0][3] != norms[1][3]:
        return None  # (one eps a layer: the C++ call takes one)
    norm_modules = (attention_out.LayerNorm, ffn_out.LayerNorm)
    if any(type(m) is not torch.nn.LayerNorm for m in norm_modules):
        return None  # a parametrized LayerNorm computes its weight in its forward
    if any(t.dtype != norms[0][2] for m in norm_modules for t in (m.weight, m.bias)):
        return None  # float32 LayerNorms in a bfloat16 layer: the op rounds them at each call
    settings = Settings(layer)
    if any(is_parametrized(m) for m in settings.inside):
        return None  # (parametrizing a module drops the plans anyway)
    if not settings.runs_plainly():
        return dispatch.RETRY  # hooks and training come and go
    if any(t.is_inference() for t in layer.parameters()) or any(t.is_inference() for t in layer.buffers()):
        return None  # no version counter: a write could not be told (nor are their packed copies kept)
    int8 = signatures[0][0] == "quantized_dense"
    built = _int8(layer, signatures, variants) if int8 else _float(layer, signatures, variants)
    if built is None or built is dispatch.RETRY:
        return built
    weights, activation, linears, sources = built
    norm_params = [t for m in norm_modules for t in (m.weight, m.bias)]
    weights[8:10], weights[18:20] = (t.contiguous() for t in norm_params[:2]), (t.contiguous() for t in norm_params[2:])
    codes = [int(int8), self_attention.num_attention_heads, ATTENTION[variants[1]], *linears, activation,
             _quantized_dense._cache_bytes() if int8 else 0, 0]
    return LayerProgram(settings, weights, codes, float(norms[0][3]), [*sources, *norm_params])


def _float(layer, signatures, variants):
    """(weights, activation code, the four linears' Linear codes, sources) of a float layer whose GEMMs ran
    oneDNN's packed linear, the own GEMM or torch's (qkv_projection's and dense's onednn,
    onednn+bias_gelu, fastbert and torch variants), or None."""
    qkv, out, ffn_in, ffn_out = signatures[0], signatures[2], signatures[4], signatures[5]
    if qkv[0] != "qkv_projection" or qkv[-1]:  # (..., num_heads, bias is None)
        return None
    for s in (out, ffn_in, ffn_out):  # (dense, shape, dtype, activation, approximate, bias is None)
        if s[0] != "dense" or s[-1]:
            return None
    if out[3:5] != ("none", "none") or ffn_out[3:5] != ("none", "none") or ffn_in[3:5] not in ACTIVATIONS:
        return None
    if signatures[3][5] or signatures[6][5]:  # a float layer's LayerNorms quantize nothing
        return None
    kinds = [variants[i] for i in (0, 2, 4, 5)]
    if any(k not in LINEARS for k in kinds) or "onednn+bias_gelu" in (kinds[0], kinds[1], kinds[3]):
        return None
    self_attention = layer.attention.self
    modules = linear_modules(layer)
    if not all(type(m) is torch.nn.Linear for m in modules):
        return None
    qkv_weight, qkv_bias = self_attention.fused_qkv()
    linears = ((self_attention.prepared, qkv_weight, qkv_bias), *(
        (m.prepared, m.dense.weight, m.dense.bias) for m in (layer.attention.output, layer.intermediate, layer.output)))
    weights = [None] * 20
    for slot, kind, (prepared, weight, bias) in zip((0, 4, 10, 14), kinds, linears):
        # oneDNN's and the own GEMM's runs read the packed copy the op calls kept; torch's the weight itself
        weights[slot] = weight if kind == "torch" else _kept(prepared, PACKED[kind], (weight,))
        if weights[slot] is None:
            return dispatch.RETRY
        weights[slot + 3] = bias.contiguous()
    sources = [p for m in modules for p in (m.weight, m.bias)]
    return weights, ACTIVATIONS[ffn_in[3:5]], [LINEARS[k] for k in kinds], sources


def _int8(layer, signatures, variants):
    """(weights, activation code, the four linears' Int8Gemm codes, sources) of a dynamic int8 layer whose
    GEMMs ran fastbert's own int8 GEMM or oneDNN's (quantized_dense's variants), each input quantized by the
    kernel before it, or None."""
    # (quantized_dense, shape, dtype, activation, approximate, quantize_output, rows, bias is None, input_scale is None)
    qkv, out, ffn_in, ffn_out = signatures[0], signatures[2], signatures[4], signatures[5]
    if any(s[0] != "quantized_dense" or s[-2] or not s[-1] for s in (qkv, out, ffn_in, ffn_out)):
        return None
    kinds = [variants[i] for i in (0, 2, 4, 5)]
    if any(k not in INT8_GEMMS for k in kinds):
        return None
    if qkv[3:6] != ("none", "none", False) or out[3:7] != ("none", "none", False, False):
        return None
    if ffn_in[3:5] not in ACTIVATIONS or ffn_in[5:7] != (True, True) or ffn_out[3:7] != ("none", "none", False, True):
        return None
    if signatures[3][5] is not True:  # the first LayerNorm quantizes FFN in's input
        return None
    self_attention = layer.attention.self
    modules = linear_modules(layer)
    # fastbert.quantization's Int8Linear, dynamic (by what it has: ops never import the model's modules)
    if not all(type(m) is not torch.nn.Linear and getattr(m, "takes_quantized_rows", False) for m in modules):
        return None
    buffers = [m.buffers_now() for m in modules]
    stacked = _kept(self_attention.prepared, "qkv_int8", tuple(t for b in buffers[:3] for t in b[:3]))
    if stacked is None:
        return dispatch.RETRY
    linears = ((self_attention.prepared, *stacked), *((m.prepared, *b[:3]) for m, b in zip(modules[3:], buffers[3:])))
    weights = [None] * 20
    for slot, kind, (prepared, weight, scale, bias) in zip((0, 4, 10, 14), kinds, linears):
        packed = _kept(prepared, "int8_packed" if kind == "fastbert" else "onednn_int8", (weight,))
        sums = _kept(prepared, "int8_sums", (weight, scale))
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            return None
        if packed is None or sums is None:
            return dispatch.RETRY
        weights[slot:slot + 4] = packed, scale.contiguous(), sums, bias
    sources = [t for b in buffers for t in b[:3]]
    return weights, ACTIVATIONS[ffn_in[3:5]], [INT8_GEMMS[k] for k in kinds], sources

