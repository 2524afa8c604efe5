// Dropout keep decisions from a counter-based hash of (seed, position): a kernel's backward
// regenerates its forward's mask from the seed alone, and any thread can decide any element.
// Usable from CUDA device code too (csrc/cuda): under nvcc the functions are __host__ __device__, and
// the arithmetic is the same integer hashing and one exact int-to-float conversion on both sides, so a
// GPU kernel keeps exactly the elements the CPU kernel keeps.
#pragma once
#include <cstdint>

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
  FASTBERT_HD bool on() const { return p > 0.f; }
  FASTBERT_HD float scale() const { return 1.f / (1.f - p); }
  // Element (row r, column j) of block (i, h): attention uses (sequence, head, query, key),
  // row-wise kernels (0, 0, row, column).
  FASTBERT_HD bool keep(int64_t i, int64_t h, int64_t r, int64_t j) const {
    uint64_t x = mix64(seed ^ mix64((uint64_t(i) << 32) ^ uint64_t(h)));
    x = mix64(x ^ ((uint64_t(r) << 32) | uint64_t(j)));
    return float(x >> 40) * (1.f / 16777216.f) >= p;  // a 24-bit uniform in [0, 1)
  }
};

}  // namespace fastbert
