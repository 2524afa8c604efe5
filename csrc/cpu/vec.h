// Loading and storing float / bfloat16 as pairs of float vectors: kernels compute in fp32 whatever
// the storage type. A "block" is 2 x VecF::size() elements (one Vectorized<BFloat16>).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <type_traits>

// avx512_bf16 in the build (setup.py adds -mavx512bf16 where the CPU has it): one-instruction bfloat16
// rounding (store2) and bfloat16 dot products (attention.cpp).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define FASTBERT_AVX512_BF16 1
#endif

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
#ifdef FASTBERT_AVX512_BF16
  // One instruction rounds 32 floats to nearest-even bfloat16; at::vec's conversion takes ~16.
  const at::vec::Vectorized<c10::BFloat16> v((__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
  auto v = at::vec::convert_float_bfloat16(a, b);
#endif
  if (n == kBlock) v.store(p); else v.store(p, n);
}

#if defined(CPU_CAPABILITY_AVX512)
// Lanes [0, n) of 16 (n may be <= 0 or >= 16): the mask of a vector's share of a tail.
inline __mmask16 lane_mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
#endif

// f(j, m) over [0, n) in blocks of m elements: every full block first, with m == kBlock a constant the
// compiler folds into plain loads and stores (no masks, no branches), then the tail.
template <typename F>
inline void for_blocks(int64_t n, const F& f) {
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) f(j, kBlock);
  if (j < n) f(j, n - j);
}

// f(j, m) over [0, n) in single vectors (m <= kHalf lanes), full ones first as in for_blocks.
template <typename F>
inline void for_vectors(int64_t n, const F& f) {
  int64_t j = 0;
  for (; j + kHalf <= n; j += kHalf) f(j, kHalf);
  if (j < n) f(j, n - j);
}

// n values as float (weights, biases: converted once per thread instead of once per row).
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t m = std::min(kBlock, n - j);
    VecF a, b;
    load2(src + j, m, a, b);
    store2(dst + j, m, a, b);
  }
}

// Sum / maximum of all lanes, in log2(lanes) shuffle steps.
inline float reduce_sum(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return a + b; }, v);
}

inline float reduce_max(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }, v);
}

// erf(x) = x * P(x^2) / Q(x^2): rational fits on |x| <= 3.92 (beyond it erf is +-1 in fp32), a few
// FMAs and one division where at::vec's erf calls Sleef's exp and divides too (GELU on CPU was
// bound by that erf). Fitted for fastbert (weighted least squares toward minimax, float64).
template <int kTerms>
inline VecF erf_rational(const VecF& x, const float (&p)[kTerms], const float (&q)[kTerms]) {
  const VecF xc = at::vec::clamp(x, VecF(-3.92f), VecF(3.92f));
  const VecF t = xc * xc;
  VecF num(p[kTerms - 1]), den(q[kTerms - 1]);
  for (int i = kTerms - 2; i >= 0; --i) {
    num = at::vec::fmadd(num, t, VecF(p[i]));
    den = at::vec::fmadd(den, t, VecF(q[i]));
  }
  return xc * num / den;
}

// Max abs error 4e-7 in fp32 arithmetic: for float storage.
inline VecF erf_fp32(const VecF& x) {
  static constexpr float p[] = {1.128378987e+00f, 1.927641630e-01f, 5.306049809e-02f,
                                3.868332598e-03f, 2.874796337e-04f, 2.034736099e-06f};
  static constexpr float q[] = {1.f, 5.041644573e-01f, 1.150846630e-01f,
                                1.517230645e-02f, 1.188116614e-03f, 3.807066605e-05f};
  return erf_rational(x, p, q);
}

// Max abs error 2e-5, far below bfloat16's rounding (4e-3) and four FMAs cheaper: for bfloat16 storage.
inline VecF erf_bf16(const VecF& x) {
  static constexpr float p[] = {1.128271222e+00f, 1.713629663e-01f, 4.139881954e-02f, 6.224965909e-04f};
  static constexpr float q[] = {1.f, 4.846202433e-01f, 9.918395430e-02f, 8.282025345e-03f};
  return erf_rational(x, p, q);
}

// e^x within 1 ulp (0.99 at worst over every float in [-104, 89], denormal results included), inline:
// Sleef's 1-ulp exp, which at::vec calls, is an out-of-line call that makes a softmax loop spill its
// accumulators around every call. x = n ln2 + r with |r| <= ln2 / 2 (ln2 split so n ln2 is exact), e^r
// by a degree-7 polynomial (minimax fit), times 2^n by scalef (rounds into denormals, inf past 88.72).
// Clamping x to [-104, 89] first keeps n finite; a NaN passes both clamps (they return their second
// operand when one is NaN). Builds without AVX-512 keep Sleef's.
inline VecF exp_fp32(const VecF& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  static constexpr float c[] = {5.000000000e-01f, 1.666666567e-01f, 4.166629538e-02f,
                                8.333496749e-03f, 1.394465100e-03f, 1.979036606e-04f};
  __m512 q = _mm512_set1_ps(c[5]);
  for (int i = 4; i >= 0; --i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(c[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
#else
  return x.exp();
#endif
}

// e^x within 1e-5 relative, far below bfloat16's rounding (2^-9): the bfloat16 softmax's exp, inline and
// cheaper than at::vec's exp_u20 (2-5% off a bf16 attention forward: RESULTS.md). 2^t (t = x log2 e) as 2^n 2^f, n = round(t), |f| <= 1/2; 2^f
// by a degree-4 polynomial (fit to relative error, 2.7e-6 at worst), times 2^n by scalef. The clamps keep n
// finite (0 below -104, inf past 89) and let a NaN through, as in exp_fp32.
inline VecF exp_bf16(const VecF& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  static constexpr float c[] = {9.999992847e-01f, 6.931217909e-01f, 2.402474433e-01f, 5.591786280e-02f,
                                9.570102207e-03f};
  __m512 p = _mm512_set1_ps(c[4]);
  for (int i = 3; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
#else
  return x.exp_u20();
#endif
}

template <typename T>
inline VecF erf_for(const VecF& x) {
  return std::is_same_v<T, float> ? erf_fp32(x) : erf_bf16(x);
}

}  // namespace fastbert
