// add_layer_norm on CPU: y = LayerNorm(dropout(x) + residual) over the last dimension, and its
// backward. Statistics in fp32 (saved for backward as mean and rstd); float and bfloat16 storage;
// rows are spread over threads, each row vectorized. Backward recomputes h = dropout(x) + residual
// instead of saving it: the dropout mask comes back from the seed (dropout.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dropout.h"
#include "vec.h"

namespace fastbert {
namespace {

// Row r's dropout multipliers (0 or 1 / (1 - p)) into `mult`; false (and nothing written) without dropout.
bool row_multipliers(const Dropout& dropout, int64_t r, int64_t n, std::vector<float>& mult) {
  if (!dropout.on()) return false;
  mult.resize(n);
  for (int64_t j = 0; j < n; ++j) mult[j] = dropout.keep(0, 0, r, j) ? dropout.scale() : 0.f;
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

template <typename T>
void forward(const T* x, const T* res, const T* w, const T* b, T* y, float* mean_out, float* rstd_out,
             int64_t rows, int64_t n, float eps, const Dropout& dropout) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    // h = dropout(x) + residual is formed once per row in fp32 (it stays in L1 for the next two
    // passes); weight and bias once per thread.
    std::vector<float> mult, h(n), wf(n), bf(n);
    to_float(w, wf.data(), n);
    to_float(b, bf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      const T* rr = res + r * n;
      const float* mr = row_multipliers(dropout, r, n, mult) ? mult.data() : nullptr;
      // The mean is taken relative to the row's first element, so a constant row's mean (and a zero
      // variance) come out exact instead of one rounding off, which rstd would magnify.
      const float shift = static_cast<float>(xr[0]) * (mr ? mr[0] : 1.f) + static_cast<float>(rr[0]);
      VecF acc0(0.f), acc1(0.f);  // two chains: a single one would wait on each add's latency
      for_blocks(n, [&](int64_t j, int64_t m) {
        VecF x0, x1, r0, r1;
        load_x(xr + j, mr ? mr + j : nullptr, m, x0, x1);
        load2(rr + j, m, r0, r1);
        const VecF h0 = x0 + r0, h1 = x1 + r1;
        store2(h.data() + j, m, h0, h1);
        VecF d0 = h0 - VecF(shift), d1 = h1 - VecF(shift);
        if (m < kBlock) {  // lanes past m would contribute -shift
          d0 = VecF::set(VecF(0.f), d0, std::min(m, kHalf));
          d1 = VecF::set(VecF(0.f), d1, std::max<int64_t>(m - kHalf, 0));
        }
        acc0 = acc0 + d0;
        acc1 = acc1 + d1;
      });
      const float mean = shift + reduce_sum(acc0 + acc1) / n;
      VecF sq0(0.f), sq1(0.f);
      const VecF vmean(mean);
      for_blocks(n, [&](int64_t j, int64_t m) {
        VecF h0, h1;
        load2(h.data() + j, m, h0, h1);
        VecF d0 = h0 - vmean, d1 = h1 - vmean;
        if (m < kBlock) {  // zero lanes past m, which would contribute mean^2
          d0 = VecF::set(VecF(0.f), d0, std::min(m, kHalf));
          d1 = VecF::set(VecF(0.f), d1, std::max<int64_t>(m - kHalf, 0));
        }
        sq0 = at::vec::fmadd(d0, d0, sq0);
        sq1 = at::vec::fmadd(d1, d1, sq1);
      });
      const float var = reduce_sum(sq0 + sq1) / n;
      const float rstd = 1.f / std::sqrt(var + eps);
      mean_out[r] = mean;
      rstd_out[r] = rstd;
      const VecF vrstd(rstd);
      T* yr = y + r * n;
      for_blocks(n, [&](int64_t j, int64_t m) {
        VecF h0, h1, w0, w1, b0, b1;
        load2(h.data() + j, m, h0, h1);
        load2(wf.data() + j, m, w0, w1);
        load2(bf.data() + j, m, b0, b1);
        store2(yr + j, m, at::vec::fmadd((h0 - vmean) * vrstd, w0, b0), at::vec::fmadd((h1 - vmean) * vrstd, w1, b1));
      });
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
  return Dropout{float(p), uint64_t(seed)};
}

void add_layer_norm_fwd(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        const at::Tensor& bias, double eps, double dropout_p, int64_t seed, const at::Tensor& out,
                        const at::Tensor& mean, const at::Tensor& rstd) {
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
            out.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, n, (float)eps, dropout);
  } else if (x.scalar_type() == at::kBFloat16) {
    forward(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
            bias.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), mean.data_ptr<float>(),
            rstd.data_ptr<float>(), rows, n, (float)eps, dropout);
  } else {
    TORCH_CHECK(false, "add_layer_norm: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
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
}
