// Loading and storing float / bfloat16 as pairs of float vectors: kernels compute in fp32 whatever
// the storage type. A "block" is 2 x VecF::size() elements (one Vectorized<BFloat16>).
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

namespace fastbert {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kHalf = VecF::size();
constexpr int64_t kBlock = 2 * kHalf;

// Load `n` (<= kBlock) elements at `p` into a, b; lanes past n are zero.
inline void load2(const float* p, int64_t n, VecF& a, VecF& b) {
  if (n == kBlock) {
    a = VecF::loadu(p);
    b = VecF::loadu(p + kHalf);
  } else {
    a = VecF::loadu(p, std::min(n, kHalf));
    b = n > kHalf ? VecF::loadu(p + kHalf, n - kHalf) : VecF(0.f);
  }
}

inline void load2(const c10::BFloat16* p, int64_t n, VecF& a, VecF& b) {
  using VecB = at::vec::Vectorized<c10::BFloat16>;
  auto v = n == kBlock ? VecB::loadu(p) : VecB::loadu(p, n);
  std::tie(a, b) = at::vec::convert_bfloat16_float(v);
}

inline void store2(float* p, int64_t n, const VecF& a, const VecF& b) {
  if (n == kBlock) {
    a.store(p);
    b.store(p + kHalf);
  } else {
    a.store(p, std::min(n, kHalf));
    if (n > kHalf) b.store(p + kHalf, n - kHalf);
  }
}

inline void store2(c10::BFloat16* p, int64_t n, const VecF& a, const VecF& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  // One instruction rounds 32 floats to nearest-even bfloat16; at::vec's conversion takes ~16.
  const at::vec::Vectorized<c10::BFloat16> v((__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
  auto v = at::vec::convert_float_bfloat16(a, b);
#endif
  if (n == kBlock) v.store(p); else v.store(p, n);
}

// Sum of all lanes (once per row: a plain loop is fine).
inline float reduce_sum(const VecF& v) {
  alignas(64) float lanes[kHalf];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kHalf; ++i) s += lanes[i];
  return s;
}

// erf(x) = x * P(x^2) / Q(x^2), a rational fit on |x| <= 3.92 (beyond it erf is +-1 in fp32), max
// abs error 4e-7 in fp32: a few FMAs and one division where at::vec's erf calls Sleef's exp and
// divides too (GELU on CPU was bound by that erf).
inline VecF erf_fast(const VecF& x) {
  const VecF xc = at::vec::clamp(x, VecF(-3.92f), VecF(3.92f));
  const VecF t = xc * xc;
  using at::vec::fmadd;
  VecF p = fmadd(VecF(2.034736099e-06f), t, VecF(2.874796337e-04f));
  p = fmadd(p, t, VecF(3.868332598e-03f));
  p = fmadd(p, t, VecF(5.306049809e-02f));
  p = fmadd(p, t, VecF(1.927641630e-01f));
  p = fmadd(p, t, VecF(1.128378987e+00f));
  VecF q = fmadd(VecF(3.807066605e-05f), t, VecF(1.188116614e-03f));
  q = fmadd(q, t, VecF(1.517230645e-02f));
  q = fmadd(q, t, VecF(1.150846630e-01f));
  q = fmadd(q, t, VecF(5.041644573e-01f));
  q = fmadd(q, t, VecF(1.f));
  return xc * p / q;
}

}  // namespace fastbert
