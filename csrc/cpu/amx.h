// AMX tiles as fastbert programs them (attention.cpp's products, float_gemm.h's bfloat16 GEMM): every tile
// 16 rows x 64 bytes, so A is 16 rows x 32 bfloat16, B 16 pair rows x 16 columns (bfloat16 pairs along the
// summed dimension, 32-bit words) and C 16 x 16 fp32; a block is up to 2 A strips x 2 B column tiles in the
// eight tile registers (4 C, 2 A, 2 B). Functions carry __attribute__((target(...))), so the file builds for
// any x86-64 CPU; callers check cpu_has_amx() first.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace fastbert {
namespace amx {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// AMX-BF16 in the CPU, and the tile state from Linux, which hands it out only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, once per process).
inline bool cpu_has_amx() {
  static const bool usable = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
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
// a[s] + 32 * step elements (row stride lda bytes), B tile n at b + step * b_step + n * b_next words (row
// stride ldb bytes, 16 rows of 64 contiguous bytes), C tile (s, n) at c + s * 16 rows + 16 * n (row stride
// ldc bytes). `ahead` (or null): bytes toward L2, `ahead_bytes` a step from each of kN streams b_next words
// apart (the next block's B, laid out as b is, or a slice of it).
template <int kS, int kN, bool kAdd>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(const c10::BFloat16* const a[2], int64_t lda,
                                                              const uint32_t* b, int64_t b_step, int64_t b_next,
                                                              int64_t ldb, int64_t steps, float* c, int64_t ldc,
                                                              const uint32_t* ahead = nullptr,
                                                              int64_t ahead_bytes = 1024) {
  float* c1 = c + 16 * (ldc / 4);
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
  for (int64_t t = 0; t < steps; ++t) {
    if (ahead != nullptr) {
      const char* next = reinterpret_cast<const char*>(ahead) + t * ahead_bytes;
      for (int64_t line = 0; line < ahead_bytes; line += 64) {
        _mm_prefetch(next + line, _MM_HINT_T1);
        if constexpr (kN > 1) _mm_prefetch(next + 4 * b_next + line, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, a[0] + 32 * t, lda);
    _tile_loadd(6, b + t * b_step, ldb);
    if constexpr (kS > 1) _tile_loadd(5, a[1] + 32 * t, lda);
    if constexpr (kN > 1) _tile_loadd(7, b + t * b_step + b_next, ldb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kN > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kS > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kS > 1 && kN > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, ldc);
  if constexpr (kN > 1) _tile_stored(1, c + 16, ldc);
  if constexpr (kS > 1) _tile_stored(2, c1, ldc);
  if constexpr (kS > 1 && kN > 1) _tile_stored(3, c1 + 16, ldc);
}

// tile_block for `strips` (1 or 2) x `tiles` (1 or 2), chosen at run time.
template <bool kAdd>
void tile_block(int64_t strips, int64_t tiles, const c10::BFloat16* const a[2], int64_t lda, const uint32_t* b,
                int64_t b_step, int64_t b_next, int64_t ldb, int64_t steps, float* c, int64_t ldc,
                const uint32_t* ahead = nullptr, int64_t ahead_bytes = 1024) {
  const auto run = [&](auto block) { block(a, lda, b, b_step, b_next, ldb, steps, c, ldc, ahead, ahead_bytes); };
  if (strips > 1 && tiles > 1) run(tile_block<2, 2, kAdd>);
  else if (strips > 1) run(tile_block<2, 1, kAdd>);
  else if (tiles > 1) run(tile_block<1, 2, kAdd>);
  else run(tile_block<1, 1, kAdd>);
}

}  // namespace amx
}  // namespace fastbert
