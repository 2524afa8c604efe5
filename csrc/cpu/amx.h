// AMX tiles as fastbert programs them (attention.cpp's products, float_gemm.h's bfloat16 GEMM, int8_gemm.h's
// u8 x s8 GEMM): every tile 16 rows x 64 bytes, so A is 16 rows x 32 bfloat16 (or 64 u8), B 16 rows of
// 16 columns x one 32-bit word (a bfloat16 pair, or 4 s8, along the summed dimension) and C 16 x 16 float32
// (int32); a block is up to 2 A strips x 2 B column tiles in the eight tile registers (4 C, 2 A, 2 B).
// Functions carry __attribute__((target(...))), so the file builds for any x86-64 CPU; callers check
// cpu_has_amx() (or cpu_has_amx_int8()) first.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace fastbert {
namespace amx {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Whether Linux hands this process the tile state: it does only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, once per process).
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return __builtin_cpu_supports("amx-tile") && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// AMX-BF16 in the CPU, and the tile state from Linux.
inline bool cpu_has_amx() {
  static const bool usable = __builtin_cpu_supports("amx-bf16") && tiles_permitted();
  return usable;
}

// AMX-INT8 in the CPU, and the tile state from Linux.
inline bool cpu_has_amx_int8() {
  static const bool usable = __builtin_cpu_supports("amx-int8") && tiles_permitted();
  return usable;
}

__attribute__((target("amx-tile"))) inline void configure() {
  alignas(64) TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  // ldtilecfg reading this very object (the intrinsic reads it through another struct type, and GCC may then
  // drop the stores above as dead under strict aliasing).
  asm volatile("ldtilecfg %0" ::"m"(config));
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

// The tile configuration for the scope of one thread's work (other code, oneDNN's, configures its own).
struct Scope {
  Scope() { configure(); }
  ~Scope() { release(); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
};

// C[kS strips x kN column tiles] (=|+=) sum over `steps` of A[strip][step] B[step][tile]: A strip s at
// a[s] + 64 bytes * step (row stride lda bytes), B tile n at b + step * b_step + n * b_next words (row
// stride ldb bytes, 16 rows of 64 contiguous bytes), C tile (s, n) at c + s * 16 rows + 16 * n (row stride
// ldc bytes). A's element picks the product: bfloat16 pairs summed into float32 (tdpbf16ps), or u8 x s8
// quads into int32 (tdpbusd, exact). `ahead` (or null): bytes toward L2, `ahead_bytes` a step from each of
// kN streams b_next words apart (the next block's B, laid out as b is, or a slice of it).
template <typename A>
using Sum = std::conditional_t<std::is_same_v<A, uint8_t>, int32_t, float>;

template <int kS, int kN, bool kAdd, typename A>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void tile_block(const A* const a[2], int64_t lda,
                                                                       const uint32_t* b, int64_t b_step,
                                                                       int64_t b_next, int64_t ldb, int64_t steps,
                                                                       Sum<A>* c, int64_t ldc,
                                                                       const uint32_t* ahead = nullptr,
                                                                       int64_t ahead_bytes = 1024) {
  static_assert(std::is_same_v<A, c10::BFloat16> || std::is_same_v<A, uint8_t>);
  constexpr int64_t kStep = 64 / sizeof(A);  // A's elements a step
  Sum<A>* c1 = c + 16 * (ldc / 4);
  if constexpr (kAdd) {
    _tile_loadd(0, c, ldc);
    if constexpr (kN > 1) _tile_loadd(1, c + 16, ldc);
    if constexpr (kS > 1) _tile_loadd(2, c1, ldc);
    if constexpr (kS > 1 && kN > 1) _tile_loadd(3, c1 + 16, ldc);
  } else {
    _tile_zero(0);
    if constexpr (kN > 1) _tile_zero(1);
    if constexpr (kS > 1) _tile_zero(2);
    if constexpr (kS > 1 && kN > 1) _tile_zero(3);
  }
// (a macro: the intrinsics are macros that paste their tile numbers into the instruction)
#define FASTBERT_TILE_PRODUCT(c, a, b) \
  if constexpr (std::is_same_v<A, uint8_t>) _tile_dpbusd(c, a, b); else _tile_dpbf16ps(c, a, b)
  for (int64_t t = 0; t < steps; ++t) {
    if (ahead != nullptr) {
      const char* next = reinterpret_cast<const char*>(ahead) + t * ahead_bytes;
      for (int64_t line = 0; line < ahead_bytes; line += 64) {
        _mm_prefetch(next + line, _MM_HINT_T1);
        if constexpr (kN > 1) _mm_prefetch(next + 4 * b_next + line, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, a[0] + kStep * t, lda);
    _tile_loadd(6, b + t * b_step, ldb);
    if constexpr (kS > 1) _tile_loadd(5, a[1] + kStep * t, lda);
    if constexpr (kN > 1) _tile_loadd(7, b + t * b_step + b_next, ldb);
    FASTBERT_TILE_PRODUCT(0, 4, 6);
    if constexpr (kN > 1) { FASTBERT_TILE_PRODUCT(1, 4, 7); }
    if constexpr (kS > 1) { FASTBERT_TILE_PRODUCT(2, 5, 6); }
    if constexpr (kS > 1 && kN > 1) { FASTBERT_TILE_PRODUCT(3, 5, 7); }
  }
#undef FASTBERT_TILE_PRODUCT
  _tile_stored(0, c, ldc);
  if constexpr (kN > 1) _tile_stored(1, c + 16, ldc);
  if constexpr (kS > 1) _tile_stored(2, c1, ldc);
  if constexpr (kS > 1 && kN > 1) _tile_stored(3, c1 + 16, ldc);
}

// tile_block for `strips` (1 or 2) x `tiles` (1 or 2), chosen at run time.
template <bool kAdd, typename A>
void tile_block(int64_t strips, int64_t tiles, const A* const a[2], int64_t lda, const uint32_t* b, int64_t b_step,
                int64_t b_next, int64_t ldb, int64_t steps, Sum<A>* c, int64_t ldc, const uint32_t* ahead = nullptr,
                int64_t ahead_bytes = 1024) {
  const auto run = [&](auto block) { block(a, lda, b, b_step, b_next, ldb, steps, c, ldc, ahead, ahead_bytes); };
  if (strips > 1 && tiles > 1) run(tile_block<2, 2, kAdd, A>);
  else if (strips > 1) run(tile_block<2, 1, kAdd, A>);
  else if (tiles > 1) run(tile_block<1, 2, kAdd, A>);
  else run(tile_block<1, 1, kAdd, A>);
}

// How the AMX GEMMs (float_gemm.h's bfloat16, int8_gemm.h's u8 x s8) share out m rows of `row_bytes` (k x
// the element's size) x n_blocks packed blocks of 16 columns, in panels of 2 blocks (32 columns), whose
// weights take 32 x row_bytes. Tasks: (a share of the rows) x (a group of panels), a thread's tasks sharing
// its rows. Rows are shared out where each thread gets 128 or more, else panels: with fewer rows each thread
// reads only its part of the weights. Where a task's rows fit in half of L2 they stay there while the task's
// panels pass, each panel meeting all of the rows in turn (from L1 after the first 32), the next one fetched
// meanwhile; then one group of panels a thread. Else each 32 rows meet a group of panels that stays in L2.
// With weights not in cache (BERT-base's four bfloat16 GEMMs, 12 layers' weights in turn) these shares, this
// order and the fetch ahead took 128 rows from 16.8 ms to 12.3 (oneDNN 14.4-14.8) and 512 rows from 45.8 to
// 41.4 (oneDNN 49.6): benchmarks/RESULTS.md.
struct Schedule {
  int64_t m, n_blocks, panels, share, groups, per_group;
  bool panels_outer;

  Schedule(int64_t rows, int64_t blocks, int64_t row_bytes) : m(rows), n_blocks(blocks), panels((blocks + 1) / 2) {
    static const int64_t l2 = [] {
      const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
      return bytes > 0 ? int64_t(bytes) : int64_t(1) << 20;
    }();
    const int64_t threads = at::get_num_threads(), row_shares = m >= 128 * threads ? threads : 1;
    share = (m + row_shares - 1) / row_shares;
    panels_outer = share * row_bytes <= l2 / 2;
    groups = panels_outer ? 1 : std::max<int64_t>(1, (panels * 32 * row_bytes + l2 / 4 - 1) / (l2 / 4));
    if (row_shares == 1) groups = (std::max(groups, threads) + threads - 1) / threads * threads;
    groups = std::min(groups, panels);
    per_group = (panels + groups - 1) / groups;
  }
  int64_t tasks() const { return (m + share - 1) / share * groups; }
  int64_t row0(int64_t task) const { return task / groups * share; }
  int64_t row_end(int64_t task) const { return std::min(m, row0(task) + share); }
  // The task's last block of 32 rows.
  int64_t last(int64_t task) const { return row0(task) + (row_end(task) - row0(task) - 1) / 32 * 32; }

  // f(r, block, ahead, ahead_bytes) for each block of 32 rows [r, ...) x panel (blocks block, block + 1) of the
  // task, in order. While a panel meets the task's rows, the next one (2 whole blocks, `steps` steps of 1 KB
  // each, block_bytes apart) is fetched toward L2: `ahead` is the byte offset from the packed weights' start
  // of what this block of rows fetches (-1: nothing), `ahead_bytes` its share of each step. Spread over the
  // panel's blocks of rows where it passes over all of them (each block its slice; all with the first took
  // 1.13x the time, 128 rows, weights from memory), else all with the first.
  template <typename F>
  void visit(int64_t task, int64_t block_bytes, int64_t steps, const F& f) const {
    const int64_t first = row0(task), end = row_end(task);
    const int64_t panel0 = task % groups * per_group, panel_end = std::min(panels, panel0 + per_group);
    const auto block_of = [&](int64_t r, int64_t panel) {
      const int64_t block = 2 * panel;
      const int64_t slices = panels_outer ? (end - first + 31) / 32 : 1, slice = (r - first) / 32;
      const bool fetch = slice < slices && panel + 1 < panel_end && block + 3 < n_blocks;
      const int64_t slice_bytes = (1024 / slices + 63) / 64 * 64;
      f(r, block, fetch ? (block + 2) * block_bytes + slice * steps * slice_bytes : int64_t(-1), slice_bytes);
    };
    if (panels_outer) {
      for (int64_t panel = panel0; panel < panel_end; ++panel)
        for (int64_t r = first; r < end; r += 32) block_of(r, panel);
    } else {
      for (int64_t r = first; r < end; r += 32)
        for (int64_t panel = panel0; panel < panel_end; ++panel) block_of(r, panel);
    }
  }
};

// Where the task's last block of rows [last, end) ends in a partial strip, both of its strips from a copy
// zero-padded to 32 rows of `width` elements (x's rows have stride ld): returns the copy, else null (the
// rows are read in place).
template <typename E>
const E* padded_last_block(const E* x, int64_t ld, int64_t last, int64_t end, int64_t width, std::vector<E>& edge) {
  if ((end - last) % 16 == 0 || width == 0) return nullptr;
  edge.assign(32 * width, E(0));
  for (int64_t i = 0; i < end - last; ++i) std::copy(x + (last + i) * ld, x + (last + i) * ld + width, edge.data() + i * width);
  return edge.data();
}

}  // namespace amx
}  // namespace fastbert
