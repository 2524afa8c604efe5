// Shared device helpers for csrc/cuda/*.cu (torch-free): storage <-> fp32 conversion, warp and block
// sums, and a deterministic fp32 column sum.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace fastbert {
namespace cuda {
namespace detail {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32), returned to every thread. `scratch`: 32
// floats of shared memory; safe to call repeatedly (it syncs before reusing scratch).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// out[j] = sum over p < parts of in[p * n + j], in fp32 with a fixed order. Block (32, 32): x picks
// the column, y strides over parts; a shared-memory tree then sums the 32 y partials.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const T* __restrict__ in, float* __restrict__ out,
                                                          int64_t parts, int64_t n) {
  __shared__ float tile[32][33];
  const int64_t j = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (j < n) {
    for (int64_t p = threadIdx.y; p < parts; p += 32) s += to_float(in[p * n + j]);
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  for (int half = 16; half > 0; half >>= 1) {
    if (threadIdx.y < half) tile[threadIdx.y][threadIdx.x] += tile[threadIdx.y + half][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && j < n) out[j] = tile[0][threadIdx.x];
}

template <typename T>
cudaError_t column_sum(const T* in, float* out, int64_t parts, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + 31) / 32;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  column_sum_kernel<T><<<dim3(unsigned(blocks)), dim3(32, 32), 0, stream>>>(in, out, parts, n);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastbert
