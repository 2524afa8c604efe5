// CUDA implementations of the fastbert_C schemas (csrc/ops.cpp) for add_layer_norm and bias_gelu:
// check the tensors like the CPU kernels do (csrc/cpu/*.cpp), then call the torch-free launchers
// (launchers.h) on the current stream. Built only where torch is a CUDA build (setup.py); it cannot
// compile against the CPU torch wheel.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

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
                                                  rstd.data_ptr<float>(), rows, n, float(eps), float(dropout_p),
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
                   bytes, rows, n, float(dropout_p), uint64_t(seed), sm_count, stream),
               "add_layer_norm_bwd");
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
  m.impl("bias_gelu_fwd", &fastbert::bias_gelu_fwd_cuda);
  m.impl("bias_gelu_bwd", &fastbert::bias_gelu_bwd_cuda);
}
