// GELU and its derivative on fp32 vectors (exact erf or tanh form): bias_gelu's kernels and the int8
// GEMM's epilogue (quantized_dense.cpp) apply the same function.
#pragma once
#include "vec.h"

namespace fastbert {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhScale = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;

template <typename T>
inline VecF gelu(const VecF& x, bool tanh_form) {
  const VecF half(0.5f), one(1.f);
  if (tanh_form) {
    VecF inner = VecF(kTanhScale) * (x + VecF(kTanhCubic) * x * x * x);
    return half * x * (one + inner.tanh());
  }
  return half * x * (one + erf_for<T>(x * VecF(kInvSqrt2)));
}

// d gelu(x) / dx
template <typename T>
inline VecF gelu_grad(const VecF& x, bool tanh_form) {
  const VecF half(0.5f), one(1.f);
  if (tanh_form) {
    VecF x2 = x * x;
    VecF t = (VecF(kTanhScale) * (x + VecF(kTanhCubic) * x2 * x)).tanh();
    VecF dinner = VecF(kTanhScale) * (one + VecF(3.f * kTanhCubic) * x2);
    return half * (one + t) + half * x * (one - t * t) * dinner;
  }
  VecF cdf = half * (one + erf_for<T>(x * VecF(kInvSqrt2)));
  VecF pdf = VecF(kInvSqrt2Pi) * (VecF(-0.5f) * x * x).exp();
  return cdf + x * pdf;
}

}  // namespace fastbert
