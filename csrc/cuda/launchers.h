// Torch-free launchers for fastbert's CUDA kernels (add_layer_norm.cu, bias_gelu.cu): raw pointers,
// sizes, a storage dtype tag and a stream in, a cudaError_t out (the launch's, via cudaGetLastError).
// bindings.cpp (built only against a CUDA torch) checks tensors and calls these; the .cu files include
// no torch header, so they compile with plain nvcc anywhere (tests/test_cuda_compile.py).
// All tensors are contiguous, row-major [rows, n]; math is fp32 whatever the storage dtype.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

extern "C++" {
namespace fastbert {
namespace cuda {

// Storage dtype of the activation tensors (x, residual, weight, bias, out, grads); statistics and
// weight/bias gradients are always float32.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// add_layer_norm keeps a row in registers: at most 8 values per thread, 1024 threads per row.
constexpr int64_t kAddLayerNormMaxN = 8192;

// out = LayerNorm(dropout(x) + residual) * weight + bias over rows of n; mean and rstd: float32 [rows].
// Dropout keeps element (r, j) where Dropout{dropout_p, seed}.keep(0, 0, r, j) (csrc/cpu/dropout.h),
// scaling kept values by 1 / (1 - dropout_p): the same elements as the CPU kernel.
cudaError_t add_layer_norm_fwd(DType dtype, const void* x, const void* residual, const void* weight,
                               const void* bias, void* out, float* mean, float* rstd, int64_t rows, int64_t n,
                               float eps, float dropout_p, uint64_t seed, cudaStream_t stream);

// Bytes of float32 scratch that add_layer_norm_bwd needs (per-block partial sums of grad_weight and
// grad_bias); sm_count: the device's multiprocessor count (it sizes the grid).
size_t add_layer_norm_bwd_workspace_bytes(int64_t rows, int64_t n, int sm_count);

// grad_h = d loss / d(dropout(x) + residual) (the residual's gradient); grad_x = grad_h * the dropout
// multipliers, written only when dropout_p > 0 (may be null otherwise); grad_weight, grad_bias:
// float32 [n], summed over rows in fp32 (per-block partials in `workspace`, then a second kernel:
// deterministic, no atomics).
cudaError_t add_layer_norm_bwd(DType dtype, const void* grad, const void* x, const void* residual,
                               const void* weight, const float* mean, const float* rstd, void* grad_h,
                               void* grad_x, float* grad_weight, float* grad_bias, void* workspace,
                               size_t workspace_bytes, int64_t rows, int64_t n, float dropout_p, uint64_t seed,
                               int sm_count, cudaStream_t stream);

// out = gelu(x + bias), exact (erf) or, with tanh_form, the tanh approximation; bias [n].
cudaError_t bias_gelu_fwd(DType dtype, const void* x, const void* bias, void* out, int64_t rows, int64_t n,
                          bool tanh_form, cudaStream_t stream);

// grad_x = grad * gelu'(x + bias).
cudaError_t bias_gelu_bwd(DType dtype, const void* grad, const void* x, const void* bias, void* grad_x,
                          int64_t rows, int64_t n, bool tanh_form, cudaStream_t stream);

// grad_bias (float32 [n]) = grad_x summed over rows, accumulated in fp32 (deterministic).
cudaError_t bias_gelu_grad_bias(DType dtype, const void* grad_x, float* grad_bias, int64_t rows, int64_t n,
                                cudaStream_t stream);

}  // namespace cuda
}  // namespace fastbert
}  // extern "C++"
