// What fastbert's own GEMMs (int8_gemm.h, float_gemm.h) share: a table of register tiles for every edge
// shape, and the loop that hands threads their tiles.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace fastbert {
namespace gemm_driver {

// Tiles of kRows x kBlocks, every smaller shape for the edges: table[rows - 1][blocks - 1].
template <typename TileFn, int kRows, int kBlocks>
struct Kernel {
  TileFn table[kRows][kBlocks];
};

template <typename TileFn, template <int, int> class Tile, int kRows, int kBlocks, int R = 1, int B = 1>
void fill(Kernel<TileFn, kRows, kBlocks>& kernel) {
  kernel.table[R - 1][B - 1] = &Tile<R, B>::run;
  if constexpr (B < kBlocks) fill<TileFn, Tile, kRows, kBlocks, R, B + 1>(kernel);
  else if constexpr (R < kRows) fill<TileFn, Tile, kRows, kBlocks, R + 1, 1>(kernel);
}

template <typename TileFn, template <int, int> class Tile, int kRows, int kBlocks>
Kernel<TileFn, kRows, kBlocks> make_kernel() {
  Kernel<TileFn, kRows, kBlocks> kernel{};
  fill<TileFn, Tile, kRows, kBlocks>(kernel);
  return kernel;
}

constexpr int64_t kTilesPerTask = 16;  // a task's rows: this many tiles' worth

// f(row0, row_end, block, blocks) for every task of an m x (n_blocks blocks of kCols columns) output: tasks
// of (a panel of kBlocks blocks) x (up to kTilesPerTask tiles of kRows rows), panel-major, so that a thread's
// consecutive tasks share one panel of weights, which stays in its L2 while the rows stream past.
template <int kRows, int kBlocks, int64_t kCols, typename F>
void for_tasks(int64_t m, int64_t n_blocks, int64_t k, const F& f) {
  constexpr int64_t kRowsPerTask = kRows * kTilesPerTask;
  const int64_t panels = (n_blocks + kBlocks - 1) / kBlocks;
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  // At least ~1M multiply-adds per thread's share: smaller GEMMs are not worth waking threads for.
  const int64_t task_macs = std::min(m, kRowsPerTask) * kBlocks * kCols * std::max<int64_t>(k, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / task_macs);
  at::parallel_for(0, panels * row_tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t panel = t / row_tasks, row0 = (t % row_tasks) * kRowsPerTask;
      const int64_t block = panel * kBlocks;
      f(row0, std::min(m, row0 + kRowsPerTask), block, std::min<int64_t>(kBlocks, n_blocks - block));
    }
  });
}

// f(row, rows, block, blocks, tile) for every tile of those tasks; `tile`: a float buffer of kRows x kBlocks x
// kCols for the tile's result where it is not the output.
template <int kRows, int kBlocks, int64_t kCols, typename F>
void for_tiles(int64_t m, int64_t n_blocks, int64_t k, const F& f) {
  for_tasks<kRows, kBlocks, kCols>(m, n_blocks, k, [&](int64_t row0, int64_t row_end, int64_t block, int64_t nb) {
    alignas(64) float tile[kRows * kBlocks * kCols];
    for (int64_t r = row0; r < row_end; r += kRows) f(r, std::min<int64_t>(kRows, row_end - r), block, nb, tile);
  });
}

}  // namespace gemm_driver
}  // namespace fastbert
