// dense on CPU, bfloat16: fastbert's own GEMM with bias and GELU in its epilogue (bf16_gemm.h), beside
// oneDNN's (fastbert/ops/dense.py; dispatch measures which is faster for a shape).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "bf16_gemm.h"

namespace fastbert {
namespace {

at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_pack: weight must be a bfloat16 [n, k] tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({bf16_gemm::blocks(n), bf16_gemm::pairs(k), bf16_gemm::kCols, bf16_gemm::kPair},
                                weight.options());
  bf16_gemm::pack(w.data_ptr<c10::BFloat16>(), n, k, packed.data_ptr<c10::BFloat16>());
  return packed;
}

// n and k: the weight's shape, which the padded packing cannot tell (n 17 and 32 pack alike).
void bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                 const std::optional<at::Tensor>& bias, int64_t activation, int64_t isa, const at::Tensor& out) {
  TORCH_CHECK(n >= 0 && k >= 0, "bf16_linear: n and k (the weight's shape) must be >= 0, got ", n, ", ", k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == k,
              "bf16_linear: x must be a contiguous bfloat16 [m, k = ", k, "] tensor, got ", x.scalar_type(), " ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const std::vector<int64_t> want{bf16_gemm::blocks(n), bf16_gemm::pairs(k), bf16_gemm::kCols, bf16_gemm::kPair};
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef(want),
              "bf16_linear: packed must be bf16_pack's output for an [n, k] = [", n, ", ", k, "] weight: bfloat16 ",
              at::IntArrayRef(want), ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(activation >= 0 && activation <= 2,
              "bf16_linear: activation must be 0 (none), 1 (gelu), 2 (gelu_tanh), got ", activation);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat)),
              "bf16_linear: bias must be a bfloat16 or float32 [n = ", n, "] tensor");
  const int64_t m = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.sizes() == at::IntArrayRef({m, n}),
              "bf16_linear: out must be a contiguous bfloat16 [", m, ", ", n, "] tensor, got ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(isa >= bf16_gemm::kBest && isa <= bf16_gemm::kLastIsa,
              "bf16_linear: isa must be 0 (best available), 1 (portable C++) or 2 (avx512_bf16), got ", isa);
  TORCH_CHECK(isa == bf16_gemm::kBest || bf16_gemm::cpu_has(isa), "bf16_linear: isa ", isa,
              " needs a CPU with avx512f and avx512_bf16; this CPU lacks it (isa 0 picks the best it has)");
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<float> converted;  // the epilogue adds float32
  if (b.defined() && b.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* values = b.data_ptr<c10::BFloat16>();
    converted.assign(values, values + n);
  }
  const float* bias_ptr = !b.defined() ? nullptr : converted.empty() ? b.data_ptr<float>() : converted.data();
  const bf16_gemm::Problem problem{x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), bias_ptr,
                                   out.data_ptr<c10::BFloat16>(), m, n, k, activation};
  bf16_gemm::linear(problem, isa);
}

bool bf16_isa_supported(int64_t isa) {
  if (isa == bf16_gemm::kBest) return true;
  return isa >= bf16_gemm::kPortable && isa <= bf16_gemm::kLastIsa && bf16_gemm::cpu_has(isa);
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CompositeExplicitAutograd, m) {
  m.impl("bf16_isa_supported", &fastbert::bf16_isa_supported);
}

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("bf16_pack", &fastbert::bf16_pack);
  m.impl("bf16_linear", &fastbert::bf16_linear);
}
