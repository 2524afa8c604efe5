// quantized_dense on CPU: the kernels around a u8 x s8 GEMM, oneDNN's or fastbert's own (int8_gemm.h)
// (fastbert/ops/quantized_dense.py).
// Activations are quantized per row (per token), asymmetric u8 with a zero point per row: BERT's rows
// differ in range by 10x and more, which one scale per tensor cannot follow. oneDNN takes one activation
// scale per tensor, so the GEMM runs with scale 1 and zero point 0 and the epilogue here applies each
// row's scale and zero-point correction, then the bias and GELU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "gelu.h"
#include "int8_gemm.h"
#include "quantize.h"
#include "vec.h"

namespace fastbert {
namespace {

template <typename T>
void quantize(const T* x, uint8_t* q, float* scale, int32_t* zero_point, int64_t rows, int64_t k) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, k, q + r * k, scale + r, zero_point + r);
  });
}

// One row of out = act(scale * (acc - zero_point * wsum) + bias), where acc = weight_scale * (q @ w^T) came
// from the u8 x s8 GEMM (oneDNN's, or a tile of the own one) and wsum = weight_scale * (w's row sums): the zero point's share of the integer sums.
template <typename T>
void dequantize_row(const float* acc, float scale, int32_t zero_point, const float* wsum, const float* bias,
                    int64_t activation, T* out, int64_t n) {
  const VecF s(scale), c(-scale * static_cast<float>(zero_point));
  const bool tanh_form = activation == 2;
  for_blocks(n, [&](int64_t j, int64_t m) {
    VecF a0, a1, w0, w1, b0(0.f), b1(0.f);
    load2(acc + j, m, a0, a1);
    load2(wsum + j, m, w0, w1);
    if (bias != nullptr) load2(bias + j, m, b0, b1);
    VecF y0 = at::vec::fmadd(s, a0, at::vec::fmadd(c, w0, b0));
    VecF y1 = at::vec::fmadd(s, a1, at::vec::fmadd(c, w1, b1));
    if (activation != 0) {
      y0 = gelu<T>(y0, tanh_form);
      y1 = gelu<T>(y1, tanh_form);
    }
    store2(out + j, m, y0, y1);
  });
}

template <typename T>
void dequantize(const float* acc, const float* scale, const int32_t* zero_point, const float* wsum,
                const float* bias, int64_t activation, T* out, int64_t rows, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      dequantize_row(acc + r * n, scale[r], zero_point[r], wsum, bias, activation, out + r * n, n);
  });
}

// dequantize, then quantize each row again for the next GEMM (FFN in -> GELU -> FFN out): the float row
// lives only in a per-thread buffer, never in memory.
void requantize(const float* acc, const float* scale, const int32_t* zero_point, const float* wsum, const float* bias,
                int64_t activation, uint8_t* q, float* q_scale, int32_t* q_zero_point, int64_t rows, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row(acc + r * n, scale[r], zero_point[r], wsum, bias, activation, row.data(), n);
      quantize_row(row.data(), n, q + r * n, q_scale + r, q_zero_point + r);
    }
  });
}

void quantize_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero_point) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: x must be a contiguous [rows, k] tensor");
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == at::kByte,
              "quantize_rows: q must be uint8 shaped like x");
  TORCH_CHECK(scale.numel() == x.size(0) && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "quantize_rows: scale must be float32 [rows]");
  TORCH_CHECK(zero_point.numel() == x.size(0) && zero_point.is_contiguous() && zero_point.scalar_type() == at::kInt,
              "quantize_rows: zero_point must be int32 [rows]");
  const int64_t rows = x.size(0), k = x.size(1);
  auto* qp = q.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    quantize(x.data_ptr<float>(), qp, scale.data_ptr<float>(), zero_point.data_ptr<int32_t>(), rows, k);
  } else if (x.scalar_type() == at::kBFloat16) {
    quantize(x.data_ptr<at::BFloat16>(), qp, scale.data_ptr<float>(), zero_point.data_ptr<int32_t>(), rows, k);
  } else {
    TORCH_CHECK(false, "quantize_rows: dtype ", x.scalar_type(), " (supported: float32, bfloat16)");
  }
}

// Static quantization: every row with the one calibrated scale and zero point.
void quantize_tensor(const at::Tensor& x, double scale, int64_t zero_point, const at::Tensor& q) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_tensor: x must be a contiguous [rows, k] tensor");
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == at::kByte,
              "quantize_tensor: q must be uint8 shaped like x");
  TORCH_CHECK(scale > 0 && zero_point >= 0 && zero_point <= 255, "quantize_tensor: scale must be > 0, zero_point in [0, 255]");
  const int64_t rows = x.size(0), k = x.size(1);
  const float inv = 1.f / static_cast<float>(scale), z = static_cast<float>(zero_point);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  auto* qp = q.data_ptr<uint8_t>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_tensor",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        const float* xp = x.data_ptr<float>();
        at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) quantize_values(xp + r * k, k, inv, z, qp + r * k);
        });
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
        at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) quantize_values(xp + r * k, k, inv, z, qp + r * k);
        });
      }));
}

// The epilogue's terms for [rows, n] checked; returns the bias pointer (nullptr without one).
const float* check_terms(const char* op, int64_t rows, int64_t n, const at::Tensor& scale, const at::Tensor& zero_point,
                         const at::Tensor& wsum, const std::optional<at::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(scale.numel() == rows && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  zero_point.numel() == rows && zero_point.scalar_type() == at::kInt && zero_point.is_contiguous(),
              op, ": scale (float32) and zero_point (int32) must be [rows]");
  TORCH_CHECK(wsum.numel() == n && wsum.scalar_type() == at::kFloat && wsum.is_contiguous(),
              op, ": wsum must be float32 [n]");
  TORCH_CHECK(activation >= 0 && activation <= 2, op, ": activation must be 0 (none), 1 (gelu), 2 (gelu_tanh)");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
              op, ": bias must be float32 [n]");
  return bias->data_ptr<float>();
}

const float* check_epilogue(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& zero_point,
                            const at::Tensor& wsum, const std::optional<at::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kFloat,
              "dequantize_rows: acc must be a contiguous float32 [rows, n] tensor");
  return check_terms("dequantize_rows", acc.size(0), acc.size(1), scale, zero_point, wsum, bias, activation);
}

void dequantize_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& zero_point,
                     const at::Tensor& wsum, const std::optional<at::Tensor>& bias, int64_t activation,
                     const at::Tensor& out) {
  const float* b = check_epilogue(acc, scale, zero_point, wsum, bias, activation);
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous(), "dequantize_rows: out must be shaped like acc");
  const int64_t rows = acc.size(0), n = acc.size(1);
  if (out.scalar_type() == at::kFloat) {
    dequantize(acc.data_ptr<float>(), scale.data_ptr<float>(), zero_point.data_ptr<int32_t>(), wsum.data_ptr<float>(),
               b, activation, out.data_ptr<float>(), rows, n);
  } else if (out.scalar_type() == at::kBFloat16) {
    dequantize(acc.data_ptr<float>(), scale.data_ptr<float>(), zero_point.data_ptr<int32_t>(), wsum.data_ptr<float>(),
               b, activation, out.data_ptr<at::BFloat16>(), rows, n);
  } else {
    TORCH_CHECK(false, "dequantize_rows: out dtype ", out.scalar_type(), " (supported: float32, bfloat16)");
  }
}

void requantize_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& zero_point,
                     const at::Tensor& wsum, const std::optional<at::Tensor>& bias, int64_t activation,
                     const at::Tensor& q, const at::Tensor& q_scale, const at::Tensor& q_zero_point) {
  const float* b = check_epilogue(acc, scale, zero_point, wsum, bias, activation);
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(q.sizes() == acc.sizes() && q.is_contiguous() && q.scalar_type() == at::kByte,
              "requantize_rows: q must be uint8 shaped like acc");
  TORCH_CHECK(q_scale.numel() == rows && q_scale.is_contiguous() && q_scale.scalar_type() == at::kFloat &&
                  q_zero_point.numel() == rows && q_zero_point.is_contiguous() && q_zero_point.scalar_type() == at::kInt,
              "requantize_rows: q_scale (float32) and q_zero_point (int32) must be [rows]");
  requantize(acc.data_ptr<float>(), scale.data_ptr<float>(), zero_point.data_ptr<int32_t>(), wsum.data_ptr<float>(), b,
             activation, q.data_ptr<uint8_t>(), q_scale.data_ptr<float>(), q_zero_point.data_ptr<int32_t>(), rows, n);
}

// fastbert's own GEMM (int8_gemm.h), where oneDNN's quantized ops are missing or for tests.
at::Tensor int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "int8_pack: weight must be an int8 [n, k] tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k <= int8_gemm::kMaxK, "int8_pack: k = ", k, " is longer than ", int8_gemm::kMaxK,
              ", where int32 sums of u8 x s8 products could overflow");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({int8_gemm::blocks(n), int8_gemm::groups(k), int8_gemm::kCols, int8_gemm::kGroup},
                                weight.options());
  int8_gemm::pack(w.data_ptr<int8_t>(), n, k, packed.data_ptr<int8_t>());
  return packed;
}

// n and k: the weight's shape, which the padded packing cannot tell (n 17 and 32 pack alike).
// The operands of int8_matmul (or `op`, which runs it) checked; the output is the caller's to check.
void check_matmul(const char* op, const at::Tensor& q, const at::Tensor& packed, int64_t n, int64_t k,
                  const at::Tensor& weight_scale, int64_t isa) {
  TORCH_CHECK(n >= 0 && k >= 0, op, ": n and k (the weight's shape) must be >= 0, got ", n, ", ", k);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) == k,
              op, ": q must be a contiguous uint8 [m, k = ", k, "] tensor, got ", q.scalar_type(), " ",
              q.sizes(), q.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.size(0) == n,
              op, ": weight_scale must be a contiguous float32 [n = ", n, "] tensor, got ",
              weight_scale.scalar_type(), " ", weight_scale.sizes());
  const std::vector<int64_t> want{int8_gemm::blocks(n), int8_gemm::groups(k), int8_gemm::kCols, int8_gemm::kGroup};
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.sizes() == at::IntArrayRef(want),
              op, ": packed must be int8_pack's output for an [n, k] = [", n, ", ", k, "] weight: int8 ",
              at::IntArrayRef(want), ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(k <= int8_gemm::kMaxK, op, ": k = ", k, " is longer than ", int8_gemm::kMaxK,
              ", where int32 sums of u8 x s8 products could overflow");
  TORCH_CHECK(isa >= int8_gemm::kBest && isa <= int8_gemm::kLastIsa,
              op, ": isa must be 0 (best available), 1 (portable C++), 2 (AVX-VNNI), 3 (AVX512-VNNI), 4 "
              "(AVX2 without VNNI) or 5 (AMX-INT8), got ", isa);
#if defined(__x86_64__)
  TORCH_CHECK(isa == int8_gemm::kBest || int8_gemm::cpu_has(isa), op, ": isa ", isa, " (",
              int8_gemm::isa_name(isa), ") needs a CPU with ", int8_gemm::isa_features(isa),
              "; this CPU lacks it (isa 0 picks the best it has)");
#else
  TORCH_CHECK(isa == int8_gemm::kBest || isa == int8_gemm::kPortable, op, ": isa ", isa, " (",
              int8_gemm::isa_name(isa), ") needs an x86-64 CPU with ", int8_gemm::isa_features(isa),
              "; fastbert was built for another architecture (only isa 1, portable C++, runs here)");
#endif
}

int8_gemm::Problem problem_of(const at::Tensor& q, const at::Tensor& packed, int64_t n, int64_t k,
                              const at::Tensor& weight_scale, float* out) {
  return {q.data_ptr<uint8_t>(), packed.data_ptr<int8_t>(), weight_scale.data_ptr<float>(), out, q.size(0), n, k,
          int8_gemm::groups(k) * int8_gemm::kBlockBytes};
}

void int8_matmul(const at::Tensor& q, const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& weight_scale,
                 int64_t isa, const at::Tensor& out) {
  check_matmul("int8_matmul", q, packed, n, k, weight_scale, isa);
  const int64_t m = q.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == at::IntArrayRef({m, n}),
              "int8_matmul: out must be a contiguous float32 [", m, ", ", n, "] tensor, got ", out.scalar_type(), " ",
              out.sizes());
  int8_gemm::matmul(problem_of(q, packed, n, k, weight_scale, out.data_ptr<float>()), isa);
}

// dequantize_rows' terms, applied to int8_matmul_dequantize's tiles.
template <typename T>
struct Dequantize {
  const float *scale, *wsum, *bias;
  const int32_t* zero_point;
  int64_t activation, n;
  T* out;

  static void apply(const void* context, int64_t row, int64_t rows, int64_t col0, int64_t cols, const float* tile,
                    int64_t ld) {
    const auto& e = *static_cast<const Dequantize*>(context);
    for (int64_t r = row; r < row + rows; ++r)
      dequantize_row(tile + (r - row) * ld, e.scale[r], e.zero_point[r], e.wsum + col0,
                     e.bias == nullptr ? nullptr : e.bias + col0, e.activation, e.out + r * e.n + col0, cols);
  }
};

// int8_matmul, then dequantize_rows of its result, tile by tile while the tile is in L1: the same float
// steps on each element, without writing or reading the float32 product.
void int8_matmul_dequantize(const at::Tensor& q, const at::Tensor& packed, int64_t n, int64_t k,
                            const at::Tensor& weight_scale, const at::Tensor& scale, const at::Tensor& zero_point,
                            const at::Tensor& wsum, const std::optional<at::Tensor>& bias, int64_t activation,
                            int64_t isa, const at::Tensor& out) {
  check_matmul("int8_matmul_dequantize", q, packed, n, k, weight_scale, isa);
  const int64_t m = q.size(0);
  const float* b = check_terms("int8_matmul_dequantize", m, n, scale, zero_point, wsum, bias, activation);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == at::IntArrayRef({m, n}) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "int8_matmul_dequantize: out must be a contiguous float32 or bfloat16 [", m, ", ", n, "] tensor, got ",
              out.scalar_type(), " ", out.sizes());
  auto run = [&](auto* out_ptr) {
    using T = std::remove_pointer_t<decltype(out_ptr)>;
    const Dequantize<T> terms{scale.data_ptr<float>(), wsum.data_ptr<float>(), b, zero_point.data_ptr<int32_t>(),
                              activation, n, out_ptr};
    int8_gemm::Problem problem = problem_of(q, packed, n, k, weight_scale, nullptr);
    problem.epilogue = {&Dequantize<T>::apply, &terms};
    int8_gemm::matmul(problem, isa);
  };
  if (out.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<at::BFloat16>());
}

bool int8_isa_supported(int64_t isa) {
  if (isa == int8_gemm::kBest) return true;
  return isa >= int8_gemm::kPortable && isa <= int8_gemm::kLastIsa && int8_gemm::cpu_has(isa);
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CompositeExplicitAutograd, m) {
  m.impl("int8_isa_supported", &fastbert::int8_isa_supported);
}

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("int8_pack", &fastbert::int8_pack);
  m.impl("int8_matmul", &fastbert::int8_matmul);
  m.impl("int8_matmul_dequantize", &fastbert::int8_matmul_dequantize);
  m.impl("quantize_rows", &fastbert::quantize_rows);
  m.impl("quantize_tensor", &fastbert::quantize_tensor);
  m.impl("dequantize_rows", &fastbert::dequantize_rows);
  m.impl("requantize_rows", &fastbert::requantize_rows);
}
