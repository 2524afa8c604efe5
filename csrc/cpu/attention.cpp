// Flash-style attention on CPU, forward and backward, for padded batches ([B, heads, S, d] with a
// key-padding mask) and packed varlen batches ([T, heads, d] with cu_seqlens).
//
// One task per (sequence, head), spread over threads in contiguous chunks; tasks run head by head, so
// each thread gets its share of every sequence (sequence by sequence, a thread could get only the long
// ones). A task reads its q, k, v rows in place (any
// row strides), then walks query blocks x key blocks: scores by GEMM (a register-blocked micro-kernel in
// the forward, torch's BLAS in the backward: see blas_sgemm), online softmax in fp32, P @ V accumulated
// in fp32. bfloat16 is converted to fp32 first, except in a forward built with avx512_bf16, which
// multiplies bfloat16 pairs (Bf16Products). Trailing padding keys are
// skipped, not computed and masked. logsumexp is saved per row; backward recomputes the probabilities
// block by block (no S x S matrix is ever stored).
// A query row with no kept key gets zeros, and logsumexp +inf so backward sees probabilities of 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "dropout.h"
#include "vec.h"

namespace fastbert {
namespace {

constexpr int64_t kBlockQ = 128;
// Key blocks of 512: fewer and larger BLAS calls, fewer online-softmax rescales (faster than 128:
// benchmarks/RESULTS.md), and the S tile (128 x 512 fp32, 256 KB) still fits in L2.
constexpr int64_t kBlockK = 512;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }


// f(i, rows) over M rows in register blocks of `rows` (a std::integral_constant): kRows, then 4, 3, 2, 1.
template <int kRows, typename F>
void for_row_blocks(int64_t M, const F& f) {
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) f(i, std::integral_constant<int, kRows>{});
  for (; i + 4 <= M; i += 4) f(i, std::integral_constant<int, 4>{});
  switch (M - i) {
    case 3: f(i, std::integral_constant<int, 3>{}); break;
    case 2: f(i, std::integral_constant<int, 2>{}); break;
    case 1: f(i, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// The running maximum `acc` with the first m lanes of x (the rest count as -inf); a NaN stays NaN.
inline VecF max_of_lanes(const VecF& acc, const VecF& x, int64_t m) {
  return at::vec::maximum(acc, m >= kHalf ? x : VecF::set(VecF(-kInf), x, std::max<int64_t>(m, 0)));
}

// C[M x N] = beta * C + alpha * A[M x K] @ B[K x N]; all row-major fp32; beta is 0 or 1.
// Register block: R rows of A x 2 vectors of B's columns. `row_max` (or null): each row's maximum of C,
// NaN if it holds one, as dot_rows takes it.
template <int R>
void gemm_rows(int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
               int64_t ldc, float alpha, bool accumulate, float* row_max) {
  VecF vmax[R];
  for (int r = 0; r < R; ++r) vmax[r] = VecF(-kInf);
  for (int64_t j = 0; j < N; j += kBlock) {
    const int64_t m = std::min(kBlock, N - j);
    VecF acc[R][2];
    // The k loop accumulates in the lambda's own locals, with the full-block load chosen once outside
    // it, and hands them to `acc` only at the end: written as one loop over `acc`, or with the stores
    // to C inside the lambda too, GCC stored every accumulator back to the stack on every step (half
    // the speed).
    auto run = [&](auto load) {
      VecF a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = VecF(0.f);
      for (int64_t c = 0; c < K; ++c) {
        VecF b0, b1;
        load(B + c * ldb + j, b0, b1);
        for (int r = 0; r < R; ++r) {
          const VecF a(A[r * lda + c]);
          a0[r] = at::vec::fmadd(a, b0, a0[r]);
          a1[r] = at::vec::fmadd(a, b1, a1[r]);
        }
      }
      for (int r = 0; r < R; ++r) acc[r][0] = a0[r], acc[r][1] = a1[r];
    };
    if (m == kBlock)
      run([](const float* p, VecF& b0, VecF& b1) { b0 = VecF::loadu(p); b1 = VecF::loadu(p + kHalf); });
    else
      run([m](const float* p, VecF& b0, VecF& b1) { load2(p, m, b0, b1); });
    for (int r = 0; r < R; ++r) {
      VecF c0 = acc[r][0] * VecF(alpha), c1 = acc[r][1] * VecF(alpha);
      if (accumulate) {
        VecF o0, o1;
        load2(C + r * ldc + j, m, o0, o1);
        c0 = c0 + o0;
        c1 = c1 + o1;
      }
      store2(C + r * ldc + j, m, c0, c1);
      if (row_max != nullptr) vmax[r] = max_of_lanes(max_of_lanes(vmax[r], c0, m), c1, m - kHalf);
    }
  }
  if (row_max != nullptr)
    for (int r = 0; r < R; ++r) row_max[r] = reduce_max(vmax[r]);
}

// The BLAS sgemm that torch itself links (MKL or OpenBLAS), found at run time so that a torch
// without one still loads fastbert._C; the micro-kernel above serves then.
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);

constexpr bool kForward = true, kBackward = false;

// BLAS, or null for the micro-kernel. FASTBERT_CPU_BLAS=0 / 1 forces one of them everywhere. Otherwise
// the forward's products go to the micro-kernel where AVX-512 is built: BLAS packs both operands on
// every call, which at these tile sizes costs more than it saves; the backward's transposed products
// stay on BLAS, where the micro-kernel did not win (benchmarks/RESULTS.md).
sgemm_fn blas_sgemm(bool forward) {
  static const sgemm_fn found = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* fn = lib ? dlsym(lib, "sgemm_") : nullptr;
    return reinterpret_cast<sgemm_fn>(fn ? fn : dlsym(RTLD_DEFAULT, "sgemm_"));
  }();
  const char* env = std::getenv("FASTBERT_CPU_BLAS");
  if (env != nullptr && (env[0] == '0' || env[0] == '1')) return env[0] == '1' ? found : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
  if (forward) return nullptr;
#endif
  return found;
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc, float alpha, bool accumulate, float* row_max) {
  // 8 rows x 2 vectors = 16 accumulators: half of AVX-512's 32 registers; AVX2 has 16 in all, so 4 rows
  // (the row maxima, touched once per column block, may live in memory there).
  constexpr int kRows = kHalf == 16 ? 8 : 4;
  for_row_blocks<kRows>(M, [&](int64_t i, auto rows) {
    gemm_rows<rows.value>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate,
                          row_max == nullptr ? nullptr : row_max + i);
  });
}


// Transposed copy: src [rows x cols] (row stride ld) -> dst [cols x rows] contiguous (16 x 16 register
// tiles where the build has AVX-512; a scalar loop elsewhere).
void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  at::vec::transpose_mxn<float>(src, ld, dst, rows, static_cast<int>(rows), static_cast<int>(cols));
}

// C[M x N] = alpha * op(A) op(B) (+ C if accumulate); row-major fp32 with row strides lda, ldb, ldc;
// op(X) = X^T where the flag says so. BLAS or the micro-kernel (on copies), as blas_sgemm says. Returns
// whether `row_max` (if not null) was written: the micro-kernel takes each row's maximum, BLAS does not.
bool gemm(bool forward, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate,
          std::vector<float>& scratch, float* row_max = nullptr) {
  if (M == 0 || N == 0) return false;
  if (const sgemm_fn sgemm = blas_sgemm(forward)) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
    const float beta = accumulate ? 1.f : 0.f;
    sgemm(trans_b ? "T" : "N", trans_a ? "T" : "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return false;
  }
  scratch.resize(std::max<size_t>(scratch.size(), (size_t)(M * K + K * N)));
  if (trans_a) {
    transpose(A, lda, K, M, scratch.data());
    A = scratch.data();
    lda = K;
  }
  if (trans_b) {
    transpose(B, ldb, N, K, scratch.data() + M * K);
    B = scratch.data() + M * K;
    ldb = N;
  }
  if (K == 0) {
    if (!accumulate) for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
    return false;
  }
  gemm_nn(M, N, K, A, lda, B, ldb, C, ldc, alpha, accumulate, row_max);
  return row_max != nullptr;
}

// Where row r of head h of sequence i lives: (start(i) + r) * row + i * seq + h * head.
struct Layout {
  int64_t seq, head, row;
  int64_t at(int64_t i, int64_t start, int64_t h, int64_t r) const { return (start + r) * row + i * seq + h * head; }
};

Layout layout_of(const at::Tensor& t) {  // [B, heads, S, d] or [T, heads, d]
  if (t.dim() == 4) return {t.stride(0), t.stride(1), t.stride(2)};
  return {0, t.stride(1), t.stride(0)};
}

struct Batch {
  int64_t sequences, heads, d;
  std::vector<int64_t> start, length;  // per sequence: first token (varlen) and length
  const bool* key_mask = nullptr;      // [B, S] for padded batches, else null
  int64_t mask_stride = 0;
  int64_t max_length = 0;
};

Batch describe(const at::Tensor& q, const std::optional<at::Tensor>& key_mask,
               const std::optional<at::Tensor>& cu_seqlens) {
  Batch b;
  b.d = q.size(-1);
  if (q.dim() == 4) {
    b.sequences = q.size(0);
    b.heads = q.size(1);
    b.start.assign(b.sequences, 0);
    b.length.assign(b.sequences, q.size(2));
    if (key_mask.has_value()) {
      TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->dim() == 2 &&
                      key_mask->size(0) == q.size(0) && key_mask->size(1) == q.size(2),
                  "attention: key_mask must be a contiguous bool [B, S]");
      b.key_mask = key_mask->data_ptr<bool>();
      b.mask_stride = key_mask->size(1);
    }
  } else {
    TORCH_CHECK(q.dim() == 3 && cu_seqlens.has_value(), "attention: varlen needs [T, heads, d] and cu_seqlens");
    auto cu = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* c = cu.data_ptr<int64_t>();
    TORCH_CHECK(cu.numel() >= 1 && c[0] >= 0, "attention: cu_seqlens must start at 0 or later");
    b.sequences = cu.numel() - 1;
    b.heads = q.size(1);
    for (int64_t i = 0; i < b.sequences; ++i) {
      TORCH_CHECK(c[i] <= c[i + 1] && c[i + 1] <= q.size(0), "attention: cu_seqlens must be non-decreasing within T");
      b.start.push_back(c[i]);
      b.length.push_back(c[i + 1] - c[i]);
    }
  }
  for (auto l : b.length) b.max_length = std::max(b.max_length, l);
  return b;
}

// Additive key bias for one sequence: 0 for kept keys, -inf for padding. Returns keys to visit
// (everything after the last kept key is padding and skipped).
int64_t key_bias(const Batch& b, int64_t i, int64_t L, float* bias) {
  int64_t visit = L;
  if (b.key_mask == nullptr) {
    std::fill(bias, bias + L, 0.f);
  } else {
    const bool* m = b.key_mask + i * b.mask_stride;
    visit = 0;
    for (int64_t j = 0; j < L; ++j) {
      bias[j] = m[j] ? 0.f : -kInf;
      if (m[j]) visit = j + 1;
    }
  }
  return visit;
}

// Rows of one (sequence, head) as fp32: the tensor itself when it is float32, else a converted copy.
template <typename T>
struct Rows {
  const float* ptr = nullptr;
  int64_t ld = 0;
  Rows() = default;
  Rows(const T* src, int64_t row_stride, int64_t rows, int64_t d, std::vector<float>& buffer) {
    if constexpr (std::is_same_v<T, float>) {
      ptr = src;
      ld = row_stride;
    } else {
      buffer.resize(std::max<size_t>(buffer.size(), (size_t)(rows * d)));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < d; j += kBlock) {
          VecF a, b;
          const int64_t m = std::min(kBlock, d - j);
          load2(src + r * row_stride + j, m, a, b);
          store2(buffer.data() + r * d + j, m, a, b);
        }
      ptr = buffer.data();
      ld = d;
    }
  }
  const float* row(int64_t r) const { return ptr + r * ld; }
};

// dst[0:d] = src[0:d] * scale, converting to T.
template <typename T>
void store_row(T* dst, const float* src, int64_t d, float scale) {
  for (int64_t j = 0; j < d; j += kBlock) {
    const int64_t m = std::min(kBlock, d - j);
    VecF a, b;
    load2(src + j, m, a, b);
    store2(dst + j, m, a * VecF(scale), b * VecF(scale));
  }
}

// The forward's two products on fp32 rows (bfloat16 storage converted once per task), by gemm(). K is
// transposed once per task (K^T [d x keys]), not once per block of queries.
template <typename T>
struct Fp32Products {
  static constexpr int64_t kScoreRows = kBlockQ;
  std::vector<float> qbuf, kbuf, vbuf, kt, scratch;
  Rows<T> Q, V;
  int64_t d = 0, keys = 0;

  // What scores() reads: Q's rows and K^T (the backward recomputes the scores with this alone).
  void start_scores(const T* q, int64_t ldq, const T* k, int64_t ldk, int64_t L, int64_t n_keys, int64_t head_dim) {
    d = head_dim;
    keys = n_keys;
    Q = Rows<T>(q, ldq, L, d, qbuf);
    const Rows<T> K(k, ldk, keys, d, kbuf);
    kt.resize(std::max<size_t>(kt.size(), (size_t)(keys * d)));
    if (keys > 0) transpose(K.ptr, K.ld, keys, d, kt.data());
  }
  void start(const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v, int64_t ldv, int64_t L, int64_t n_keys,
             int64_t head_dim) {
    start_scores(q, ldq, k, ldk, L, n_keys, head_dim);
    V = Rows<T>(v, ldv, keys, d, vbuf);
  }
  float pending_scale = 1.f;  // S holds the scores / this (the softmax applies it): scaled in the product
  int64_t score_stride(int64_t nk) const { return nk; }  // S's row stride
  // S [nq x nk] = scale * Q[qb:] K[kb:]^T, and each row's maximum where the micro-kernel runs (true).
  bool scores(int64_t qb, int64_t nq, int64_t kb, int64_t nk, float scale, float* S, float* row_max) {
    return gemm(kForward, false, false, nq, nk, d, Q.row(qb), Q.ld, kt.data() + kb, keys, S, nk, scale, false,
                scratch, row_max);
  }
  // Where the softmax writes P [nq x nk] (row stride ld): over the scores, in place.
  float* probabilities(int64_t /*nq*/, int64_t nk, float* S, int64_t& ld) {
    ld = nk;
    return P = S;
  }
  // O [nq x d] += P V[kb:]
  void accumulate(int64_t nq, int64_t kb, int64_t nk, float* O) {
    gemm(kForward, false, false, nq, d, nk, P, nk, V.row(kb), V.ld, O, d, 1.f, true, scratch);
  }
  float* P = nullptr;
};

#ifdef FASTBERT_AVX512_BF16

// C[M x N] = alpha * A B (+ C if accumulate), fp32 C. A: M rows of 2K bfloat16 (row stride lda elements),
// read as K pairs. B: K rows of N pairs (uint32, row stride ldb), pair k of column n holding the two
// elements of B's summed dimension that meet A's pair k. _mm512_dpbf16_ps adds both products of each
// pair to an fp32 lane: two products per lane per instruction. Register block: R rows x 32 columns
// (2R accumulators). `row_max` (or null): each row's maximum of C, NaN if it holds one, taken while the
// rows are still in registers (the softmax then skips a pass over the scores).
template <int R>
void dot_rows(int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C,
              int64_t ldc, float alpha, bool accumulate, float* row_max) {
  const __m512 minus_inf = _mm512_set1_ps(-kInf);
  VecF vmax[R];
  for (int r = 0; r < R; ++r) vmax[r] = VecF(minus_inf);
  for (int64_t j = 0; j < N; j += 32) {
    const int64_t m = std::min<int64_t>(32, N - j);
    const __mmask16 lo = lane_mask(m), hi = lane_mask(m - 16);
    __m512 acc[R][2];
    auto run = [&](auto load) {  // as in gemm_rows: locals in the k loop, handed out once at the end
      __m512 a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < K; ++c) {
        __m512i b0, b1;
        load(B + c * ldb + j, b0, b1);
        for (int r = 0; r < R; ++r) {
          uint32_t pair;
          std::memcpy(&pair, A + r * lda + 2 * c, sizeof pair);
          const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
          a0[r] = _mm512_dpbf16_ps(a0[r], a, (__m512bh)b0);
          a1[r] = _mm512_dpbf16_ps(a1[r], a, (__m512bh)b1);
        }
      }
      for (int r = 0; r < R; ++r) acc[r][0] = a0[r], acc[r][1] = a1[r];
    };
    if (m == 32)
      run([](const uint32_t* p, __m512i& b0, __m512i& b1) { b0 = _mm512_loadu_si512(p); b1 = _mm512_loadu_si512(p + 16); });
    else
      run([lo, hi](const uint32_t* p, __m512i& b0, __m512i& b1) {
        b0 = _mm512_maskz_loadu_epi32(lo, p);
        b1 = _mm512_maskz_loadu_epi32(hi, p + 16);
      });
    for (int r = 0; r < R; ++r) {
      float* c = C + r * ldc + j;
      __m512 c0 = _mm512_mul_ps(acc[r][0], _mm512_set1_ps(alpha)), c1 = _mm512_mul_ps(acc[r][1], _mm512_set1_ps(alpha));
      if (accumulate) {
        c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(lo, c));
        c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(hi, c + 16));
      }
      _mm512_mask_storeu_ps(c, lo, c0);
      _mm512_mask_storeu_ps(c + 16, hi, c1);
      if (row_max != nullptr)  // at::vec::maximum keeps a NaN; lanes past N count as -inf
        vmax[r] = at::vec::maximum(vmax[r], at::vec::maximum(VecF(_mm512_mask_blend_ps(lo, minus_inf, c0)),
                                                             VecF(_mm512_mask_blend_ps(hi, minus_inf, c1))));
    }
  }
  if (row_max != nullptr)
    for (int r = 0; r < R; ++r) row_max[r] = reduce_max(vmax[r]);
}

void dot(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda, const uint32_t* B, int64_t ldb,
         float* C, int64_t ldc, float alpha, bool accumulate, float* row_max = nullptr) {
  for_row_blocks<8>(M, [&](int64_t i, auto rows) {
    dot_rows<rows.value>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate,
                         row_max == nullptr ? nullptr : row_max + i);
  });
}

// X [rows x d] bfloat16 (row stride ld, even, as d) -> out [d/2][rows] pairs: a transpose of X's rows read
// as 32-bit words (bits moved, never computed on). The form of X^T as a product's right operand.
void pairs_along_d(const c10::BFloat16* x, int64_t ld, int64_t rows, int64_t d, std::vector<uint32_t>& out) {
  out.resize(std::max<size_t>(out.size(), (size_t)(d / 2 * rows)));
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(x), ld / 2, reinterpret_cast<float*>(out.data()), rows,
                                (int)rows, (int)(d / 2));
}

// X [rows x d] bfloat16 (row stride ld) -> out [rows/2][d] pairs: out[t][c] = (X[2t][c], X[2t + 1][c]), an odd
// last row paired with zeros. The form of X as a product's right operand, summed over its rows.
void pairs_along_rows(const c10::BFloat16* x, int64_t ld, int64_t rows, int64_t d, std::vector<uint32_t>& out) {
  const int64_t pairs = (rows + 1) / 2;
  out.resize(std::max<size_t>(out.size(), (size_t)(pairs * d)));
  alignas(64) static constexpr int16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < pairs; ++t) {
    const c10::BFloat16* even = x + 2 * t * ld;
    for (int64_t c = 0; c < d; c += 32) {
      const int64_t m = std::min<int64_t>(32, d - c);
      const __mmask32 mask = m == 32 ? 0xFFFFFFFFu : (__mmask32)((1u << m) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, even + c);
      const __m512i b = 2 * t + 1 < rows ? _mm512_maskz_loadu_epi16(mask, even + ld + c) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(out.data() + t * d + c, lane_mask(m), _mm512_permutex2var_epi16(a, low, b));
      _mm512_mask_storeu_epi32(out.data() + t * d + c + 16, lane_mask(m - 16), _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// n rounded up to even: the width of rows of whole bfloat16 pairs.
inline int64_t pair_width(int64_t n) { return (n + 1) / 2 * 2; }

// X [rows x cols] fp32 (row stride ld) * scale -> out [rows x width] bfloat16, width = cols rounded up to
// even (a zero in the odd last column): rows of whole pairs, a product's left operand. Returns width.
int64_t round_to_pairs(const float* x, int64_t ld, int64_t rows, int64_t cols, float scale,
                       std::vector<c10::BFloat16>& out) {
  const int64_t width = pair_width(cols);
  out.resize(std::max<size_t>(out.size(), (size_t)(rows * width)));
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* row = out.data() + r * width;
    for_blocks(cols, [&](int64_t j, int64_t m) {
      VecF a, b;
      load2(x + r * ld + j, m, a, b);
      store2(row + j, m, a * VecF(scale), b * VecF(scale));
    });
    if (width > cols) row[cols] = c10::BFloat16(0.f);
  }
  return width;
}

// The forward's two products straight on bfloat16 storage (no fp32 copies), fp32 accumulation. Q's
// rows are already pairs along d. K^T is laid out as [d/2][keys] pairs: a transpose of K's rows read as
// 32-bit words (bits moved, never computed on). V as [keys/2][d] pairs: rows 2t and 2t+1 interleaved.
// P is rounded to bfloat16 for P V, as flash-attention's GPU kernels do; its normalizer stays fp32.
// Needs an even head dim and an even K row stride, so that every K row's pairs start at its first
// element (the rows are read as 32-bit words through unaligned loads).
struct Bf16Products {
  static constexpr int64_t kScoreRows = kBlockQ;
  std::vector<uint32_t> kt, vp;
  std::vector<c10::BFloat16> pb;
  const c10::BFloat16* q = nullptr;
  int64_t ldq = 0, d = 0, keys = 0;
  float pending_scale = 1.f;  // S holds the scores / this (the softmax applies it)

  static bool serves(int64_t head_dim, int64_t k_row_stride) { return head_dim % 2 == 0 && k_row_stride % 2 == 0; }
  int64_t score_stride(int64_t nk) const { return nk; }

  void start_scores(const c10::BFloat16* q_rows, int64_t q_stride, const c10::BFloat16* k, int64_t ldk,
                    int64_t /*rows: Q is read in place*/, int64_t key_count, int64_t head_dim) {
    q = q_rows, ldq = q_stride, d = head_dim, keys = key_count;
    pairs_along_d(k, ldk, keys, d, kt);
  }
  void start(const c10::BFloat16* q_rows, int64_t q_stride, const c10::BFloat16* k, int64_t ldk,
             const c10::BFloat16* v, int64_t ldv, int64_t rows, int64_t key_count, int64_t head_dim) {
    start_scores(q_rows, q_stride, k, ldk, rows, key_count, head_dim);
    pairs_along_rows(v, ldv, keys, d, vp);
  }
  bool scores(int64_t qb, int64_t nq, int64_t kb, int64_t nk, float scale, float* S, float* row_max) {
    dot(nq, nk, d / 2, q + qb * ldq, ldq, kt.data() + kb, keys, S, nk, scale, false, row_max);
    return true;
  }
  // P as the softmax writes it: bfloat16 rows of whole pairs (width nk rounded up to even), P V's left operand.
  c10::BFloat16* probabilities(int64_t nq, int64_t nk, float* /*S*/, int64_t& ld) {
    ld = pair_width(nk);
    pb.resize(std::max<size_t>(pb.size(), (size_t)(nq * ld)));
    return pb.data();
  }
  void accumulate(int64_t nq, int64_t kb, int64_t nk, float* O) {
    const int64_t width = pair_width(nk);
    dot(nq, d, width / 2, pb.data(), width, vp.data() + kb / 2 * d, d, O, d, 1.f, true);
  }
};

// Each row's maximum of the unscaled scores S [rows x cols] (row stride ld), the scale left to the softmax
// where it is positive (max(x) * scale is the scaled maximum, rounding included; the exp's product applies it),
// else applied here. Returns the scale still pending.
float row_maxima(float* S, int64_t ld, int64_t rows, int64_t cols, float scale, float* row_max) {
  const bool leave = scale > 0.f && std::isfinite(scale);
  const VecF s(scale);
  for (int64_t r = 0; r < rows; ++r) {
    VecF vmax(-kInf);
    for_vectors(cols, [&](int64_t j, int64_t m) {
      VecF x = VecF::loadu(S + r * ld + j, m);
      if (!leave) {
        x = x * s;
        x.store(S + r * ld + j, m);
      }
      vmax = max_of_lanes(vmax, x, m);
    });
    row_max[r] = reduce_max(vmax);
  }
  return leave ? scale : 1.f;
}

// The same two products on ATen's batch-reduce GEMM (at::native::cpublas::brgemm: oneDNN's ukernel, on
// AMX tiles where the CPU has them, AVX-512 otherwise), as torch's own CPU flash attention runs them.
// Bf16Products' layouts are what it reads as "VNNI" B: K^T as pairs along d, V as pairs along keys.
// brgemm has no alpha: a positive scale is left to the softmax's exp (a product there instead of a pass
// over S), any other is applied after. Each thread releases the tile state when done.
struct BrgemmProducts : Bf16Products {
  ~BrgemmProducts() { at::native::cpublas::brgemm_release(true); }
  bool scores(int64_t qb, int64_t nq, int64_t kb, int64_t nk, float scale, float* S, float* row_max) {
    at::native::cpublas::brgemm(nq, nk, d, ldq, keys, nk, false, q + qb * ldq,
                                reinterpret_cast<const c10::BFloat16*>(kt.data() + kb), S, true);
    pending_scale = row_maxima(S, nk, nq, nk, scale, row_max);
    return true;
  }
  void accumulate(int64_t nq, int64_t kb, int64_t nk, float* O) {
    const int64_t width = pair_width(nk);
    at::native::cpublas::brgemm(nq, d, width, width, d, d, /*add to O*/ kb != 0, pb.data(),
                                reinterpret_cast<const c10::BFloat16*>(vp.data() + kb / 2 * d), O, true);
  }
};

// C [strips x 16 rows, tiles x 16 columns] (=|+=) A B on amx::tile_block, in blocks of 2 x 2 (then the
// 1-wide edges); B's column tiles 16 words apart. strip_at(s): strip s's first row.
template <bool kAdd, typename StripAt>
void tile_product(int64_t strips, int64_t tiles, const StripAt& strip_at, int64_t lda, const uint32_t* b,
                  int64_t b_step, int64_t ldb, int64_t steps, float* c, int64_t ldc) {
  for (int64_t s = 0; s < strips; s += 2) {
    const c10::BFloat16* a[2] = {strip_at(s), s + 1 < strips ? strip_at(s + 1) : nullptr};
    float* cs = c + s * 16 * (ldc / 4);
    for (int64_t n = 0; n < tiles; n += 2)
      amx::tile_block<kAdd>(std::min<int64_t>(2, strips - s), std::min<int64_t>(2, tiles - n), a, lda, b + 16 * n,
                            b_step, 16, ldb, steps, cs + 16 * n, ldc);
  }
}

// The same two products on AMX tiles, programmed here: each tile op one instruction, where brgemm pays a
// kernel lookup and a tile configuration per call (on a Xeon with AMX, d = 32 varlen forward over 8192
// tokens: sequences of 16 tokens 5.57 ms on brgemm, 2.75 here; of 256 tokens 8.77 and 8.44), the tiles as
// amx.h lays them out. Rows past a block's last are computed too and never read: Q's last partial strip is
// copied into zero-padded rows, K^T's pair rows and S are padded to 16 columns, P to 32 keys and V's pairs
// to 16 key pairs, with zeros. Needs a head dim that is a multiple of 32 (A's 64-byte rows) and an even K
// row stride.
struct AmxProducts : Bf16Products {
  // The scores of 32 rows (two tile strips) at a time, their softmax right after, while their rows of S are in
  // L1: on a Xeon with AMX an 8 x 128 forward 1.05-1.08x faster than a whole query block's scores first; level
  // at 2 x 512, where 32 rows of S outgrow L1.
  static constexpr int64_t kScoreRows = 32;
  std::vector<c10::BFloat16> edge;  // Q's last strip where it has fewer than 16 rows, zero-padded
  int64_t ldkt = 0;                 // K^T's pair rows, padded to 16 keys

  static bool serves(int64_t head_dim, int64_t k_row_stride) { return head_dim % 32 == 0 && k_row_stride % 2 == 0; }
  amx::Scope tiles;

  void start(const c10::BFloat16* q_rows, int64_t q_stride, const c10::BFloat16* k, int64_t ldk,
             const c10::BFloat16* v, int64_t ldv, int64_t /*rows*/, int64_t key_count, int64_t head_dim) {
    q = q_rows, ldq = q_stride, d = head_dim, keys = key_count, ldkt = round_up(keys, 16);
    kt.resize(std::max<size_t>(kt.size(), (size_t)(d / 2 * ldkt)));
    at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(k), ldk / 2, reinterpret_cast<float*>(kt.data()),
                                  ldkt, (int)keys, (int)(d / 2));
    for (int64_t r = 0; r < d / 2; ++r) std::fill(kt.begin() + r * ldkt + keys, kt.begin() + (r + 1) * ldkt, 0u);
    pairs_along_rows(v, ldv, keys, d, vp);
    const int64_t pairs = (keys + 1) / 2, padded = round_up(keys, 32) / 2;
    vp.resize(std::max<size_t>(vp.size(), (size_t)(padded * d)));
    std::fill(vp.begin() + pairs * d, vp.begin() + padded * d, 0u);
  }
  int64_t score_stride(int64_t nk) const { return round_up(nk, 16); }
  bool scores(int64_t qb, int64_t nq, int64_t kb, int64_t nk, float scale, float* S, float* row_max) {
    const int64_t lds = score_stride(nk), full = nq / 16;
    const c10::BFloat16* rows = q + qb * ldq;
    const auto product = [&](int64_t strips, const auto& strip_at, int64_t lda, float* c) {
      tile_product<false>(strips, lds / 16, strip_at, lda, kt.data() + kb, 16 * ldkt, ldkt * 4, d / 32, c, lds * 4);
    };
    if (full > 0) product(full, [&](int64_t s) { return rows + 16 * s * ldq; }, ldq * 2, S);  // in place
    if (nq % 16 != 0) {  // the last strip from its zero-padded copy
      edge.assign(16 * d, c10::BFloat16(0.f));
      for (int64_t r = 16 * full; r < nq; ++r)
        std::copy(rows + r * ldq, rows + r * ldq + d, edge.data() + (r - 16 * full) * d);
      product(1, [&](int64_t) { return edge.data(); }, d * 2, S + full * 16 * lds);
    }
    pending_scale = row_maxima(S, lds, nq, nk, scale, row_max);
    return true;
  }
  // P as the softmax writes it: bfloat16 rows padded to 32 keys (zeros past nk), 16-row strips.
  c10::BFloat16* probabilities(int64_t nq, int64_t nk, float* /*S*/, int64_t& ld) {
    ld = round_up(nk, 32);
    pb.resize(std::max<size_t>(pb.size(), (size_t)(round_up(nq, 16) * ld)));
    return pb.data();
  }
  void accumulate(int64_t nq, int64_t kb, int64_t nk, float* O) {
    const int64_t ld = round_up(nk, 32);
    const auto product = [&](auto add) {
      tile_product<add.value>((nq + 15) / 16, d / 16, [&](int64_t s) { return pb.data() + 16 * s * ld; }, ld * 2,
                              vp.data() + kb / 2 * d, 16 * d, d * 4, ld / 32, O, d * 4);
    };
    if (kb == 0) product(std::false_type{});  // the first key block writes O (3-7% off the forward here)
    else product(std::true_type{});
  }
};

// The backward's products on brgemm, bfloat16 operands with fp32 sums: Q, K, V, dO read in place as left
// operands or in pair layouts as right ones; the tiles (P, dS) rounded to bfloat16 first, as
// flash-attention's GPU kernels do. The fp32 work between the products (D, dS, dropout, the dominant key)
// is the fp32 backward's own.
struct BrgemmGradients {
  std::vector<uint32_t> qt, gt, gp, qp, kp;
  std::vector<c10::BFloat16> left;
  std::vector<float> transposed;
  const c10::BFloat16 *k = nullptr, *v = nullptr;
  int64_t ldk = 0, ldv = 0, d = 0, L = 0;

  static bool serves(int64_t head_dim, int64_t q_row_stride, int64_t g_row_stride) {
    return head_dim % 2 == 0 && q_row_stride % 2 == 0 && g_row_stride % 2 == 0;
  }
  ~BrgemmGradients() { at::native::cpublas::brgemm_release(true); }

  void start(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* k_rows, int64_t k_stride,
             const c10::BFloat16* v_rows, int64_t v_stride, const c10::BFloat16* g, int64_t ldg, int64_t rows,
             int64_t keys, int64_t head_dim) {
    k = k_rows, ldk = k_stride, v = v_rows, ldv = v_stride, d = head_dim, L = rows;
    pairs_along_d(q, ldq, L, d, qt);     // Q^T: scores
    pairs_along_d(g, ldg, L, d, gt);     // dO^T: dP
    pairs_along_rows(g, ldg, L, d, gp);  // dO: dV
    pairs_along_rows(q, ldq, L, d, qp);  // Q: dK
    pairs_along_rows(k, ldk, keys, d, kp);  // K: dQ
  }
  const c10::BFloat16* as_bf16(const std::vector<uint32_t>& pairs, int64_t offset) const {
    return reinterpret_cast<const c10::BFloat16*>(pairs.data() + offset);
  }
  void scores(int64_t kb, int64_t nk, int64_t qb, int64_t nq, float scale, float* St) {
    at::native::cpublas::brgemm(nk, nq, d, ldk, L, nq, false, k + kb * ldk, as_bf16(qt, qb), St, true);
    const VecF s(scale);
    for_vectors(nk * nq, [&](int64_t j, int64_t m) { (VecF::loadu(St + j, m) * s).store(St + j, m); });
  }
  void probability_grads(int64_t kb, int64_t nk, int64_t qb, int64_t nq, float* dPt) {
    at::native::cpublas::brgemm(nk, nq, d, ldv, L, nq, false, v + kb * ldv, as_bf16(gt, qb), dPt, true);
  }
  void add_dv(int64_t nq, int64_t qb, int64_t nk, const float* Pt, float* dV) {
    const int64_t width = round_to_pairs(Pt, nq, nk, nq, 1.f, left);
    at::native::cpublas::brgemm(nk, d, width, width, d, d, true, left.data(), as_bf16(gp, qb / 2 * d), dV, true);
  }
  void add_dk_dq(int64_t kb, int64_t nk, int64_t qb, int64_t nq, const float* dSt, float scale, float* dK,
                 float* dQ) {
    int64_t width = round_to_pairs(dSt, nq, nk, nq, scale, left);
    at::native::cpublas::brgemm(nk, d, width, width, d, d, true, left.data(), as_bf16(qp, qb / 2 * d), dK, true);
    transposed.resize(std::max<size_t>(transposed.size(), (size_t)(nq * nk)));
    transpose(dSt, nq, nk, nq, transposed.data());  // dS [nq x nk]
    width = round_to_pairs(transposed.data(), nk, nq, nk, scale, left);
    at::native::cpublas::brgemm(nq, d, width, width, d, d, true, left.data(), as_bf16(kp, kb / 2 * d), dQ, true);
  }
};
#endif

// exp for the forward's probabilities. float32: exp_fp32 (within 1 ulp), the one the backward recomputes
// P with from the saved logsumexp; for bfloat16, whose rounding is 2^-9, the cheaper exp_bf16 (within 1e-5,
// 2-5% off the brgemm forward on a Xeon with AMX against at::vec's exp_u20) is exact enough.
template <typename T>
inline VecF fast_exp(const VecF& x) {
  if constexpr (std::is_same_v<T, float>) return exp_fp32(x);
  else return exp_bf16(x);
}

// Starts moving `task`'s rows of each (tensor, layout) toward L2. A task's q, k and v rows sit a packed
// projection's row apart (3 x hidden elements), a stride the hardware prefetchers do not follow: fetching
// the next task's while this one computes made the forward 1.12x faster (MiniLM's corpus batches, fp32
// and bf16).
template <typename T>
void prefetch_task(const Batch& b, int64_t task, std::initializer_list<std::pair<const T*, Layout>> tensors) {
  const int64_t i = task % b.sequences, h = task / b.sequences;
  for (const auto& [p, l] : tensors)
    for (int64_t r = 0; r < b.length[i]; ++r)
      for (int64_t byte = 0; byte < b.d * (int64_t)sizeof(T); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(p + l.at(i, b.start[i], h, r)) + byte, /*read*/ 0,
                           /*toward L2*/ 2);
}

template <typename T, typename Products>
void forward_with(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Batch& b, float scale,
                  const Dropout& dropout, const at::Tensor& out, const at::Tensor& lse) {
  const Layout lq = layout_of(q), lk = layout_of(k), lv = layout_of(v), lo = layout_of(out);
  const Layout ll = q.dim() == 4 ? Layout{b.heads * q.size(2), q.size(2), 1} : Layout{0, q.size(0), 1};
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int64_t d = b.d;
  constexpr int64_t strip = Products::kScoreRows;
  at::parallel_for(0, b.sequences * b.heads, 1, [&](int64_t begin, int64_t end) {
    Products products;
    // Blocks no larger than the longest sequence needs (the AMX products' padded to whole tiles), not the
    // largest blocks: those zeroed 256 KB of S a thread a call (1x16 forward 1.3-1.5x faster without).
    const int64_t rows = std::min(kBlockQ, round_up(b.max_length, 16));
    const int64_t cols = std::min(kBlockK, round_up(b.max_length, 32));
    std::vector<float> O(rows * d), S(rows * cols), bias(b.max_length), row_max(rows), row_sum(rows), block_max(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % b.sequences, h = task / b.sequences, L = b.length[i], s0 = b.start[i];
      if (L == 0) continue;
      const int64_t keys = key_bias(b, i, L, bias.data());
      if (task + 1 < end) prefetch_task<T>(b, task + 1, {{qp, lq}, {kp, lk}, {vp, lv}});  // while this one computes
      products.start(qp + lq.at(i, s0, h, 0), lq.row, kp + lk.at(i, s0, h, 0), lk.row, vp + lv.at(i, s0, h, 0),
                     lv.row, L, keys, d);
      for (int64_t qb = 0; qb < L; qb += kBlockQ) {
        const int64_t nq = std::min(kBlockQ, L - qb);
        std::fill(O.begin(), O.begin() + nq * d, 0.f);
        std::fill(row_max.begin(), row_max.end(), -kInf);
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        for (int64_t kb = 0; kb < keys; kb += kBlockK) {
          const int64_t nk = std::min(kBlockK, keys - kb);
          // Right-padded batches have no padding left among the visited keys: then no bias to add.
          const bool masked = std::find(bias.begin() + kb, bias.begin() + kb + nk, -kInf) != bias.begin() + kb + nk;
          const bool kept = !masked || std::find(bias.begin() + kb, bias.begin() + kb + nk, 0.f) != bias.begin() + kb + nk;
          const int64_t lds = products.score_stride(nk);  // S's row stride
          int64_t ld = 0;
          auto* P = products.probabilities(nq, nk, S.data(), ld);  // where P V reads the probabilities
          bool have_max = false;
          float pending = 1.f;  // S * pending: the scores
          VecF vpending(pending);
          for (int64_t r = 0; r < nq; ++r) {
            if (r % strip == 0) {  // the scores of the rows [r, r + strip)
              // Each row's maximum comes with the scores where the product takes it (not with a padding bias).
              have_max = products.scores(qb + r, std::min(strip, nq - r), kb, nk, scale, S.data() + r * lds,
                                         block_max.data() + r) && !masked;
              pending = products.pending_scale;
              vpending = VecF(pending);
            }
            float* s = S.data() + r * lds;
            auto* p = P + r * ld;
            float top = block_max[r] * pending;
            if (!have_max) {
              VecF vmax(-kInf);
              for_vectors(nk, [&](int64_t j, int64_t m) {
                VecF x = VecF::loadu(s + j, m);
                if (masked) {  // a padding key's score is -inf whatever it holds (x + -inf would keep a NaN)
                  const VecF padding = VecF::loadu(bias.data() + kb + j, m);
                  x = VecF::blendv(x, padding, padding < VecF(0.f));
                  x.store(s + j, m);
                }
                vmax = max_of_lanes(vmax, x, m);
              });
              top = reduce_max(vmax) * pending;
            }
            float m_new = std::max(top, row_max[r]);  // in this order a NaN score stays NaN
            if (m_new == -kInf) {
              if (!kept) {  // every key so far is padding: nothing to add
                std::fill(p, p + ld, 0.f);
                continue;
              }
              m_new = std::numeric_limits<float>::quiet_NaN();  // kept keys all scored -inf: NaN, as softmax gives
            }
            const float correction = std::exp(row_max[r] - m_new);  // 0 on the first kept block
            // One pass: exp, the row's sum, and the probabilities stored as P V reads them (rounded to
            // bfloat16 pairs by the bf16 products); with dropout they stay fp32 in S until it has run.
            const bool drop = dropout.on();
            VecF sum_a(0.f), sum_b(0.f);
            for_blocks(nk, [&](int64_t j, int64_t m) {
              VecF a, b;
              load2(s + j, m, a, b);
              // The product rounded before the subtraction, as for the maximum: an FMA's exact product
              // puts the row's top score up to half an ulp of it above m_new (exp of +1e22 at scores
              // of 1e30), and the backward takes its scores rounded too.
              a = fast_exp<T>(a * vpending - VecF(m_new));
              b = fast_exp<T>(b * vpending - VecF(m_new));
              if (m < kBlock) {  // lanes past nk loaded zeros, whose exp is not 0
                a = VecF::set(VecF(0.f), a, std::min(m, kHalf));
                b = VecF::set(VecF(0.f), b, std::max<int64_t>(m - kHalf, 0));
              }
              sum_a = sum_a + a;
              sum_b = sum_b + b;
              if (drop) store2(s + j, m, a, b); else store2(p + j, m, a, b);
            });
            row_sum[r] = row_sum[r] * correction + reduce_sum(sum_a + sum_b);  // the normalizer sees every probability
            if (row_max[r] != -kInf && correction != 1.f) store_row(O.data() + r * d, O.data() + r * d, d, correction);
            row_max[r] = m_new;
            if (drop) {  // ... P @ V only the kept ones, scaled by 1 / (1 - p)
              dropout_run(dropout, i, h, qb + r, kb, 0, 1, nk, s, s);
              if (static_cast<void*>(p) != static_cast<void*>(s)) store_row(p, s, nk, 1.f);
            }
            if (ld > nk) std::fill(p + nk, p + ld, 0.f);  // the odd key's zero partner
          }
          products.accumulate(nq, kb, nk, O.data());
        }
        for (int64_t r = 0; r < nq; ++r) {
          const float l = row_sum[r];
          store_row(op + lo.at(i, s0, h, qb + r), O.data() + r * d, d, l > 0.f ? 1.f / l : 0.f);
          // no kept key: +inf (backward's probabilities 0); a NaN score stays NaN (backward's gradients too)
          lp[ll.at(i, s0, h, qb + r)] = l > 0.f ? row_max[r] + std::log(l) : std::isnan(l) ? l : kInf;
        }
      }
    }
  });
}

template <typename P>
struct Kind {
  using type = P;
};

// Calls f(Kind<Products>{}) with the forward's products for T. The backward takes its scores from the
// same ones: exp(s - lse) must see the forward's s bit for bit, for where the scores are large (a custom
// scale, an outlier query), another summation order is off by an ulp of |s|, and that ulp is the
// probability's relative error in the exponent (dV 4% off at a score of 1e6, NaN gradients at 1e30).
template <typename T, typename F>
void with_forward_products(const Batch& b, const at::Tensor& k, F&& f) {
#ifdef FASTBERT_AVX512_BF16
  // bfloat16 products wherever the forward runs on the micro-kernel (FASTBERT_CPU_BLAS=1: fp32 BLAS);
  // FASTBERT_CPU_BF16_DOT=0 keeps the micro-kernel on fp32 copies (as a build without avx512_bf16 does).
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const char* env = std::getenv("FASTBERT_CPU_BF16_DOT");
    const bool dot = env == nullptr || env[0] != '0';
    if (dot && blas_sgemm(kForward) == nullptr && Bf16Products::serves(b.d, layout_of(k).row))
      return f(Kind<Bf16Products>{});
  }
#endif
  f(Kind<Fp32Products<T>>{});
}

template <typename T>
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Batch& b, float scale,
             const Dropout& dropout, const at::Tensor& out, const at::Tensor& lse) {
  with_forward_products<T>(b, k, [&](auto kind) {
    forward_with<T, typename decltype(kind)::type>(q, k, v, b, scale, dropout, out, lse);
  });
}

// The backward's products on fp32 rows (bfloat16 storage converted once per task), by gemm(), but for
// the scores, which come from the forward's products (Scores). Tiles are transposed (key rows x query
// columns): P^T, dP^T, dS^T.
template <typename T, typename Scores>
struct Fp32Gradients {
  std::vector<float> qbuf, kbuf, vbuf, gbuf, S, scratch;
  Rows<T> Q, K, V, dO;
  Scores forward;
  int64_t d = 0;

  void start(const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v, int64_t ldv, const T* g, int64_t ldg,
             int64_t L, int64_t keys, int64_t head_dim) {
    d = head_dim;
    forward.start_scores(q, ldq, k, ldk, L, keys, head_dim);
    Q = Rows<T>(q, ldq, L, d, qbuf);
    K = Rows<T>(k, ldk, keys, d, kbuf);
    V = Rows<T>(v, ldv, keys, d, vbuf);
    dO = Rows<T>(g, ldg, L, d, gbuf);
  }
  // St [nk x nq] = scale * K[kb:] Q[qb:]^T, as the forward's S [nq x nk] transposed
  void scores(int64_t kb, int64_t nk, int64_t qb, int64_t nq, float scale, float* St) {
    S.resize(std::max<size_t>(S.size(), (size_t)(nq * nk)));
    forward.scores(qb, nq, kb, nk, scale, S.data(), nullptr);
    transpose(S.data(), nk, nq, nk, St);
  }
  // dPt [nk x nq] = V[kb:] dO[qb:]^T
  void probability_grads(int64_t kb, int64_t nk, int64_t qb, int64_t nq, float* dPt) {
    gemm(kBackward, false, true, nk, nq, d, V.row(kb), V.ld, dO.row(qb), dO.ld, dPt, nq, 1.f, false, scratch);
  }
  // dV [nk x d] += Pt dO[qb:]
  void add_dv(int64_t nq, int64_t qb, int64_t nk, const float* Pt, float* dV) {
    gemm(kBackward, false, false, nk, d, nq, Pt, nq, dO.row(qb), dO.ld, dV, d, 1.f, true, scratch);
  }
  // dK [nk x d] += scale * dSt Q[qb:]; dQ [nq x d] += scale * dSt^T K[kb:]
  void add_dk_dq(int64_t kb, int64_t nk, int64_t qb, int64_t nq, const float* dSt, float scale, float* dK,
                 float* dQ) {
    gemm(kBackward, false, false, nk, d, nq, dSt, nq, Q.row(qb), Q.ld, dK, d, scale, true, scratch);
    gemm(kBackward, true, false, nq, d, nk, dSt, nq, K.row(kb), K.ld, dQ, d, scale, true, scratch);
  }
};

template <typename T, typename Gradients>
void backward_with(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& lse, const Batch& b, float scale, const Dropout& dropout,
              const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  const Layout lg = layout_of(grad), lq = layout_of(q), lk = layout_of(k), lv = layout_of(v);
  const Layout ldq = layout_of(dq), ldk = layout_of(dk), ldv = layout_of(dv);
  const Layout ll = q.dim() == 4 ? Layout{b.heads * q.size(2), q.size(2), 1} : Layout{0, q.size(0), 1};
  const T *gp = grad.data_ptr<T>(), *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const float* lp = lse.data_ptr<float>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
  const int64_t d = b.d, Lmax = b.max_length;
  at::parallel_for(0, b.sequences * b.heads, 1, [&](int64_t begin, int64_t end) {
    Gradients products;
    // Blocks no larger than the longest sequence (as the forward's): dK and dV are zeroed each key block.
    const int64_t rows = std::min(kBlockQ, Lmax), cols = std::min(kBlockK, Lmax);
    std::vector<float> D(Lmax), LSE(Lmax), bias(Lmax), dQ(Lmax * d), dK(cols * d), dV(cols * d), P(cols * rows),
        dP(cols * rows), kept(dropout.on() ? cols * rows : 0), zeros(d, 0.f), row_total(rows), dominant(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % b.sequences, h = task / b.sequences, L = b.length[i], s0 = b.start[i];
      if (L == 0) continue;
      const int64_t keys = key_bias(b, i, L, bias.data());
      const bool single_key = std::count(bias.begin(), bias.begin() + keys, 0.f) == 1;
      products.start(qp + lq.at(i, s0, h, 0), lq.row, kp + lk.at(i, s0, h, 0), lk.row, vp + lv.at(i, s0, h, 0),
                     lv.row, gp + lg.at(i, s0, h, 0), lg.row, L, keys, d);
      for (int64_t r = 0; r < L; ++r) LSE[r] = lp[ll.at(i, s0, h, r)];
      // P^T [nk, nq] = exp(K Q^T * scale - lse) of tile (kb, qb), 0 at padding keys; +inf lse gives 0.
      // With dropout, `kept` gets the probabilities dropout kept, scaled by 1 / (1 - p).
      auto probabilities = [&](int64_t kb, int64_t nk, int64_t qb, int64_t nq) {
        products.scores(kb, nk, qb, nq, scale, P.data());
        for (int64_t j = 0; j < nk; ++j) {
          float* p = P.data() + j * nq;
          if (bias[kb + j] == -kInf) {  // padding: 0 whatever its score holds
            std::fill(p, p + nq, 0.f);
            continue;
          }
          for_vectors(nq, [&](int64_t r, int64_t m) {
            exp_fp32(VecF::loadu(p + r, m) - VecF::loadu(LSE.data() + qb + r, m)).store(p + r, m);
          });
        }
        if (dropout.on())  // P^T's row j is key kb + j over queries qb ...: a column run of keep()
          for (int64_t j = 0; j < nk; ++j)
            dropout_run(dropout, i, h, qb, kb + j, 1, 0, nq, P.data() + j * nq, kept.data() + j * nq);
        return dropout.on() ? kept.data() : P.data();
      };
      // D[qb:qb+nq] += rowsum over the tile's keys of (dropped) P * dP, dP^T = V dO^T.
      auto add_to_D = [&](const float* Pk, int64_t nk, int64_t qb, int64_t nq) {
        for (int64_t j = 0; j < nk; ++j)
          for_vectors(nq, [&](int64_t r, int64_t m) {
            const VecF sum = VecF::loadu(D.data() + qb + r, m) +
                             VecF::loadu(Pk + j * nq + r, m) * VecF::loadu(dP.data() + j * nq + r, m);
            sum.store(D.data() + qb + r, m);
          });
      };
      // D = rowsum(P * dP), in fp32 from the same P and dP that dS = P * (dP - D) uses, rather than
      // rowsum(dO * O): O's rounding (T's, or fp32's summed over d) is uncorrelated with dP's, and where
      // softmax is nearly one-hot dP - D cancels to almost nothing, so D from O left q and k gradients
      // with ~60x plain PyTorch's error. With one key block each tile holds its rows' every key, so the
      // tile's own P and dP give D; otherwise a first pass over all key blocks (two more GEMMs a tile).
      const bool one_key_block = keys <= kBlockK;
      std::fill(D.begin(), D.begin() + L, 0.f);
      if (!one_key_block)
        for (int64_t kb = 0; kb < keys; kb += kBlockK) {
          const int64_t nk = std::min(kBlockK, keys - kb);
          for (int64_t qb = 0; qb < L; qb += kBlockQ) {
            const int64_t nq = std::min(kBlockQ, L - qb);
            const float* Pk = probabilities(kb, nk, qb, nq);
            products.probability_grads(kb, nk, qb, nq, dP.data());
            add_to_D(Pk, nk, qb, nq);
          }
        }
      std::fill(dQ.begin(), dQ.begin() + L * d, 0.f);
      for (int64_t kb = 0; kb < keys; kb += kBlockK) {
        const int64_t nk = std::min(kBlockK, keys - kb);
        std::fill(dK.begin(), dK.end(), 0.f);
        std::fill(dV.begin(), dV.end(), 0.f);
        for (int64_t qb = 0; qb < L; qb += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, L - qb);
          const float* Pk = probabilities(kb, nk, qb, nq);
          // dV takes the dropped probabilities
          products.add_dv(nq, qb, nk, Pk, dV.data());
          products.probability_grads(kb, nk, qb, nq, dP.data());
          if (one_key_block) add_to_D(Pk, nk, qb, nq);
          if (single_key) {  // softmax over one key is constant: q and k get exactly no gradient
            std::fill(dP.begin(), dP.begin() + nk * nq, 0.f);
            std::fill(D.begin() + qb, D.begin() + qb + nq, 0.f);
          }
          if (dropout.on())  // gradient of the probabilities before dropout
            for (int64_t j = 0; j < nk; ++j)
              dropout_run(dropout, i, h, qb, kb + j, 1, 0, nq, dP.data() + j * nq, dP.data() + j * nq);
          for (int64_t j = 0; j < nk; ++j) {  // dS^T = P^T * (dP^T - D)
            float* p = P.data() + j * nq;
            float* dp = dP.data() + j * nq;
            for_vectors(nq, [&](int64_t r, int64_t m) {
              (VecF::loadu(p + r, m) * (VecF::loadu(dp + r, m) - VecF::loadu(D.data() + qb + r, m))).store(dp + r, m);
            });
          }
          if (one_key_block) {
            // A row's dS sums to zero. Where one key holds most of the probability (P > 1/2), its
            // dP - D cancels to a few ulps of D (the others' P * (dP - D) do not): take its dS as minus
            // the sum of the others instead. Property runs on short, sharp rows had q gradients at
            // 30-600x plain PyTorch's error before.
            std::fill(dominant.begin(), dominant.begin() + nq, -1.f);  // key index as float (exact)
            std::fill(row_total.begin(), row_total.begin() + nq, 0.f);
            for (int64_t j = 0; j < nk; ++j)
              for_vectors(nq, [&](int64_t r, int64_t m) {
                (VecF::loadu(row_total.data() + r, m) + VecF::loadu(dP.data() + j * nq + r, m)).store(row_total.data() + r, m);
                const VecF dom = VecF::loadu(dominant.data() + r, m);
                VecF::blendv(dom, VecF(float(j)), VecF::loadu(P.data() + j * nq + r, m) > VecF(0.5f)).store(dominant.data() + r, m);
              });
            for (int64_t r = 0; r < nq; ++r)
              if (dominant[r] >= 0.f) {
                float& ds = dP[int64_t(dominant[r]) * nq + r];
                ds = -(row_total[r] - ds);
              }
          }
          products.add_dk_dq(kb, nk, qb, nq, dP.data(), scale, dK.data(), dQ.data() + qb * d);
        }
        for (int64_t j = 0; j < nk; ++j) {
          store_row(dkp + ldk.at(i, s0, h, kb + j), dK.data() + j * d, d, 1.f);
          store_row(dvp + ldv.at(i, s0, h, kb + j), dV.data() + j * d, d, 1.f);
        }
      }
      for (int64_t j = keys; j < L; ++j) {  // trailing padding keys: no gradient
        store_row(dkp + ldk.at(i, s0, h, j), zeros.data(), d, 1.f);
        store_row(dvp + ldv.at(i, s0, h, j), zeros.data(), d, 1.f);
      }
      for (int64_t r = 0; r < L; ++r) store_row(dqp + ldq.at(i, s0, h, r), dQ.data() + r * d, d, 1.f);
    }
  });
}

template <typename T>
void backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& lse, const Batch& b, float scale, const Dropout& dropout,
              const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  with_forward_products<T>(b, k, [&](auto kind) {
    backward_with<T, Fp32Gradients<T, typename decltype(kind)::type>>(grad, q, k, v, lse, b, scale, dropout, dq, dk, dv);
  });
}

// lse: one float32 per query row and head, [B, heads, S] or [heads, T], contiguous.
void check_lse(const at::Tensor& q, const at::Tensor& lse) {
  const int64_t rows = q.dim() == 4 ? q.size(0) * q.size(1) * q.size(2) : q.size(0) * q.size(1);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == rows,
              "attention: lse must be contiguous float32 with one value per query row and head (", rows, "), got ",
              lse.sizes());
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 3 || t->dim() == 4, "attention: q, k, v must be [B, heads, S, d] or [T, heads, d]");
    TORCH_CHECK(t->stride(-1) == 1, "attention: the head dimension must be contiguous (stride 1)");
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type(), "attention: q, k, v must match");
  }
}

Dropout make_dropout(double p, int64_t seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "attention: dropout_p must be in [0, 1), got ", p);
  return dropout_with(p, uint64_t(seed));
}

void attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& cu_seqlens,
                   double scale, double dropout_p, int64_t seed, const at::Tensor& out, const at::Tensor& lse) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  check_inputs(q, k, v);
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(-1) == 1 && out.scalar_type() == q.scalar_type(),
              "attention: out must match q");
  check_lse(q, lse);
  const Batch b = describe(q, key_mask, cu_seqlens);
  if (q.scalar_type() == at::kFloat) forward<float>(q, k, v, b, (float)scale, dropout, out, lse);
  else if (q.scalar_type() == at::kBFloat16) forward<at::BFloat16>(q, k, v, b, (float)scale, dropout, out, lse);
  else TORCH_CHECK(false, "attention: dtype ", q.scalar_type(), " (supported: float32, bfloat16)");
}

#ifdef FASTBERT_AVX512_BF16
// attention_fwd in bfloat16 on `Products` (brgemm's or the AMX tiles'), after the checks both share;
// `needs`: what Products::serves asks of the head dim and K's rows.
template <typename Products>
void bf16_forward(const char* name, const char* needs, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const std::optional<at::Tensor>& key_mask,
                  const std::optional<at::Tensor>& cu_seqlens, double scale, double dropout_p, int64_t seed,
                  const at::Tensor& out, const at::Tensor& lse) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  check_inputs(q, k, v);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, name, ": bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(Products::serves(q.size(-1), layout_of(k).row), name, ": needs ", needs, ", got head dim ",
              q.size(-1), " and K row stride ", layout_of(k).row);
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(-1) == 1 && out.scalar_type() == q.scalar_type(),
              "attention: out must match q");
  check_lse(q, lse);
  forward_with<at::BFloat16, Products>(q, k, v, describe(q, key_mask, cu_seqlens), (float)scale, dropout, out, lse);
}
#endif

// attention_fwd with both products on brgemm (BrgemmProducts): bfloat16 with an even head dim and K
// row stride, in a build with avx512_bf16 (the pair layouts are made with it).
void attention_fwd_brgemm(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& cu_seqlens,
                          double scale, double dropout_p, int64_t seed, const at::Tensor& out, const at::Tensor& lse) {
#ifdef FASTBERT_AVX512_BF16
  bf16_forward<BrgemmProducts>("attention_fwd_brgemm", "an even head dim and an even K row stride", q, k, v, key_mask,
                               cu_seqlens, scale, dropout_p, seed, out, lse);
#else
  TORCH_CHECK(false, "attention_fwd_brgemm: fastbert._C was built without avx512_bf16");
#endif
}

// attention_fwd with both products on AMX tiles (AmxProducts): bfloat16, a head dim that is a multiple of
// 32 and an even K row stride, on a CPU with AMX-BF16 whose kernel grants the tile state.
void attention_fwd_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& cu_seqlens,
                       double scale, double dropout_p, int64_t seed, const at::Tensor& out, const at::Tensor& lse) {
#ifdef FASTBERT_AVX512_BF16
  TORCH_CHECK(amx::cpu_has_amx(),
              "attention_fwd_amx: this CPU has no AMX-BF16, or Linux refused the tile state");
  bf16_forward<AmxProducts>("attention_fwd_amx", "a head dim that is a multiple of 32 and an even K row stride", q, k,
                            v, key_mask, cu_seqlens, scale, dropout_p, seed, out, lse);
#else
  TORCH_CHECK(false, "attention_fwd_amx: fastbert._C was built without avx512_bf16");
#endif
}

void attention_bwd(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_mask,
                   const std::optional<at::Tensor>& cu_seqlens, double scale, double dropout_p, int64_t seed,
                   const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  check_inputs(q, k, v);
  for (const auto* t : {&grad, &out, &dq, &dk, &dv})
    TORCH_CHECK(t->sizes() == q.sizes() && t->stride(-1) == 1 && t->scalar_type() == q.scalar_type(),
                "attention: grad, out, dq, dk, dv must match q");
  check_lse(q, lse);
  const Batch b = describe(q, key_mask, cu_seqlens);
  if (q.scalar_type() == at::kFloat) backward<float>(grad, q, k, v, lse, b, (float)scale, dropout, dq, dk, dv);
  else if (q.scalar_type() == at::kBFloat16)
    backward<at::BFloat16>(grad, q, k, v, lse, b, (float)scale, dropout, dq, dk, dv);
  else TORCH_CHECK(false, "attention: dtype ", q.scalar_type(), " (supported: float32, bfloat16)");
}

// attention_bwd with its products on brgemm (BrgemmGradients), for attention_fwd_brgemm's forward.
void attention_bwd_brgemm(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_mask,
                          const std::optional<at::Tensor>& cu_seqlens, double scale, double dropout_p, int64_t seed,
                          const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
#ifdef FASTBERT_AVX512_BF16
  const Dropout dropout = make_dropout(dropout_p, seed);
  check_inputs(q, k, v);
  for (const auto* t : {&grad, &out, &dq, &dk, &dv})
    TORCH_CHECK(t->sizes() == q.sizes() && t->stride(-1) == 1 && t->scalar_type() == q.scalar_type(),
                "attention: grad, out, dq, dk, dv must match q");
  check_lse(q, lse);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "attention_bwd_brgemm: bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(BrgemmGradients::serves(q.size(-1), layout_of(q).row, layout_of(grad).row),
              "attention_bwd_brgemm: needs an even head dim and even q and grad row strides");
  backward_with<at::BFloat16, BrgemmGradients>(grad, q, k, v, lse, describe(q, key_mask, cu_seqlens), (float)scale,
                                               dropout, dq, dk, dv);
#else
  TORCH_CHECK(false, "attention_bwd_brgemm: fastbert._C was built without avx512_bf16");
#endif
}

// The keep mask the kernels apply, as a bool [sequences, heads, rows, cols] tensor: for tests.
// Attention's block (i, h) is (sequence, head); row-wise kernels use sequences = heads = 1.
at::Tensor dropout_keep(int64_t seed, double dropout_p, int64_t sequences, int64_t heads, int64_t rows,
                                  int64_t cols) {
  const Dropout dropout = make_dropout(dropout_p, seed);
  at::Tensor keep = at::empty({sequences, heads, rows, cols}, at::kBool);
  bool* out = keep.data_ptr<bool>();
  for (int64_t i = 0; i < sequences; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) *out++ = dropout.keep(i, h, r, j);
  return keep;
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("attention_fwd", &fastbert::attention_fwd);
  m.impl("attention_bwd", &fastbert::attention_bwd);
  m.impl("attention_fwd_brgemm", &fastbert::attention_fwd_brgemm);
  m.impl("attention_fwd_amx", &fastbert::attention_fwd_amx);
  m.impl("attention_bwd_brgemm", &fastbert::attention_bwd_brgemm);
}

TORCH_LIBRARY_IMPL(fastbert_C, CompositeExplicitAutograd, m) {
  m.impl("dropout_keep", &fastbert::dropout_keep);
}
