"""int8 inference: `quantize(model)` turns every linear of the encoder (Q, K, V, attention output, FFN in
and out) into an Int8Linear: int8 weights per output channel, activations quantized at run time per
token ("dynamic") or with one range per layer calibrated beforehand ("static"); ops.quantized_dense runs
them. Embeddings, LayerNorm, softmax, attention, the pooler, the heads and the residual stream stay in
the model's float dtype."""
from __future__ import annotations

import copy
import re

import torch
from torch import nn

from fastbert import ops
from fastbert.ops import reference

MODES = ("dynamic", "static")
OBSERVERS = ("minmax", "percentile")
PERCENTILE = 99.99  # the "percentile" observer's range: this percentile of each batch's values (and 100 - it)
PERCENTILE_SAMPLE = 1 << 20  # values drawn per batch for it (torch.quantile takes at most 16M)
# The linears quantize() replaces, as paths below each encoder layer.
ENCODER_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                   "intermediate.dense", "output.dense")
_ENCODER_LINEAR = re.compile(r"(^|\.)encoder\.layer\.\d+\.(" + "|".join(map(re.escape, ENCODER_LINEARS)) + ")$")


class RangeObserver:
    """The range of a layer's inputs over calibration batches: overall min / max, or the mean over
    batches of a high and a low percentile (outliers of one batch do not set the range)."""

    def __init__(self, kind: str):
        self.kind, self.lows, self.highs = kind, [], []

    def __call__(self, x: torch.Tensor) -> None:
        values = x.detach().float().reshape(-1)
        if self.kind == "minmax":
            self.lows.append(float(values.min()))
            self.highs.append(float(values.max()))
            return
        if values.numel() > PERCENTILE_SAMPLE:
            g = torch.Generator(device=values.device).manual_seed(len(self.lows))
            values = values[torch.randint(0, values.numel(), (PERCENTILE_SAMPLE,), generator=g, device=values.device)]
        q = torch.quantile(values, torch.tensor([1 - PERCENTILE / 100, PERCENTILE / 100], device=values.device))
        self.lows.append(float(q[0]))
        self.highs.append(float(q[1]))

    def range(self) -> tuple[float, float]:
        if not self.lows:
            raise ValueError("no calibration batch reached this layer")
        if self.kind == "minmax":
            return min(self.lows), max(self.highs)
        return sum(self.lows) / len(self.lows), sum(self.highs) / len(self.highs)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights [out, in] and float32 per-channel scales; bias float32; for static
    quantization also the calibrated input scale and zero point. Its tensors are buffers (no gradients);
    `.to(dtype)` leaves them as they are (a bfloat16 scale would put up to 0.4% error on a whole output
    channel): a cast model computes its activations in the new dtype."""

    _KEPT = ("weight_scale", "bias", "input_scale", "input_zero_point")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, static: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.register_buffer("input_scale", torch.ones(()) if static else None)
        self.register_buffer("input_zero_point", torch.zeros((), dtype=torch.int32) if static else None)
        self.prepared = ops.PreparedWeights()  # oneDNN's packed copy of `weight`
        self.observer: RangeObserver | None = None  # set while calibrating

    @classmethod
    def from_linear(cls, linear: nn.Linear, static: bool = False) -> "Int8Linear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, static)
        weight, scale = reference.quantize_weight(linear.weight)
        module.weight.copy_(weight)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        return module.to(linear.weight.device)

    @property
    def static(self) -> bool:
        return self.buffers_now()[3] is not None

    @property
    def takes_quantized_rows(self) -> bool:
        """Whether its input may come as ops.QuantizedRows (dynamic, not calibrating)."""
        return not self.static and self.observer is None

    def forward(self, x, activation: str = "none", approximate: str = "none", quantize_output: bool = False):
        if self.observer is not None:
            self.observer(x)
        weight, weight_scale, bias, input_scale, input_zero_point = self.buffers_now()
        return ops.quantized_dense(x, weight, weight_scale, bias, activation, approximate, self.prepared,
                                   quantize_output and input_scale is None, input_scale, input_zero_point)

    def buffers_now(self) -> tuple:
        """weight, weight_scale, bias, input_scale, input_zero_point: from the buffer dict, as nn.Module's
        __getattr__ costs ~0.5 us a buffer and a batch of one pays it for every layer (a parametrized
        buffer lives elsewhere: then by attribute)."""
        b = self._buffers
        try:
            return b["weight"], b["weight_scale"], b["bias"], b["input_scale"], b["input_zero_point"]
        except KeyError:
            return self.weight, self.weight_scale, self.bias, self.input_scale, self.input_zero_point

    def _apply(self, fn, *args, **kwargs):
        self.prepared.clear()
        kept = {name: getattr(self, name) for name in self._KEPT}
        super()._apply(fn, *args, **kwargs)
        for name, t in kept.items():  # moved with the module, never cast: a cast would round them
            if t is not None:
                self._buffers[name] = t.to(device=self.weight.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{'static' if self.static else 'dynamic'}")


def fused(linears, x, prepared: ops.PreparedWeights):
    """Int8Linears of one input (Q, K, V) as one GEMM on their stacked weights, kept in `prepared` (their
    owner's); [..., sum of out_features]. Static layers of one input share its calibrated range."""
    for m in linears:
        if m.observer is not None:
            m.observer(x)
    buffers = [m.buffers_now() for m in linears]
    sources = tuple(t for b in buffers for t in b[:3] if t is not None)

    def stack(*_):
        biases = [m.bias for m in linears]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        return torch.cat([m.weight for m in linears]), torch.cat([m.weight_scale for m in linears]), bias

    weight, scale, bias = prepared.get("qkv_int8", sources, stack)
    return ops.quantized_dense(x, weight, scale, bias, prepared=prepared, input_scale=buffers[0][3],
                               input_zero_point=buffers[0][4])


def replace_linears(model: nn.Module, mode: str = "dynamic") -> list[Int8Linear]:
    """Every encoder linear of `model` replaced by an Int8Linear of its weights (or an empty one where
    the linear is on the meta device, to load a saved int8 model into); returns them."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    targets = [name for name, m in model.named_modules() if _ENCODER_LINEAR.search(name)]
    if not targets or not hasattr(model, "clear_prepared_weights"):
        raise TypeError(f"quantize() needs a fastbert BertModel or BertFor* model, got {type(model).__name__} "
                        "(for a transformers or sentence-transformers model: fastbert.optimize(model, quantize='int8'))")
    made = []
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent, linear = model.get_submodule(parent_name), model.get_submodule(name)
        if isinstance(linear, Int8Linear):
            raise ValueError(f"quantize(): {name} is quantized already")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"quantize(): {name} is a {type(linear).__name__}, not an nn.Linear")
        made.append(Int8Linear.from_linear(linear, static=mode == "static"))
        setattr(parent, leaf, made[-1])
    model.clear_prepared_weights()
    # A config of the model's own: another model built on the same config object stays a float model.
    _set_config(model, model.config, copy.deepcopy(model.config))
    model.config.extra["fastbert_quantization"] = {"bits": 8, "mode": mode}
    return made


def saved_form(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The int8 weights flattened for the file. transformers and sentence-transformers know no int8 BERT
    (they ignore a quantization config they do not know) and would load [out, in] int8 values as float
    weights, giving wrong numbers silently; a flat tensor fails their shape check, so they refuse it."""
    return {k: v.reshape(-1) if v.dtype == torch.int8 and v.dim() == 2 else v for k, v in state.items()}


def loaded_form(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`saved_form` undone: each flat int8 weight back to its module's [out, in] (an earlier 2-D save
    passes as it is)."""
    def unflat(k, v):
        want = expected.get(k)
        if v.dtype == torch.int8 and v.dim() == 1 and want is not None and want.dim() == 2 \
                and v.numel() == want.numel():
            return v.view(want.shape)
        return v
    return {k: unflat(k, v) for k, v in state.items()}


def _set_config(model: nn.Module, old, new) -> None:
    """`new` wherever the model and its parts (a head's encoder) hold `old`."""
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _run(model, batch) -> None:
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def quantize(model: nn.Module, mode: str = "dynamic", calibration=None, observer: str = "minmax",
             freeze: bool = True) -> nn.Module:
    """Quantize `model`'s encoder linears to int8, in place, for inference; returns `model` in eval mode.

    mode "dynamic": activations are quantized per token at run time, from each token's own range (the
    accurate choice: no calibration). mode "static": one range per layer input, measured by running
    `calibration` (an iterable of batches: input_ids tensors, (input_ids, attention_mask) tuples or
    dicts of the model's keyword arguments) through the model, with `observer` "minmax" or "percentile";
    then bias and GELU run inside oneDNN's int8 GEMM. `freeze`: every remaining parameter stops requiring
    grad, so that calls outside torch.no_grad() work (int8 weights have no gradient, and an int8 layer
    refuses inputs that need one)."""
    if mode == "static" and calibration is None:
        raise ValueError("mode='static' needs calibration batches (calibration=[input_ids, ...])")
    if mode == "dynamic" and calibration is not None:
        raise ValueError("calibration is for mode='static'; dynamic quantization measures each token itself")
    if observer not in OBSERVERS:
        raise ValueError(f"observer must be one of {OBSERVERS}, got {observer!r}")
    if mode == "dynamic" and observer != "minmax":
        raise ValueError(f"observer={observer!r} is for mode='static' (calibration); dynamic quantization takes each "
                         "token's own range")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    config, training = getattr(model, "config", None), model.training
    layers = replace_linears(model, mode)
    model.eval()
    try:
        if mode == "static":
            _calibrate(model, layers, calibration, observer)
    except BaseException:  # the model as it was: not half int8, its config saying static
        for name, linear in linears.items():
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, linear)
        _set_config(model, model.config, config)
        model.clear_prepared_weights()
        model.train(training)
        raise
    if freeze:
        model.requires_grad_(False)
    return model


def _calibrate(model, layers, calibration, observer) -> None:
    """Each static layer's input range from the calibration batches, run through the model."""
    # Calibrate on the dynamic int8 model: each layer sees the inputs the quantized layers before it give.
    scales = [(m.input_scale, m.input_zero_point) for m in layers]
    for m in layers:
        m.input_scale = m.input_zero_point = None
        m.observer = RangeObserver(observer)
    try:
        with torch.inference_mode():
            for batch in calibration:
                _run(model, batch)
        for m, (scale, zero_point) in zip(layers, scales):
            lo, hi = m.observer.range()
            scale[()], zero_point[()] = reference.range_to_scale(lo, hi)
            m.input_scale, m.input_zero_point = scale, zero_point
    finally:
        for m in layers:
            m.observer = None
    model.clear_prepared_weights()


def fast_activation_dtype() -> torch.dtype:
    """What an int8 model best computes between its int8 GEMMs on this CPU: bfloat16 where oneDNN runs it
    natively (avx512_bf16 or AMX; costs little accuracy beside the int8 GEMMs'), else float32."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())
