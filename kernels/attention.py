"""Flash attention in Triton (non-causal): padded batches with a key-padding mask, and packed varlen.

Forward: one program per (query block, head, sequence) walks the key blocks with an online softmax in
fp32 (base-2 exponent: the scale carries log2(e)) and stores the output and the logsumexp of each
query row (base 2, as the exponents are: a round trip through the natural log moved it by an ulp of the
row's top score, and at large scores that ulp is the probabilities' error in the exponent, NaN gradients
at scale=1e8; +inf for a row with no kept key, whose output is zeros). Backward recomputes
the probabilities from q, k and the logsumexp, never storing an S x S matrix: one kernel per query
block first takes delta = rowsum(P * dP) over the key blocks, then accumulates dQ over them again;
then one kernel per key block accumulates dK and dV over the query blocks (no atomics: deterministic).

Layouts: q, k, v, out and the gradients are [B, heads, S, d] or [T, heads, d] with any strides (each
tensor passes its own); varlen sequences are rows cu_seqlens[i]:cu_seqlens[i+1] of the packed tensor.
Logsumexp and delta are float32 [B, heads, S] or [heads, T].

Dropout on the probabilities: a key j is kept for query row r of (sequence b, head h) when
rand(seed, ((b * heads + h) * max_len + r) * max_len + j) >= dropout_p (Philox, so backward
regenerates the same mask), and kept probabilities are scaled by 1 / (1 - dropout_p).

Launch helpers only: the caller allocates the outputs and decides when these kernels run.
"""
import torch
import triton
import triton.language as tl

from fastbert.kernels._launch import on_device_of

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


@triton.jit
def _sequence_bounds(CU_SEQLENS, b, max_len, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence b: from cu_seqlens when packed, else (0, S)."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b).to(tl.int64)
        length = (tl.load(CU_SEQLENS + b + 1) - tl.load(CU_SEQLENS + b)).to(tl.int32)
    else:
        start = tl.zeros((), tl.int64)
        length = tl.zeros((), tl.int32) + max_len
    return start, length


@triton.jit
def _keep(seed, b, h, rows, cols, num_heads, max_len, dropout_p):
    """Dropout mask [BLOCK_M, BLOCK_N] for query rows x keys of (sequence b, head h): True = kept."""
    offsets = ((b * num_heads + h) * max_len + rows[:, None].to(tl.int64)) * max_len + cols[None, :]
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _key_block(K, V, KEY_MASK, b, n0, length, dims, dim_ok, stride_ks, stride_kd, stride_vs, stride_vd,
               stride_mb, stride_ms, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key block at n0: its positions, keys and values (zeros past the sequence), which keys count."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_in = cols < length
    key_ok = col_in
    if HAS_MASK:
        key_ok = key_ok & (tl.load(KEY_MASK + b * stride_mb + cols * stride_ms, mask=col_in, other=0) != 0)
    kv_mask = col_in[:, None] & dim_ok[None, :]
    k = tl.load(K + cols[:, None] * stride_ks + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vs + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
    return cols, k, v, key_ok


@triton.jit
def _fp16_range(x, AXIS: tl.constexpr):
    """Powers of two (down, up) per row (AXIS=1) or column (AXIS=0) of the float32 tile x that bring each
    line's largest |x| below 2^15 before it is rounded to float16 for a dot product, and back after: dS
    passes float16's 65504 (large output gradients, as fp16 loss scaling makes them) where the gradients
    summed from it do not. Exact (exponent arithmetic); 1 for lines in range; inf and NaN stay so."""
    top = tl.max(tl.abs(x), AXIS).to(tl.int32, bitcast=True)
    e = tl.maximum(((top >> 23) & 0xFF) - 127 - 14, 0)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _attention_fwd_kernel(
    Q,  # [B, heads, S, d] | [T, heads, d] queries, strides stride_q*
    K,  # keys, same shape as Q, strides stride_k*
    V,  # values, same shape as Q, strides stride_v*
    O,  # output, same shape as Q (written), strides stride_o*
    LSE,  # float32 [B, heads, S] | [heads, T] logsumexp per query row (written), strides stride_l*
    KEY_MASK,  # uint8 [B, S], nonzero = keep the key (read only when HAS_MASK), strides stride_m*
    CU_SEQLENS,  # int32 [B + 1] token offsets of the sequences (read only when IS_VARLEN)
    SEED,  # int64 [1] dropout seed (read only when DROPOUT)
    stride_qb, stride_qh, stride_qs, stride_qd,  # Q strides: sequence (0 for varlen), head, row, dim
    stride_kb, stride_kh, stride_ks, stride_kd,  # K strides, as Q's
    stride_vb, stride_vh, stride_vs, stride_vd,  # V strides, as Q's
    stride_ob, stride_oh, stride_os, stride_od,  # O strides, as Q's
    stride_lb, stride_lh, stride_ls,  # LSE strides: sequence (0 for varlen), head, row
    stride_mb, stride_ms,  # KEY_MASK strides: sequence, key
    num_heads,  # heads
    max_len,  # S for padded batches, max_seqlen for varlen (bounds the grid and dropout offsets)
    head_dim,  # d (BLOCK_D >= d; the columns past d are masked)
    qk_scale,  # softmax scale * log2(e)
    dropout_p,  # probability of dropping a probability (DROPOUT only)
    keep_scale,  # 1 / (1 - dropout_p) (DROPOUT only)
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length = _sequence_bounds(CU_SEQLENS, b, max_len, IS_VARLEN)
    if pid_m * BLOCK_M >= length:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    dim_ok = dims < head_dim
    Q += b * stride_qb + h * stride_qh + start * stride_qs
    K += b * stride_kb + h * stride_kh + start * stride_ks
    V += b * stride_vb + h * stride_vh + start * stride_vs
    q = tl.load(Q + rows[:, None] * stride_qs + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the scores (base 2)
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(0, length, BLOCK_N):
        cols, k, v, key_ok = _key_block(K, V, KEY_MASK, b, n0, length, dims, dim_ok, stride_ks, stride_kd,
                                        stride_vs, stride_vd, stride_mb, stride_ms, HAS_MASK, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all keys so far masked: exp2(-inf) = 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(_keep(seed, b, h, rows, cols, num_heads, max_len, dropout_p), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new

    kept = l_i > 0.0
    out = acc / tl.where(kept, l_i, 1.0)[:, None]  # acc is 0 where no key is kept
    if DROPOUT:
        out = out * keep_scale
    O += b * stride_ob + h * stride_oh + start * stride_os
    tl.store(O + rows[:, None] * stride_os + dims[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    # +inf marks a row with no kept key (the backward's probabilities 0); a NaN score keeps lse NaN, and
    # so NaN gradients (with +inf V's came back zeros beside the NaN).
    lse = tl.where(kept, m_i + tl.log2(tl.where(kept, l_i, 1.0)), tl.where(l_i != l_i, l_i, float("inf")))
    tl.store(LSE + b * stride_lb + h * stride_lh + (start + rows) * stride_ls, lse, mask=row_ok)


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,  # [B, heads, S, d] | [T, heads, d] queries, strides stride_q*
    K,  # keys, same shape, strides stride_k*
    V,  # values, same shape, strides stride_v*
    DO,  # gradient of the output, same shape, strides stride_g*
    DK,  # gradient of K (written), same shape, strides stride_dk*
    DV,  # gradient of V (written), same shape, strides stride_dv*
    LSE,  # float32 [B, heads, S] | [heads, T] forward logsumexp, strides stride_l*
    DELTA,  # float32, LSE's shape and strides: rowsum(P * dP), from the dQ kernel
    DS_REST,  # float32, LSE's shape and strides: the row's dS summed over all but its dominant key, from the dQ kernel
    DOMINANT,  # int32, LSE's shape and strides: the row's dominant key (-1 for none), from the dQ kernel
    KEY_MASK,  # uint8 [B, S], nonzero = keep the key (read only when HAS_MASK), strides stride_m*
    CU_SEQLENS,  # int32 [B + 1] token offsets of the sequences (read only when IS_VARLEN)
    SEED,  # int64 [1] dropout seed (read only when DROPOUT)
    stride_qb, stride_qh, stride_qs, stride_qd,  # Q strides: sequence (0 for varlen), head, row, dim
    stride_kb, stride_kh, stride_ks, stride_kd,  # K strides, as Q's
    stride_vb, stride_vh, stride_vs, stride_vd,  # V strides, as Q's
    stride_gb, stride_gh, stride_gs, stride_gd,  # DO strides, as Q's
    stride_dkb, stride_dkh, stride_dks, stride_dkd,  # DK strides, as Q's
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,  # DV strides, as Q's
    stride_lb, stride_lh, stride_ls,  # LSE, DELTA, DS_REST, DOMINANT strides: sequence (0 for varlen), head, row
    stride_mb, stride_ms,  # KEY_MASK strides: sequence, key
    num_heads,  # heads
    max_len,  # S for padded batches, max_seqlen for varlen
    head_dim,  # d
    scale,  # softmax scale
    qk_scale,  # softmax scale * log2(e)
    dropout_p,  # probability of dropping a probability (DROPOUT only)
    keep_scale,  # 1 / (1 - dropout_p) (DROPOUT only)
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length = _sequence_bounds(CU_SEQLENS, b, max_len, IS_VARLEN)
    if pid_n * BLOCK_N >= length:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_in = cols < length
    dim_ok = dims < head_dim
    key_ok = col_in
    if HAS_MASK:
        key_ok = key_ok & (tl.load(KEY_MASK + b * stride_mb + cols * stride_ms, mask=col_in, other=0) != 0)
    kv_mask = col_in[:, None] & dim_ok[None, :]
    K += b * stride_kb + h * stride_kh + start * stride_ks
    V += b * stride_vb + h * stride_vh + start * stride_vs
    k = tl.load(K + cols[:, None] * stride_ks + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vs + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
    Q += b * stride_qb + h * stride_qh + start * stride_qs
    DO += b * stride_gb + h * stride_gh + start * stride_gs
    LSE += b * stride_lb + h * stride_lh + start * stride_ls
    DELTA += b * stride_lb + h * stride_lh + start * stride_ls
    DS_REST += b * stride_lb + h * stride_lh + start * stride_ls
    DOMINANT += b * stride_lb + h * stride_lh + start * stride_ls
    if DROPOUT:
        seed = tl.load(SEED)

    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for m0 in range(0, length, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(Q + rows[:, None] * stride_qs + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * stride_gs + dims[None, :] * stride_gd, mask=q_mask, other=0.0)
        lse = tl.load(LSE + rows * stride_ls, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + rows * stride_ls, mask=row_ok, other=0.0)
        ds_rest = tl.load(DS_REST + rows * stride_ls, mask=row_ok, other=0.0)
        dom = tl.load(DOMINANT + rows * stride_ls, mask=row_ok, other=-1)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        p = tl.exp2(tl.where(key_ok[None, :], s, float("-inf")) - lse[:, None])  # 0 for masked keys, empty rows
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dL/d(dropped probabilities)
        if DROPOUT:  # keep_scale multiplies dV at the end: P / (1 - dropout_p) can pass float16's range
            keep = _keep(seed, b, h, rows, cols, num_heads, max_len, dropout_p)
            dv = tl.dot(tl.trans(tl.where(keep, p, 0.0).to(do.dtype)), do, dv, input_precision=PRECISION)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        ds = tl.where(cols[None, :] == dom[:, None], -ds_rest[:, None], ds)  # a row's dS sums to zero: see the dQ kernel
        if q.dtype == tl.float16:  # dK's rows are dS's columns: scaled per column
            down, up = _fp16_range(ds, 0)
            dk += tl.dot(tl.trans((ds * down[None, :]).to(q.dtype)), q, input_precision=PRECISION) * up[:, None]
        else:
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PRECISION)

    DK += b * stride_dkb + h * stride_dkh + start * stride_dks
    DV += b * stride_dvb + h * stride_dvh + start * stride_dvs
    tl.store(DK + cols[:, None] * stride_dks + dims[None, :] * stride_dkd, (dk * scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    if DROPOUT:
        dv = dv * keep_scale
    tl.store(DV + cols[:, None] * stride_dvs + dims[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _probs_and_grads(q, do, lse, K, V, KEY_MASK, SEED, b, h, rows, n0, length, dims, dim_ok,
                     stride_ks, stride_kd, stride_vs, stride_vd, stride_mb, stride_ms, num_heads, max_len,
                     qk_scale, dropout_p, keep_scale, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                     BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """For a block of query rows and the key block at n0: the keys, the probabilities P (0 for masked
    keys) and dP, the gradient of P before dropout (dropped entries 0, kept ones scaled)."""
    cols, k, v, key_ok = _key_block(K, V, KEY_MASK, b, n0, length, dims, dim_ok, stride_ks, stride_kd,
                                    stride_vs, stride_vd, stride_mb, stride_ms, HAS_MASK, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    p = tl.exp2(tl.where(key_ok[None, :], s, float("-inf")) - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        keep = _keep(tl.load(SEED), b, h, rows, cols, num_heads, max_len, dropout_p)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    return k, p, dp


@triton.jit
def _attention_bwd_dq_kernel(
    Q,  # [B, heads, S, d] | [T, heads, d] queries, strides stride_q*
    K,  # keys, same shape, strides stride_k*
    V,  # values, same shape, strides stride_v*
    DO,  # gradient of the output, same shape, strides stride_g*
    DQ,  # gradient of Q (written), same shape, strides stride_dq*
    LSE,  # float32 [B, heads, S] | [heads, T] forward logsumexp, strides stride_l*
    DELTA,  # float32, LSE's shape and strides: rowsum(P * dP) (written)
    DS_REST,  # float32, LSE's shape and strides: the row's dS summed over all but its dominant key (written)
    DOMINANT,  # int32, LSE's shape and strides: the row's dominant key, -1 for none (written)
    KEY_MASK,  # uint8 [B, S], nonzero = keep the key (read only when HAS_MASK), strides stride_m*
    CU_SEQLENS,  # int32 [B + 1] token offsets of the sequences (read only when IS_VARLEN)
    SEED,  # int64 [1] dropout seed (read only when DROPOUT)
    stride_qb, stride_qh, stride_qs, stride_qd,  # Q strides: sequence (0 for varlen), head, row, dim
    stride_kb, stride_kh, stride_ks, stride_kd,  # K strides, as Q's
    stride_vb, stride_vh, stride_vs, stride_vd,  # V strides, as Q's
    stride_gb, stride_gh, stride_gs, stride_gd,  # DO strides, as Q's
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,  # DQ strides, as Q's
    stride_lb, stride_lh, stride_ls,  # LSE, DELTA, DS_REST, DOMINANT strides: sequence (0 for varlen), head, row
    stride_mb, stride_ms,  # KEY_MASK strides: sequence, key
    num_heads,  # heads
    max_len,  # S for padded batches, max_seqlen for varlen
    head_dim,  # d
    scale,  # softmax scale
    qk_scale,  # softmax scale * log2(e)
    dropout_p,  # probability of dropping a probability (DROPOUT only)
    keep_scale,  # 1 / (1 - dropout_p) (DROPOUT only)
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length = _sequence_bounds(CU_SEQLENS, b, max_len, IS_VARLEN)
    if pid_m * BLOCK_M >= length:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    dim_ok = dims < head_dim
    q_mask = row_ok[:, None] & dim_ok[None, :]
    Q += b * stride_qb + h * stride_qh + start * stride_qs
    DO += b * stride_gb + h * stride_gh + start * stride_gs
    q = tl.load(Q + rows[:, None] * stride_qs + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_gs + dims[None, :] * stride_gd, mask=q_mask, other=0.0)
    lse_at = b * stride_lb + h * stride_lh + (start + rows) * stride_ls
    lse = tl.load(LSE + lse_at, mask=row_ok, other=float("inf"))
    K += b * stride_kb + h * stride_kh + start * stride_ks
    V += b * stride_vb + h * stride_vh + start * stride_vs

    # delta = rowsum(P * dP) from the very P and dP that dS uses below, written for the dK/dV kernel
    # (launched after this one). Not rowsum(dO * O): O's rounding does not cancel against dP's, and
    # where softmax is nearly one-hot dP - delta is almost nothing, so q and k lost their precision.
    delta = tl.zeros((BLOCK_M,), tl.float32)
    dom = tl.full((BLOCK_M,), -1, tl.int32)  # the row's dominant key (P > 1/2), -1 for none; one key even
    for n0 in range(0, length, BLOCK_N):     # where rounding puts two tied keys just above 1/2
        k, p, dp = _probs_and_grads(q, do, lse, K, V, KEY_MASK, SEED, b, h, rows, n0, length, dims, dim_ok,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_mb, stride_ms, num_heads,
                                    max_len, qk_scale, dropout_p, keep_scale, HAS_MASK, DROPOUT, BLOCK_N, PRECISION)
        delta += tl.sum(p * dp, 1)
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int32)
        dom = tl.maximum(dom, tl.max(tl.where(p > 0.5, cols[None, :], -1), 1))
    tl.store(DELTA + lse_at, delta, mask=row_ok)
    tl.store(DOMINANT + lse_at, dom, mask=row_ok)

    # A row's dS sums to zero (sum P = 1). Where one key holds P > 1/2 its own dP - delta cancels to a few
    # ulps of delta, so its dS is taken as minus the others' sum: dq = sum_j dS_j k_j - (sum_j dS_j) k_dom,
    # k_dom gathered by a 0/1 row (zero where no key dominates); the others' sum and the dominant key's
    # index go to the dK kernel, which so corrects the very key this kernel chose (the identity holds for
    # any one key; it only helps where that key's P is large).
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_dom = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    ds_total = tl.zeros((BLOCK_M,), tl.float32)
    ds_dom = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(0, length, BLOCK_N):
        k, p, dp = _probs_and_grads(q, do, lse, K, V, KEY_MASK, SEED, b, h, rows, n0, length, dims, dim_ok,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_mb, stride_ms, num_heads,
                                    max_len, qk_scale, dropout_p, keep_scale, HAS_MASK, DROPOUT, BLOCK_N, PRECISION)
        ds = p * (dp - delta[:, None])
        if k.dtype == tl.float16:  # dQ's rows are dS's rows: scaled per row
            down, up = _fp16_range(ds, 1)
            ds_low = (ds * down[:, None]).to(k.dtype)
            dq += tl.dot(ds_low, k, input_precision=PRECISION) * up[:, None]
            ds = ds_low.to(tl.float32) * up[:, None]  # the values the product used, for the dK kernel's correction
        else:
            ds = ds.to(k.dtype)
            dq = tl.dot(ds, k, dq, input_precision=PRECISION)
            ds = ds.to(tl.float32)
        dominant = (n0 + tl.arange(0, BLOCK_N))[None, :] == dom[:, None]
        k_dom = tl.dot(dominant.to(k.dtype), k, k_dom, input_precision=PRECISION)
        ds_total += tl.sum(ds, 1)
        ds_dom += tl.sum(tl.where(dominant, ds, 0.0), 1)
    dq -= ds_total[:, None] * k_dom
    tl.store(DS_REST + lse_at, ds_total - ds_dom, mask=row_ok)

    DQ += b * stride_dqb + h * stride_dqh + start * stride_dqs
    tl.store(DQ + rows[:, None] * stride_dqs + dims[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)


# ---------------------------------------------------------------------------------------------- host


def _strides(t):
    """(sequence, head, row, dim) strides of [B, heads, S, d], or of [T, heads, d] with sequence 0."""
    return tuple(t.stride()) if t.dim() == 4 else (0, t.stride(1), t.stride(0), t.stride(2))


def _row_strides(t):
    """(sequence, head, row) strides of a float32 [B, heads, S] or [heads, T] per-row statistic."""
    return tuple(t.stride()) if t.dim() == 3 else (0, t.stride(0), t.stride(1))


def _config(q):
    """Tile sizes and warps for q's head dim; BLOCK_D is the next power of two of d (at least 16)."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    block = 64 if block_d <= 64 else 32
    return block, block, block_d, 4 if block_d <= 64 else 8


def _batch(q, cu_seqlens, max_seqlen):
    """(sequences, heads, max_len): the grid's extent and the dropout offsets' row length."""
    if cu_seqlens is not None:
        return cu_seqlens.numel() - 1, q.shape[1], max_seqlen
    return q.shape[0], q.shape[1], q.shape[2]


def _mask_args(key_mask, dummy):
    """(pointer, sequence stride, key stride) of the key mask; a dummy pointer, never read, when absent."""
    if key_mask is None:
        return dummy, 0, 0
    return key_mask, key_mask.stride(0), key_mask.stride(1)


def forward(q, k, v, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed, out, lse):
    """Writes out (q's shape) and lse (float32 [B, heads, S] | [heads, T]).

    q, k, v: [B, heads, S, d] with key_mask uint8 [B, S] or None, or [T, heads, d] with cu_seqlens
    int32 [B + 1] and max_seqlen; seed: int64 [1], read when dropout_p > 0."""
    sequences, heads, max_len = _batch(q, cu_seqlens, max_seqlen)
    if q.numel() == 0 or sequences == 0 or max_len == 0:
        return
    block_m, block_n, block_d, warps = _config(q)
    mask, stride_mb, stride_ms = _mask_args(key_mask, lse)
    grid = (triton.cdiv(max_len, block_m), heads, sequences)
    with on_device_of(q):
        _attention_fwd_kernel[grid](
            q, k, v, out, lse, mask, cu_seqlens if cu_seqlens is not None else lse, seed if seed is not None else lse,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_row_strides(lse), stride_mb, stride_ms,
            heads, max_len, q.shape[-1], scale * LOG2E, dropout_p, 1.0 / (1.0 - dropout_p),
            HAS_MASK=key_mask is not None, IS_VARLEN=cu_seqlens is not None, DROPOUT=dropout_p > 0,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION="ieee", num_warps=warps,
        )


def backward(grad, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed, dq, dk, dv):
    """Writes dq, dk, dv (q's shape) from the output gradient `grad` and forward's lse (`out` is not
    read: delta comes from the probabilities themselves)."""
    sequences, heads, max_len = _batch(q, cu_seqlens, max_seqlen)
    if q.numel() == 0 or sequences == 0 or max_len == 0:
        return
    block_m, block_n, block_d, warps = _config(q)
    delta = torch.empty_like(lse)  # LSE's strides: the kernels share them; the dQ kernel writes both
    ds_rest = torch.empty_like(lse)
    dominant = torch.empty_like(lse, dtype=torch.int32)
    cu = cu_seqlens if cu_seqlens is not None else lse
    mask, stride_mb, stride_ms = _mask_args(key_mask, lse)
    common = dict(HAS_MASK=key_mask is not None, IS_VARLEN=cu_seqlens is not None, DROPOUT=dropout_p > 0,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION="ieee", num_warps=warps)
    scalars = (heads, max_len, q.shape[-1], scale, scale * LOG2E, dropout_p, 1.0 / (1.0 - dropout_p))
    seed = seed if seed is not None else lse
    with on_device_of(q):
        _attention_bwd_dq_kernel[(triton.cdiv(max_len, block_m), heads, sequences)](
            q, k, v, grad, dq, lse, delta, ds_rest, dominant, mask, cu, seed,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad), *_strides(dq),
            *_row_strides(lse), stride_mb, stride_ms, *scalars, **common,
        )
        _attention_bwd_dkdv_kernel[(triton.cdiv(max_len, block_n), heads, sequences)](
            q, k, v, grad, dk, dv, lse, delta, ds_rest, dominant, mask, cu, seed,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad), *_strides(dk), *_strides(dv),
            *_row_strides(lse), stride_mb, stride_ms, *scalars, **common,
        )
