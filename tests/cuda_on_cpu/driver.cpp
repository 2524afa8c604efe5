// C entry points to the CUDA launchers (csrc/cuda/launchers.h) for tests/emulated_cuda.py's ctypes: the
// structs by pointer, no stream (the emulator runs a launch to completion).
#include "launchers.h"

using fastbert::cuda::AttentionBatch;
using fastbert::cuda::AttentionTensor;
using fastbert::cuda::DType;

extern "C" {

// t: q, k, v, out
int emulated_attention_fwd(int dtype, const AttentionBatch* batch, const AttentionTensor* t, float* lse, float scale,
                           double dropout_p, uint64_t seed) {
  return fastbert::cuda::attention_fwd(DType(dtype), *batch, t[0], t[1], t[2], t[3], lse, scale, dropout_p, seed,
                                       nullptr);
}

size_t emulated_attention_bwd_workspace_bytes(const AttentionBatch* batch) {
  return fastbert::cuda::attention_bwd_workspace_bytes(*batch);
}

// t: grad, q, k, v, out, dq, dk, dv
int emulated_attention_bwd(int dtype, const AttentionBatch* batch, const AttentionTensor* t, const float* lse,
                           void* workspace, size_t workspace_bytes, float scale, double dropout_p, uint64_t seed) {
  return fastbert::cuda::attention_bwd(DType(dtype), *batch, t[0], t[1], t[2], t[3], t[4], lse, t[5], t[6], t[7],
                                       workspace, workspace_bytes, scale, dropout_p, seed, nullptr);
}

// p: x, residual, weight, bias, out
int emulated_add_layer_norm_fwd(int dtype, void* const* p, float* mean, float* rstd, int64_t rows, int64_t n, float eps,
                                double dropout_p, uint64_t seed) {
  return fastbert::cuda::add_layer_norm_fwd(DType(dtype), p[0], p[1], p[2], p[3], p[4], mean, rstd, rows, n, eps,
                                            dropout_p, seed, nullptr);
}

size_t emulated_add_layer_norm_bwd_workspace_bytes(int64_t rows, int64_t n, int sm_count) {
  return fastbert::cuda::add_layer_norm_bwd_workspace_bytes(rows, n, sm_count);
}

// p: grad, x, residual, weight, grad_h, grad_x (null without dropout)
int emulated_add_layer_norm_bwd(int dtype, void* const* p, const float* mean, const float* rstd, float* grad_weight,
                                float* grad_bias, void* workspace, size_t workspace_bytes, int64_t rows, int64_t n,
                                double dropout_p, uint64_t seed, int sm_count) {
  return fastbert::cuda::add_layer_norm_bwd(DType(dtype), p[0], p[1], p[2], p[3], mean, rstd, p[4], p[5], grad_weight,
                                            grad_bias, workspace, workspace_bytes, rows, n, dropout_p, seed, sm_count,
                                            nullptr);
}

int emulated_bias_gelu_fwd(int dtype, const void* x, const void* bias, void* out, int64_t rows, int64_t n, bool tanh_form) {
  return fastbert::cuda::bias_gelu_fwd(DType(dtype), x, bias, out, rows, n, tanh_form, nullptr);
}

int emulated_bias_gelu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                           int64_t n, bool tanh_form) {
  return fastbert::cuda::bias_gelu_bwd(DType(dtype), grad, x, bias, grad_x, rows, n, tanh_form, nullptr);
}

}  // extern "C"
