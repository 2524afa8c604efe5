// C entry points to the CUDA launchers (csrc/cuda/launchers.h) for tests/emulated_cuda.py's ctypes: the
// structs by pointer, no stream (the emulator runs a launch to completion).
#include "launchers.h"

using fastbert::cuda::AttentionBatch;
using fastbert::cuda::AttentionTensor;
using fastbert::cuda::DType;

extern "C" {

// t: q, k, v, out
int emulated_attention_fwd(int dtype, const AttentionBatch* batch, const AttentionTensor* t, float* lse, float scale,
                           float dropout_p, uint64_t seed) {
  return fastbert::cuda::attention_fwd(DType(dtype), *batch, t[0], t[1], t[2], t[3], lse, scale, dropout_p, seed,
                                       nullptr);
}

size_t emulated_attention_bwd_workspace_bytes(const AttentionBatch* batch) {
  return fastbert::cuda::attention_bwd_workspace_bytes(*batch);
}

// t: grad, q, k, v, out, dq, dk, dv
int emulated_attention_bwd(int dtype, const AttentionBatch* batch, const AttentionTensor* t, const float* lse,
                           void* workspace, size_t workspace_bytes, float scale, float dropout_p, uint64_t seed) {
  return fastbert::cuda::attention_bwd(DType(dtype), *batch, t[0], t[1], t[2], t[3], t[4], lse, t[5], t[6], t[7],
                                       workspace, workspace_bytes, scale, dropout_p, seed, nullptr);
}

}  // extern "C"
