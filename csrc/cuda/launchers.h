// Torch-free launchers for fastbert's CUDA kernels (add_layer_norm.cu, attention.cu, bias_gelu.cu):
// raw pointers, sizes, a storage dtype tag and a stream in, a cudaError_t out (the launch's, via
// cudaGetLastError).
// bindings.cpp (built only against a CUDA torch) checks tensors and calls these; the .cu files include
// no torch header, so they compile with plain nvcc anywhere (tests/test_build.py).
// Row-wise ops take contiguous, row-major [rows, n] tensors; attention takes strided views (below).
// Math is fp32 whatever the storage dtype.
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
// Dropout keeps element (r, j) where dropout_with(dropout_p, seed).keep(0, 0, r, j) (csrc/cpu/dropout.h),
// scaling kept values by 1 / (1 - dropout_p): the same elements as the CPU kernel.
cudaError_t add_layer_norm_fwd(DType dtype, const void* x, const void* residual, const void* weight,
                               const void* bias, void* out, float* mean, float* rstd, int64_t rows, int64_t n,
                               float eps, double dropout_p, uint64_t seed, cudaStream_t stream);

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
                               size_t workspace_bytes, int64_t rows, int64_t n, double dropout_p, uint64_t seed,
                               int sm_count, cudaStream_t stream);

// Widest attention head: tiles are padded to 32, 64 or 128 columns.
constexpr int64_t kAttentionMaxHeadDim = 128;

// One attention tensor (q, k, v, out, their gradients), any strides but a contiguous head dim: row r of
// head h of sequence i is at data + (start_i + r) * row + i * seq + h * head elements, with start_i =
// cu_seqlens[i] in a varlen batch ([T, heads, d]: seq = 0) and 0 in a padded one ([B, heads, S, d]).
// The launchers only read the inputs.
struct AttentionTensor {
  void* data;
  int64_t seq, head, row;
};

// A padded batch (B sequences of S rows, optional key-padding mask) or a varlen one (cu_seqlens).
struct AttentionBatch {
  int64_t sequences = 0;                // B
  int64_t heads = 0;
  int64_t tokens = 0;                   // rows per head: S (padded) or T (varlen)
  int64_t head_dim = 0;                 // 1 .. kAttentionMaxHeadDim
  const uint8_t* key_mask = nullptr;    // padded only: device [B, S], nonzero = keep; null keeps all keys
  const int32_t* cu_seqlens = nullptr;  // varlen only: device int32 [B + 1], rising from 0 to T
};

// out = softmax(q k^T * scale, masked keys excluded) v, with dropout on the probabilities; lse: float32
// logsumexp of the scaled scores, contiguous [B, heads, S] (padded) or [heads, T] (varlen), +inf for a
// query row with no kept key (whose out row is zeros). Dropout keeps probability (query r, key j) of
// head h of sequence i where dropout_with(dropout_p, seed).keep(i, h, r, j) (csrc/cpu/dropout.h), scaling
// it by 1 / (1 - dropout_p): the elements the CPU kernel keeps.
cudaError_t attention_fwd(DType dtype, const AttentionBatch& batch, AttentionTensor q, AttentionTensor k,
                          AttentionTensor v, AttentionTensor out, float* lse, float scale, double dropout_p,
                          uint64_t seed, cudaStream_t stream);

// Bytes of scratch that attention_bwd needs: three values per lse entry (D = rowsum(P * dP), the row's
// dominant key and the other keys' dS summed).
size_t attention_bwd_workspace_bytes(const AttentionBatch& batch);

// dq, dk, dv from grad (d loss / d out) and the forward's out and lse, recomputing the probabilities
// tile by tile; deterministic (one kernel for dq per query tile, one for dk and dv per key tile, no
// atomics). Keys after the last kept one get zero gradients.
cudaError_t attention_bwd(DType dtype, const AttentionBatch& batch, AttentionTensor grad, AttentionTensor q,
                          AttentionTensor k, AttentionTensor v, AttentionTensor out, const float* lse,
                          AttentionTensor dq, AttentionTensor dk, AttentionTensor dv, void* workspace,
                          size_t workspace_bytes, float scale, double dropout_p, uint64_t seed,
                          cudaStream_t stream);

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
