// bias_gelu on CUDA: y = gelu(x + bias), exact (erf) or tanh form, and its backward. Torch-free
// (launchers.h); float / half / bfloat16 storage, fp32 math; mirrors csrc/cpu/bias_gelu.cpp.
// Elementwise over [rows, n]: blockIdx.x picks 256 columns (so bias is read once per thread, no
// division by n), blockIdx.y strides over rows. grad_bias is a separate deterministic fp32 column sum
// (bias_gelu_grad_bias), since the op schema returns only grad_x and Python sums it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "launchers.h"

namespace fastbert {
namespace cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhScale = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;
constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;

__device__ __forceinline__ float gelu(float x, bool tanh_form) {
  if (tanh_form) {
    const float inner = kTanhScale * (x + kTanhCubic * x * x * x);
    return 0.5f * x * (1.f + tanhf(inner));
  }
  return 0.5f * x * (1.f + erff(x * kInvSqrt2));
}

// d gelu(x) / dx
__device__ __forceinline__ float gelu_grad(float x, bool tanh_form) {
  if (tanh_form) {
    const float x2 = x * x;
    const float t = tanhf(kTanhScale * (x + kTanhCubic * x2 * x));
    const float dinner = kTanhScale * (1.f + 3.f * kTanhCubic * x2);
    // Past |x| ~ 1.8e19 x^2 is inf where 1 - t^2 is 0: the term is 0 wherever 1 - t^2 is (not 0 * inf = NaN).
    const float sech2 = 1.f - t * t;
    return 0.5f * (1.f + t) + (sech2 == 0.f ? 0.f : 0.5f * x * sech2 * dinner);
  }
  const float cdf = 0.5f * (1.f + erff(x * kInvSqrt2));
  const float pdf = kInvSqrt2Pi * expf(-0.5f * x * x);
  return cdf + x * pdf;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out, int64_t rows,
                   int64_t n, bool tanh_form) {
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= n) return;
  const float b = to_float(bias[j]);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t i = r * n + j;
    out[i] = from_float<T>(gelu(to_float(x[i]) + b, tanh_form));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ bias,
                    T* __restrict__ grad_x, int64_t rows, int64_t n, bool tanh_form) {
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= n) return;
  const float b = to_float(bias[j]);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t i = r * n + j;
    grad_x[i] = from_float<T>(to_float(grad[i]) * gelu_grad(to_float(x[i]) + b, tanh_form));
  }
}

bool grid_for(int64_t rows, int64_t n, dim3& grid) {
  const int64_t col_blocks = (n + kThreads - 1) / kThreads;
  if (col_blocks > 0x7fffffff) return false;
  grid = dim3(unsigned(col_blocks), unsigned(rows < kMaxRowBlocks ? rows : kMaxRowBlocks));
  return true;
}

template <typename T>
cudaError_t forward(const void* x, const void* bias, void* out, int64_t rows, int64_t n, bool tanh_form,
                    cudaStream_t stream) {
  dim3 grid;
  if (!grid_for(rows, n, grid)) return cudaErrorInvalidValue;
  forward_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(bias),
                                                   static_cast<T*>(out), rows, n, tanh_form);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows, int64_t n,
                     bool tanh_form, cudaStream_t stream) {
  dim3 grid;
  if (!grid_for(rows, n, grid)) return cudaErrorInvalidValue;
  backward_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(grad), static_cast<const T*>(x),
                                                    static_cast<const T*>(bias), static_cast<T*>(grad_x), rows, n,
                                                    tanh_form);
  return cudaGetLastError();
}

}  // namespace

cudaError_t bias_gelu_fwd(DType dtype, const void* x, const void* bias, void* out, int64_t rows, int64_t n,
                          bool tanh_form, cudaStream_t stream) {
  if (rows < 0 || n < 0) return cudaErrorInvalidValue;
  if (rows == 0 || n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return forward<float>(x, bias, out, rows, n, tanh_form, stream);
    case DType::kFloat16:
      return forward<__half>(x, bias, out, rows, n, tanh_form, stream);
    case DType::kBFloat16:
      return forward<__nv_bfloat16>(x, bias, out, rows, n, tanh_form, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bias_gelu_bwd(DType dtype, const void* grad, const void* x, const void* bias, void* grad_x,
                          int64_t rows, int64_t n, bool tanh_form, cudaStream_t stream) {
  if (rows < 0 || n < 0) return cudaErrorInvalidValue;
  if (rows == 0 || n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return backward<float>(grad, x, bias, grad_x, rows, n, tanh_form, stream);
    case DType::kFloat16:
      return backward<__half>(grad, x, bias, grad_x, rows, n, tanh_form, stream);
    case DType::kBFloat16:
      return backward<__nv_bfloat16>(grad, x, bias, grad_x, rows, n, tanh_form, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bias_gelu_grad_bias(DType dtype, const void* grad_x, float* grad_bias, int64_t rows, int64_t n,
                                cudaStream_t stream) {
  if (rows < 0 || n < 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return detail::column_sum(static_cast<const float*>(grad_x), grad_bias, rows, n, stream);
    case DType::kFloat16:
      return detail::column_sum(static_cast<const __half*>(grad_x), grad_bias, rows, n, stream);
    case DType::kBFloat16:
      return detail::column_sum(static_cast<const __nv_bfloat16*>(grad_x), grad_bias, rows, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastbert
