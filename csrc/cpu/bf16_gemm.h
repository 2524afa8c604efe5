// fastbert's own bfloat16 GEMM: out[m, n] = act(sum_k x[m, k] * w[n, k] + bias[n]) rounded to bfloat16, the
// sum in float32. For the row counts of a batch of one to a few sequences (16 to 128 rows) oneDNN's bf16
// GEMM runs at 30-75% of what this one does on Zen 5 (benchmarks/RESULTS.md); dispatch measures both.
//
// The weight is packed once into [blocks(n)][pairs(k)][16][2]: 16 output channels x 2 consecutive k per
// 64 bytes, what one vdpbf16ps multiplies against a pair of x broadcast to every lane (the int8 GEMM's
// design, int8_gemm.h, with pairs for quads). The padding (n to 16, k to 2) is zero.
//
// The avx512_bf16 tiles carry __attribute__((target(...))) so the file builds for any CPU; the runtime
// check picks them where the CPU has the instruction, portable C++ elsewhere (and in tests).
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gelu.h"
#include "vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define FASTBERT_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))
#endif

namespace fastbert {
namespace bf16_gemm {

constexpr int64_t kCols = 16;  // output channels per packed block
constexpr int64_t kPair = 2;   // k values per float32 lane
constexpr int64_t kBlockValues = kCols * kPair;

// isa argument of bf16_linear.
enum Isa : int64_t { kBest = 0, kPortable = 1, kAvx512Bf16 = 2, kLastIsa = kAvx512Bf16 };

inline int64_t blocks(int64_t n) { return (n + kCols - 1) / kCols; }
inline int64_t pairs(int64_t k) { return (k + kPair - 1) / kPair; }

inline bool cpu_has(int64_t isa) {
  if (isa == kPortable) return true;
#if defined(__x86_64__)
  static const bool avx512_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (isa == kAvx512Bf16) return avx512_bf16;
#endif
  return false;
}

inline int64_t best_isa() { return cpu_has(kAvx512Bf16) ? kAvx512Bf16 : kPortable; }

// w [n, k] row-major -> packed [blocks(n)][pairs(k)][16][2], every value written (padding zero).
inline void pack(const c10::BFloat16* w, int64_t n, int64_t k, c10::BFloat16* packed) {
  const int64_t p_count = pairs(k);
  at::parallel_for(0, blocks(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      c10::BFloat16* dst = packed + b * p_count * kBlockValues;
      for (int64_t p = 0; p < p_count; ++p)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t t = 0; t < kPair; ++t) {
            const int64_t row = b * kCols + c, col = p * kPair + t;
            *dst++ = row < n && col < k ? w[row * k + col] : c10::BFloat16(0.f);
          }
    }
  });
}

// One GEMM's operands: x [m, k] and out [m, n] row-major; bias float32 [n] or nullptr; activation 0 none,
// 1 GELU (erf), 2 GELU (tanh).
struct Problem {
  const c10::BFloat16* x;
  const c10::BFloat16* packed;  // as pack() made it
  const float* bias;
  c10::BFloat16* out;
  int64_t m, n, k, activation;
  int64_t block_stride() const { return pairs(k) * kBlockValues; }
};

// A tile: kRows rows from `row` x kBlocks 16-channel blocks from `block`, as float32 sums at `tile`
// (row stride ldt, kBlocks x 16 columns).
using TileFn = void (*)(const Problem&, int64_t row, int64_t block, float* tile, int64_t ldt);

// The tile's rows [row, row + rows) x its columns [col0, col0 + cols) to out: bias, GELU, bfloat16, while
// the tile is in L1.
inline void epilogue(const Problem& p, int64_t row, int64_t rows, int64_t col0, int64_t cols, const float* tile,
                     int64_t ldt) {
  const bool tanh_form = p.activation == 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* t = tile + r * ldt;
    c10::BFloat16* o = p.out + (row + r) * p.n + col0;
    for_blocks(cols, [&](int64_t j, int64_t m) {
      VecF a, b, bias_a(0.f), bias_b(0.f);
      load2(t + j, m, a, b);
      if (p.bias != nullptr) load2(p.bias + col0 + j, m, bias_a, bias_b);
      a = a + bias_a;
      b = b + bias_b;
      if (p.activation != 0) {
        a = gelu<c10::BFloat16>(a, tanh_form);
        b = gelu<c10::BFloat16>(b, tanh_form);
      }
      store2(o + j, m, a, b);
    });
  }
}

// A pair of x row values as one 32-bit lane: pair p of a row with k values; past k zero (the padded weights
// are zero too, but reading past the row could leave the tensor).
inline int32_t load_pair(const c10::BFloat16* row, int64_t p, int64_t k) {
  int32_t v = 0;
  std::memcpy(&v, row + p * kPair, static_cast<size_t>(std::min(kPair, k - p * kPair)) * sizeof(c10::BFloat16));
  return v;
}

// ---------------------------------------------------------------- portable: float loops for the compiler

template <int kRows, int kBlocks>
void tile_portable(const Problem& p, int64_t row, int64_t block, float* tile, int64_t ldt) {
  const c10::BFloat16* w = p.packed + block * p.block_stride();
  const c10::BFloat16* x = p.x + row * p.k;
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kBlocks * kCols; ++c) {
      const c10::BFloat16* wc = w + (c / kCols) * p.block_stride() + (c % kCols) * kPair;
      float acc = 0.f;
      for (int64_t i = 0; i < p.k; ++i)
        acc += static_cast<float>(x[r * p.k + i]) * static_cast<float>(wc[(i / kPair) * kBlockValues + i % kPair]);
      tile[r * ldt + c] = acc;
    }
}

#if defined(__x86_64__)

// vdpbf16ps in asm, accumulating in place (as int8_gemm.h's dpbusd: the intrinsic makes gcc copy every
// accumulator on each k step).
FASTBERT_AVX512_BF16_TARGET __attribute__((always_inline)) inline void dpbf16(__m512& acc, __m512 x, __m512 w) {
  asm("vdpbf16ps %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
}

// One k pair: the kBlocks weight vectors at w (blocks block_stride values apart), each row's pair x
// broadcast to all lanes.
template <int kRows, int kBlocks>
FASTBERT_AVX512_BF16_TARGET __attribute__((always_inline)) inline void pair_avx512(
    __m512 (&acc)[kRows][kBlocks], const c10::BFloat16* w, int64_t block_stride, const int32_t (&x)[kRows]) {
  __m512 wv[kBlocks];
#pragma GCC unroll 4
  for (int b = 0; b < kBlocks; ++b) wv[b] = _mm512_loadu_ps(w + b * block_stride);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m512 xr = _mm512_castsi512_ps(_mm512_set1_epi32(x[r]));
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) dpbf16(acc[r][b], xr, wv[b]);
  }
}

// kRows x kBlocks accumulators (6 x 4 = 24 of the 32 zmm registers) and one pair's weights in kBlocks more.
template <int kRows, int kBlocks>
FASTBERT_AVX512_BF16_TARGET void tile_avx512(const Problem& p, int64_t row, int64_t block, float* tile, int64_t ldt) {
  __m512 acc[kRows][kBlocks];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t stride = p.block_stride();
  const c10::BFloat16* w = p.packed + block * stride;
  const c10::BFloat16* x = p.x + row * p.k;
  const int64_t full = p.k / kPair;
  for (int64_t g = 0; g < full; ++g) {
    int32_t xv[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) std::memcpy(&xv[r], x + r * p.k + g * kPair, sizeof(int32_t));
    pair_avx512(acc, w + g * kBlockValues, stride, xv);
  }
  if (full * kPair < p.k) {
    int32_t xv[kRows];
    for (int r = 0; r < kRows; ++r) xv[r] = load_pair(x + r * p.k, full, p.k);
    pair_avx512(acc, w + full * kBlockValues, stride, xv);
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(tile + r * ldt + b * kCols, acc[r][b]);
}

#endif  // __x86_64__

// ---------------------------------------------------------------- driver

// Tiles of kRows x kBlocks, every smaller shape for the edges: table[rows - 1][blocks - 1].
template <int kRows, int kBlocks>
struct Kernel {
  TileFn table[kRows][kBlocks];
};

template <template <int, int> class Tile, int kRows, int kBlocks, int R = 1, int B = 1>
void fill(Kernel<kRows, kBlocks>& kernel) {
  kernel.table[R - 1][B - 1] = &Tile<R, B>::run;
  if constexpr (B < kBlocks) fill<Tile, kRows, kBlocks, R, B + 1>(kernel);
  else if constexpr (R < kRows) fill<Tile, kRows, kBlocks, R + 1, 1>(kernel);
}

template <template <int, int> class Tile, int kRows, int kBlocks>
Kernel<kRows, kBlocks> make_kernel() {
  Kernel<kRows, kBlocks> kernel{};
  fill<Tile, kRows, kBlocks>(kernel);
  return kernel;
}

template <int kRows, int kBlocks>
struct PortableTile {
  static void run(const Problem& p, int64_t row, int64_t block, float* tile, int64_t ldt) {
    tile_portable<kRows, kBlocks>(p, row, block, tile, ldt);
  }
};
#if defined(__x86_64__)
template <int kRows, int kBlocks>
struct Avx512Tile {
  static void run(const Problem& p, int64_t row, int64_t block, float* tile, int64_t ldt) {
    tile_avx512<kRows, kBlocks>(p, row, block, tile, ldt);
  }
};
#endif

// Tasks of (a panel of kBlocks blocks) x (up to kRowsPerTask rows), panel-major, as int8_gemm.h's run: a
// thread's consecutive tasks share a panel of weights, which stays in its L2 while the x rows stream past.
template <int kRows, int kBlocks>
void run(const Problem& p, const Kernel<kRows, kBlocks>& kernel) {
  constexpr int64_t kRowsPerTask = kRows * 16;
  constexpr int64_t kTileCols = kBlocks * kCols;
  const int64_t n_blocks = blocks(p.n);
  const int64_t panels = (n_blocks + kBlocks - 1) / kBlocks;
  const int64_t row_tasks = (p.m + kRowsPerTask - 1) / kRowsPerTask;
  // At least ~1M multiply-adds per thread's share: smaller GEMMs are not worth waking threads for.
  const int64_t task_macs = std::min(p.m, kRowsPerTask) * kTileCols * std::max<int64_t>(p.k, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / task_macs);
  at::parallel_for(0, panels * row_tasks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[kRows * kTileCols];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t panel = t / row_tasks, row0 = (t % row_tasks) * kRowsPerTask;
      const int64_t block = panel * kBlocks, nb = std::min<int64_t>(kBlocks, n_blocks - block);
      const int64_t col0 = block * kCols, cols = std::min(nb * kCols, p.n - col0);
      const int64_t row_end = std::min(p.m, row0 + kRowsPerTask);
      for (int64_t r = row0; r < row_end; r += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, row_end - r);
        kernel.table[rows - 1][nb - 1](p, r, block, tile, kTileCols);
        epilogue(p, r, rows, col0, cols, tile, kTileCols);
      }
    }
  });
}

// isa: an Isa the CPU has (the caller checks); kBest picks.
inline void linear(const Problem& p, int64_t isa) {
  if (p.m == 0 || p.n == 0) return;
  if (isa == kBest) isa = best_isa();
#if defined(__x86_64__)
  if (isa == kAvx512Bf16) {
    static const auto kernel = make_kernel<Avx512Tile, 6, 4>();
    return run(p, kernel);
  }
#endif
  static const auto kernel = make_kernel<PortableTile, 4, 1>();
  run(p, kernel);
}

}  // namespace bf16_gemm
}  // namespace fastbert
