"""int8 inference: `quantize(model)` turns every linear of the encoder (Q, K, V, attention output, FFN in
and out) into an Int8Linear: int8 weights per output channel, activations quantized per token at run
time (ops.quantized_dense). Embeddings, LayerNorm, softmax, attention, the pooler, the heads and the
residual stream stay in the model's float dtype."""
from __future__ import annotations

import re

import torch
from torch import nn

from fastbert import ops
from fastbert.ops import reference

MODES = ("dynamic",)
# The linears quantize() replaces, as paths below each encoder layer.
ENCODER_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                   "intermediate.dense", "output.dense")


class Int8Linear(nn.Module):
    """A linear layer with int8 weights [out, in] and float32 per-channel scales; bias float32. Its
    tensors are buffers (no gradients); `.to(dtype)` leaves them float32 (a bfloat16 scale would put up to
    0.4% error on a whole output channel): a cast model computes its activations in the new dtype."""

    _FLOAT32 = ("weight_scale", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.prepared = ops.PreparedWeights()  # oneDNN's packed copy of `weight`

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        weight, scale = reference.quantize_weight(linear.weight)
        module.weight.copy_(weight)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        return module.to(linear.weight.device)

    def forward(self, x, activation: str = "none", approximate: str = "none", quantize_output: bool = False):
        return ops.quantized_dense(x, self.weight, self.weight_scale, self.bias, activation, approximate, self.prepared,
                                   quantize_output)

    def _apply(self, fn, *args, **kwargs):
        self.prepared.clear()
        kept = {name: getattr(self, name) for name in self._FLOAT32}
        super()._apply(fn, *args, **kwargs)
        for name, t in kept.items():  # moved with the module, never cast: a cast would round them
            if t is not None:
                self._buffers[name] = t.to(device=self.weight.device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def stack(linears) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Int8Linears of one input stacked into one GEMM's weight, scale and bias (the fused QKV)."""
    biases = [m.bias for m in linears]
    bias = None if any(b is None for b in biases) else torch.cat(biases)
    return torch.cat([m.weight for m in linears]), torch.cat([m.weight_scale for m in linears]), bias


_ENCODER_LINEAR = re.compile(r"(^|\.)encoder\.layer\.\d+\.(" + "|".join(map(re.escape, ENCODER_LINEARS)) + ")$")


def quantize(model: nn.Module, mode: str = "dynamic", freeze: bool = True) -> nn.Module:
    """Quantize `model`'s encoder linears to int8, in place, for inference; returns `model` in eval mode.
    mode "dynamic": activations are quantized per token at run time, from each token's own range.
    `freeze`: every remaining parameter stops requiring grad, so that calls outside torch.no_grad() work
    (int8 weights have no gradient, and an int8 layer refuses inputs that need one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    targets = [name for name, m in model.named_modules() if _ENCODER_LINEAR.search(name)]
    if not targets or not hasattr(model, "clear_prepared_weights"):
        raise TypeError(f"quantize() needs a fastbert BertModel or BertFor* model, got {type(model).__name__} "
                        "(for a transformers or sentence-transformers model: fastbert.optimize(model, quantize='int8'))")
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent, linear = model.get_submodule(parent_name), model.get_submodule(name)
        if isinstance(linear, Int8Linear):
            continue  # already quantized
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"quantize(): {name} is a {type(linear).__name__}, not an nn.Linear")
        setattr(parent, leaf, Int8Linear.from_linear(linear))
    model.clear_prepared_weights()
    model.config.extra["fastbert_quantization"] = {"bits": 8, "mode": mode}
    if freeze:
        model.requires_grad_(False)
    return model.eval()


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())
