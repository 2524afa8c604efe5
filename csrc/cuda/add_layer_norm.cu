// add_layer_norm on CUDA: y = LayerNorm(dropout(x) + residual) over the last dimension, and its
// backward. Torch-free (launchers.h); float / half / bfloat16 storage, fp32 math, fp32 mean and rstd
// saved for backward. Mirrors csrc/cpu/add_layer_norm.cpp, including its dropout keep decisions
// (csrc/cpu/dropout.h, hashed from the seed and the element's (row, column)).
//
// A row of n <= 8192 lives in registers: `tpr` threads per row, each holding up to kCols = 8 columns
// j = lane + k * tpr. Rows of n <= 256 take one warp each (4 rows per 128-thread block, warp-shuffle
// sums only); longer rows take one block of round_up(n / 8, 32) threads (block sums).
// Backward recomputes h = dropout(x) + residual and keeps per-thread fp32 partials of grad_weight and
// grad_bias across the rows it visits (a grid-stride loop over rows); each row slot writes its partials
// to `workspace`, and a second kernel sums them per column in a fixed order (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpu/dropout.h"
#include "common.cuh"
#include "launchers.h"

namespace fastbert {
namespace cuda {
namespace {

using detail::block_sum;
using detail::from_float;
using detail::to_float;
using detail::warp_sum;

constexpr int kCols = 8;          // values per thread
constexpr int kWarpRowMaxN = 256;  // up to here: one warp per row
constexpr int kWarpRowsPerBlock = 4;

struct Launch {
  bool warp_rows;
  int threads;         // per block
  int rows_per_block;  // 1 unless warp_rows
};

Launch plan(int64_t n) {
  if (n <= kWarpRowMaxN) return {true, 32 * kWarpRowsPerBlock, kWarpRowsPerBlock};
  const int64_t tpr = ((n + kCols - 1) / kCols + 31) / 32 * 32;
  return {false, int(tpr), 1};
}

template <bool kWarpRows>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  if (kWarpRows) return warp_sum(v);
  return block_sum(v, scratch);
}

template <typename T, bool kWarpRows>
__global__ void __launch_bounds__(1024)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                   const T* __restrict__ b, T* __restrict__ y, float* __restrict__ mean_out,
                   float* __restrict__ rstd_out, int64_t rows, int n, float eps, Dropout dropout) {
  __shared__ float scratch[32];
  const int tpr = kWarpRows ? 32 : blockDim.x;
  const int lane = kWarpRows ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t r = kWarpRows ? int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5) : int64_t(blockIdx.x);
  if (r >= rows) return;  // warp-uniform (warp rows) or block-uniform (block rows)
  const int64_t o = r * n;
  const bool drop = dropout.on();
  const float scale = drop ? dropout.scale() : 1.f;

  float h[kCols];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int j = lane + k * tpr;
    h[k] = 0.f;
    if (j < n) {
      float xv = to_float(x[o + j]);
      if (drop) xv = xv * (dropout.keep(0, 0, r, j) ? scale : 0.f);
      h[k] = xv + to_float(res[o + j]);
      s += h[k];
    }
  }
  float mean = row_sum<kWarpRows>(s, scratch) / n;
  if (fabsf(mean) == INFINITY) {  // the row's sum left fp32's range (a row of ~1e36): summed again scaled by 2^-72
    float small = 0.f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) small += h[k] * 0x1p-72f;  // h is 0 past the row
    mean = row_sum<kWarpRows>(small, scratch) / n * 0x1p72f;
  }
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    if (lane + k * tpr < n) {
      const float d = h[k] - mean;
      sq += d * d;
    }
  }
  const float var = row_sum<kWarpRows>(sq, scratch) / n;
  float rstd = 1.f / sqrtf(var + eps);
  if (var == INFINITY) {  // the same in every thread of the row: the reductions below stay uniform
    // The squares left fp32's range (deviations past ~1e17 in a row of 768), and rstd came out 0: the row
    // was the bias alone. LayerNorm is scale-invariant: the sum again on the deviations times 2^-72
    // (exact; what underflows is negligible beside a deviation that overflowed, and so is eps).
    constexpr float kDown = 0x1p-72f;
    float small = 0.f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      if (lane + k * tpr < n) {
        const float d = (h[k] - mean) * kDown;
        small += d * d;
      }
    }
    rstd = kDown / sqrtf(row_sum<kWarpRows>(small, scratch) / n);
  }
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int j = lane + k * tpr;
    if (j < n) y[o + j] = from_float<T>((h[k] - mean) * rstd * to_float(w[j]) + to_float(b[j]));
  }
}

// grad_h = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); grad_w = sum g*xhat; grad_b = sum g.
// Row slot `slot` (one per warp or per block) visits rows slot, slot + slots, ... and finally writes
// its partials to part_w[slot * n + j] and part_b[slot * n + j].
template <typename T, bool kWarpRows>
__global__ void __launch_bounds__(1024)
    backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ res,
                    const T* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
                    T* __restrict__ grad_h, T* __restrict__ grad_x, float* __restrict__ part_w,
                    float* __restrict__ part_b, int64_t rows, int n, Dropout dropout) {
  __shared__ float scratch[32];
  const int tpr = kWarpRows ? 32 : blockDim.x;
  const int lane = kWarpRows ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t slot = kWarpRows ? int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5) : int64_t(blockIdx.x);
  const int64_t slots = kWarpRows ? int64_t(gridDim.x) * (blockDim.x >> 5) : int64_t(gridDim.x);
  const bool drop = dropout.on();
  const float scale = drop ? dropout.scale() : 1.f;

  float wv[kCols], pw[kCols], pb[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int j = lane + k * tpr;
    wv[k] = j < n ? to_float(w[j]) : 0.f;
    pw[k] = 0.f;
    pb[k] = 0.f;
  }
  for (int64_t r = slot; r < rows; r += slots) {  // uniform over the warp / block
    const int64_t o = r * n;
    const float mu = mean[r], rs = rstd[r];
    float gv[kCols], xh[kCols];
    unsigned kept = 0;  // bit k: column lane + k * tpr kept by dropout
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int j = lane + k * tpr;
      gv[k] = 0.f;
      xh[k] = 0.f;
      if (j < n) {
        float xv = to_float(x[o + j]);
        if (drop) {
          const bool keep = dropout.keep(0, 0, r, j);
          kept |= unsigned(keep) << k;
          xv = xv * (keep ? scale : 0.f);
        }
        gv[k] = to_float(g[o + j]);
        xh[k] = (xv + to_float(res[o + j]) - mu) * rs;
        const float d = gv[k] * wv[k];
        s1 += d;
        s2 += d * xh[k];
        pw[k] += gv[k] * xh[k];
        pb[k] += gv[k];
      }
    }
    const float mean_d = row_sum<kWarpRows>(s1, scratch) / n;
    const float mean_dx = row_sum<kWarpRows>(s2, scratch) / n;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int j = lane + k * tpr;
      if (j < n) {
        const float dh = rs * (gv[k] * wv[k] - mean_d - xh[k] * mean_dx);
        grad_h[o + j] = from_float<T>(dh);
        if (drop) grad_x[o + j] = from_float<T>(dh * (((kept >> k) & 1u) ? scale : 0.f));
      }
    }
  }
  if (slot < slots) {
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int j = lane + k * tpr;
      if (j < n) {
        part_w[slot * n + j] = pw[k];
        part_b[slot * n + j] = pb[k];
      }
    }
  }
}

// Row slots for backward: enough resident warps to hide memory latency (about half of an SM's 2048
// threads), never more than there are rows.
int64_t backward_slots(int64_t rows, int64_t n, int sm_count) {
  if (rows <= 0 || n <= 0) return 0;
  const Launch l = plan(n);
  const int64_t blocks_per_sm = l.threads >= 1024 ? 1 : 1024 / l.threads;
  const int64_t max_blocks = int64_t(sm_count > 0 ? sm_count : 1) * blocks_per_sm;
  const int64_t need_blocks = (rows + l.rows_per_block - 1) / l.rows_per_block;
  const int64_t blocks = need_blocks < max_blocks ? need_blocks : max_blocks;
  return blocks * l.rows_per_block;
}

template <typename T>
cudaError_t forward(const void* x, const void* res, const void* w, const void* b, void* y, float* mean, float* rstd,
                    int64_t rows, int64_t n, float eps, Dropout dropout, cudaStream_t stream) {
  const Launch l = plan(n);
  const int64_t blocks = (rows + l.rows_per_block - 1) / l.rows_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  auto args = [&](auto kernel) {
    kernel<<<unsigned(blocks), l.threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), static_cast<const T*>(b),
        static_cast<T*>(y), mean, rstd, rows, int(n), eps, dropout);
  };
  if (l.warp_rows) {
    args(forward_kernel<T, true>);
  } else {
    args(forward_kernel<T, false>);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* g, const void* x, const void* res, const void* w, const float* mean,
                     const float* rstd, void* grad_h, void* grad_x, float* grad_w, float* grad_b, float* part,
                     int64_t rows, int64_t n, Dropout dropout, int sm_count, cudaStream_t stream) {
  const Launch l = plan(n);
  const int64_t slots = backward_slots(rows, n, sm_count);
  const int64_t blocks = slots / l.rows_per_block;
  float* part_w = part;
  float* part_b = part + slots * n;
  auto args = [&](auto kernel) {
    kernel<<<unsigned(blocks), l.threads, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
        mean, rstd, static_cast<T*>(grad_h), static_cast<T*>(grad_x), part_w, part_b, rows, int(n), dropout);
  };
  if (l.warp_rows) {
    args(backward_kernel<T, true>);
  } else {
    args(backward_kernel<T, false>);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = detail::column_sum(part_w, grad_w, slots, n, stream);
  if (err != cudaSuccess) return err;
  return detail::column_sum(part_b, grad_b, slots, n, stream);
}

cudaError_t check_sizes(int64_t rows, int64_t n, double dropout_p) {
  if (rows < 0 || n < 0 || n > kAddLayerNormMaxN) return cudaErrorInvalidValue;
  if (!(dropout_p >= 0.0 && dropout_p < 1.0)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t add_layer_norm_fwd(DType dtype, const void* x, const void* residual, const void* weight,
                               const void* bias, void* out, float* mean, float* rstd, int64_t rows, int64_t n,
                               float eps, double dropout_p, uint64_t seed, cudaStream_t stream) {
  cudaError_t err = check_sizes(rows, n, dropout_p);
  if (err != cudaSuccess) return err;
  if (rows == 0 || n == 0) return cudaSuccess;
  const Dropout dropout = dropout_with(dropout_p, seed);
  switch (dtype) {
    case DType::kFloat32:
      return forward<float>(x, residual, weight, bias, out, mean, rstd, rows, n, eps, dropout, stream);
    case DType::kFloat16:
      return forward<__half>(x, residual, weight, bias, out, mean, rstd, rows, n, eps, dropout, stream);
    case DType::kBFloat16:
      return forward<__nv_bfloat16>(x, residual, weight, bias, out, mean, rstd, rows, n, eps, dropout, stream);
  }
  return cudaErrorInvalidValue;
}

size_t add_layer_norm_bwd_workspace_bytes(int64_t rows, int64_t n, int sm_count) {
  if (rows <= 0 || n <= 0 || n > kAddLayerNormMaxN) return 0;
  return size_t(2 * backward_slots(rows, n, sm_count) * n) * sizeof(float);
}

cudaError_t add_layer_norm_bwd(DType dtype, const void* grad, const void* x, const void* residual,
                               const void* weight, const float* mean, const float* rstd, void* grad_h,
                               void* grad_x, float* grad_weight, float* grad_bias, void* workspace,
                               size_t workspace_bytes, int64_t rows, int64_t n, double dropout_p, uint64_t seed,
                               int sm_count, cudaStream_t stream) {
  cudaError_t err = check_sizes(rows, n, dropout_p);
  if (err != cudaSuccess) return err;
  if (n == 0) return cudaSuccess;
  if (rows == 0) {  // empty sums
    err = cudaMemsetAsync(grad_weight, 0, size_t(n) * sizeof(float), stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(grad_bias, 0, size_t(n) * sizeof(float), stream);
  }
  const Dropout dropout = dropout_with(dropout_p, seed);
  if (dropout.on() && grad_x == nullptr) return cudaErrorInvalidValue;
  if (workspace == nullptr || workspace_bytes < add_layer_norm_bwd_workspace_bytes(rows, n, sm_count)) {
    return cudaErrorInvalidValue;
  }
  float* part = static_cast<float*>(workspace);
  switch (dtype) {
    case DType::kFloat32:
      return backward<float>(grad, x, residual, weight, mean, rstd, grad_h, grad_x, grad_weight, grad_bias, part,
                             rows, n, dropout, sm_count, stream);
    case DType::kFloat16:
      return backward<__half>(grad, x, residual, weight, mean, rstd, grad_h, grad_x, grad_weight, grad_bias, part,
                              rows, n, dropout, sm_count, stream);
    case DType::kBFloat16:
      return backward<__nv_bfloat16>(grad, x, residual, weight, mean, rstd, grad_h, grad_x, grad_weight, grad_bias,
                                     part, rows, n, dropout, sm_count, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastbert
