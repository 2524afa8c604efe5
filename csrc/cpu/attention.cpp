// Flash-style attention on CPU, forward and backward, for padded batches ([B, heads, S, d] with a
// key-padding mask) and packed varlen batches ([T, heads, d] with cu_seqlens).
//
// One task per (sequence, head), spread over threads. A task copies its q, k, v rows into fp32
// scratch (any strides, float or bfloat16 in), then walks query blocks x key blocks: scores with a
// register-blocked micro-GEMM, online softmax in fp32, P @ V accumulated in fp32. logsumexp is saved
// per row; backward recomputes the probabilities block by block (no S x S matrix is ever stored).
// A query row with no kept key gets zeros, and logsumexp +inf so backward sees probabilities of 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "vec.h"

namespace fastbert {
namespace {

constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 128;
constexpr float kInf = std::numeric_limits<float>::infinity();

// C[M x N] = beta * C + alpha * A[M x K] @ B[K x N]; all row-major fp32; beta is 0 or 1.
// Register block: R rows of A x 2 vectors of B's columns.
template <int R>
void gemm_rows(int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
               int64_t ldc, float alpha, bool accumulate) {
  for (int64_t j = 0; j < N; j += kBlock) {
    const int64_t m = std::min(kBlock, N - j);
    VecF acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = VecF(0.f);
    for (int64_t c = 0; c < K; ++c) {
      VecF b0, b1;
      load2(B + c * ldb + j, m, b0, b1);
      for (int r = 0; r < R; ++r) {
        const VecF a(A[r * lda + c]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      VecF c0 = acc[r][0] * VecF(alpha), c1 = acc[r][1] * VecF(alpha);
      if (accumulate) {
        VecF o0, o1;
        load2(C + r * ldc + j, m, o0, o1);
        c0 = c0 + o0;
        c1 = c1 + o1;
      }
      store2(C + r * ldc + j, m, c0, c1);
    }
  }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, float alpha, bool accumulate) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) gemm_rows<4>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate);
  switch (M - i) {
    case 3: gemm_rows<3>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate); break;
    case 2: gemm_rows<2>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate); break;
    case 1: gemm_rows<1>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, accumulate); break;
    default: break;
  }
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

// Copy `rows` rows of width d (row stride `ld`) into contiguous fp32, optionally transposed to [d, rows].
template <typename T>
void gather(const T* src, int64_t ld, int64_t rows, int64_t d, float* dst, bool transpose) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const float v = static_cast<float>(src[r * ld + c]);
      if (transpose) dst[c * rows + r] = v; else dst[r * d + c] = v;
    }
}

template <typename T>
void scatter(const float* src, int64_t rows, int64_t d, T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * ld + c] = static_cast<T>(src[r * d + c]);
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

template <typename T>
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Batch& b, float scale,
             const at::Tensor& out, const at::Tensor& lse) {
  const Layout lq = layout_of(q), lk = layout_of(k), lv = layout_of(v), lo = layout_of(out);
  const Layout ll = q.dim() == 4 ? Layout{b.heads * q.size(2), q.size(2), 1} : Layout{0, q.size(0), 1};
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int64_t d = b.d, Lmax = b.max_length;
  at::parallel_for(0, b.sequences * b.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(Lmax * d), KT(d * Lmax), V(Lmax * d), O(kBlockQ * d), S(kBlockQ * kBlockK), bias(Lmax),
        row_max(kBlockQ), row_sum(kBlockQ), result(Lmax * d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / b.heads, h = task % b.heads, L = b.length[i], s0 = b.start[i];
      if (L == 0) continue;
      const int64_t keys = key_bias(b, i, L, bias.data());
      gather(qp + lq.at(i, s0, h, 0), lq.row, L, d, Q.data(), false);
      gather(kp + lk.at(i, s0, h, 0), lk.row, keys, d, KT.data(), true);  // [d, keys]
      gather(vp + lv.at(i, s0, h, 0), lv.row, keys, d, V.data(), false);
      for (int64_t qb = 0; qb < L; qb += kBlockQ) {
        const int64_t nq = std::min(kBlockQ, L - qb);
        std::fill(O.begin(), O.begin() + nq * d, 0.f);
        std::fill(row_max.begin(), row_max.end(), -kInf);
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        for (int64_t kb = 0; kb < keys; kb += kBlockK) {
          const int64_t nk = std::min(kBlockK, keys - kb);
          gemm(nq, nk, d, Q.data() + qb * d, d, KT.data() + kb, keys, S.data(), nk, scale, false);
          for (int64_t r = 0; r < nq; ++r) {
            float* s = S.data() + r * nk;
            float mx = -kInf;
            for (int64_t j = 0; j < nk; ++j) {
              s[j] += bias[kb + j];
              mx = std::max(mx, s[j]);
            }
            const float m_new = std::max(row_max[r], mx);
            if (m_new == -kInf) {  // every key so far is padding: nothing to add
              std::fill(s, s + nk, 0.f);
              continue;
            }
            const float correction = std::exp(row_max[r] - m_new);  // 0 on the first kept block
            float sum = 0.f;
            int64_t j = 0;
            for (; j + kHalf <= nk; j += kHalf) {
              VecF p = (VecF::loadu(s + j) - VecF(m_new)).exp();
              p.store(s + j);
              sum += reduce_sum(p);
            }
            for (; j < nk; ++j) {
              s[j] = std::exp(s[j] - m_new);
              sum += s[j];
            }
            row_sum[r] = row_sum[r] * correction + sum;
            row_max[r] = m_new;
            if (correction != 1.f)
              for (int64_t c = 0; c < d; ++c) O[r * d + c] *= correction;
          }
          gemm(nq, d, nk, S.data(), nk, V.data() + kb * d, d, O.data(), d, 1.f, true);
        }
        for (int64_t r = 0; r < nq; ++r) {
          const float l = row_sum[r], inv = l > 0.f ? 1.f / l : 0.f;
          for (int64_t c = 0; c < d; ++c) result[(qb + r) * d + c] = O[r * d + c] * inv;
          lp[ll.at(i, s0, h, qb + r)] = l > 0.f ? row_max[r] + std::log(l) : kInf;
        }
      }
      scatter(result.data(), L, d, op + lo.at(i, s0, h, 0), lo.row);
    }
  });
}

template <typename T>
void backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, const Batch& b, float scale, const at::Tensor& dq,
              const at::Tensor& dk, const at::Tensor& dv) {
  const Layout lg = layout_of(grad), lq = layout_of(q), lk = layout_of(k), lv = layout_of(v), lo = layout_of(out);
  const Layout ldq = layout_of(dq), ldk = layout_of(dk), ldv = layout_of(dv);
  const Layout ll = q.dim() == 4 ? Layout{b.heads * q.size(2), q.size(2), 1} : Layout{0, q.size(0), 1};
  const T *gp = grad.data_ptr<T>(), *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(),
          *op = out.data_ptr<T>();
  const float* lp = lse.data_ptr<float>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
  const int64_t d = b.d, Lmax = b.max_length;
  at::parallel_for(0, b.sequences * b.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(Lmax * d), QT(d * Lmax), K(Lmax * d), V(Lmax * d), dO(Lmax * d), dOT(d * Lmax),
        O(Lmax * d), D(Lmax), LSE(Lmax), bias(Lmax), dQ(Lmax * d), dK(Lmax * d), dV(Lmax * d),
        P(kBlockK * kBlockQ), dP(kBlockK * kBlockQ), dS(kBlockQ * kBlockK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / b.heads, h = task % b.heads, L = b.length[i], s0 = b.start[i];
      if (L == 0) continue;
      const int64_t keys = key_bias(b, i, L, bias.data());
      gather(qp + lq.at(i, s0, h, 0), lq.row, L, d, Q.data(), false);
      gather(qp + lq.at(i, s0, h, 0), lq.row, L, d, QT.data(), true);
      gather(kp + lk.at(i, s0, h, 0), lk.row, L, d, K.data(), false);
      gather(vp + lv.at(i, s0, h, 0), lv.row, L, d, V.data(), false);
      gather(gp + lg.at(i, s0, h, 0), lg.row, L, d, dO.data(), false);
      gather(gp + lg.at(i, s0, h, 0), lg.row, L, d, dOT.data(), true);
      gather(op + lo.at(i, s0, h, 0), lo.row, L, d, O.data(), false);
      for (int64_t r = 0; r < L; ++r) {
        // D = rowsum(dO * O) = sum_j P_rj dP_rj, accumulated in the micro-GEMM's order (fused
        // multiply-adds over the head dimension), so that over a single key dP - D is exactly 0.
        float s = 0.f;
        for (int64_t c = 0; c < d; ++c) s = std::fma(O[r * d + c], dO[r * d + c], s);
        D[r] = s;
        LSE[r] = lp[ll.at(i, s0, h, r)];
      }
      std::fill(dQ.begin(), dQ.begin() + L * d, 0.f);
      std::fill(dK.begin(), dK.begin() + L * d, 0.f);  // padding keys get zero gradient
      std::fill(dV.begin(), dV.begin() + L * d, 0.f);
      for (int64_t kb = 0; kb < keys; kb += kBlockK) {
        const int64_t nk = std::min(kBlockK, keys - kb);
        for (int64_t qb = 0; qb < L; qb += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, L - qb);
          // P^T [nk, nq] = exp(K Q^T * scale + bias - lse)
          gemm(nk, nq, d, K.data() + kb * d, d, QT.data() + qb, L, P.data(), nq, scale, false);
          for (int64_t j = 0; j < nk; ++j)
            for (int64_t r = 0; r < nq; ++r) {
              float& p = P[j * nq + r];
              p = std::exp(p + bias[kb + j] - LSE[qb + r]);  // -inf bias or +inf lse -> 0
            }
          gemm(nk, d, nq, P.data(), nq, dO.data() + qb * d, d, dV.data() + kb * d, d, 1.f, true);
          gemm(nk, nq, d, V.data() + kb * d, d, dOT.data() + qb, L, dP.data(), nq, 1.f, false);
          for (int64_t j = 0; j < nk; ++j)
            for (int64_t r = 0; r < nq; ++r) {
              const float ds = P[j * nq + r] * (dP[j * nq + r] - D[qb + r]);
              dP[j * nq + r] = ds;      // dS^T
              dS[r * nk + j] = ds;      // dS
            }
          gemm(nk, d, nq, dP.data(), nq, Q.data() + qb * d, d, dK.data() + kb * d, d, scale, true);
          gemm(nq, d, nk, dS.data(), nk, K.data() + kb * d, d, dQ.data() + qb * d, d, scale, true);
        }
      }
      scatter(dQ.data(), L, d, dqp + ldq.at(i, s0, h, 0), ldq.row);
      scatter(dK.data(), L, d, dkp + ldk.at(i, s0, h, 0), ldk.row);
      scatter(dV.data(), L, d, dvp + ldv.at(i, s0, h, 0), ldv.row);
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 3 || t->dim() == 4, "attention: q, k, v must be [B, heads, S, d] or [T, heads, d]");
    TORCH_CHECK(t->stride(-1) == 1, "attention: the head dimension must be contiguous (stride 1)");
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type(), "attention: q, k, v must match");
  }
}

void attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& cu_seqlens,
                   double scale, const at::Tensor& out, const at::Tensor& lse) {
  check_inputs(q, k, v);
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(-1) == 1 && out.scalar_type() == q.scalar_type(),
              "attention: out must match q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "attention: lse must be contiguous float32");
  const Batch b = describe(q, key_mask, cu_seqlens);
  if (q.scalar_type() == at::kFloat) forward<float>(q, k, v, b, (float)scale, out, lse);
  else if (q.scalar_type() == at::kBFloat16) forward<at::BFloat16>(q, k, v, b, (float)scale, out, lse);
  else TORCH_CHECK(false, "attention: dtype ", q.scalar_type(), " (supported: float32, bfloat16)");
}

void attention_bwd(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_mask,
                   const std::optional<at::Tensor>& cu_seqlens, double scale, const at::Tensor& dq,
                   const at::Tensor& dk, const at::Tensor& dv) {
  check_inputs(q, k, v);
  for (const auto* t : {&grad, &out, &dq, &dk, &dv})
    TORCH_CHECK(t->sizes() == q.sizes() && t->stride(-1) == 1 && t->scalar_type() == q.scalar_type(),
                "attention: grad, out, dq, dk, dv must match q");
  const Batch b = describe(q, key_mask, cu_seqlens);
  if (q.scalar_type() == at::kFloat) backward<float>(grad, q, k, v, out, lse, b, (float)scale, dq, dk, dv);
  else if (q.scalar_type() == at::kBFloat16) backward<at::BFloat16>(grad, q, k, v, out, lse, b, (float)scale, dq, dk, dv);
  else TORCH_CHECK(false, "attention: dtype ", q.scalar_type(), " (supported: float32, bfloat16)");
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert_C, CPU, m) {
  m.impl("attention_fwd", &fastbert::attention_fwd);
  m.impl("attention_bwd", &fastbert::attention_bwd);
}
