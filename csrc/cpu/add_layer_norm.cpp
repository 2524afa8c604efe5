// add_layer_norm on CPU: y = LayerNorm(dropout(x) + residual) over the last dimension, and its
// backward. Statistics in fp32 (saved for backward as mean and rstd); float and bfloat16 storage;
// rows are spread over threads, each row vectorized. Backward recomputes h = dropout(x) + residual
// instead of saving it: the dropout mask comes back from the seed (dropout.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>

#include "dropout.h"
#include "quantize.h"
#include "vec.h"

namespace fastbert {
namespace {

// Row r's dropout multipliers (0 or 1 / (1 - p)) into `mult`; false (and nothing written) without dropout.
bool row_multipliers(const Dropout& dropout, int64_t r, int64_t n, std::vector<float>& mult) {
  if (!dropout.on()) return false;
  mult.resize(n);
  std::fill(mult.begin(), mult.begin() + n, 1.f);
  dropout_run(dropout, 0, 0, r, 0, 0, 1, n, mult.data(), mult.data());
  return true;
}

// x[j : j + m] as two float vectors, times the dropout multipliers when there are any.
template <typename T>
inline void load_x(const T* x, const float* mult, int64_t m, VecF& a, VecF& b) {
  load2(x, m, a, b);
  if (mult != nullptr) {
    VecF m0, m1;
    load2(mult, m, m0, m1);
    a = a * m0;
    b = b * m1;
  }
}

// Lanes [m, kBlock) of (a, b) set to zero: past a row's end they would add -shift or -mean.
inline void zero_past(int64_t m, VecF& a, VecF& b) {
  if (m < kBlock) {
    a = VecF::set(VecF(0.f), a, std::min(m, kHalf));
    b = VecF::set(VecF(0.f), b, std::max<int64_t>(m - kHalf, 0));
  }
}

// Where an int8 GEMM reads the output next (inference): each row also quantized to uint8 as
// quantize_rows does it, while the row is still in L1, instead of in a second pass over memory.
struct RowQuantization {
  uint8_t* q;
  float* scale;
  int32_t* zero_point;
};

// A row's mean and (biased) variance in double, two passes over h as h_at(j, m, h0, h1) gives it.
template <typename HAt>
std::pair<double, double> moments_in_double(const HAt& h_at, int64_t n) {
  std::vector<float> h(n);
  for_blocks(n, [&](int64_t j, int64_t m) {
    VecF h0, h1;
    h_at(j, m, h0, h1);
    store2(h.data() + j, m, h0, h1);
  });
  double sum = 0.0, squares = 0.0;
  for (const float v : h) sum += v;
  const double mean = sum / n;
  for (const float v : h) squares += (v - mean) * (v - mean);
  return {mean, squares / n};
}

// One pass for the statistics, one for the output; x and residual are re-read (from L1) rather than h
// being stored, and weight and bias are converted once per thread. The sums are taken around `shift`,
// about the mean of the row's first block (kBlock = 32 elements with AVX-512, 16 with AVX2): for an
// ordinary row within ~std/sqrt(kBlock) of the true mean, so var = E[d^2] - E[d]^2 loses almost
// nothing to cancellation. Where E[d]^2 exceeds the variance (it can reach n/kBlock times it: a row
// whose first block sits far from the rest) the sums are taken again around the mean, as a two-pass
// LayerNorm does; so E[d^2] is never more than twice the variance it yields.
template <typename T>
void forward(const T* x, const T* res, const T* w, const T* b, T* y, float* mean_out, float* rstd_out,
             int64_t rows, int64_t n, float eps, const Dropout& dropout, const RowQuantization* quantized = nullptr) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> mult, wf(n), bf(n);  // weight and bias as float once per thread
    to_float(w, wf.data(), n);
    to_float(b, bf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      const T* rr = res + r * n;
      const float* mr = row_multipliers(dropout, r, n, mult) ? mult.data() : nullptr;
      auto h_at = [&](int64_t j, int64_t m, VecF& h0, VecF& h1) {  // dropout(x) + residual, fp32
        VecF r0, r1;
        load_x(xr + j, mr ? mr + j : nullptr, m, h0, h1);
        load2(rr + j, m, r0, r1);
        h0 = h0 + r0;
        h1 = h1 + r1;
      };
      // The shift: h[0] plus the mean deviation from it over the first block. Taken relative to h[0], a
      // constant row's shift (and so its mean) is that constant exactly and its variance exactly zero.
      const int64_t first = std::min(n, kBlock);
      VecF f0, f1;
      h_at(0, first, f0, f1);
      const float first_h = static_cast<float>(xr[0]) * (mr ? mr[0] : 1.f) + static_cast<float>(rr[0]);
      f0 = f0 - VecF(first_h);
      f1 = f1 - VecF(first_h);
      zero_past(first, f0, f1);
      const float shift = first_h + reduce_sum(f0 + f1) / first;
      // (sum of d, sum of d^2) over the row, d = h - c; two chains each: one would wait on every add.
      auto sums_around = [&](float c) {
        const VecF vc(c);
        VecF s0(0.f), s1(0.f), q0(0.f), q1(0.f);
        for_blocks(n, [&](int64_t j, int64_t m) {
          VecF h0, h1;
          h_at(j, m, h0, h1);
          VecF d0 = h0 - vc, d1 = h1 - vc;
          zero_past(m, d0, d1);
          s0 = s0 + d0;
          s1 = s1 + d1;
          q0 = at::vec::fmadd(d0, d0, q0);
          q1 = at::vec::fmadd(d1, d1, q1);
        });
        return std::make_pair(reduce_sum(s0 + s1) / n, reduce_sum(q0 + q1) / n);
      };
      const auto [mean_d, mean_d2] = sums_around(shift);
      float mean = shift + mean_d;
      float var = mean_d2 - mean_d * mean_d;
      if (mean_d * mean_d > 0.5f * mean_d2) {
        // The first block was far from the mean: d was large where h was not, and the sums lost bits.
        // Take them again around the mean (the corrected two-pass algorithm: the mean gets the residual
        // mean of the deviations, the variance loses its square).
        const auto [correction, around_mean] = sums_around(mean);
        mean += correction;
        var = around_mean - correction * correction;
      }
      float rstd = 1.f / std::sqrt(std::max(var, 0.f) + eps);
      if (!std::isfinite(var)) {
        // The squares left float's range (deviations past ~1e17 in a row of 768): var came out inf - inf
        // = NaN, or inf and rstd 0 (the row was the bias alone). LayerNorm is scale-invariant, so such a
        // row has an ordinary answer: its moments again in double, two passes (rare rows; h's own NaN or
        // inf still gives NaN).
        const auto [m, v] = moments_in_double(h_at, n);
        mean = static_cast<float>(m);
        rstd = static_cast<float>(1.0 / std::sqrt(std::max(v, 0.0) + eps));
      }
      mean_out[r] = mean;
      rstd_out[r] = rstd;
      const VecF vmean(mean), vrstd(rstd);
      T* yr = y + r * n;
      for_blocks(n, [&](int64_t j, int64_t m) {
        VecF h0, h1, w0, w1, b0, b1;
        h_at(j, m, h0, h1);
        load2(wf.data() + j, m, w0, w1);
        load2(bf.data() + j, m, b0, b1);
        store2(yr + j, m, at::vec::fmadd((h0 - vmean) * vrstd, w0, b0), at::vec::fmadd((h1 - vmean) * vrstd, w1, b1));
      });
      if (quantized != nullptr)
        quantize_row(yr, n, quantized->q + r * n, quantized->scale + r, quantized->zero_point + r);
    }
  });
}

// grad_h = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); grad_w = sum g*xhat; grad_b = sum g.
template <typename T>
void backward(const T* g, const T* x, const T* res, const T* w, const float* mean, const float* rstd, T* grad_h,
              T* grad_x, float* grad_w, float* grad_b, int64_t rows, int64_t n, const Dropout& dropout) {
  // Each chunk of rows accumulates its own grad_w / grad_b partials; they are summed at the end.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
  std::vector<float> partial(2 * chunks * n, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    std::vector<float> mult;
    for (int64_t c = c_begin; c < c_end; ++c) {
      float* pw = partial.data() + (2 * c) * n;
      float* pb = pw + n;
      for (int64_t r = c * rows / chunks; r < (c + 1) * rows / chunks; ++r) {
        const int64_t o = r * n;
        const VecF vmean(mean[r]), vrstd(rstd[r]);
        const float* mr = row_multipliers(dropout, r, n, mult) ? mult.data() : nullptr;
        VecF s1(0.f), s2(0.f);
        for (int64_t j = 0; j < n; j += kBlock) {
          const int64_t m = std::min(kBlock, n - j);
          VecF g0, g1, x0, x1, r0, r1, w0, w1, pw0, pw1, pb0, pb1;
          load2(g + o + j, m, g0, g1);
          load_x(x + o + j, mr ? mr + j : nullptr, m, x0, x1);
          load2(res + o + j, m, r0, r1);
          load2(w + j, m, w0, w1);
          VecF xh0 = (x0 + r0 - vmean) * vrstd, xh1 = (x1 + r1 - vmean) * vrstd;
          VecF d0 = g0 * w0, d1 = g1 * w1;  // zero past m: g lanes are zero
          s1 = s1 + d0 + d1;
          s2 = s2 + d0 * xh0 + d1 * xh1;
          load2(pw + j, m, pw0, pw1);
          load2(pb + j, m, pb0, pb1);
          store2(pw + j, m, pw0 + g0 * xh0, pw1 + g1 * xh1);
          store2(pb + j, m, pb0 + g0, pb1 + g1);
        }
        const VecF mean_d(reduce_sum(s1) / n), mean_dx(reduce_sum(s2) / n);
        for (int64_t j = 0; j < n; j += kBlock) {
          const int64_t m = std::min(kBlock, n - j);
          VecF g0, g1, x0, x1, r0, r1, w0, w1;
          load2(g + o + j, m, g0, g1);
          load_x(x + o + j, mr ? mr + j : nullptr, m, x0, x1);
          load2(res + o + j, m, r0, r1);
          load2(w + j, m, w0, w1);
          VecF xh0 = (x0 + r0 - vmean) * vrstd, xh1 = (x1 + r1 - vmean) * vrstd;
          const VecF dh0 = vrstd * (g0 * w0 - mean_d - xh0 * mean_dx), dh1 = vrstd * (g1 * w1 - mean_d - xh1 * mean_dx);
          store2(grad_h + o + j, m, dh0, dh1);
          if (mr != nullptr) {  // d(dropout(x)) / dx: the same multipliers
            VecF m0, m1;
            load2(mr + j, m, m0, m1);
            store2(grad_x + o + j, m, dh0 * m0, dh1 * m1);
          }
        }
      }
    }
  });
  for (int64_t j = 0; j < n; ++j) {
    float sw = 0.f, sb = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      sw += partial[(2 * c) * n + j];
      sb += partial[(2 * c + 1) * n + j];
    }
    grad_w[j] = sw;
    grad_b[j] = sb;
  }
}

void check_same(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(),
              "add_layer_norm: ", what, " must be contiguous and match x in shape and dtype");
}

void check_stats(const at::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == rows && t.scalar_type() == at::kFloat,
              "add_layer_norm: ", what, " must be float32 with one value per row");
}

Dropout make_dropout(double p, int64_t seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "add_layer_norm: dropout_p must be in [0, 1), got ", p);
  return dropout_with(p, uint64_t(seed));
}

void checked_forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, const at::Tensor& bias,
                     double eps, double dropout_p, int64_t seed, const at::Tensor& out, const at::Tensor& mean,
                     const at::Tensor& rstd, const RowQuantization* quantized) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(x.is_contiguous(), "add_layer_norm: x must be contiguous");
  check_same(residual, x, "residual");
  check_same(out, x, "out");
  TORCH_CHECK(weight.is_contiguous() && bias.is_contiguous() && weight.numel() == n && bias.numel() == n &&
                  weight.scalar_type() == x.scalar_type() && bias.scalar_type() == x.scalar_type(),
              "add_layer_norm: weight and bias must be [N] in x's dtype");
  check_stats(mean, rows, "mean");
  check_stats(rstd, rows, "rstd");
  if (x.scalar_type() == at::kFloat) {
    forward(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
            out.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, n, (float)eps, dropout,
            quantized);
  } else if (x.scalar_type() == at::kBFloat16) {
    forward(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
            bias.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), mean.data_ptr<float>(),
            rstd.data_ptr<float>(), rows, n, (float)eps, dropout, quantized);
  } else {
    TORCH_CHECK(false, "add_layer_norm: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
}

void add_layer_norm_fwd(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        const at::Tensor& bias, double eps, double dropout_p, int64_t seed, const at::Tensor& out,
                        const at::Tensor& mean, const at::Tensor& rstd) {
  checked_forward(x, residual, weight, bias, eps, dropout_p, seed, out, mean, rstd, nullptr);
}

// Inference: the output and its per-row uint8 quantization (no dropout, no statistics kept).
void add_layer_norm_quantize(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                             const at::Tensor& bias, double eps, const at::Tensor& out, const at::Tensor& q,
                             const at::Tensor& q_scale, const at::Tensor& q_zero_point) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == at::kByte,
              "add_layer_norm_quantize: q must be uint8 shaped like x");
  check_stats(q_scale, rows, "q_scale");
  TORCH_CHECK(q_zero_point.numel() == rows && q_zero_point.is_contiguous() && q_zero_point.scalar_type() == at::kInt,
              "add_layer_norm_quantize: q_zero_point must be int32 [rows]");
  const RowQuantization quantized{q.data_ptr<uint8_t>(), q_scale.data_ptr<float>(), q_zero_point.data_ptr<int32_t>()};
  auto stats = at::empty({2, rows}, x.options().dtype(at::kFloat));
  checked_forward(x, residual, weight, bias, eps, 0.0, 0, out, stats[0], stats[1], &quantized);
}

void add_layer_norm_bwd(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
                        int64_t seed, const at::Tensor& grad_h, const at::Tensor& grad_x, const at::Tensor& grad_weight,
                        const at::Tensor& grad_bias) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  if (dropout.on()) check_same(grad_x, x, "grad_x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(x.is_contiguous(), "add_layer_norm: x must be contiguous");
  check_same(grad, x, "grad");
  check_same(residual, x, "residual");
  check_same(grad_h, x, "grad_h");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "add_layer_norm: weight must be [N] in x's dtype");
  check_stats(mean, rows, "mean");
  check_stats(rstd, rows, "rstd");
  TORCH_CHECK(grad_weight.is_contiguous() && grad_weight.numel() == n && grad_weight.scalar_type() == at::kFloat &&
                  grad_bias.is_contiguous() && grad_bias.numel() == n && grad_bias.scalar_type() == at::kFloat,
              "add_layer_norm: grad_weight and grad_bias must be float32 [N]");
  if (x.scalar_type() == at::kFloat) {
    backward(grad.data_ptr<float>(), x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
             mean.data_ptr<float>(), rstd.data_ptr<float>(), grad_h.data_ptr<float>(),
             dropout.on() ? grad_x.data_ptr<float>() : nullptr, grad_weight.data_ptr<float>(), grad_bias.data_ptr<float>(),
             rows, n, dropout);
  } else if (x.scalar_type() == at::kBFloat16) {
    backward(grad.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
             weight.data_ptr<at::BFloat16>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
             grad_h.data_ptr<at::BFloat16>(), dropout.on() ? grad_x.data_ptr<at::BFloat16>() : nullptr,
             grad_weight.data_ptr<float>(), grad_bias.data_ptr<float>(), rows, n, dropout);
  } else {
    TORCH_CHECK(false, "add_layer_norm: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("add_layer_norm_fwd", &fastbert::add_layer_norm_fwd);
  m.impl("add_layer_norm_bwd", &fastbert::add_layer_norm_bwd);
  m.impl("add_layer_norm_quantize", &fastbert::add_layer_norm_quantize);
}
