// encoder_layer: one BERT encoder layer of an inference forward in one call, for batches where Python
// between the kernels costs as much as the kernels (fastbert/ops/encoder_layer.py; on CPU, and on CUDA
// tensors in a CUDA build, where the calls below dispatch to the CUDA kernels). It makes the
// calls the layer's ops make, in their order, on the implementations a plan recorded for them (codes
// below), so its output is bit-equal to the layer's op by op: no kernel of its own, no choice of its own.
//
// weights: 20 slots, four per linear (weight, weight_scale, wsum, bias) for QKV (stacked), the attention
// output, FFN in and FFN out at 0, 4, 10, 14, and (weight, bias) of the two LayerNorms at 8 and 18.
// Float layers: the weight is oneDNN's packed copy (dense_pack's for the own GEMM, the weight itself for
// torch's) and weight_scale / wsum are empty; int8 layers:
// int8_pack's packed weight, its float32 scales and scale x row sums (quantized_dense's "fastbert" GEMM).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string_view>

namespace fastbert {
namespace {

// codes: int8 or float; heads; attention's variant (Attention below); for each linear (QKV, output,
// FFN in, FFN out) how it ran (Linear or Int8Gemm below); GELU's form (1 erf, 2 tanh); the bytes that
// quantized_dense's blocks of rows fill (_cache_bytes); whether to NaN-fill outputs (as fastbert's tests do).
enum Code : int64_t {
  kInt8, kHeads, kAttention, kQkvLinear, kOutLinear, kInLinear, kFfnLinear, kActivation, kCacheBytes, kPoison, kCodes
};
// dense's variants (and qkv_projection's onednn, torch and fastbert): oneDNN's packed GEMM with bias and
// GELU as post-ops; the same without them, then fastbert's bias_gelu kernel in place; torch's F.linear and
// F.gelu; fastbert's own float32 / bfloat16 GEMM (float_gemm.h) with both in its epilogue; oneDNN's
// GEMM on each thread's share of the rows (dense_onednn_rows).
enum Linear : int64_t { kOnednn, kOnednnThenBiasGelu, kTorch, kOwnDense, kOnednnRows };
// quantized_dense's variants: fastbert's own GEMM (int8_gemm.h), oneDNN's u8 x s8 GEMM.
enum Int8Gemm : int64_t { kOwnGemm, kOnednnGemm };
// attention's variants: fastbert's kernel, the same on ATen's brgemm, torch's SDPA (padded batches only),
// fastbert's kernel on its own AMX tiles.
enum Attention : int64_t { kFastbert, kBrgemm, kTorchSdpa, kAmx };

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Opt = std::optional<at::Tensor>;
using Out = const at::Tensor&;

// The ops' C++ signatures, as their schemas (csrc/ops.cpp; torch's mkldnn::_linear_pointwise) give them.
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, const Opt&, double,
                         double, int64_t, Out, Out);
using LayerNormFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                         int64_t, Out, Out, Out);
using LayerNormQuantizeFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                 Out, Out, Out, Out);
using BiasGeluFn = void(const at::Tensor&, const at::Tensor&, bool, Out);
using QuantizeRowsFn = void(const at::Tensor&, Out, Out, Out);
using RequantizeRowsFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const Opt&, int64_t, Out, Out, Out);
using DequantizeRowsFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                              int64_t, Out);
// (torch registers this one's kernel with its tensors by value: a typed handle must say so)
using QlinearFn = at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor, Opt, double, int64_t,
                             std::optional<at::ScalarType>, std::string_view, c10::List<std::optional<at::Scalar>>,
                             std::string_view);
using DenseGemmFn = void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const Opt&, int64_t, int64_t, Out);
using DenseOnednnRowsFn = void(const at::Tensor&, const at::Tensor&, const Opt&, std::string_view,
                               std::optional<std::string_view>, Out);
using Int8MatmulFn = void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&, int64_t, Out);
using Int8MatmulDequantizeFn = void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, int64_t,
                                    int64_t, Out);

// torch's oneDNN ops, looked up where a layer first runs one (a torch build may lack them; then no layer
// program uses them).
const c10::TypedOperatorHandle<LinearFn>& onednn_linear() {
  static const auto op = find<LinearFn>("mkldnn::_linear_pointwise");
  return op;
}

const c10::TypedOperatorHandle<QlinearFn>& onednn_int8_linear() {
  static const auto op = find<QlinearFn>("onednn::qlinear_pointwise");
  return op;
}

// fastbert's own.
struct Ops {
  c10::TypedOperatorHandle<AttentionFn> attention = find<AttentionFn>("fastbert_C::attention_fwd");
  c10::TypedOperatorHandle<AttentionFn> attention_brgemm = find<AttentionFn>("fastbert_C::attention_fwd_brgemm");
  c10::TypedOperatorHandle<AttentionFn> attention_amx = find<AttentionFn>("fastbert_C::attention_fwd_amx");
  c10::TypedOperatorHandle<LayerNormFn> layer_norm = find<LayerNormFn>("fastbert_C::add_layer_norm_fwd");
  c10::TypedOperatorHandle<LayerNormQuantizeFn> layer_norm_quantize =
      find<LayerNormQuantizeFn>("fastbert_C::add_layer_norm_quantize");
  c10::TypedOperatorHandle<BiasGeluFn> bias_gelu = find<BiasGeluFn>("fastbert_C::bias_gelu_fwd");
  c10::TypedOperatorHandle<QuantizeRowsFn> quantize_rows = find<QuantizeRowsFn>("fastbert_C::quantize_rows");
  c10::TypedOperatorHandle<RequantizeRowsFn> requantize_rows = find<RequantizeRowsFn>("fastbert_C::requantize_rows");
  c10::TypedOperatorHandle<DequantizeRowsFn> dequantize_rows = find<DequantizeRowsFn>("fastbert_C::dequantize_rows");
  c10::TypedOperatorHandle<DenseGemmFn> dense_gemm = find<DenseGemmFn>("fastbert_C::dense_gemm");
  c10::TypedOperatorHandle<DenseOnednnRowsFn> dense_onednn_rows =
      find<DenseOnednnRowsFn>("fastbert_C::dense_onednn_rows");
  c10::TypedOperatorHandle<Int8MatmulFn> int8_matmul = find<Int8MatmulFn>("fastbert_C::int8_matmul");
  c10::TypedOperatorHandle<Int8MatmulDequantizeFn> int8_matmul_dequantize =
      find<Int8MatmulDequantizeFn>("fastbert_C::int8_matmul_dequantize");
};

const Ops& ops() {
  static const Ops kOps;  // looked up once, at the first call (after every library registered its ops)
  return kOps;
}

// A layer's rows quantized per row, as ops.QuantizedRows holds them.
struct Rows {
  at::Tensor q, scale, zero_point;
};

struct Layer {
  const c10::List<Opt>& weights;
  at::IntArrayRef codes;
  int64_t batch, seq;  // padded: x is [batch * seq, H]; packed: batch 0
  double eps;

  at::Tensor w(int64_t slot) const { return weights.get(slot).value(); }
  Opt bias(int64_t slot) const { return weights.get(slot); }
  bool int8() const { return codes[kInt8] != 0; }

  // at::empty, NaN-filled while fastbert's tests poison outputs (fastbert/ops/_alloc.py).
  at::Tensor empty(at::IntArrayRef shape, const at::TensorOptions& options) const {
    at::Tensor t = at::empty(shape, options);
    if (codes[kPoison] && t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
    return t;
  }

  Rows quantize(const at::Tensor& x) const {  // quantized_dense's quantize_rows of a float input
    const int64_t rows = x.size(0);
    Rows r{empty(x.sizes(), x.options().dtype(at::kByte)), empty({rows}, x.options().dtype(at::kFloat)),
           empty({rows}, x.options().dtype(at::kInt))};
    ops().quantize_rows.call(x, r.q, r.scale, r.zero_point);
    return r;
  }

  // The linear at `slot` of x [M, K] (float), as its `kind` ran (Linear), GELU after it where `gelu`; or, in
  // an int8 layer, of x or its `rows` on the Int8Gemm `kind`.
  at::Tensor linear(const at::Tensor& x, const Rows* rows, int64_t slot, at::ScalarType dtype, int64_t kind = 0,
                    bool gelu = false) const {
    if (!int8()) {
      const bool tanh = codes[kActivation] == 2;
      if (kind == kTorch) {
        at::Tensor y = at::linear(x, w(slot), bias(slot + 3));
        return gelu ? at::gelu(y, tanh ? "tanh" : "none") : y;
      }
      if (kind == kOwnDense) {  // n: the bias's (the packed weight is padded)
        TORCH_CHECK(bias(slot + 3).has_value(), "encoder_layer: the own GEMM's linears need their bias");
        const int64_t n = bias(slot + 3)->size(0);
        at::Tensor y = empty({x.size(0), n}, x.options());
        ops().dense_gemm.call(x, w(slot), n, x.size(1), bias(slot + 3), gelu ? codes[kActivation] : 0, 0, y);
        return y;
      }
      c10::List<std::optional<at::Scalar>> scalars;
      scalars.push_back(std::nullopt);  // _onednn.POST_OPS' [None]
      if (kind == kOnednnThenBiasGelu && gelu) {
        at::Tensor y = onednn_linear().call(x, w(slot), std::nullopt, "none", scalars, "");
        ops().bias_gelu.call(y, bias(slot + 3).value(), tanh, y);
        return y;
      }
      const char* attr = gelu ? "gelu" : "none";
      const char* algorithm = gelu ? (tanh ? "tanh" : "none") : "";
      if (kind == kOnednnRows) {  // n: the bias's (all of a layer's linears have one)
        at::Tensor y = empty({x.size(0), bias(slot + 3)->size(0)}, x.options());
        ops().dense_onednn_rows.call(x, w(slot), bias(slot + 3), attr, algorithm, y);
        return y;
      }
      return onednn_linear().call(x, w(slot), bias(slot + 3), attr, scalars, algorithm);
    }
    const Rows q = rows != nullptr ? *rows : quantize(x);
    const at::Tensor& scale = w(slot + 1);
    at::Tensor out = empty({q.q.size(0), scale.size(0)}, q.scale.options().dtype(dtype));
    if (kind == kOwnGemm) {  // each tile dequantized in cache
      ops().int8_matmul_dequantize.call(q.q, w(slot), scale.size(0), q.q.size(1), scale, q.scale, q.zero_point,
                                        w(slot + 2), bias(slot + 3), 0, 0, out);
    } else {
      int8_blocks(q, slot, kind, [&](const at::Tensor& acc, auto block) {
        ops().dequantize_rows.call(acc, block(q.scale), block(q.zero_point), w(slot + 2), bias(slot + 3), 0,
                                   block(out));
      });
    }
    return out;
  }

  // FFN in of an int8 layer: GEMM, then bias, GELU and the next GEMM's quantization.
  Rows requantize(const Rows& x, int64_t kind) const {
    const int64_t m = x.q.size(0), n = w(11).size(0);
    Rows out{empty({m, n}, x.q.options()), empty({m}, x.scale.options()), empty({m}, x.zero_point.options())};
    int8_blocks(x, 10, kind, [&](const at::Tensor& acc, auto block) {
      ops().requantize_rows.call(acc, block(x.scale), block(x.zero_point), w(12), bias(13), codes[kActivation],
                                 block(out.q), block(out.scale), block(out.zero_point));
    });
    return out;
  }

  // quantized_dense's two-step path: the float32 GEMM product of q's rows with the weight at `slot`, in blocks
  // of rows that stay in cache (quantized_dense.rows_per_block), each handed to `epilogue(acc, block)`, where
  // block(t) is t's rows of the block.
  template <typename Epilogue>
  void int8_blocks(const Rows& q, int64_t slot, int64_t kind, const Epilogue& epilogue) const {
    const at::Tensor& scale = w(slot + 1);
    const int64_t m = q.q.size(0), n = scale.size(0), k = q.q.size(1);
    const int64_t step = std::max<int64_t>(32, codes[kCacheBytes] / (4 * n) / 32 * 32);
    for (int64_t r0 = 0; r0 < m; r0 += step) {
      const int64_t rows = std::min(step, m - r0);
      auto block = [&](const at::Tensor& t) { return rows == m ? t : t.narrow(0, r0, rows); };
      at::Tensor acc;
      if (kind == kOwnGemm) {
        acc = empty({rows, n}, q.scale.options());
        ops().int8_matmul.call(block(q.q), w(slot), n, k, scale, 0, acc);
      } else {  // scale 1 and zero point 0: the epilogue applies each row's
        acc = onednn_int8_linear().call(block(q.q), 1.0, 0, w(slot), scale,
                                         at::zeros({n}, scale.options().dtype(at::kLong)), std::nullopt, 1.0, 0,
                                         at::kFloat, "none", c10::List<std::optional<at::Scalar>>(), "");
      }
      epilogue(acc, block);
    }
  }

  at::Tensor layer_norm(const at::Tensor& y, const at::Tensor& residual, int64_t slot) const {
    at::Tensor out = empty(y.sizes(), y.options());
    at::Tensor mean = empty({y.size(0)}, y.options().dtype(at::kFloat)), rstd = empty({y.size(0)}, mean.options());
    ops().layer_norm.call(y, residual, w(slot), w(slot + 1), eps, 0.0, 0, out, mean, rstd);
    return out;
  }

  Rows layer_norm_quantize(const at::Tensor& y, const at::Tensor& residual, int64_t slot, at::Tensor& out) const {
    out = empty(y.sizes(), y.options());
    Rows r{empty(y.sizes(), y.options().dtype(at::kByte)), empty({y.size(0)}, y.options().dtype(at::kFloat)),
           empty({y.size(0)}, y.options().dtype(at::kInt))};
    ops().layer_norm_quantize.call(y, residual, w(slot), w(slot + 1), eps, out, r.q, r.scale, r.zero_point);
    return r;
  }

  // Self-attention of qkv [T, 3H] -> the context [T, H] (T = batch x seq padded, else packed tokens).
  at::Tensor attention(const at::Tensor& qkv, const Opt& key_mask, const Opt& cu_seqlens) const {
    const int64_t heads = codes[kHeads], hidden = qkv.size(1) / 3, d = hidden / heads, t = qkv.size(0);
    const bool padded = batch > 0;
    at::Tensor split = padded ? qkv.view({batch, seq, 3, heads, d}).permute({2, 0, 3, 1, 4})
                              : qkv.view({t, 3, heads, d}).transpose(0, 1);
    at::Tensor q = split[0], k = split[1], v = split[2];  // [B, heads, S, d] or [T, heads, d], strided
    if (codes[kAttention] == kTorchSdpa) {  // attention's torch variant: mask [B, 1, 1, S], True = keep
      const Opt mask = key_mask.has_value() ? Opt(key_mask->view({batch, 1, 1, seq})) : std::nullopt;
      return at::scaled_dot_product_attention(q, k, v, mask).transpose(1, 2).reshape({t, hidden});
    }
    at::Tensor out, lse;
    if (padded) {
      out = empty({batch, seq, heads, d}, qkv.options()).transpose(1, 2);  // the output projection reads it so
      lse = empty({batch, heads, seq}, qkv.options().dtype(at::kFloat));
    } else {
      out = empty({t, heads, d}, qkv.options());
      lse = empty({heads, t}, qkv.options().dtype(at::kFloat));
    }
    const double scale = std::pow(static_cast<double>(d), -0.5);  // Python's d ** -0.5
    if (codes[kAttention] == kBrgemm || codes[kAttention] == kAmx) {
      const int64_t row_dim = padded ? 2 : 0;  // both read k's rows as bfloat16 pairs: an even row stride
      if (k.stride(row_dim) % 2) k = k.contiguous();
      (codes[kAttention] == kAmx ? ops().attention_amx : ops().attention_brgemm)
          .call(q, k, v, key_mask, cu_seqlens, scale, 0.0, 0, out, lse);
    } else {
      ops().attention.call(q, k, v, key_mask, cu_seqlens, scale, 0.0, 0, out, lse);
    }
    return (padded ? out.transpose(1, 2) : out).reshape({t, hidden});
  }
};

std::vector<at::Tensor> encoder_layer(const at::Tensor& x, const Opt& rows_q, const Opt& rows_scale,
                                      const Opt& rows_zero_point, const Opt& key_mask, const Opt& cu_seqlens,
                                      int64_t batch, int64_t seq, const c10::List<Opt>& weights,
                                      at::IntArrayRef codes, double eps, bool quantize_output) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "encoder_layer: x must be a contiguous [tokens, hidden] tensor");
  TORCH_CHECK(weights.size() == 20 && codes.size() == kCodes, "encoder_layer: 20 weight slots and ", int(kCodes),
              " codes (fastbert/ops/encoder_layer.py makes them)");
  TORCH_CHECK(batch == 0 || batch * seq == x.size(0), "encoder_layer: batch x seq must be x's rows when padded");
  TORCH_CHECK(rows_q.has_value() == rows_scale.has_value() && rows_q.has_value() == rows_zero_point.has_value(),
              "encoder_layer: rows_q, rows_scale and rows_zero_point come together (x quantized) or not at all");
  TORCH_CHECK(codes[kHeads] > 0 && x.size(1) % codes[kHeads] == 0 && codes[kAttention] >= kFastbert &&
                  codes[kAttention] <= kAmx && (codes[kAttention] != kTorchSdpa || batch > 0) &&
                  codes[kActivation] >= 1 && codes[kActivation] <= 2,
              "encoder_layer: codes out of range (heads must divide the hidden size; torch's SDPA is for padded "
              "batches only)");
  TORCH_CHECK(batch > 0 || cu_seqlens.has_value(), "encoder_layer: packed tokens (batch 0) need cu_seqlens");
  for (const int64_t code : {kQkvLinear, kOutLinear, kInLinear, kFfnLinear})
    TORCH_CHECK(codes[code] >= 0 && codes[code] <= (codes[kInt8] ? kOnednnGemm : kOnednnRows),
                "encoder_layer: a linear's code is out of range (Linear for float layers, Int8Gemm for int8)");
  const Layer layer{weights, codes, batch, seq, eps};
  const at::ScalarType dtype = x.scalar_type();
  const bool rows_in = rows_q.has_value();
  TORCH_CHECK(!rows_in || layer.int8(), "encoder_layer: quantized rows go in only to an int8 layer");
  const Rows x_rows = rows_in ? Rows{rows_q->reshape({x.size(0), -1}), *rows_scale, *rows_zero_point} : Rows{};

  const at::Tensor qkv = layer.linear(x, rows_in ? &x_rows : nullptr, 0, dtype, codes[kQkvLinear]);
  const at::Tensor context = layer.attention(qkv, key_mask, cu_seqlens);
  const at::Tensor y = layer.linear(context, nullptr, 4, dtype, codes[kOutLinear]);
  at::Tensor hidden, ffn_out;  // the LayerNorm's output (the next residual) and FFN out's
  if (layer.int8()) {
    const Rows h = layer.requantize(layer.layer_norm_quantize(y, x, 8, hidden), codes[kInLinear]);
    ffn_out = layer.linear(at::Tensor(), &h, 14, dtype, codes[kFfnLinear]);
  } else {
    hidden = layer.layer_norm(y, x, 8);
    const at::Tensor h = layer.linear(hidden, nullptr, 10, dtype, codes[kInLinear], /*gelu=*/true);
    ffn_out = layer.linear(h, nullptr, 14, dtype, codes[kFfnLinear]);
  }
  if (!quantize_output) return {layer.layer_norm(ffn_out, hidden, 18)};
  at::Tensor out;
  const Rows r = layer.layer_norm_quantize(ffn_out, hidden, 18, out);
  return {out, r.q, r.scale, r.zero_point};
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("encoder_layer", &fastbert::encoder_layer);
}

// oneDNN's packed weights are MkldnnCPU tensors: a float layer's call dispatches on that key.
TORCH_LIBRARY_IMPL(fastbert_C, MkldnnCPU, m) {
  m.impl("encoder_layer", &fastbert::encoder_layer);
}

#ifdef FASTBERT_WITH_CUDA
// On CUDA tensors the same calls reach CUDA kernels (at::linear on cuBLAS, fastbert_C's attention and
// add_layer_norm in csrc/cuda): the cuda backend's float layers (torch's linears, fastbert's attention).
TORCH_LIBRARY_IMPL(fastbert_C, CUDA, m) {
  m.impl("encoder_layer", &fastbert::encoder_layer);
}
#endif
