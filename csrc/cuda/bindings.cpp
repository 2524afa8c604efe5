// CUDA implementations of the fastbert_C schemas (csrc/ops.cpp) for add_layer_norm, attention and
// bias_gelu: check the tensors like the CPU kernels do (csrc/cpu/*.cpp), then call the torch-free
// launchers (launchers.h) on the current stream. Built only where torch is a CUDA build (setup.py); it
// cannot compile against the CPU torch wheel.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "launchers.h"

namespace fastbert {
namespace {

using cuda::DType;
using cuda::kAddLayerNormMaxN;

// The schema implementations are named *_cuda so they never overload the launchers (cuda::*).
DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " (supported on CUDA: float32, float16, bfloat16)");
  }
  return DType::kFloat32;  // unreachable
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* op, const char* what) {
  TORCH_CHECK(t.is_cuda(), op, ": ", what, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", what, " is on ", t.device(), " but x is on ", like.device());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// ------------------------------------------------------------------------------------ add_layer_norm

void aln_check_same(const at::Tensor& t, const at::Tensor& like, const char* what) {
  check_cuda(t, like, "add_layer_norm", what);
  TORCH_CHECK(t.is_contiguous() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(),
              "add_layer_norm: ", what, " must be contiguous and match x in shape and dtype");
}

void aln_check_stats(const at::Tensor& t, const at::Tensor& x, int64_t rows, const char* what) {
  check_cuda(t, x, "add_layer_norm", what);
  TORCH_CHECK(t.is_contiguous() && t.numel() == rows && t.scalar_type() == at::kFloat,
              "add_layer_norm: ", what, " must be float32 with one value per row");
}

void aln_check_x(const at::Tensor& x, double dropout_p, int64_t n) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "add_layer_norm: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK(x.is_cuda(), "add_layer_norm: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1, "add_layer_norm: x must have at least one dimension");
  TORCH_CHECK(x.is_contiguous(), "add_layer_norm: x must be contiguous");
  TORCH_CHECK(n <= kAddLayerNormMaxN, "add_layer_norm: the CUDA kernel handles a last dimension of at most ",
              kAddLayerNormMaxN, ", got ", n, " (use the triton or reference backend)");
}

void add_layer_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        const at::Tensor& bias, double eps, double dropout_p, int64_t seed, const at::Tensor& out,
                        const at::Tensor& mean, const at::Tensor& rstd) {
  const int64_t n = x.dim() >= 1 ? x.size(-1) : 0, rows = n ? x.numel() / n : 0;
  aln_check_x(x, dropout_p, n);
  aln_check_same(residual, x, "residual");
  aln_check_same(out, x, "out");
  check_cuda(weight, x, "add_layer_norm", "weight");
  check_cuda(bias, x, "add_layer_norm", "bias");
  TORCH_CHECK(weight.is_contiguous() && bias.is_contiguous() && weight.numel() == n && bias.numel() == n &&
                  weight.scalar_type() == x.scalar_type() && bias.scalar_type() == x.scalar_type(),
              "add_layer_norm: weight and bias must be [N] in x's dtype");
  aln_check_stats(mean, x, rows, "mean");
  aln_check_stats(rstd, x, rows, "rstd");
  const DType dtype = dtype_of(x, "add_layer_norm");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_launch(cuda::add_layer_norm_fwd(dtype, x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                                  bias.data_ptr(), out.data_ptr(), mean.data_ptr<float>(),
                                                  rstd.data_ptr<float>(), rows, n, float(eps), dropout_p,
                                                  uint64_t(seed), stream),
               "add_layer_norm_fwd");
}

void add_layer_norm_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
                        int64_t seed, const at::Tensor& grad_h, const at::Tensor& grad_x, const at::Tensor& grad_weight,
                        const at::Tensor& grad_bias) {
  const int64_t n = x.dim() >= 1 ? x.size(-1) : 0, rows = n ? x.numel() / n : 0;
  aln_check_x(x, dropout_p, n);
  const bool drop = dropout_p > 0.0;
  if (drop) aln_check_same(grad_x, x, "grad_x");  // else unused (an empty tensor)
  aln_check_same(grad, x, "grad");
  aln_check_same(residual, x, "residual");
  aln_check_same(grad_h, x, "grad_h");
  check_cuda(weight, x, "add_layer_norm", "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "add_layer_norm: weight must be [N] in x's dtype");
  aln_check_stats(mean, x, rows, "mean");
  aln_check_stats(rstd, x, rows, "rstd");
  check_cuda(grad_weight, x, "add_layer_norm", "grad_weight");
  check_cuda(grad_bias, x, "add_layer_norm", "grad_bias");
  TORCH_CHECK(grad_weight.is_contiguous() && grad_weight.numel() == n && grad_weight.scalar_type() == at::kFloat &&
                  grad_bias.is_contiguous() && grad_bias.numel() == n && grad_bias.scalar_type() == at::kFloat,
              "add_layer_norm: grad_weight and grad_bias must be float32 [N]");
  const DType dtype = dtype_of(x, "add_layer_norm");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const size_t bytes = cuda::add_layer_norm_bwd_workspace_bytes(rows, n, sm_count);
  // From the caching allocator, on the current stream: freed when this function returns, reusable
  // only by work ordered after the kernels that use it.
  const at::Tensor workspace = at::empty({int64_t(bytes)}, x.options().dtype(at::kByte));
  check_launch(cuda::add_layer_norm_bwd(
                   dtype, grad.data_ptr(), x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                   mean.data_ptr<float>(), rstd.data_ptr<float>(), grad_h.data_ptr(), drop ? grad_x.data_ptr() : nullptr,
                   grad_weight.data_ptr<float>(), grad_bias.data_ptr<float>(), bytes ? workspace.data_ptr() : nullptr,
                   bytes, rows, n, dropout_p, uint64_t(seed), sm_count, stream),
               "add_layer_norm_bwd");
}

// ----------------------------------------------------------------------------------------- attention

void attn_check_like(const at::Tensor& t, const at::Tensor& q, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), "attention: ", what, " must be on ", q.device(), ", got ",
              t.device());
  TORCH_CHECK(t.sizes() == q.sizes() && t.stride(-1) == 1 && t.scalar_type() == q.scalar_type(), "attention: ", what,
              " must match q in shape and dtype, with a contiguous head dimension (stride 1)");
}

void attn_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "attention: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK(q.is_cuda(), "attention: q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3 || q.dim() == 4, "attention: q, k, v must be [B, heads, S, d] or [T, heads, d]");
  TORCH_CHECK(q.stride(-1) == 1, "attention: the head dimension must be contiguous (stride 1)");
  attn_check_like(k, q, "k");
  attn_check_like(v, q, "v");
  const int64_t d = q.size(-1);
  TORCH_CHECK(d >= 1 && d <= cuda::kAttentionMaxHeadDim, "attention: the CUDA kernel handles head_dim 1 to ",
              cuda::kAttentionMaxHeadDim, ", got head_dim ", d, " (use the triton or reference backend)");
}

void attn_check_lse(const at::Tensor& lse, const at::Tensor& q) {  // one value per row of each head
  TORCH_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.numel() == q.numel() / q.size(-1),
              "attention: lse must be a contiguous float32 [B, heads, S] or [heads, T] on q's device");
}

cuda::AttentionTensor attn_tensor(const at::Tensor& t) {  // [B, heads, S, d] or [T, heads, d]
  if (t.dim() == 4) return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
  return {t.data_ptr(), 0, t.stride(1), t.stride(0)};
}

// The launchers' batch, the tensors it points into (cu_seqlens converted to int32 if need be) and the
// storage dtype; checks lse. Runs under a CUDAGuard for q's device (the conversion launches a kernel).
struct AttnBatch {
  cuda::AttentionBatch batch;
  at::Tensor key_mask, cu_seqlens;
  DType dtype;
};

AttnBatch attn_batch(const at::Tensor& q, const at::Tensor& lse, const std::optional<at::Tensor>& key_mask,
                     const std::optional<at::Tensor>& cu_seqlens) {
  attn_check_lse(lse, q);
  AttnBatch a;
  a.dtype = dtype_of(q, "attention");
  a.batch.heads = q.size(1);
  a.batch.head_dim = q.size(-1);
  if (q.dim() == 4) {
    a.batch.sequences = q.size(0);
    a.batch.tokens = q.size(2);
    if (key_mask.has_value()) {
      const at::Tensor& m = *key_mask;
      TORCH_CHECK(m.is_cuda() && m.device() == q.device(), "attention: key_mask must be on ", q.device());
      TORCH_CHECK((m.scalar_type() == at::kBool || m.scalar_type() == at::kByte) && m.is_contiguous() &&
                      m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == q.size(2),
                  "attention: key_mask must be a contiguous bool [B, S]");
      a.key_mask = m;
      a.batch.key_mask = static_cast<const uint8_t*>(m.data_ptr());
    }
  } else {
    TORCH_CHECK(cu_seqlens.has_value(), "attention: varlen needs [T, heads, d] and cu_seqlens");
    const at::Tensor& cu = *cu_seqlens;
    TORCH_CHECK(cu.is_cuda() && cu.device() == q.device(), "attention: cu_seqlens must be on ", q.device());
    TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1 && (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
                "attention: cu_seqlens must be an int32 [B + 1]");
    // Its values are not checked here (that would wait for the GPU): varlen_attention checks them in
    // eager mode, and the kernels clamp offsets to [0, T].
    a.cu_seqlens = cu.to(at::kInt).contiguous();
    a.batch.sequences = a.cu_seqlens.numel() - 1;
    a.batch.tokens = q.size(0);
    a.batch.cu_seqlens = a.cu_seqlens.data_ptr<int32_t>();
  }
  return a;
}

void attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& cu_seqlens,
                        double scale, double dropout_p, int64_t seed, const at::Tensor& out, const at::Tensor& lse) {
  attn_check_inputs(q, k, v, dropout_p);
  attn_check_like(out, q, "out");
  const c10::cuda::CUDAGuard guard(q.device());
  const AttnBatch a = attn_batch(q, lse, key_mask, cu_seqlens);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_launch(cuda::attention_fwd(a.dtype, a.batch, attn_tensor(q), attn_tensor(k), attn_tensor(v), attn_tensor(out),
                                   lse.data_ptr<float>(), float(scale), dropout_p, uint64_t(seed), stream),
               "attention_fwd");
}

void attention_bwd_cuda(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_mask,
                        const std::optional<at::Tensor>& cu_seqlens, double scale, double dropout_p, int64_t seed,
                        const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  attn_check_inputs(q, k, v, dropout_p);
  attn_check_like(grad, q, "grad");
  attn_check_like(out, q, "out");
  attn_check_like(dq, q, "dq");
  attn_check_like(dk, q, "dk");
  attn_check_like(dv, q, "dv");
  const c10::cuda::CUDAGuard guard(q.device());
  const AttnBatch a = attn_batch(q, lse, key_mask, cu_seqlens);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const size_t bytes = cuda::attention_bwd_workspace_bytes(a.batch);
  // From the caching allocator on the current stream, like add_layer_norm's workspace.
  const at::Tensor workspace = at::empty({int64_t(bytes)}, q.options().dtype(at::kByte));
  check_launch(cuda::attention_bwd(a.dtype, a.batch, attn_tensor(grad), attn_tensor(q), attn_tensor(k), attn_tensor(v),
                                   attn_tensor(out), lse.data_ptr<float>(), attn_tensor(dq), attn_tensor(dk),
                                   attn_tensor(dv), bytes ? workspace.data_ptr() : nullptr, bytes, float(scale),
                                   dropout_p, uint64_t(seed), stream),
               "attention_bwd");
}

// ----------------------------------------------------------------------------------------- bias_gelu

void bg_check(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& out, const char* out_name) {
  TORCH_CHECK(x.is_cuda(), "bias_gelu: x must be a CUDA tensor, got ", x.device());
  check_cuda(bias, x, "bias_gelu", "bias");
  check_cuda(out, x, "bias_gelu", out_name);
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous() && out.is_contiguous(), "bias_gelu: tensors must be contiguous");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "bias_gelu: bias must be [x.size(-1)]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "bias_gelu: ", out_name,
              " must match x");
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias dtypes differ");
}

void bias_gelu_fwd_cuda(const at::Tensor& x, const at::Tensor& bias, bool tanh_form, const at::Tensor& out) {
  bg_check(x, bias, out, "out");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const DType dtype = dtype_of(x, "bias_gelu");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_launch(cuda::bias_gelu_fwd(dtype, x.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, n, tanh_form,
                                             stream),
               "bias_gelu_fwd");
}

void bias_gelu_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh_form,
                   const at::Tensor& grad_x) {
  bg_check(x, bias, grad_x, "grad_x");
  check_cuda(grad, x, "bias_gelu", "grad");
  TORCH_CHECK(grad.is_contiguous() && grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "bias_gelu: grad must match x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const DType dtype = dtype_of(x, "bias_gelu");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_launch(cuda::bias_gelu_bwd(dtype, grad.data_ptr(), x.data_ptr(), bias.data_ptr(), grad_x.data_ptr(),
                                             rows, n, tanh_form, stream),
               "bias_gelu_bwd");
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CUDA, m) {
  m.impl("add_layer_norm_fwd", &fastbert::add_layer_norm_fwd_cuda);
  m.impl("add_layer_norm_bwd", &fastbert::add_layer_norm_bwd_cuda);
  m.impl("attention_fwd", &fastbert::attention_fwd_cuda);
  m.impl("attention_bwd", &fastbert::attention_bwd_cuda);
  m.impl("bias_gelu_fwd", &fastbert::bias_gelu_fwd_cuda);
  m.impl("bias_gelu_bwd", &fastbert::bias_gelu_bwd_cuda);
}
