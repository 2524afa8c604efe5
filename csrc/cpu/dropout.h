// Dropout keep decisions from a counter-based hash of (seed, position): a kernel's backward
// regenerates its forward's mask from the seed alone, and any thread can decide any element.
// Usable from CUDA device code too (csrc/cuda): under nvcc the functions are __host__ __device__, and
// the arithmetic is the same integer hashing and one exact int-to-float conversion on both sides, so a
// GPU kernel keeps exactly the elements the CPU kernel keeps.
#pragma once
#include <cmath>
#include <cstdint>
#if !defined(__CUDACC__) && defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#ifdef __CUDACC__
#define FASTBERT_HD __host__ __device__
#else
#define FASTBERT_HD
#endif

namespace fastbert {

FASTBERT_HD inline uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct Dropout {
  float p = 0.f;
  uint64_t seed = 0;
  float keep_scale = 1.f;  // 1 / (1 - p), from p in double: dropout_with()
  FASTBERT_HD bool on() const { return p > 0.f; }
  FASTBERT_HD float scale() const { return keep_scale; }
  // Element (row r, column j) of block (i, h): attention uses (sequence, head, query, key),
  // row-wise kernels (0, 0, row, column).
  FASTBERT_HD bool keep(int64_t i, int64_t h, int64_t r, int64_t j) const {
    uint64_t x = mix64(seed ^ mix64((uint64_t(i) << 32) ^ uint64_t(h)));
    x = mix64(x ^ ((uint64_t(r) << 32) | uint64_t(j)));
    return float(x >> 40) * (1.f / 16777216.f) >= p;  // a 24-bit uniform in [0, 1)
  }
};

// Dropout with probability p in [0, 1) (the caller checks). The scale is taken from p in double: p's float
// rounding passes into 1 / (1 - p) magnified (1.3e-5 at p = 0.999), and p = 1 - 1e-8 is 1 in float.
inline Dropout dropout_with(double p, uint64_t seed) {
  return Dropout{float(p), seed, float(1.0 / (1.0 - p))};
}

#ifndef __CUDACC__
// y[t] = keep(i, h, r + t * dr, j + t * dj) ? x[t] * scale() : 0 for t in [0, n): a run along a row
// (dr = 0, dj = 1) or a column (dr = 1, dj = 0); y may be x. The same decisions as keep(); with
// AVX-512 the hash runs on 8 positions a vector.
inline void dropout_run(const Dropout& d, int64_t i, int64_t h, int64_t r, int64_t j, int64_t dr, int64_t dj,
                        int64_t n, const float* x, float* y) {
  const float scale = d.scale();
  int64_t t = 0;
#ifdef CPU_CAPABILITY_AVX512
  const uint64_t base = mix64(d.seed ^ mix64((uint64_t(i) << 32) ^ uint64_t(h)));
  // keep <=> u * 2^-24 >= p for the 24-bit u, both sides exact: u >= ceil(p * 2^24)
  const __m512i threshold = _mm512_set1_epi64((long long)std::ceil(double(d.p) * 16777216.0));
  // Lane t hashes ((r + t * dr) << 32) | (j + t * dj) = key0 + t * step: the halves never carry while
  // j + n < 2^32 (j is a key or column index).
  const uint64_t step = (uint64_t(dr) << 32) | uint64_t(dj);
  __m512i key = _mm512_add_epi64(_mm512_set1_epi64((long long)((uint64_t(r) << 32) | uint64_t(j))),
                                 _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi64((long long)step)));
  const __m512i key_step = _mm512_set1_epi64((long long)(8 * step));
  auto mix = [](__m512i z) {  // mix64 on 8 lanes
    z = _mm512_add_epi64(z, _mm512_set1_epi64((long long)0x9E3779B97F4A7C15ull));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ull));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((long long)0x94D049BB133111EBull));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  };
  auto keep8 = [&]() {  // the next 8 decisions
    const __m512i z = mix(_mm512_xor_si512(_mm512_set1_epi64((long long)base), key));
    key = _mm512_add_epi64(key, key_step);
    return (unsigned)_mm512_cmpge_epu64_mask(_mm512_srli_epi64(z, 40), threshold);
  };
  for (; t < n; t += 16) {
    const int64_t m = n - t < 16 ? n - t : 16;
    const __mmask16 in = m == 16 ? 0xFFFF : (__mmask16)((1u << m) - 1);
    const unsigned low = keep8();
    const __mmask16 kept = (__mmask16)(low | (keep8() << 8)) & in;
    const __m512 v = _mm512_maskz_loadu_ps(in, x + t);
    _mm512_mask_storeu_ps(y + t, in, _mm512_maskz_mul_ps(kept, v, _mm512_set1_ps(scale)));
  }
#endif
  for (; t < n; ++t) y[t] = d.keep(i, h, r + t * dr, j + t * dj) ? x[t] * scale : 0.f;
}
#endif

}  // namespace fastbert
