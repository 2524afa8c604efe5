// dense on CPU: fastbert's own float32 / bfloat16 GEMM with bias and GELU in its epilogue (float_gemm.h),
// beside oneDNN's, over all rows or row shares in parallel (fastbert/ops/dense.py; dispatch measures which
// is faster for a shape).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <vector>

#include "float_gemm.h"

namespace fastbert {
namespace {

bool floating(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// T's packed shape for an [n, k] weight.
std::vector<int64_t> packed_shape(at::ScalarType dtype, int64_t n, int64_t k) {
  if (dtype == at::kFloat) return {float_gemm::blocks(n), float_gemm::groups<float>(k), float_gemm::kCols, 1};
  return {float_gemm::blocks(n), float_gemm::groups<c10::BFloat16>(k), float_gemm::kCols, 2};
}

at::Tensor dense_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && floating(weight), "dense_pack: weight must be a float32 or bfloat16 [n, k] tensor, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty(packed_shape(weight.scalar_type(), n, k), weight.options());
  if (weight.scalar_type() == at::kFloat) {
    float_gemm::pack(w.data_ptr<float>(), n, k, packed.data_ptr<float>());
  } else {
    float_gemm::pack(w.data_ptr<c10::BFloat16>(), n, k, packed.data_ptr<c10::BFloat16>());
  }
  return packed;
}

bool isa_supported(int64_t isa, at::ScalarType dtype) {
  if (isa == float_gemm::kBest) return true;
  if (isa < float_gemm::kPortable || isa > float_gemm::kLastIsa) return false;
  return dtype == at::kFloat ? float_gemm::cpu_has<float>(isa) : float_gemm::cpu_has<c10::BFloat16>(isa);
}

// n and k: the weight's shape, which the padded packing cannot tell (n 17 and 32 pack alike).
void dense_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                const std::optional<at::Tensor>& bias, int64_t activation, int64_t isa, const at::Tensor& out) {
  TORCH_CHECK(n >= 0 && k >= 0, "dense_gemm: n and k (the weight's shape) must be >= 0, got ", n, ", ", k);
  TORCH_CHECK(x.dim() == 2 && floating(x) && x.is_contiguous() && x.size(1) == k,
              "dense_gemm: x must be a contiguous float32 or bfloat16 [m, k = ", k, "] tensor, got ", x.scalar_type(),
              " ", x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const at::ScalarType dtype = x.scalar_type();
  const std::vector<int64_t> want = packed_shape(dtype, n, k);
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous() && packed.sizes() == at::IntArrayRef(want),
              "dense_gemm: packed must be dense_pack's output for an [n, k] = [", n, ", ", k, "] weight: ", dtype, " ",
              at::IntArrayRef(want), ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(activation >= 0 && activation <= 2,
              "dense_gemm: activation must be 0 (none), 1 (gelu), 2 (gelu_tanh), got ", activation);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && floating(*bias)),
              "dense_gemm: bias must be a float32 or bfloat16 [n = ", n, "] tensor");
  const int64_t m = x.size(0);
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.sizes() == at::IntArrayRef({m, n}),
              "dense_gemm: out must be a contiguous ", dtype, " [", m, ", ", n, "] tensor (x's dtype), got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(isa >= float_gemm::kBest && isa <= float_gemm::kLastIsa,
              "dense_gemm: isa must be 0 (best available), 1 (portable C++), 2 (AVX-512) or 3 (AMX, bfloat16), got ",
              isa);
  TORCH_CHECK(isa != float_gemm::kAmx || dtype == at::kBFloat16, "dense_gemm: isa 3 (AMX) is for bfloat16 only");
  TORCH_CHECK(isa_supported(isa, dtype), "dense_gemm: isa ", isa, " needs a CPU with ",
              isa == float_gemm::kAmx ? "AMX-BF16 (and Linux's permission for its tiles)"
                                      : dtype == at::kBFloat16 ? "avx512f and avx512_bf16" : "avx512f",
              "; this CPU lacks it (isa 0 picks the best it has)");
  at::assert_no_overlap(out, x);  // other panels still read the rows a tile has written
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<float> converted;  // the epilogue adds float32
  const float* bias_ptr = nullptr;
  if (b.defined() && b.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* values = b.data_ptr<c10::BFloat16>();
    converted.assign(values, values + n);
    bias_ptr = converted.data();
  } else if (b.defined()) {
    bias_ptr = b.data_ptr<float>();
  }
  if (dtype == at::kFloat) {
    float_gemm::linear(float_gemm::Problem<float>{x.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr,
                                                  out.data_ptr<float>(), m, n, k, activation}, isa);
  } else {
    float_gemm::linear(float_gemm::Problem<c10::BFloat16>{x.data_ptr<c10::BFloat16>(),
                                                          packed.data_ptr<c10::BFloat16>(), bias_ptr,
                                                          out.data_ptr<c10::BFloat16>(), m, n, k, activation}, isa);
  }
}

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);

using BiasGeluFn = void(const at::Tensor&, const at::Tensor&, bool, const at::Tensor&);

// oneDNN's linear (torch's mkldnn::_linear_pointwise: weight as packed by _reorder_linear_weight, attr and
// algorithm its post-op) on each thread's share of x's rows, one single-threaded call per thread (oneDNN
// runs serially inside a parallel region), written into out. On a Xeon with AMX this ran bf16 1024 x 768
// -> 768 at ~2400 GFLOP/s against ~1300 for one call over all threads (benchmarks/RESULTS.md). A GELU with
// a bias runs as fastbert's bias_gelu kernel on the thread's rows while they are in cache, written straight
// into out (2.44 ms against 2.63 with oneDNN's post-op for bf16 1024 x 768 -> 3072 there).
void dense_onednn_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       std::string_view attr, std::optional<std::string_view> algorithm, const at::Tensor& out) {
  static const auto linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearFn>();
  static const auto bias_gelu =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastbert_C::bias_gelu_fwd", "").typed<BiasGeluFn>();
  const bool gelu_after = attr == "gelu" && bias.has_value();
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && out.scalar_type() == x.scalar_type(),
              "dense_onednn_rows: out must be an [m, n] tensor of x's dtype for x [m, k], got x ", x.scalar_type(), " ",
              x.sizes(), ", out ", out.scalar_type(), " ", out.sizes());
  const int64_t m = x.size(0), parts = std::min<int64_t>(at::get_num_threads(), (m + 15) / 16);
  const int64_t share = parts > 0 ? (m + parts - 1) / parts : 0;
  const at::ThreadLocalState state;  // grad and inference mode are per thread: each worker takes the caller's
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t part = begin; part < end; ++part) {
      const int64_t start = part * share, rows = std::min(share, m - start);
      if (rows <= 0) continue;
      c10::List<std::optional<at::Scalar>> scalars;
      scalars.push_back(std::nullopt);
      if (gelu_after) {
        const at::Tensor y = linear.call(x.narrow(0, start, rows), weight, std::nullopt, "none", scalars, "");
        bias_gelu.call(y, *bias, algorithm == "tanh", out.narrow(0, start, rows));
      } else {
        out.narrow(0, start, rows).copy_(linear.call(x.narrow(0, start, rows), weight, bias, attr, scalars, algorithm));
      }
    }
  });
}

bool dense_isa_supported(int64_t isa, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dense_isa_supported: dtype must be float32 or bfloat16");
  return isa_supported(isa, dtype);
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CompositeExplicitAutograd, m) {
  m.impl("dense_isa_supported", &fastbert::dense_isa_supported);
  // (any backend: a packed float32 weight is an MkldnnCPU tensor; the kernel is mkldnn's op on row shares)
  m.impl("dense_onednn_rows", &fastbert::dense_onednn_rows);
}

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("dense_pack", &fastbert::dense_pack);
  m.impl("dense_gemm", &fastbert::dense_gemm);
}
