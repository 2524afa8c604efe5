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

// f(row, rows, block, blocks, tile) for every tile of an m x (n_blocks blocks of `cols` columns) output, in
// tasks of (a panel of kBlocks blocks) x (up to 16 tiles of rows), panel-major: a thread's consecutive tasks
// share one panel of weights, which stays in its L2 while the rows stream past. `tile`: a per-thread float
// buffer of kRows x kBlocks x cols for the tile's result where it is not the output.
template <int kRows, int kBlocks, int64_t kCols, typename F>
void for_tiles(int64_t m, int64_t n_blocks, int64_t k, const F& f) {
  constexpr int64_t kRowsPerTask = kRows * 16;
  const int64_t panels = (n_blocks + kBlocks - 1) / kBlocks;
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  // At least ~1M multiply-adds per thread's share: smaller GEMMs are not worth waking threads for.
  const int64_t task_macs = std::min(m, kRowsPerTask) * kBlocks * kCols * std::max<int64_t>(k, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / task_macs);
  at::parallel_for(0, panels * row_tasks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[kRows * kBlocks * kCols];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t panel = t / row_tasks, row0 = (t % row_tasks) * kRowsPerTask;
      const int64_t block = panel * kBlocks, nb = std::min<int64_t>(kBlocks, n_blocks - block);
      const int64_t row_end = std::min(m, row0 + kRowsPerTask);
      for (int64_t r = row0; r < row_end; r += kRows) f(r, std::min<int64_t>(kRows, row_end - r), block, nb, tile);
    }
  });
}

}  // namespace gemm_driver
}  // namespace fastbert
