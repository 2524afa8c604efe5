// fastbert's own u8 x s8 GEMM: acc[m, n] = scale[n] * float(sum_k q[m, k] * w[n, k]), the int32 sum exact
// and one float32 multiply, as oneDNN's qlinear_pointwise computes it with activation scale 1 and zero
// point 0 (quantized_dense.cpp's epilogues take either one's output). For torch builds without oneDNN's
// quantized ops, and CPUs oneDNN serves badly.
//
// The weight is packed once into [blocks(n)][groups(k)][16][4]: 16 output channels x 4 consecutive k per
// 64 bytes, exactly what one vpdpbusd multiplies against 4 bytes of q broadcast to every lane. The padding
// (n to 16, k to 4) is zero, so padded lanes add nothing.
//
// ISA-specific code carries __attribute__((target(...))) per function instead of global -m flags: the
// file builds on a machine with AVX2 only, or without AVX, and the runtime check picks what the CPU has.
// On AMX-INT8 the packing is a tile's B as it stands: a step of 64 k values is 16 of the 64-byte groups, 1 KB
// a block, one tdpbusd multiplying 16 rows of q against it (run_amx).
// The VNNI paths use vpdpbusd: it adds 4 u8 x s8 products into int32 without intermediate saturation
// (vpmaddubsw would saturate 255 * 127 * 2 to int16, which is what oneDNN does on CPUs without VNNI).
// The AVX2 path widens both to int16 and multiplies pairs into int32 (vpmaddwd): exact, at half the rate.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_driver.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "amx.h"
#define FASTBERT_AVX512_VNNI __attribute__((target("avx512f,avx512vnni")))
#define FASTBERT_AVX_VNNI __attribute__((target("avx2,avxvnni")))
#define FASTBERT_AVX2 __attribute__((target("avx2")))
#endif

namespace fastbert {
namespace int8_gemm {

constexpr int64_t kCols = 16;  // output channels per packed block
constexpr int64_t kGroup = 4;  // k values per int32 lane
constexpr int64_t kBlockBytes = kCols * kGroup;
// The longest k whose sums cannot overflow int32: k * 255 * 128 <= 2^31 - 1.
constexpr int64_t kMaxK = INT32_MAX / (255 * 128);

// isa argument of int8_matmul. kAmx: AMX-INT8 tiles where k is a multiple of 64, else (a k whose tail a tile
// cannot take) AVX512-VNNI.
enum Isa : int64_t { kBest = 0, kPortable = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAvx2 = 4, kAmx = 5, kLastIsa = kAmx };

inline int64_t blocks(int64_t n) { return (n + kCols - 1) / kCols; }
inline int64_t groups(int64_t k) { return (k + kGroup - 1) / kGroup; }

inline const char* isa_name(int64_t isa) {
  switch (isa) {
    case kPortable: return "portable C++";
    case kAvxVnni: return "AVX-VNNI (256-bit)";
    case kAvx512Vnni: return "AVX512-VNNI";
    case kAvx2: return "AVX2 (no VNNI)";
    case kAmx: return "AMX-INT8";
    default: return "best available";
  }
}

// The CPU features an ISA needs, as /proc/cpuinfo names them (for error messages).
inline const char* isa_features(int64_t isa) {
  return isa == kAmx         ? "amx_int8, avx512f and avx512_vnni"
         : isa == kAvx512Vnni ? "avx512f and avx512_vnni"
         : isa == kAvxVnni  ? "avx2 and avx_vnni"
         : isa == kAvx2     ? "avx2"
                            : "nothing";
}

inline bool cpu_has(int64_t isa) {
  if (isa == kPortable) return true;
#if defined(__x86_64__)
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  static const bool avx512_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
  static const bool avx_vnni = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (isa == kAvx512Vnni) return avx512_vnni;
  if (isa == kAvxVnni) return avx_vnni;
  if (isa == kAvx2) return avx2;
  if (isa == kAmx) return avx512_vnni && amx::cpu_has_amx_int8();
#endif
  return false;
}

inline int64_t best_isa() {
  if (cpu_has(kAmx)) return kAmx;
  if (cpu_has(kAvx512Vnni)) return kAvx512Vnni;
  if (cpu_has(kAvxVnni)) return kAvxVnni;
  if (cpu_has(kAvx2)) return kAvx2;
  return kPortable;
}

// w [n, k] row-major -> packed [blocks(n)][groups(k)][16][4], every byte written (padding zero).
inline void pack(const int8_t* w, int64_t n, int64_t k, int8_t* packed) {
  const int64_t g_count = groups(k);
  at::parallel_for(0, blocks(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int8_t* dst = packed + b * g_count * kBlockBytes;
      for (int64_t g = 0; g < g_count; ++g)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t t = 0; t < kGroup; ++t) {
            const int64_t row = b * kCols + c, col = g * kGroup + t;
            *dst++ = row < n && col < k ? w[row * k + col] : 0;
          }
    }
  });
}

// What follows a tile where the GEMM's float32 result is not the output: `apply(context, row, rows, col0,
// cols, tile, ld)` gets the tile's rows [row, row + rows) x columns [col0, col0 + cols) in `tile` (row stride
// ld), still in L1, and writes the real output (quantized_dense.cpp: dequantize, bias, GELU, bfloat16).
struct Epilogue {
  void (*apply)(const void* context, int64_t row, int64_t rows, int64_t col0, int64_t cols, const float* tile,
                int64_t ld) = nullptr;
  const void* context = nullptr;
};

// One GEMM's operands. q [m, k] and out [m, n] are row-major with row strides k and n; with an epilogue,
// out is unused.
struct Problem {
  const uint8_t* q;
  const int8_t* packed;  // as pack() made it
  const float* scale;    // [n]
  float* out;
  int64_t m, n, k;
  int64_t block_stride;  // bytes from one 16-channel block to the next: groups(k) * 64
  const int32_t* pairs = nullptr;  // the AVX2 path's q, as split_pairs made it
  Epilogue epilogue;
};

// Four bytes of a q row as one int32 lane: group g of a row with k values; past k they are zero (the
// matching weights are zero too, but reading past the row could leave the tensor).
inline int32_t load_group(const uint8_t* row, int64_t g, int64_t k) {
  int32_t v = 0;
  std::memcpy(&v, row + g * kGroup, static_cast<size_t>(std::min(kGroup, k - g * kGroup)));
  return v;
}

inline int32_t load_full_group(const uint8_t* row, int64_t g) {
  int32_t v;
  std::memcpy(&v, row + g * kGroup, sizeof(v));
  return v;
}

// A tile: kRows rows from `row`, kBlocks 16-channel blocks from `block` (clipped to n on store), stored at
// `out` (the tile's first element; row stride ldo).
using TileFn = void (*)(const Problem&, int64_t row, int64_t block, float* out, int64_t ldo);

// ---------------------------------------------------------------- portable: int32 loops for the compiler

// Each k group's 16 x 4 weights are widened once into 4 rows of 16 int32 (reused by kRows rows of q), so
// the inner loops are contiguous int32 multiply-adds over 16 channels.
template <int kRows>
void tile_portable(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
  int32_t acc[kRows][kCols] = {};
  const int8_t* w = p.packed + block * p.block_stride;
  const uint8_t* q = p.q + row * p.k;
  const int64_t g_count = groups(p.k);
  for (int64_t g = 0; g < g_count; ++g) {
    int32_t wt[kGroup][kCols];
    for (int64_t c = 0; c < kCols; ++c)
      for (int64_t t = 0; t < kGroup; ++t) wt[t][c] = w[g * kBlockBytes + c * kGroup + t];
    for (int r = 0; r < kRows; ++r) {
      for (int64_t t = 0; t < kGroup; ++t) {
        const int64_t i = g * kGroup + t;
        const int32_t x = i < p.k ? q[r * p.k + i] : 0;  // past k: zero, as the padded weights are
        for (int64_t c = 0; c < kCols; ++c) acc[r][c] += x * wt[t][c];
      }
    }
  }
  const int64_t col0 = block * kCols, cols = std::min(kCols, p.n - col0);
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = p.scale[col0 + c] * static_cast<float>(acc[r][c]);
}

#if defined(__x86_64__)

// vpdpbusd in asm, accumulating in place: with the intrinsics gcc 12 copies every accumulator to another
// register and to the stack on each k step (a third of the speed).
FASTBERT_AVX512_VNNI __attribute__((always_inline)) inline void dpbusd(__m512i& acc, __m512i x, __m512i w) {
  asm("vpdpbusd %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
}

// {vex}: the AVX-VNNI encoding, which runs on CPUs without AVX-512 ("x": only registers it can name).
FASTBERT_AVX_VNNI __attribute__((always_inline)) inline void dpbusd(__m256i& acc, __m256i x, __m256i w) {
  asm("%{vex%} vpdpbusd %[w], %[x], %[acc]" : [acc] "+x"(acc) : [x] "x"(x), [w] "x"(w));
}

// ---------------------------------------------------------------- AVX512-VNNI: 16 channels per zmm

// One k group: the kBlocks weight vectors at w (blocks block_stride bytes apart), each row's 4 q bytes x
// broadcast to all lanes.
template <int kRows, int kBlocks>
FASTBERT_AVX512_VNNI __attribute__((always_inline)) inline void group_avx512(
    __m512i (&acc)[kRows][kBlocks], const int8_t* w, int64_t block_stride, const int32_t (&x)[kRows]) {
  __m512i wv[kBlocks];
#pragma GCC unroll 4
  for (int b = 0; b < kBlocks; ++b) wv[b] = _mm512_loadu_si512(w + b * block_stride);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m512i xr = _mm512_set1_epi32(x[r]);
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) dpbusd(acc[r][b], xr, wv[b]);
  }
}

// kRows x kBlocks accumulators (6 x 4 = 24 of the 32 zmm registers) and the weights of one k group in
// kBlocks more.
template <int kRows, int kBlocks>
FASTBERT_AVX512_VNNI void tile_avx512(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
  __m512i acc[kRows][kBlocks];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_si512();
  const int8_t* w = p.packed + block * p.block_stride;
  const uint8_t* q = p.q + row * p.k;
  const int64_t full = p.k / kGroup;
  for (int64_t g = 0; g < full; ++g) {
    int32_t x[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) x[r] = load_full_group(q + r * p.k, g);
    group_avx512(acc, w + g * kBlockBytes, p.block_stride, x);
  }
  if (full * kGroup < p.k) {
    int32_t x[kRows];
    for (int r = 0; r < kRows; ++r) x[r] = load_group(q + r * p.k, full, p.k);
    group_avx512(acc, w + full * kBlockBytes, p.block_stride, x);
  }
#pragma GCC unroll 4
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t col0 = (block + b) * kCols, cols = std::min(kCols, p.n - col0);
    const __mmask16 mask = cols == kCols ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, p.scale + col0);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + b * kCols, mask,
                            _mm512_mul_ps(scale, _mm512_maskz_cvtepi32_ps(mask, acc[r][b])));
  }
}

// out[r, block's 16 channels] = scale x float(lo[r] : hi[r]), clipped to n.
template <int kRows>
FASTBERT_AVX2 __attribute__((always_inline)) inline void store_ymm(const Problem& p, int64_t block, float* out,
                                                                   int64_t ldo, const __m256i (&lo)[kRows],
                                                                   const __m256i (&hi)[kRows]) {
  const int64_t col0 = block * kCols, cols = std::min(kCols, p.n - col0);
  float scale[kCols] = {};
  std::memcpy(scale, p.scale + col0, cols * sizeof(float));  // the scale vector ends at n
  const __m256 scale_lo = _mm256_loadu_ps(scale), scale_hi = _mm256_loadu_ps(scale + 8);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    float* o = out + r * ldo;
    const __m256 y_lo = _mm256_mul_ps(scale_lo, _mm256_cvtepi32_ps(lo[r]));
    const __m256 y_hi = _mm256_mul_ps(scale_hi, _mm256_cvtepi32_ps(hi[r]));
    if (cols == kCols) {
      _mm256_storeu_ps(o, y_lo);
      _mm256_storeu_ps(o + 8, y_hi);
    } else {
      float y[kCols];
      _mm256_storeu_ps(y, y_lo);
      _mm256_storeu_ps(y + 8, y_hi);
      std::memcpy(o, y, cols * sizeof(float));
    }
  }
}

// ---------------------------------------------------------------- AVX-VNNI: one block is two ymm

template <int kRows>
FASTBERT_AVX_VNNI __attribute__((always_inline)) inline void group_avx_vnni(
    __m256i (&lo)[kRows], __m256i (&hi)[kRows], const int8_t* w, const int32_t (&x)[kRows]) {
  const __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m256i xr = _mm256_set1_epi32(x[r]);
    dpbusd(lo[r], xr, w_lo);
    dpbusd(hi[r], xr, w_hi);
  }
}

// kRows x 2 accumulators (6 x 2 = 12 of the 16 ymm registers), the block's two weight vectors and the
// broadcast q lane: VEX vpdpbusd has no broadcast memory operand.
template <int kRows>
FASTBERT_AVX_VNNI void tile_avx_vnni(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
  __m256i lo[kRows], hi[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  const int8_t* w = p.packed + block * p.block_stride;
  const uint8_t* q = p.q + row * p.k;
  const int64_t full = p.k / kGroup;
  for (int64_t g = 0; g < full; ++g) {
    int32_t x[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) x[r] = load_full_group(q + r * p.k, g);
    group_avx_vnni(lo, hi, w + g * kBlockBytes, x);
  }
  if (full * kGroup < p.k) {
    int32_t x[kRows];
    for (int r = 0; r < kRows; ++r) x[r] = load_group(q + r * p.k, full, p.k);
    group_avx_vnni(lo, hi, w + full * kBlockBytes, x);
  }
  store_ymm(p, block, out, ldo, lo, hi);
}

// ---------------------------------------------------------------- AVX2 without VNNI: int16 pairs

// A block's 16 channels x 4 k bytes are two ymm (8 channels each); every int32 lane holds one channel's
// 4 weights w0..w3. As int16 they split into even (w0, w2) and odd (w1, w3) pairs, and each q group of 4
// bytes the same way, so two vpmaddwd give x0 w0 + x2 w2 and x1 w1 + x3 w3 per lane: exact, as
// 255 x 128 x 2 fits int32 (vpmaddubsw would saturate it in int16).
FASTBERT_AVX2 __attribute__((always_inline)) inline __m256i even_bytes(__m256i w) {
  return _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);
}

// acc += x_even . w_even + x_odd . w_odd, in asm for the reason dpbusd is: with intrinsics gcc keeps the
// accumulators on the stack.
FASTBERT_AVX2 __attribute__((always_inline)) inline void madd_pairs(__m256i& acc, __m256i x_even, __m256i w_even,
                                                                    __m256i x_odd, __m256i w_odd) {
  __m256i even, odd;
  asm("vpmaddwd %[we], %[xe], %[even]\n\t"
      "vpmaddwd %[wo], %[xo], %[odd]\n\t"
      "vpaddd %[even], %[acc], %[acc]\n\t"
      "vpaddd %[odd], %[acc], %[acc]"
      : [acc] "+x"(acc), [even] "=&x"(even), [odd] "=&x"(odd)
      : [xe] "x"(x_even), [we] "x"(w_even), [xo] "x"(x_odd), [wo] "x"(w_odd));
}

// q's groups split once per GEMM into int32 pairs {even, odd} ({x0, x2} and {x1, x3} as int16), so the
// tiles broadcast them straight from memory (a load, not two vector uops per row and group).
inline void split_pairs(const Problem& p, int32_t* pairs) {
  const int64_t g_count = groups(p.k);
  at::parallel_for(0, p.m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < g_count; ++g) {
        const uint32_t v = static_cast<uint32_t>(load_group(p.q + r * p.k, g, p.k));
        pairs[2 * (r * g_count + g)] = static_cast<int32_t>(v & 0x00ff00ffu);
        pairs[2 * (r * g_count + g) + 1] = static_cast<int32_t>((v >> 8) & 0x00ff00ffu);
      }
  });
}

template <int kRows>
FASTBERT_AVX2 __attribute__((always_inline)) inline void group_avx2(
    __m256i (&lo)[kRows], __m256i (&hi)[kRows], const int8_t* w, const int32_t* pairs, int64_t row_stride) {
  const __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  const __m256i lo_even = even_bytes(w_lo), lo_odd = _mm256_srai_epi16(w_lo, 8);
  const __m256i hi_even = even_bytes(w_hi), hi_odd = _mm256_srai_epi16(w_hi, 8);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m256i x_even = _mm256_set1_epi32(pairs[r * row_stride]);
    const __m256i x_odd = _mm256_set1_epi32(pairs[r * row_stride + 1]);
    madd_pairs(lo[r], x_even, lo_even, x_odd, lo_odd);
    madd_pairs(hi[r], x_even, hi_even, x_odd, hi_odd);
  }
}

// kRows x 2 accumulators (4 x 2 = 8 of the 16 ymm registers) and the block's four int16 weight vectors.
// The loop is tile_avx_vnni's, written again: a function inlines only steps of its own target (avx2 here).
template <int kRows>
FASTBERT_AVX2 void tile_avx2(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
  __m256i lo[kRows], hi[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  const int8_t* w = p.packed + block * p.block_stride;
  const int64_t g_count = groups(p.k);
  const int32_t* pairs = p.pairs + row * g_count * 2;
  for (int64_t g = 0; g < g_count; ++g) group_avx2(lo, hi, w + g * kBlockBytes, pairs + 2 * g, g_count * 2);
  store_ymm(p, block, out, ldo, lo, hi);
}

#endif  // __x86_64__

// ---------------------------------------------------------------- driver

template <int kRows, int kBlocks>
struct PortableTile {
  static void run(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
    tile_portable<kRows>(p, row, block, out, ldo);
  }
};
#if defined(__x86_64__)
template <int kRows, int kBlocks>
struct Avx512Tile {
  static void run(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
    tile_avx512<kRows, kBlocks>(p, row, block, out, ldo);
  }
};
template <int kRows, int kBlocks>
struct AvxVnniTile {
  static void run(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
    tile_avx_vnni<kRows>(p, row, block, out, ldo);
  }
};
template <int kRows, int kBlocks>
struct Avx2Tile {
  static void run(const Problem& p, int64_t row, int64_t block, float* out, int64_t ldo) {
    tile_avx2<kRows>(p, row, block, out, ldo);
  }
};
#endif

template <int kRows, int kBlocks>
void run(const Problem& p, const gemm_driver::Kernel<TileFn, kRows, kBlocks>& kernel) {
  constexpr int64_t kTileCols = kBlocks * kCols;
  gemm_driver::for_tiles<kRows, kBlocks, kCols>(p.m, blocks(p.n), p.k, [&](int64_t r, int64_t rows, int64_t block,
                                                                            int64_t nb, float* tile) {
    const int64_t col0 = block * kCols;
    if (p.epilogue.apply == nullptr) {
      kernel.table[rows - 1][nb - 1](p, r, block, p.out + r * p.n + col0, p.n);
    } else {
      kernel.table[rows - 1][nb - 1](p, r, block, tile, kTileCols);
      p.epilogue.apply(p.epilogue.context, r, rows, col0, std::min(nb * kCols, p.n - col0), tile, kTileCols);
    }
  });
}

#if defined(__x86_64__)
// The float32 result of a block's int32 sums (row stride 32), scale[n] x float(sum), to out (row stride ldo).
FASTBERT_AVX512_VNNI inline void scale_sums(const Problem& p, const int32_t* sums, int64_t rows, int64_t col0,
                                            int64_t cols, float* out, int64_t ldo) {
  for (int64_t c = 0; c < cols; c += kCols) {
    const __mmask16 mask = cols - c >= kCols ? __mmask16(0xffff) : __mmask16((1u << (cols - c)) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, p.scale + col0 + c);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + c, mask,
                            _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, sums + r * 32 + c))));
  }
}

// u8 x s8 on AMX-INT8, k a multiple of 64, tasks as amx::Schedule shares them out (float_gemm.h's bfloat16
// run_amx, which measured them): a block of 32 rows meets a panel of 2 packed blocks on amx::tile_block (q's
// rows read in place, a partial strip from a zero-padded copy), the int32 sums scaled to float32 into the
// output, or into a tile for the epilogue, while they are in L1.
inline void run_amx(const Problem& p) {
  const int64_t steps = p.k / 64, stride = p.block_stride / 4;  // stride: words from block to block
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(p.packed);
  const amx::Schedule schedule(p.m, blocks(p.n), p.k);
  at::parallel_for(0, schedule.tasks(), 1, [&](int64_t begin, int64_t end) {
    amx::Scope tiles;
    alignas(64) int32_t sums[32 * 32];
    alignas(64) float tile[32 * 32];
    std::vector<uint8_t> edge;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row_end = schedule.row_end(task), last = schedule.last(task);
      const uint8_t* padded = amx::padded_last_block(p.q, p.k, last, row_end, p.k, edge);
      schedule.visit(task, p.block_stride, steps, [&](int64_t r, int64_t block, int64_t ahead, int64_t ahead_bytes) {
        const int64_t rows = std::min<int64_t>(32, row_end - r), strips = (rows + 15) / 16;
        const uint8_t* a[2] = {p.q + r * p.k, strips > 1 ? p.q + (r + 16) * p.k : nullptr};
        if (r == last && padded != nullptr) a[0] = padded, a[1] = padded + 16 * p.k;
        const int64_t nb = std::min<int64_t>(2, blocks(p.n) - block), col0 = block * kCols;
        amx::tile_block<false>(strips, nb, a, p.k, packed + block * stride, 256, stride, 64, steps, sums, 32 * 4,
                               ahead < 0 ? nullptr : packed + ahead / 4, ahead_bytes);
        const int64_t cols = std::min(nb * kCols, p.n - col0);
        if (p.epilogue.apply == nullptr) return scale_sums(p, sums, rows, col0, cols, p.out + r * p.n + col0, p.n);
        scale_sums(p, sums, rows, col0, cols, tile, 32);
        p.epilogue.apply(p.epilogue.context, r, rows, col0, cols, tile, 32);
      });
    }
  });
}
#endif

// isa: an Isa the CPU has (the caller checks); kBest picks.
inline void matmul(const Problem& p, int64_t isa) {
  if (p.m == 0 || p.n == 0) return;
  if (isa == kBest) isa = best_isa();
#if defined(__x86_64__)
  if (isa == kAmx && p.k % 64 == 0) return run_amx(p);
  if (isa == kAvx512Vnni || isa == kAmx) {
    static const auto kernel = gemm_driver::make_kernel<TileFn, Avx512Tile, 6, 4>();
    return run(p, kernel);
  }
  if (isa == kAvxVnni) {
    static const auto kernel = gemm_driver::make_kernel<TileFn, AvxVnniTile, 6, 1>();
    return run(p, kernel);
  }
  if (isa == kAvx2) {
    static const auto kernel = gemm_driver::make_kernel<TileFn, Avx2Tile, 4, 1>();
    std::vector<int32_t> pairs(static_cast<size_t>(p.m * groups(p.k) * 2));
    split_pairs(p, pairs.data());
    Problem split = p;
    split.pairs = pairs.data();
    return run(split, kernel);
  }
#endif
  static const auto kernel = gemm_driver::make_kernel<TileFn, PortableTile, 8, 1>();
  run(p, kernel);
}

}  // namespace int8_gemm
}  // namespace fastbert
