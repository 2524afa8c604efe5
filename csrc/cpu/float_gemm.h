// fastbert's own float32 and bfloat16 GEMM: out[m, n] = act(sum_k x[m, k] * w[n, k] + bias[n]) in x's dtype,
// the sum in float32. On Zen 5 oneDNN's GEMMs run at 46-89% of this one's rate at 16 rows and 80-97% at 128
// (benchmarks/RESULTS.md); from 1024 rows they are level within 0.93-1.07x (oneDNN's float32 falls behind at
// 4096 rows). Dispatch measures both per shape class. vdpbf16ps flushes denormal inputs and
// results to zero (the portable path does not): far below bfloat16's rounding.
//
// The weight is packed once into [blocks(n)][groups(k)][16][kPack]: 16 output channels x the k values one
// 32-bit lane holds (1 float, 2 bfloat16) per 64 bytes, what one vfmadd231ps (float32) or vdpbf16ps
// (bfloat16, a pair's two products) multiplies against x's 32 bits broadcast to every lane: the int8 GEMM's
// design (int8_gemm.h). The padding (n to 16, k to kPack) is zero.
//
// The AVX-512 tiles carry __attribute__((target(...))) so the file builds for any CPU; the runtime check
// picks them where the CPU has avx512f (and avx512_bf16 for bfloat16), portable C++ elsewhere (and in tests).
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gelu.h"
#include "gemm_driver.h"
#include "vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define FASTBERT_AVX512F_TARGET __attribute__((target("avx512f")))

#include "amx.h"
#endif

namespace fastbert {
namespace float_gemm {

constexpr int64_t kCols = 16;  // output channels per packed block

// k values per 32-bit lane: 1 float, 2 bfloat16.
template <typename T>
constexpr int64_t kPack = 4 / sizeof(T);

// isa argument of dense_gemm. kAmx: bfloat16 on AMX tiles (amx.h), the k past whole 32-value steps and the
// epilogue on AVX-512.
enum Isa : int64_t { kBest = 0, kPortable = 1, kAvx512 = 2, kAmx = 3, kLastIsa = kAmx };

inline int64_t blocks(int64_t n) { return (n + kCols - 1) / kCols; }
template <typename T>
int64_t groups(int64_t k) { return (k + kPack<T> - 1) / kPack<T>; }

// The AVX-512 tiles need avx512f, and vdpbf16ps (avx512_bf16) for bfloat16.
template <typename T>
bool cpu_has(int64_t isa) {
  if (isa == kPortable) return true;
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") &&
                             (std::is_same_v<T, float> || __builtin_cpu_supports("avx512bf16"));
  if (isa == kAvx512) return avx512;
  if (isa == kAmx) return std::is_same_v<T, c10::BFloat16> && avx512 && amx::cpu_has_amx();
#endif
  return false;
}

// AMX where bfloat16 has it (on a Xeon with AMX 1.15-1.47x oneDNN's linear, one thread, 512 x 768 -> 768,
// -> 3072 and 512 x 3072 -> 768: benchmarks/RESULTS.md), else AVX-512, else portable C++.
template <typename T>
int64_t best_isa() { return cpu_has<T>(kAmx) ? kAmx : cpu_has<T>(kAvx512) ? kAvx512 : kPortable; }

// w [n, k] row-major -> packed [blocks(n)][groups(k)][16][kPack], every value written (padding zero).
template <typename T>
void pack(const T* w, int64_t n, int64_t k, T* packed) {
  const int64_t g_count = groups<T>(k);
  at::parallel_for(0, blocks(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* dst = packed + b * g_count * kCols * kPack<T>;
      for (int64_t g = 0; g < g_count; ++g)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t t = 0; t < kPack<T>; ++t) {
            const int64_t row = b * kCols + c, col = g * kPack<T> + t;
            *dst++ = row < n && col < k ? w[row * k + col] : T(0.f);
          }
    }
  });
}

// One GEMM's operands: x [m, k] and out [m, n] row-major; bias float32 [n] or nullptr; activation 0 none,
// 1 GELU (erf), 2 GELU (tanh).
template <typename T>
struct Problem {
  const T* x;
  const T* packed;  // as pack() made it
  const float* bias;
  T* out;
  int64_t m, n, k, activation;
  int64_t block_stride() const { return groups<T>(k) * kCols * kPack<T>; }  // values from block to block
};

// A tile: kRows rows from `row` x kBlocks 16-channel blocks from `block`, the sums over k in [k0, k1) (whole
// groups, or up to k) added to the float32 sums at `tile` (row stride ldt), or written there where k0 is 0.
template <typename T>
using TileFn = void (*)(const Problem<T>&, int64_t row, int64_t block, int64_t k0, int64_t k1, float* tile,
                        int64_t ldt);

// k per chunk: a panel's weights for one chunk (k x 64 columns) take at most 192 KB, so that they stay in L2
// beside the task's rows while its tiles pass over them (float32 1024 x 3072 -> 768: the whole panel, 768 KB,
// and 96 rows of x, 1.1 MB, left L2 and the GEMM ran at 0.91x oneDNN's).
template <typename T>
constexpr int64_t kChunk = 192 * 1024 / (64 * sizeof(T));

// The tile's rows [row, row + rows) x its columns [col0, col0 + cols) to out: bias, GELU, T, while the tile
// is in L1.
template <typename T>
void epilogue(const Problem<T>& p, int64_t row, int64_t rows, int64_t col0, int64_t cols, const float* tile,
              int64_t ldt) {
  const bool tanh_form = p.activation == 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* t = tile + r * ldt;
    T* o = p.out + (row + r) * p.n + col0;
    for_blocks(cols, [&](int64_t j, int64_t m) {
      VecF a, b, bias_a(0.f), bias_b(0.f);
      load2(t + j, m, a, b);
      if (p.bias != nullptr) load2(p.bias + col0 + j, m, bias_a, bias_b);
      a = a + bias_a;
      b = b + bias_b;
      if (p.activation != 0) {
        a = gelu<T>(a, tanh_form);
        b = gelu<T>(b, tanh_form);
      }
      store2(o + j, m, a, b);
    });
  }
}

// Group g of a row with k values as one 32-bit lane; past k zero (the padded weights are zero too, but
// reading past the row could leave the tensor).
template <typename T>
int32_t load_group(const T* row, int64_t g, int64_t k) {
  int32_t v = 0;
  std::memcpy(&v, row + g * kPack<T>, static_cast<size_t>(std::min(kPack<T>, k - g * kPack<T>)) * sizeof(T));
  return v;
}

// ---------------------------------------------------------------- portable: float loops for the compiler

template <typename T, int kRows, int kBlocks>
void tile_portable(const Problem<T>& p, int64_t row, int64_t block, int64_t k0, int64_t k1, float* tile,
                   int64_t ldt) {
  const int64_t stride = p.block_stride();
  const T* w = p.packed + block * stride;
  const T* x = p.x + row * p.k;
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kBlocks * kCols; ++c) {
      const T* wc = w + (c / kCols) * stride + (c % kCols) * kPack<T>;
      float acc = k0 == 0 ? 0.f : tile[r * ldt + c];
      for (int64_t i = k0; i < k1; ++i)
        acc += static_cast<float>(x[r * p.k + i]) *
               static_cast<float>(wc[(i / kPack<T>) * kCols * kPack<T> + i % kPack<T>]);
      tile[r * ldt + c] = acc;
    }
}

#if defined(__x86_64__)

// acc += x * w lane by lane: a float32 FMA, or for bfloat16 pairs both products (vdpbf16ps). In asm,
// accumulating in place (as int8_gemm.h's dpbusd: the intrinsics make gcc copy every accumulator on each
// k step); the assembler takes vdpbf16ps whatever the compiler's target.
template <typename T>
FASTBERT_AVX512F_TARGET __attribute__((always_inline)) inline void multiply_add(__m512& acc, __m512 x, __m512 w) {
  if constexpr (std::is_same_v<T, float>) {
    asm("vfmadd231ps %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
  } else {
    asm("vdpbf16ps %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
  }
}

// One k group: the kBlocks weight vectors at w (blocks block_stride values apart), each row's 32 bits of x
// broadcast to all lanes.
template <typename T, int kRows, int kBlocks>
FASTBERT_AVX512F_TARGET __attribute__((always_inline)) inline void group_avx512(
    __m512 (&acc)[kRows][kBlocks], const T* w, int64_t block_stride, const int32_t (&x)[kRows]) {
  __m512 wv[kBlocks];
#pragma GCC unroll 4
  for (int b = 0; b < kBlocks; ++b) wv[b] = _mm512_loadu_ps(w + b * block_stride);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m512 xr = _mm512_castsi512_ps(_mm512_set1_epi32(x[r]));
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) multiply_add<T>(acc[r][b], xr, wv[b]);
  }
}

// kRows x kBlocks accumulators (6 x 4 = 24 of the 32 zmm registers) and one group's weights in kBlocks more.
template <typename T, int kRows, int kBlocks>
FASTBERT_AVX512F_TARGET void tile_avx512(const Problem<T>& p, int64_t row, int64_t block, int64_t k0, int64_t k1,
                                         float* tile, int64_t ldt) {
  __m512 acc[kRows][kBlocks];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b)
      acc[r][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + r * ldt + b * kCols);
  const int64_t stride = p.block_stride();
  constexpr int64_t kGroupValues = kCols * kPack<T>;
  const T* w = p.packed + block * stride;
  const T* x = p.x + row * p.k;
  const int64_t full = k1 / kPack<T>;  // k1 is a whole group's end, or k
  for (int64_t g = k0 / kPack<T>; g < full; ++g) {
    int32_t xv[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) std::memcpy(&xv[r], x + r * p.k + g * kPack<T>, sizeof(int32_t));
    group_avx512<T>(acc, w + g * kGroupValues, stride, xv);
  }
  if (full * kPack<T> < k1) {
    int32_t xv[kRows];
    for (int r = 0; r < kRows; ++r) xv[r] = load_group(x + r * p.k, full, p.k);
    group_avx512<T>(acc, w + full * kGroupValues, stride, xv);
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(tile + r * ldt + b * kCols, acc[r][b]);
}

#endif  // __x86_64__

// ---------------------------------------------------------------- driver

// The tile functions as make_kernel takes them: AVX-512's or portable C++'s.
template <typename T, bool kAvx512>
struct Tiles {
  template <int kRows, int kBlocks>
  struct Tile {
    static void run(const Problem<T>& p, int64_t row, int64_t block, int64_t k0, int64_t k1, float* tile,
                    int64_t ldt) {
#if defined(__x86_64__)
      if constexpr (kAvx512) return tile_avx512<T, kRows, kBlocks>(p, row, block, k0, k1, tile, ldt);
#endif
      tile_portable<T, kRows, kBlocks>(p, row, block, k0, k1, tile, ldt);
    }
  };
};

// Each task's tiles chunk by chunk of k (kChunk), their sums kept in a per-task buffer between chunks; then
// the epilogue, tile by tile.
template <typename T, int kRows, int kBlocks>
void run(const Problem<T>& p, const gemm_driver::Kernel<TileFn<T>, kRows, kBlocks>& kernel) {
  constexpr int64_t kTileCols = kBlocks * kCols;
  gemm_driver::for_tasks<kRows, kBlocks, kCols>(p.m, blocks(p.n), p.k, [&](int64_t row0, int64_t row_end,
                                                                            int64_t block, int64_t nb) {
    alignas(64) float sums[kRows * gemm_driver::kTilesPerTask * kTileCols];
    int64_t k0 = 0;
    do {  // (once where k is 0: the sums are zeros)
      const int64_t k1 = std::min(p.k, k0 + kChunk<T>);
      for (int64_t r = row0; r < row_end; r += kRows)
        kernel.table[std::min<int64_t>(kRows, row_end - r) - 1][nb - 1](p, r, block, k0, k1,
                                                                        sums + (r - row0) * kTileCols, kTileCols);
      k0 = k1;
    } while (k0 < p.k);
    const int64_t col0 = block * kCols;
    for (int64_t r = row0; r < row_end; r += kRows)
      epilogue(p, r, std::min<int64_t>(kRows, row_end - r), col0, std::min(nb * kCols, p.n - col0),
               sums + (r - row0) * kTileCols, kTileCols);
  });
}

#if defined(__x86_64__)
// bfloat16 on AMX, tasks as amx::Schedule shares them out. A block of 32 rows meets a panel: the sums over
// whole 32-value steps of k on amx::tile_block (x's rows read in place, a partial strip of 16 rows from a
// zero-padded copy; a packed block holds a step's 16 pair rows x 16 columns as 1 KB), the rest of k on the
// AVX-512 tiles, then run's epilogue while the tile is in L1.
inline void run_amx(const Problem<c10::BFloat16>& p) {
  using T = c10::BFloat16;
  static const auto tail = gemm_driver::make_kernel<TileFn<T>, Tiles<T, true>::template Tile, 6, 2>();
  const int64_t steps = p.k / 32, stride = p.block_stride() / kPack<T>;  // stride: words from block to block
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(p.packed);
  const amx::Schedule schedule(p.m, blocks(p.n), p.k * sizeof(T));
  at::parallel_for(0, schedule.tasks(), 1, [&](int64_t begin, int64_t end) {
    amx::Scope tiles;
    alignas(64) float sums[32 * 32];
    std::vector<T> edge;  // a partial strip's rows, zero-padded to 16
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row_end = schedule.row_end(task), last = schedule.last(task);
      const T* padded = amx::padded_last_block(p.x, p.k, last, row_end, 32 * steps, edge);
      // Rows [r, r + 32) x a panel: the tiles' sums, the rest of k, the epilogue.
      schedule.visit(task, stride * 4, steps, [&](int64_t r, int64_t block, int64_t ahead, int64_t ahead_bytes) {
        const int64_t rows = std::min<int64_t>(32, row_end - r), strips = (rows + 15) / 16;
        const T* a[2] = {p.x + r * p.k, strips > 1 ? p.x + (r + 16) * p.k : nullptr};
        int64_t lda = p.k * 2;
        if (r == last && padded != nullptr) a[0] = padded, a[1] = padded + 16 * 32 * steps, lda = 32 * steps * 2;
        const int64_t nb = std::min<int64_t>(2, blocks(p.n) - block);
        if (steps > 0) amx::tile_block<false>(strips, nb, a, lda, packed + block * stride, 256, stride, 64, steps,
                                              sums, 32 * 4, ahead < 0 ? nullptr : packed + ahead / 4, ahead_bytes);
        else std::fill(sums, sums + 32 * 32, 0.f);  // (k 0: the bias alone)
        for (int64_t i = 0; i < rows && 32 * steps < p.k; i += 6)  // k past the whole steps, added to (or,
          tail.table[std::min<int64_t>(6, rows - i) - 1][nb - 1](  // where there are none, written to) the sums
              p, r + i, block, 32 * steps, p.k, sums + i * 32, 32);
        epilogue(p, r, rows, block * kCols, std::min(nb * kCols, p.n - block * kCols), sums, 32);
      });
    }
  });
}
#endif

// isa: an Isa the CPU has for T (the caller checks); kBest picks.
template <typename T>
void linear(const Problem<T>& p, int64_t isa) {
  if (p.m == 0 || p.n == 0) return;
  if (isa == kBest) isa = best_isa<T>();
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == kAmx) return run_amx(p);
  }
  if (isa == kAvx512) {
    if constexpr (std::is_same_v<T, float>) {
      // 16 rows or fewer (a query or a few): 8 x 3 tiles, so each panel of weights passes once or twice, not
      // up to three times (a Xeon, one process: 1.02-1.10x at 16 rows, 1.10-1.22x at 8; RESULTS.md).
      static const auto few_rows = gemm_driver::make_kernel<TileFn<T>, Tiles<T, true>::template Tile, 8, 3>();
      if (p.m <= 16) return run(p, few_rows);
    }
    static const auto kernel = gemm_driver::make_kernel<TileFn<T>, Tiles<T, true>::template Tile, 6, 4>();
    return run(p, kernel);
  }
#endif
  static const auto kernel = gemm_driver::make_kernel<TileFn<T>, Tiles<T, false>::template Tile, 4, 1>();
  run(p, kernel);
}

}  // namespace float_gemm
}  // namespace fastbert
