// Per-row uint8 quantization shared by the kernels that feed an int8 GEMM (quantized_dense.cpp and
// add_layer_norm.cpp): the same float steps as reference.py's quantize_rows, so all produce its bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "vec.h"

namespace fastbert {

inline float reduce_min(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return at::vec::minimum(a, b); }, v);
}

// m (<= kBlock) lanes of a, b, whole numbers in [0, 255], as bytes at q.
inline void store_bytes(uint8_t* q, int64_t m, const VecF& a, const VecF& b) {
#if defined(CPU_CAPABILITY_AVX512)
  // Truncating to int32 then narrowing to bytes (vpmovdb) is exact for whole numbers in range: a
  // block in four instructions, where the byte-by-byte loop below costs one store per value.
  _mm512_mask_cvtepi32_storeu_epi8(q, lane_mask(m), _mm512_cvttps_epi32(a));
  _mm512_mask_cvtepi32_storeu_epi8(q + kHalf, lane_mask(m - kHalf), _mm512_cvttps_epi32(b));
#else
  float buf[kBlock];
  a.store(buf);
  b.store(buf + kHalf);
  for (int64_t i = 0; i < m; ++i) q[i] = static_cast<uint8_t>(buf[i]);
#endif
}

// q = clamp(round(x * inv) + z, 0, 255) for k values.
template <typename T>
void quantize_values(const T* x, int64_t k, float inv, float z, uint8_t* q) {
  const VecF vinv(inv), vz(z), zero(0.f), top(255.f);
  for_blocks(k, [&](int64_t j, int64_t m) {
    VecF a, b;
    load2(x + j, m, a, b);
    store_bytes(q + j, m, at::vec::clamp((a * vinv).round() + vz, zero, top),
                at::vec::clamp((b * vinv).round() + vz, zero, top));
  });
}

// One row: lo = min(0, x), hi = max(0, x), scale = (hi - lo) / 255, zero point = round(-lo / scale),
// q = clamp(round(x / scale) + zero point, 0, 255), in exactly this float arithmetic (reference.py's
// quantize_rows does the same steps, so both produce the same bytes). A NaN in the row makes its scale NaN.
template <typename T>
void quantize_row(const T* x, int64_t k, uint8_t* q, float* scale, int32_t* zero_point) {
  VecF lo(0.f), hi(0.f);
  for_blocks(k, [&](int64_t j, int64_t m) {
    VecF a, b;
    load2(x + j, m, a, b);  // lanes past m are zero: the range includes 0 anyway
    lo = at::vec::minimum(lo, at::vec::minimum(a, b));
    hi = at::vec::maximum(hi, at::vec::maximum(a, b));
  });
  const float l = reduce_min(lo), h = reduce_max(hi);
  float s = (h - l) / 255.f;
  if (s == 0.f) s = 1.f;  // an all-zero row
  s = std::max(s, std::numeric_limits<float>::min());  // a tiny range: 1 / s stays finite
  const float inv = 1.f / s;
  const float z = std::min(std::max(std::nearbyint(-l * inv), 0.f), 255.f);
  *scale = s;
  *zero_point = static_cast<int32_t>(z);
  quantize_values(x, k, inv, z, q);
}

}  // namespace fastbert
