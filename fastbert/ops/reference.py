"""The naive ops: ground truth for every parity test and the fallback at run time.

Each is what a tutorial would write, in plain PyTorch, differentiable by autograd. Tests run them on
float64 copies of the inputs to get the truth, and in the input dtype as the naive bound; dispatch runs them
when no kernel can serve a call (LayerNorm and attention on float32 copies of half-precision inputs:
in_float32).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

ACTIVATIONS = ("none", "gelu")
APPROXIMATIONS = ("none", "tanh")  # GELU's form: exact (erf) or tanh, as torch.nn.functional.gelu spells it


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def bias_gelu(x, bias, approximate="none"):
    return gelu(x + bias, approximate)


def dense(x, weight, bias=None, activation="none", approximate="none"):
    y = x @ weight.t()
    if bias is not None:
        y = y + bias
    return gelu(y, approximate) if activation == "gelu" else y


def quantize_weight(weight):
    """Symmetric per-output-channel int8: weight [N, K] -> (int8 values, float32 scale [N]); values in
    [-127, 127] so that -w quantizes to -q. An all-zero row gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_rows(x):
    """Per-row asymmetric uint8: x [M, K] -> (q uint8, scale float32 [M], zero_point int32 [M]), with the
    range widened to include 0. The arithmetic is float32 whatever x's dtype: the quantization is defined
    by these steps, and the C++ kernel takes the same ones, so both produce the same bytes."""
    x = x.float()
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    scale = _usable((hi - lo) / 255)
    inv = 1 / scale
    zero_point = torch.round(-lo * inv).clamp(0, 255)
    q = (torch.round(x * inv[:, None]) + zero_point[:, None]).clamp(0, 255)
    return q.to(torch.uint8), scale, zero_point.to(torch.int32)


def quantize_tensor(x, scale, zero_point):
    """Static quantization: x [M, K] -> uint8 with one calibrated scale (float32, 0-dim) and zero point."""
    inv = 1 / scale.float()
    return (torch.round(x.float() * inv) + int(zero_point)).clamp(0, 255).to(torch.uint8)


def range_to_scale(lo, hi):
    """The uint8 scale (float32) and zero point (int32) of a calibrated range [lo, hi], widened to include 0,
    as quantize_rows derives them from a row's own range."""
    lo, hi = torch.as_tensor(lo, dtype=torch.float32).clamp(max=0), torch.as_tensor(hi, dtype=torch.float32).clamp(min=0)
    scale = _usable((hi - lo) / 255)
    return scale, torch.round(-lo * (1 / scale)).clamp(0, 255).to(torch.int32)


def _usable(scale):
    """1 for an all-zero range; at least float32's smallest normal number, whose reciprocal is finite (a
    range below ~7.5e-37 would make 1 / scale infinite and the zero point NaN)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale.clamp(min=torch.finfo(torch.float32).tiny))


class QuantizedRows(NamedTuple):
    """Activations quantized per row, as quantize_rows makes them: x ~= (values - zero_point) x scale, row by
    row. `values` keeps x's shape; `dtype` is the float dtype they stand for."""

    values: torch.Tensor  # uint8 [..., K]
    scale: torch.Tensor  # float32 [rows]
    zero_point: torch.Tensor  # int32 [rows]
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        rows = self.values.reshape(-1, self.values.shape[-1])
        x = (rows.double() - self.zero_point.double()[:, None]) * self.scale.double()[:, None]
        return x.reshape(self.values.shape)


def quantized_dense(x, weight, weight_scale, bias=None, activation="none", approximate="none", quantize_output=False,
                    input_scale=None, input_zero_point=None):
    """dense with int8 weights ([N, K] values and float32 scale [N]) on x quantized per row by
    quantize_rows (or given as QuantizedRows), or with a calibrated `input_scale` and `input_zero_point`
    by quantize_tensor; the products summed in x's dtype (float64 for the truth). The result in x's
    dtype, or, with quantize_output, as QuantizedRows of it."""
    if isinstance(x, QuantizedRows):
        shape, dt = x.values.shape, x.dtype
        q, scale, zero_point = x.values.reshape(-1, shape[-1]), x.scale, x.zero_point
    elif input_scale is not None:
        shape, dt = x.shape, x.dtype
        q = quantize_tensor(x.reshape(-1, shape[-1]), input_scale, input_zero_point)
        scale, zero_point = input_scale.float().expand(q.shape[0]), input_zero_point.int().expand(q.shape[0])
    else:
        shape, dt = x.shape, x.dtype
        q, scale, zero_point = quantize_rows(x.reshape(-1, shape[-1]))
    x_hat = (q.to(dt) - zero_point.to(dt)[:, None]) * scale.to(dt)[:, None]
    y = dense(x_hat, weight.to(dt) * weight_scale.to(dt)[:, None], None if bias is None else bias.to(dt),
              activation, approximate)
    if quantize_output:
        values, y_scale, y_zero_point = quantize_rows(y)
        return QuantizedRows(values.reshape(*shape[:-1], weight.shape[0]), y_scale, y_zero_point, dt)
    return y.reshape(*shape[:-1], weight.shape[0])


def qkv_projection(x, weight, bias, num_heads):
    qkv = dense(x, weight, bias)  # [..., 3 * hidden]
    head_dim = weight.shape[0] // 3 // num_heads
    if x.dim() == 3:  # [B, S, 3H] -> 3 x [B, heads, S, d]
        b, s, _ = qkv.shape
        return tuple(t.reshape(b, s, num_heads, head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    return tuple(t.reshape(-1, num_heads, head_dim) for t in qkv.chunk(3, dim=-1))  # 3 x [T, heads, d]


def softmax(scores):
    if scores.shape[-1] == 0:  # no keys: nothing to normalize (amax refuses an empty dimension)
        return scores
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def attention(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, need_weights=False):
    """q, k, v: [B, heads, S, d]; attention_mask: [B, S] with 1 = keep. Returns [B, heads, S, d]
    (and the probabilities [B, heads, S, S], after dropout, if need_weights). A query row with no kept key gives
    zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, heads, S, S]
    if attention_mask is not None:
        keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        # A finite fill (not -inf) keeps a row with no kept key finite, and its gradient too.
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        probs = softmax(scores) * keep.any(dim=-1, keepdim=True)
    else:
        probs = softmax(scores)
    dropped = torch.nn.functional.dropout(probs, dropout_p) if dropout_p > 0 else probs
    out = dropped @ v
    return (out, dropped) if need_weights else out  # the probabilities P V used, as transformers' eager returns


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, scale=None):
    """q, k, v: [T, heads, d] packed; sequence i holds tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:  # an empty sequence contributes no rows
            continue
        qi, ki, vi = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, s, d]
        outs.append(attention(qi, ki, vi, None, dropout_p, scale)[0].transpose(0, 1))  # [s, heads, d]
    return torch.cat(outs, dim=0) if outs else q + k + v  # no rows (T = 0), in the graph as torch.cat's would be


HALVES = (torch.float16, torch.bfloat16)


def in_float32(fn):
    """`fn` run on float32 copies of its half-precision tensor arguments, its tensor outputs rounded to its
    first argument's dtype: a naive op as the run-time fallback. Statistics and softmax in float16 overflow where
    the kernels' (and torch's own LayerNorm and SDPA) don't: a variance past 65504 when a feature is 256 away
    from its row's mean, a score past it, both NaN."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        dtype = args[0].dtype
        if dtype not in HALVES:
            return fn(*args, **kwargs)
        out = fn(*(a.float() if isinstance(a, torch.Tensor) and a.dtype in HALVES else a for a in args), **kwargs)
        return tuple(o.to(dtype) for o in out) if isinstance(out, tuple) else out.to(dtype)
    return run


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0):
    h = (torch.nn.functional.dropout(x, dropout_p) if dropout_p > 0 else x) + residual
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * weight + bias
