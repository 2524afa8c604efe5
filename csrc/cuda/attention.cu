// attention on CUDA: out = softmax(q k^T * scale, masked keys excluded) v, forward and backward, for
// padded batches ([B, heads, S, d], optional key-padding mask) and packed varlen ones ([T, heads, d],
// cu_seqlens). Torch-free (launchers.h); float / half / bfloat16 storage, fp32 math. Mirrors
// csrc/cpu/attention.cpp: lse +inf and a zero output for a query row with no kept key, its dropout keep
// decisions (csrc/cpu/dropout.h, hashed from (sequence, head, query, key)), its D for backward
// (sum_j P_dropped dP recomputed in fp32 from the P and dP that dS uses, never rowsum(dO * O), whose
// rounding would not cancel where softmax is nearly one-hot), its dominant-key correction (a row's dS
// sums to zero, so the dS of a key with P > 1/2, whose dP - D cancels to a few ulps, is taken as minus the
// others' sum), and exactly zero q/k gradients when one key is kept.
//
// A first version: fp32 FMA on shared-memory tiles, no tensor cores (wmma/mma for fp16/bf16 is the next
// step). A block is 256 threads, 16 x 16: thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j of
// every tile, so a row's owners are one half-warp and its max and sum reduce by shuffles. Head dims
// 1..128 run on tiles padded with zeros to 32, 64 or 128 columns.
// Forward: a block per 64 query rows walks key tiles (K, then V, through one buffer) with an online
// softmax. Backward, deterministic (no atomics): a block per 64 query rows computes D and dQ, then a
// block per 64 key rows accumulates dK and dV over query tiles. Keys after the last kept one are
// skipped, as on CPU, and get zero gradients.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpu/dropout.h"
#include "common.cuh"
#include "launchers.h"

namespace fastbert {
namespace cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr int kThreads = 256;  // ty = threadIdx.x / 16 picks rows, tx = threadIdx.x % 16 columns
constexpr int kRows = 64;      // a block's own rows: queries (forward, dQ) or keys (dK, dV)
constexpr float kInf = __builtin_huge_valf();

// Rows of the tiles a block streams past its own: fewer at d = 128, so that backward's shared memory
// stays under 96 KB.
template <int D>
__host__ __device__ constexpr int stream_rows() {
  return D == 128 ? 32 : 64;
}

// Shared memory: `own` tiles of kRows x (D + 1) floats (+1: rows start in different banks), one
// streamed tile, a kRows x streamed score tile, and up to four vectors of streamed length.
template <int D>
constexpr size_t smem_bytes(int own) {
  constexpr int n = stream_rows<D>();
  return size_t(own * kRows * (D + 1) + n * (D + 1) + kRows * (n + 1) + 4 * n) * sizeof(float);
}

struct Params {
  AttentionBatch batch;
  AttentionTensor q, k, v, out, grad, dq, dk, dv;
  float* lse;    // [B, heads, S] or [heads, T]
  float* delta;  // backward's D, laid out like lse
  float* ds_rest;  // backward: a row's dS summed over all keys but its dominant one, laid out like lse
  int* dominant;   // backward: a row's dominant key (P > 1/2), -1 for none, laid out like lse
  float scale;
  Dropout dropout;
};

// A block's sequence and the first of its kRows rows. Padded: sequence i owns tiles i * tiles ..
// (i + 1) * tiles - 1. Varlen: its tiles start at cu[i] / kRows + i, which leaves room for its
// ceil(length / kRows) tiles before the next sequence's: T / kRows + B tiles in all, a few idle.
struct Seq {
  int64_t i, start, length, first;
};

__device__ Seq locate(const AttentionBatch& b) {
  const int64_t t = blockIdx.x;
  if (b.cu_seqlens == nullptr) {
    const int64_t tiles = (b.tokens + kRows - 1) / kRows;
    return {t / tiles, 0, b.tokens, t % tiles * kRows};
  }
  const int32_t* cu = b.cu_seqlens;
  int64_t lo = 0, hi = b.sequences - 1;
  while (lo < hi) {  // the last sequence whose tiles start at or before t
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] / kRows + mid <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  // Offsets are clamped to [0, T]: bad ones (checked in Python, not here) give idle blocks, never
  // reads out of bounds.
  const int64_t start = cu[lo] < 0 ? 0 : cu[lo], end = cu[lo + 1] < b.tokens ? cu[lo + 1] : b.tokens;
  return {lo, start, end - start, (t - cu[lo] / kRows - lo) * kRows};
}

__device__ __forceinline__ bool live(const Seq& s) { return s.first >= 0 && s.first < s.length; }

template <typename T>
__device__ __forceinline__ T* row_ptr(const AttentionTensor& t, const Seq& s, int64_t h, int64_t r) {
  return static_cast<T*>(t.data) + ((s.start + r) * t.row + s.i * t.seq + h * t.head);
}

__device__ __forceinline__ int64_t lse_index(const AttentionBatch& b, const Seq& s, int64_t h, int64_t r) {
  return b.cu_seqlens ? h * b.tokens + s.start + r : (s.i * b.heads + h) * b.tokens + r;
}

// max that keeps a NaN (fmaxf drops it: a row of NaN scores then looked all masked and gave zeros).
__device__ __forceinline__ float nan_max(float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); }

// A score, or -inf at a masked key: selected, not added (a NaN or inf there plus -inf is NaN, and reached
// every row of the head).
__device__ __forceinline__ float masked(float score, float bias) { return bias < 0.f ? bias : score; }

// Over the 16 threads that own a row (one half-warp).
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ int row_max(int v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) {
    const int other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Keys to visit (everything after the last kept key is padding) and whether exactly one is kept.
struct Keys {
  int64_t visit;
  bool single;
};

__device__ Keys scan_keys(const AttentionBatch& b, const Seq& s) {
  if (b.key_mask == nullptr) return {s.length, s.length == 1};
  __shared__ int last, kept;
  if (threadIdx.x == 0) last = kept = 0;
  __syncthreads();
  const uint8_t* mask = b.key_mask + s.i * b.tokens;
  int my_last = 0, my_kept = 0;
  for (int64_t j = threadIdx.x; j < s.length; j += kThreads) {
    if (mask[j]) {
      my_last = int(j) + 1;
      ++my_kept;
    }
  }
  if (my_kept) {
    atomicMax(&last, my_last);
    atomicAdd(&kept, my_kept);
  }
  __syncthreads();
  return {last, kept == 1};
}

__device__ __forceinline__ bool key_kept(const AttentionBatch& b, const Seq& s, int64_t j, int64_t visit) {
  return j < visit && (b.key_mask == nullptr || b.key_mask[s.i * b.tokens + j]);
}

// dst[r][c] (row stride D + 1) = src[r * row_stride + c] in fp32 for r < rows and c < d, else 0 (rows
// past the sequence, columns past the head dim). Consecutive threads read consecutive columns.
template <typename T, int D, int kTileRows>
__device__ void load_tile(float* dst, const T* src, int64_t row_stride, int64_t rows, int d) {
  for (int e = threadIdx.x; e < kTileRows * D; e += kThreads) {
    const int r = e / D, c = e % D;
    dst[r * (D + 1) + c] = r < rows && c < d ? to_float(src[r * row_stride + c]) : 0.f;
  }
}

// acc[i][j] += sum over c < K of A[ty + 16 i][c] * B(c, tx + 16 j), A with row stride lda and B(c, j)
// at B[c * b_c + j * b_j]: scores of two row tiles (B holds keys: b_c = 1, b_j = their row stride) or
// a score tile times a row tile (B holds values: b_c = their row stride, b_j = 1). A half-warp reads
// one A element (a broadcast) and 16 B elements in distinct banks (row strides are odd).
template <int RI, int CJ, int K>
__device__ __forceinline__ void tile_product(float (&acc)[RI][CJ], const float* A, int lda, const float* B, int b_c,
                                             int b_j) {
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll 4
  for (int c = 0; c < K; ++c) {
    float a[RI], b[CJ];
#pragma unroll
    for (int i = 0; i < RI; ++i) a[i] = A[(ty + 16 * i) * lda + c];
#pragma unroll
    for (int j = 0; j < CJ; ++j) b[j] = B[c * b_c + (tx + 16 * j) * b_j];
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
      for (int j = 0; j < CJ; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

// Rows ty + 16 i (< rows) of acc * scale into t's rows first + ..., columns tx + 16 j (< d).
template <typename T, int RI, int CJ>
__device__ void store_rows(const AttentionTensor& t, const Seq& s, int64_t h, int64_t first, const float (&acc)[RI][CJ],
                           float scale, int d) {
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int64_t r = first + ty + 16 * i;
    if (r >= s.length) continue;
    T* dst = row_ptr<T>(t, s, h, r);
#pragma unroll
    for (int j = 0; j < CJ; ++j) {
      if (tx + 16 * j < d) dst[tx + 16 * j] = from_float<T>(acc[i][j] * scale);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  constexpr int N = stream_rows<D>(), LD = D + 1, LT = N + 1, RI = kRows / 16, CJ = N / 16, DJ = D / 16;
  extern __shared__ float smem[];
  float* sQ = smem;                // [kRows][LD] this block's queries
  float* sKV = sQ + kRows * LD;    // [N][LD] a key tile's K, then its V
  float* sP = sKV + N * LD;        // [kRows][LT] probabilities, dropout applied
  float* sBias = sP + kRows * LT;  // [N] 0 for a kept key, -inf for a masked one
  const Seq s = locate(p.batch);
  if (!live(s)) return;  // the whole block
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15, d = int(p.batch.head_dim);
  const int64_t h = blockIdx.y, q0 = s.first;
  const Keys keys = scan_keys(p.batch, s);
  load_tile<T, D, kRows>(sQ, row_ptr<T>(p.q, s, h, q0), p.q.row, s.length - q0, d);

  float o[RI][DJ] = {}, m[RI], l[RI];  // l: this thread's part of the row sum
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    m[i] = -kInf;
    l[i] = 0.f;
  }
  for (int64_t kb = 0; kb < keys.visit; kb += N) {
    const int64_t nk = keys.visit - kb < N ? keys.visit - kb : N;
    __syncthreads();  // the last tile's readers are done with sKV, sP and sBias
    load_tile<T, D, N>(sKV, row_ptr<T>(p.k, s, h, kb), p.k.row, nk, d);
    for (int j = threadIdx.x; j < N; j += kThreads) sBias[j] = key_kept(p.batch, s, kb + j, keys.visit) ? 0.f : -kInf;
    __syncthreads();
    float sc[RI][CJ] = {};
    tile_product<RI, CJ, D>(sc, sQ, LD, sKV, 1, LD);
    __syncthreads();  // sKV takes V
    load_tile<T, D, N>(sKV, row_ptr<T>(p.v, s, h, kb), p.v.row, nk, d);
#pragma unroll
    for (int i = 0; i < RI; ++i) {
      float mx = -kInf;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        sc[i][j] = masked(sc[i][j] * p.scale, sBias[tx + 16 * j]);
        mx = nan_max(mx, sc[i][j]);
      }
      const float m_new = nan_max(m[i], row_max(mx));
      const bool none = m_new == -kInf;  // every key so far is masked: nothing to add
      const float correction = none ? 1.f : expf(m[i] - m_new);  // 0 on the first kept tile
      m[i] = m_new;
      l[i] *= correction;
#pragma unroll
      for (int c = 0; c < DJ; ++c) o[i][c] *= correction;
      const int64_t r = q0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        float e = none ? 0.f : expf(sc[i][j] - m_new);
        l[i] += e;  // the normalizer sees every probability ...
        if (p.dropout.on() && e != 0.f) {  // ... P V only the kept ones, scaled by 1 / (1 - p)
          e = p.dropout.keep(s.i, h, r, kb + tx + 16 * j) ? e * p.dropout.scale() : 0.f;
        }
        sP[(ty + 16 * i) * LT + tx + 16 * j] = e;
      }
    }
    __syncthreads();
    tile_product<RI, DJ, N>(o, sP, LT, sKV, LD, 1);
  }
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const float sum = row_sum(l[i]);
    const int64_t r = q0 + ty + 16 * i;
    if (tx == 0 && r < s.length) p.lse[lse_index(p.batch, s, h, r)] = sum > 0.f ? m[i] + logf(sum) : sum != sum ? sum : kInf;
    l[i] = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int c = 0; c < DJ; ++c) o[i][c] *= l[i];
  }
  store_rows<T>(p.out, s, h, q0, o, 1.f, d);
}

// Key tile [kb, kb + N) against a block's queries (sQ, and dO in sG): pr = the probabilities before
// dropout, from the saved lse (0 for masked keys and rows with lse +inf); dp = dO V^T. Leaves V in sKV.
template <typename T, int D, int RI, int CJ>
__device__ void probs_and_grads(const Params& p, const Seq& s, int64_t h, int64_t kb, int64_t visit, const float* sQ,
                                const float* sG, float* sKV, float* sBias, const float (&lse)[RI],
                                float (&pr)[RI][CJ], float (&dp)[RI][CJ]) {
  constexpr int N = stream_rows<D>(), LD = D + 1;
  const int tx = threadIdx.x & 15, d = int(p.batch.head_dim);
  const int64_t nk = visit - kb < N ? visit - kb : N;
  __syncthreads();  // the last tile's readers are done with sKV, sBias and the score tile
  load_tile<T, D, N>(sKV, row_ptr<T>(p.k, s, h, kb), p.k.row, nk, d);
  for (int j = threadIdx.x; j < N; j += kThreads) sBias[j] = key_kept(p.batch, s, kb + j, visit) ? 0.f : -kInf;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < RI; ++i)
#pragma unroll
    for (int j = 0; j < CJ; ++j) pr[i][j] = dp[i][j] = 0.f;
  tile_product<RI, CJ, D>(pr, sQ, LD, sKV, 1, LD);
#pragma unroll
  for (int i = 0; i < RI; ++i)
#pragma unroll
    for (int j = 0; j < CJ; ++j) pr[i][j] = expf(masked(pr[i][j] * p.scale, sBias[tx + 16 * j]) - lse[i]);
  __syncthreads();  // sKV takes V
  load_tile<T, D, N>(sKV, row_ptr<T>(p.v, s, h, kb), p.v.row, nk, d);
  __syncthreads();
  tile_product<RI, CJ, D>(dp, sG, LD, sKV, 1, LD);
}

// dQ = scale * dS K with dS = P * (dP_dropped - D), per block of 64 query rows; also writes D =
// sum_j P_dropped dP (one more pass over the keys, as the CPU kernel does), each row's dominant key and
// the others' dS for dkdv_kernel.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  constexpr int N = stream_rows<D>(), LD = D + 1, LT = N + 1, RI = kRows / 16, CJ = N / 16, DJ = D / 16;
  extern __shared__ float smem[];
  float* sQ = smem;                // [kRows][LD] this block's queries
  float* sG = sQ + kRows * LD;     // [kRows][LD] their output gradients dO
  float* sKV = sG + kRows * LD;    // [N][LD] a key tile's K or V
  float* sS = sKV + N * LD;        // [kRows][LT] dS
  float* sBias = sS + kRows * LT;  // [N]
  const Seq s = locate(p.batch);
  if (!live(s)) return;  // the whole block
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15, d = int(p.batch.head_dim);
  const int64_t h = blockIdx.y, q0 = s.first;
  const Keys keys = scan_keys(p.batch, s);
  load_tile<T, D, kRows>(sQ, row_ptr<T>(p.q, s, h, q0), p.q.row, s.length - q0, d);
  load_tile<T, D, kRows>(sG, row_ptr<T>(p.grad, s, h, q0), p.grad.row, s.length - q0, d);
  __syncthreads();
  float lse[RI], delta[RI];
  int dom[RI];  // the row's dominant key (P > 1/2), -1 for none
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int64_t r = q0 + ty + 16 * i;
    lse[i] = r < s.length ? p.lse[lse_index(p.batch, s, h, r)] : kInf;
    delta[i] = 0.f;
    dom[i] = -1;
  }
  float pr[RI][CJ], dp[RI][CJ];
  if (!keys.single) {
    for (int64_t kb = 0; kb < keys.visit; kb += N) {
      probs_and_grads<T, D>(p, s, h, kb, keys.visit, sQ, sG, sKV, sBias, lse, pr, dp);
#pragma unroll
      for (int i = 0; i < RI; ++i) {
        const int64_t r = q0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < CJ; ++j) {
          float e = pr[i][j];
          // The largest index where rounding puts two tied keys just above 1/2: one key a row, as in
          // every kernel, so that dkdv_kernel corrects the very key this one did.
          if (pr[i][j] > 0.5f && kb + tx + 16 * j > dom[i]) dom[i] = int(kb + tx + 16 * j);
          if (p.dropout.on() && e != 0.f) e = p.dropout.keep(s.i, h, r, kb + tx + 16 * j) ? e * p.dropout.scale() : 0.f;
          delta[i] = fmaf(e, dp[i][j], delta[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    delta[i] = keys.single ? 0.f : row_sum(delta[i]);
    dom[i] = row_max(dom[i]);
    const int64_t r = q0 + ty + 16 * i;
    if (tx == 0 && r < s.length) p.delta[lse_index(p.batch, s, h, r)] = delta[i];
  }

  // A row's dS sums to zero (sum P = 1), and the dominant key's own dP - D cancels to a few ulps: its dS
  // is taken as minus the others' sum. dQ gets sum_j dS_j k_j - (sum_j dS_j) k_dom, which is that, and
  // dkdv_kernel gets the others' sum and the key.
  float dq[RI][DJ] = {}, ds_total[RI] = {}, ds_dom[RI] = {};
  if (!keys.single) {  // softmax over one key is constant: dQ stays exactly zero
    for (int64_t kb = 0; kb < keys.visit; kb += N) {
      const int64_t nk = keys.visit - kb < N ? keys.visit - kb : N;
      probs_and_grads<T, D>(p, s, h, kb, keys.visit, sQ, sG, sKV, sBias, lse, pr, dp);
#pragma unroll
      for (int i = 0; i < RI; ++i) {
        const int64_t r = q0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < CJ; ++j) {
          float g = dp[i][j];  // the gradient of the probability before dropout
          if (p.dropout.on() && pr[i][j] != 0.f) {
            g = p.dropout.keep(s.i, h, r, kb + tx + 16 * j) ? g * p.dropout.scale() : 0.f;
          }
          const float ds = pr[i][j] * (g - delta[i]);
          sS[(ty + 16 * i) * LT + tx + 16 * j] = ds;
          ds_total[i] += ds;
          if (kb + tx + 16 * j == dom[i]) ds_dom[i] += ds;
        }
      }
      __syncthreads();  // everyone is done with V
      load_tile<T, D, N>(sKV, row_ptr<T>(p.k, s, h, kb), p.k.row, nk, d);
      __syncthreads();
      tile_product<RI, DJ, N>(dq, sS, LT, sKV, LD, 1);
    }
  }
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    ds_total[i] = row_sum(ds_total[i]);
    ds_dom[i] = row_sum(ds_dom[i]);
    const int64_t r = q0 + ty + 16 * i;
    if (r >= s.length) continue;
    if (dom[i] >= 0) {
      const T* k_dom = row_ptr<T>(p.k, s, h, dom[i]);
#pragma unroll
      for (int c = 0; c < DJ; ++c) {
        if (tx + 16 * c < d) dq[i][c] -= ds_total[i] * to_float(k_dom[tx + 16 * c]);
      }
    }
    if (tx == 0) {
      p.ds_rest[lse_index(p.batch, s, h, r)] = ds_total[i] - ds_dom[i];
      p.dominant[lse_index(p.batch, s, h, r)] = dom[i];
    }
  }
  store_rows<T>(p.dq, s, h, q0, dq, p.scale, d);
}

// dV = P_dropped^T dO and dK = scale * dS^T Q, per block of 64 key rows, over all query tiles. Tiles
// are transposed here: thread rows are keys, columns queries.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  constexpr int N = stream_rows<D>(), LD = D + 1, LT = N + 1, RI = kRows / 16, CJ = N / 16, DJ = D / 16;
  extern __shared__ float smem[];
  float* sK = smem;                 // [kRows][LD] this block's keys
  float* sV = sK + kRows * LD;      // [kRows][LD] their values
  float* sQG = sV + kRows * LD;     // [N][LD] a query tile's Q, then dO, then Q again
  float* sS = sQG + N * LD;         // [kRows][LT] P_dropped^T, then dS^T
  float* sLse = sS + kRows * LT;    // [N] the query tile's lse (+inf past the sequence)
  float* sDelta = sLse + N;         // [N] and its D
  int* sDom = reinterpret_cast<int*>(sDelta + N);  // [N] its rows' dominant keys (-1 for none), from dq_kernel
  float* sRest = sDelta + 2 * N;   // [N] and their dS summed over the other keys
  const Seq s = locate(p.batch);
  if (!live(s)) return;  // the whole block
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15, d = int(p.batch.head_dim);
  const int64_t h = blockIdx.y, k0 = s.first;
  const Keys keys = scan_keys(p.batch, s);
  float dk[RI][DJ] = {}, dv[RI][DJ] = {};
  if (k0 < keys.visit) {  // else padding keys: zero gradients
    load_tile<T, D, kRows>(sK, row_ptr<T>(p.k, s, h, k0), p.k.row, keys.visit - k0, d);
    load_tile<T, D, kRows>(sV, row_ptr<T>(p.v, s, h, k0), p.v.row, keys.visit - k0, d);
    float bias[RI];
#pragma unroll
    for (int i = 0; i < RI; ++i) bias[i] = key_kept(p.batch, s, k0 + ty + 16 * i, keys.visit) ? 0.f : -kInf;
    for (int64_t qb = 0; qb < s.length; qb += N) {
      const int64_t nq = s.length - qb < N ? s.length - qb : N;
      __syncthreads();  // the last tile's readers are done with sQG, sS and the vectors
      load_tile<T, D, N>(sQG, row_ptr<T>(p.q, s, h, qb), p.q.row, nq, d);
      for (int r = threadIdx.x; r < N; r += kThreads) {
        sLse[r] = r < nq ? p.lse[lse_index(p.batch, s, h, qb + r)] : kInf;
        sDelta[r] = r < nq ? p.delta[lse_index(p.batch, s, h, qb + r)] : 0.f;
        sDom[r] = r < nq ? p.dominant[lse_index(p.batch, s, h, qb + r)] : -1;
        sRest[r] = r < nq ? p.ds_rest[lse_index(p.batch, s, h, qb + r)] : 0.f;
      }
      __syncthreads();
      float pr[RI][CJ] = {}, dp[RI][CJ] = {};
      tile_product<RI, CJ, D>(pr, sK, LD, sQG, 1, LD);
#pragma unroll
      for (int i = 0; i < RI; ++i)
#pragma unroll
        for (int j = 0; j < CJ; ++j) pr[i][j] = expf(masked(pr[i][j] * p.scale, bias[i]) - sLse[tx + 16 * j]);
      __syncthreads();  // sQG takes dO
      load_tile<T, D, N>(sQG, row_ptr<T>(p.grad, s, h, qb), p.grad.row, nq, d);
      __syncthreads();
      tile_product<RI, CJ, D>(dp, sV, LD, sQG, 1, LD);
#pragma unroll
      for (int i = 0; i < RI; ++i) {
#pragma unroll
        for (int j = 0; j < CJ; ++j) {
          float e = pr[i][j], g = dp[i][j];
          if (p.dropout.on() && e != 0.f) {
            const bool keep = p.dropout.keep(s.i, h, qb + tx + 16 * j, k0 + ty + 16 * i);
            e = keep ? e * p.dropout.scale() : 0.f;
            g = keep ? g * p.dropout.scale() : 0.f;
          }
          sS[(ty + 16 * i) * LT + tx + 16 * j] = e;
          const bool dominant = k0 + ty + 16 * i == sDom[tx + 16 * j];  // see dq_kernel
          dp[i][j] = keys.single ? 0.f : dominant ? -sRest[tx + 16 * j] : pr[i][j] * (g - sDelta[tx + 16 * j]);  // dS
        }
      }
      __syncthreads();
      tile_product<RI, DJ, N>(dv, sS, LT, sQG, LD, 1);
      __syncthreads();  // sS takes dS, sQG Q again
#pragma unroll
      for (int i = 0; i < RI; ++i)
#pragma unroll
        for (int j = 0; j < CJ; ++j) sS[(ty + 16 * i) * LT + tx + 16 * j] = dp[i][j];
      load_tile<T, D, N>(sQG, row_ptr<T>(p.q, s, h, qb), p.q.row, nq, d);
      __syncthreads();
      tile_product<RI, DJ, N>(dk, sS, LT, sQG, LD, 1);
    }
  }
  store_rows<T>(p.dk, s, h, k0, dk, p.scale, d);
  store_rows<T>(p.dv, s, h, k0, dv, 1.f, d);
}

int64_t grid_tiles(const AttentionBatch& b) {
  if (b.cu_seqlens == nullptr) return b.sequences * ((b.tokens + kRows - 1) / kRows);
  return b.tokens / kRows + b.sequences;
}

template <int D>
cudaError_t launch(void (*kernel)(Params), int own, const Params& p, cudaStream_t stream) {
  const size_t bytes = smem_bytes<D>(own);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err != cudaSuccess) return err;
  kernel<<<dim3(unsigned(grid_tiles(p.batch)), unsigned(p.batch.heads)), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run(bool forward, const Params& p, cudaStream_t stream) {
  if (forward) return launch<D>(forward_kernel<T, D>, 1, p, stream);
  const cudaError_t err = launch<D>(dq_kernel<T, D>, 2, p, stream);  // writes D, which dkdv_kernel reads
  if (err != cudaSuccess) return err;
  return launch<D>(dkdv_kernel<T, D>, 2, p, stream);
}

template <typename T>
cudaError_t run(bool forward, const Params& p, cudaStream_t stream) {
  if (p.batch.head_dim <= 32) return run<T, 32>(forward, p, stream);
  if (p.batch.head_dim <= 64) return run<T, 64>(forward, p, stream);
  return run<T, 128>(forward, p, stream);
}

cudaError_t run(DType dtype, bool forward, const Params& p, cudaStream_t stream) {
  const AttentionBatch& b = p.batch;
  if (b.sequences < 0 || b.heads < 0 || b.tokens < 0 || b.head_dim < 1 || b.head_dim > kAttentionMaxHeadDim ||
      b.heads > 65535 || (b.key_mask != nullptr && b.cu_seqlens != nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (b.sequences == 0 || b.heads == 0 || b.tokens == 0) return cudaSuccess;
  if (grid_tiles(b) > 0x7fffffff) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return run<float>(forward, p, stream);
    case DType::kFloat16:
      return run<__half>(forward, p, stream);
    case DType::kBFloat16:
      return run<__nv_bfloat16>(forward, p, stream);
  }
  return cudaErrorInvalidValue;
}

int64_t lse_count(const AttentionBatch& b) {
  return (b.cu_seqlens ? 1 : b.sequences) * b.heads * b.tokens;
}

}  // namespace

cudaError_t attention_fwd(DType dtype, const AttentionBatch& batch, AttentionTensor q, AttentionTensor k,
                          AttentionTensor v, AttentionTensor out, float* lse, float scale, double dropout_p,
                          uint64_t seed, cudaStream_t stream) {
  if (!(dropout_p >= 0.0 && dropout_p < 1.0)) return cudaErrorInvalidValue;
  const Params p{batch, q, k, v, out, {}, {}, {}, {}, lse, nullptr, nullptr, nullptr, scale, dropout_with(dropout_p, seed)};
  return run(dtype, true, p, stream);
}

size_t attention_bwd_workspace_bytes(const AttentionBatch& batch) {
  // D, the others' dS and the dominant key, each laid out like lse
  return batch.sequences > 0 && batch.heads > 0 && batch.tokens > 0 ? 3 * size_t(lse_count(batch)) * sizeof(float) : 0;
}

cudaError_t attention_bwd(DType dtype, const AttentionBatch& batch, AttentionTensor grad, AttentionTensor q,
                          AttentionTensor k, AttentionTensor v, AttentionTensor out, const float* lse,
                          AttentionTensor dq, AttentionTensor dk, AttentionTensor dv, void* workspace,
                          size_t workspace_bytes, float scale, double dropout_p, uint64_t seed,
                          cudaStream_t stream) {
  if (workspace_bytes < attention_bwd_workspace_bytes(batch) || !(dropout_p >= 0.0 && dropout_p < 1.0)) {
    return cudaErrorInvalidValue;
  }
  float* rows = static_cast<float*>(workspace);
  const int64_t count = lse_count(batch);
  const Params p{batch, q, k, v, out, grad, dq, dk, dv, const_cast<float*>(lse) /* only read */,
                 rows, rows + count, reinterpret_cast<int*>(rows + 2 * count), scale, dropout_with(dropout_p, seed)};
  return run(dtype, false, p, stream);
}

}  // namespace cuda
}  // namespace fastbert
