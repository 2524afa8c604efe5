// GELU and its derivative on fp32 vectors (exact erf or tanh form): bias_gelu's kernels and the int8
// GEMM's epilogue (quantized_dense.cpp) apply the same function.
#pragma once
#include "vec.h"

namespace fastbert {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhScale = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;

// 1 + erf(x / sqrt 2), at least 0 (a NaN kept): the bfloat16 erf passes -1 by ~2e-5 at its clamp, and
// x (1 + erf) would then grow with |x| below x = -5.5, with the wrong sign (GELU(-1e6) was 8.56).
template <typename T>
inline VecF one_plus_erf(const VecF& x) {
  const VecF y = VecF(1.f) + erf_for<T>(x * VecF(kInvSqrt2));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(_mm512_setzero_ps(), y);  // max returns its second operand when either is NaN
#else
  return at::vec::maximum(y, VecF(0.f));
#endif
}

template <typename T>
inline VecF gelu(const VecF& x, bool tanh_form) {
  const VecF half(0.5f), one(1.f);
  if (tanh_form) {
    VecF inner = VecF(kTanhScale) * (x + VecF(kTanhCubic) * x * x * x);
    return half * x * (one + inner.tanh());
  }
  return half * x * one_plus_erf<T>(x);
}

// d gelu(x) / dx
template <typename T>
inline VecF gelu_grad(const VecF& x, bool tanh_form) {
  const VecF half(0.5f), one(1.f);
  if (tanh_form) {
    VecF x2 = x * x;
    VecF t = (VecF(kTanhScale) * (x + VecF(kTanhCubic) * x2 * x)).tanh();
    VecF dinner = VecF(kTanhScale) * (one + VecF(3.f * kTanhCubic) * x2);
    // Past |x| ~ 1.8e19 x^2 is inf where 1 - t^2 is 0: the term is 0 wherever 1 - t^2 is (not 0 * inf = NaN).
    const VecF sech2 = one - t * t;
    return half * (one + t) + VecF::blendv(half * x * sech2 * dinner, VecF(0.f), sech2 == VecF(0.f));
  }
  VecF cdf = half * one_plus_erf<T>(x);
  VecF pdf = VecF(kInvSqrt2Pi) * (VecF(-0.5f) * x * x).exp();
  return cdf + x * pdf;
}

}  // namespace fastbert
