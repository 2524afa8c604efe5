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
  auto v = at::vec::convert_float_bfloat16(a, b);
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

}  // namespace fastbert
