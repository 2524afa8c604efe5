// bias_gelu on CPU: y = gelu(x + bias), exact (erf) or tanh form, and its backward.
// Vectorized over the hidden dimension in fp32 (float and bfloat16 storage), threaded over rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gelu.h"
#include "vec.h"

namespace fastbert {
namespace {

// Rows of `n` elements, f(r, bias as float); grain so a thread gets at least ~32K elements.
template <typename T, typename F>
void for_rows(int64_t rows, int64_t n, const T* bias, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> b(n);
    to_float(bias, b.data(), n);
    for (int64_t r = begin; r < end; ++r) f(r, b.data());
  });
}

template <typename T>
void forward(const T* x, const T* bias, T* out, int64_t rows, int64_t n, bool tanh_form) {
  for_rows(rows, n, bias, [&](int64_t r, const float* b) {
    const T* xr = x + r * n;
    T* yr = out + r * n;
    for_blocks(n, [&](int64_t j, int64_t m) {
      VecF x0, x1, b0, b1;
      load2(xr + j, m, x0, x1);
      load2(b + j, m, b0, b1);
      store2(yr + j, m, gelu<T>(x0 + b0, tanh_form), gelu<T>(x1 + b1, tanh_form));
    });
  });
}

template <typename T>
void backward(const T* grad, const T* x, const T* bias, T* grad_x, int64_t rows, int64_t n, bool tanh_form) {
  for_rows(rows, n, bias, [&](int64_t r, const float* b) {
    const int64_t o = r * n;
    for_blocks(n, [&](int64_t j, int64_t m) {
      VecF g0, g1, x0, x1, b0, b1;
      load2(grad + o + j, m, g0, g1);
      load2(x + o + j, m, x0, x1);
      load2(b + j, m, b0, b1);
      store2(grad_x + o + j, m, g0 * gelu_grad<T>(x0 + b0, tanh_form), g1 * gelu_grad<T>(x1 + b1, tanh_form));
    });
  });
}

void check(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous() && out.is_contiguous(), "bias_gelu: tensors must be contiguous");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "bias_gelu: bias must be [x.size(-1)]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "bias_gelu: out must match x");
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias dtypes differ");
}

void bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias, bool tanh_form, const at::Tensor& out) {
  check(x, bias, out);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  if (x.scalar_type() == at::kFloat) {
    forward(x.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(), rows, n, tanh_form);
  } else if (x.scalar_type() == at::kBFloat16) {
    forward(x.data_ptr<at::BFloat16>(), bias.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n, tanh_form);
  } else {
    TORCH_CHECK(false, "bias_gelu: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
}

void bias_gelu_bwd(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh_form,
                   const at::Tensor& grad_x) {
  check(x, bias, grad_x);
  TORCH_CHECK(grad.is_contiguous() && grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "bias_gelu: grad must match x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  if (x.scalar_type() == at::kFloat) {
    backward(grad.data_ptr<float>(), x.data_ptr<float>(), bias.data_ptr<float>(), grad_x.data_ptr<float>(), rows, n,
             tanh_form);
  } else if (x.scalar_type() == at::kBFloat16) {
    backward(grad.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), bias.data_ptr<at::BFloat16>(),
             grad_x.data_ptr<at::BFloat16>(), rows, n, tanh_form);
  } else {
    TORCH_CHECK(false, "bias_gelu: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("bias_gelu_fwd", &fastbert::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &fastbert::bias_gelu_bwd);
}
