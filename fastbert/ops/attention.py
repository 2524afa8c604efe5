"""attention: softmax(q k^T * scale) v over [B, heads, S, d] with a key-padding mask."""
from __future__ import annotations

import functools

import torch

from fastbert import dispatch, tuning
from fastbert.ops import _alloc, _checks, reference
from fastbert.ops._op import OpSpec, by_device
from fastbert.ops._seed import dropout_seed, seed_int


@dispatch.follows_autocast
def attention(q, k, v, attention_mask=None, dropout_p: float = 0.0, scale: float | None = None, need_weights=False):
    """q, k, v [B, heads, S, d]; attention_mask [B, S], 1 = keep (bool, int or float 0/1).
    Returns [B, heads, S, d]; with need_weights=True also the probabilities [B, heads, S, S].
    A query row with no kept key gives zeros."""
    if not dispatch.trusted("attention", q, attention_mask is None, dropout_p, scale, need_weights):
        for name, t in (("q", q), ("k", k), ("v", v)):
            _checks.tensor(name, t, (4,))
        _checks.same_dtype_device(q=q, k=k, v=v)
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(
                f"q, k and v must have the same shape [B, heads, S, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if attention_mask is not None:
            _checks.tensor("attention_mask", attention_mask, (2,), floating=False)
            _checks.same_device("attention_mask", attention_mask, "q", q)
            _checks.shape("attention_mask", attention_mask, (q.shape[0], q.shape[2]), "[batch, seq] of q")
            if not torch.compiler.is_compiling():  # (the model passes bool masks: nothing to read there)
                _checks.padding_mask_values(attention_mask)
        _checks.probability("dropout_p", dropout_p)
    inputs = {"tensors": (q, k, v), "head_dim": q.shape[-1], "dropout_p": dropout_p, "need_weights": need_weights}
    return dispatch.call("attention", inputs, q, k, v, attention_mask, float(dropout_p), scale, need_weights)


@dispatch.follows_autocast
def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0, scale: float | None = None):
    """q, k, v [T, heads, d] packed; cu_seqlens int32 [B + 1] from 0 to T; max_seqlen the longest length."""
    if not dispatch.trusted("varlen_attention", q, dropout_p, scale):
        for name, t in (("q", q), ("k", k), ("v", v)):
            _checks.tensor(name, t, (3,))
        _checks.same_dtype_device(q=q, k=k, v=v)
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(
                f"q, k and v must have the same shape [T, heads, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        _checks.tensor("cu_seqlens", cu_seqlens, (1,), floating=False)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32, got dtype {cu_seqlens.dtype}")
        _checks.same_device("cu_seqlens", cu_seqlens, "q", q)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
        if not torch.compiler.is_compiling():  # value checks are data-dependent: eager only
            lengths = cu_seqlens.diff()
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0] or bool((lengths < 0).any()):
                raise ValueError(
                    f"cu_seqlens must rise from 0 to the token count {q.shape[0]} without decreasing, got {cu_seqlens.tolist()}"
                )
            if int(lengths.max()) > max_seqlen:
                raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({int(lengths.max())})")
        _checks.probability("dropout_p", dropout_p)
    inputs = {"tensors": (q, k, v), "head_dim": q.shape[-1], "dropout_p": dropout_p}
    return dispatch.call("varlen_attention", inputs, q, k, v, cu_seqlens, int(max_seqlen), float(dropout_p), scale)


dispatch.register("attention", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS, probabilities=True))(
    reference.in_float32(reference.attention)
)
dispatch.register("varlen_attention", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(
    reference.in_float32(reference.varlen_attention)
)


def _head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it in place (the head dim contiguous, rows that do not overlap), else a dense
    copy: an expanded gradient (stride 0) or rows closer than d made BLAS refuse its leading dimension and
    the backward return garbage. `.contiguous()` would keep the odd strides of a tensor torch calls
    contiguous (an empty one, or size-1 dims). The row stride is BLAS's leading dimension, so it must be
    d or more even where there is one row (a [B, heads, 1, d] transposed from [B, heads, d, 1])."""
    if _read_in_place(t.shape, t.stride()):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


@functools.lru_cache(maxsize=1024)
def _read_in_place(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """_head_dim_contiguous's test, per layout (remembered: a model calls with a few layouts, and the test
    cost ~3 us a tensor, three a call)."""
    return strides[-1] == 1 and _rows_apart(shape, strides) and strides[2 if len(shape) == 4 else 0] >= shape[-1]


def _rows_apart(shape, strides) -> bool:
    """Whether no two elements share memory (each dim's stride spans the smaller dims before it)."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _empty_output(q: torch.Tensor, allocate=_alloc.empty) -> torch.Tensor:
    """[B, heads, S, d] as a view of a [B, S, heads, d] buffer: the output projection reads it in place."""
    if q.dim() == 4:
        b, h, s, d = q.shape
        return allocate((b, s, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    return allocate(q.shape, dtype=q.dtype, device=q.device)


def _lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    return tuple(q.shape[:3]) if q.dim() == 4 else (q.shape[1], q.shape[0])  # [B, heads, S] | [heads, T]


# q, k, v [B, heads, S, d] with key_mask bool [B, S] (or None), or packed [T, heads, d] with cu_seqlens
# int32 [B + 1] and max_seqlen. The dropout seed travels as a tensor (drawn from torch's generator, so
# torch.manual_seed reproduces it) and the kernels hash keep decisions from it: backward regenerates the
# mask, nothing else is saved. Outputs: out (q's shape) and the logsumexp lse, float32 [B, heads, S] | [heads, T].
SPEC = OpSpec(
    "attention",
    forward_schema="(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? cu_seqlens, SymInt max_seqlen, "
                   "float scale, float dropout_p, Tensor? seed) -> (Tensor, Tensor)",
    backward_schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_mask, "
                    "Tensor? cu_seqlens, SymInt max_seqlen, float scale, float dropout_p, Tensor? seed) "
                    "-> (Tensor, Tensor, Tensor)",
    forward_fake=lambda q, *rest: (_empty_output(q, torch.empty), q.new_empty(_lse_shape(q), dtype=torch.float32)),
    backward_fake=lambda grad, q, *rest: tuple(_empty_output(q, torch.empty) for _ in range(3)),
    saved=lambda inputs, outputs: (*inputs[:3], *outputs, *inputs[3:]),
    input_grads=lambda inputs, grads: (*grads, None, None, None, None, None, None),
    recorded_as=lambda saved: "attention" if saved[0].dim() == 4 else "varlen_attention",
)


# ---------------------------------------------------------------- cxx: C++ kernels (csrc/cpu, csrc/cuda)
# torch.ops.fastbert_C.attention_fwd/bwd dispatch on the tensors' device to csrc/cpu/attention.cpp or
# csrc/cuda/attention.cu (in a CUDA build of _C). They need no max_seqlen; the CUDA backward reads `out`.


def _cxx_forward(q, k, v, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed):
    q, k, v = (_head_dim_contiguous(t) for t in (q, k, v))
    out = _empty_output(q)
    lse = _alloc.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    torch.ops.fastbert_C.attention_fwd(q, k, v, key_mask, cu_seqlens, scale, dropout_p, seed_int(seed), out, lse)
    return out, lse


def _cxx_backward(grad, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed):
    grad, q, k, v, out = (_head_dim_contiguous(t) for t in (grad, q, k, v, out))
    dq, dk, dv = _empty_output(q), _empty_output(q), _empty_output(q)
    torch.ops.fastbert_C.attention_bwd(grad, q, k, v, out, lse, key_mask, cu_seqlens, scale, dropout_p,
                                       seed_int(seed), dq, dk, dv)
    return dq, dk, dv


CXX = SPEC.kernels("cxx", _cxx_forward, _cxx_backward, by_device)


def _even_rows(t: torch.Tensor) -> torch.Tensor:
    """t with an even row stride (rows of [B, heads, S, d] or [T, heads, d]): brgemm's kernels read its rows
    as bfloat16 pairs."""
    # clone, not contiguous(): torch calls a tensor contiguous whatever the strides of its size-1 dims
    return t if t.stride(0 if t.dim() == 3 else 2) % 2 == 0 else t.clone(memory_format=torch.contiguous_format)


def _brgemm_forward(q, k, v, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed, kernel="brgemm"):
    q, v = (_head_dim_contiguous(t) for t in (q, v))
    k = _even_rows(_head_dim_contiguous(k))
    out = _empty_output(q)
    lse = _alloc.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    getattr(torch.ops.fastbert_C, f"attention_fwd_{kernel}")(q, k, v, key_mask, cu_seqlens, scale, dropout_p,
                                                              seed_int(seed), out, lse)
    return out, lse


def _brgemm_backward(grad, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed):
    k, v, out = (_head_dim_contiguous(t) for t in (k, v, out))
    grad, q = (_even_rows(_head_dim_contiguous(t)) for t in (grad, q))
    dq, dk, dv = _empty_output(q), _empty_output(q), _empty_output(q)
    torch.ops.fastbert_C.attention_bwd_brgemm(grad, q, k, v, out, lse, key_mask, cu_seqlens, scale, dropout_p,
                                              seed_int(seed), dq, dk, dv)
    return dq, dk, dv


# Both passes' products on ATen's brgemm (AMX tiles where the CPU has them), the rest as the C++ kernel's.
BRGEMM = SPEC.kernels("brgemm", _brgemm_forward, _brgemm_backward, "cpu")
# The forward's products on AMX tiles programmed in fastbert (no library call per product); brgemm's backward.
AMX = SPEC.kernels("amx", functools.partial(_brgemm_forward, kernel="amx"), _brgemm_backward, "cpu")


def _cxx(q, k, v, attention_mask, dropout_p, scale, need_weights, pair=CXX):
    key_mask = None if attention_mask is None else attention_mask.bool().contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # On CUDA too the seed stays on the CPU: one seed keeps the same elements on both devices, and reading
    # it into the kernel's arguments never waits for the GPU.
    return pair(q, k, v, key_mask, None, q.shape[2], scale, dropout_p, dropout_seed(dropout_p))[0]


def _cxx_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, pair=CXX):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return pair(q, k, v, None, cu_seqlens, max_seqlen, scale, dropout_p, dropout_seed(dropout_p))[0]


@functools.lru_cache(maxsize=None)
def _brgemm_machine_reasons(kernel: str = "brgemm") -> tuple[str, ...]:
    """Why this machine cannot run the brgemm (or amx) kernels: a build without avx512_bf16, a CPU without
    AMX-BF16 (amx), or a one-time check against the C++ kernel, forward and backward, that fails (oneDNN picks
    its own code per CPU, AMX among them: the check runs it on the CPU that will use it)."""
    from fastbert.testing import tolerance

    try:
        from fastbert import _C
    except ImportError as e:
        return (f"fastbert._C is not built ({e})",)
    if not _C.AVX512_BF16:
        return ("fastbert._C was built without avx512_bf16 (the pair layouts brgemm reads are made with it)",)
    if kernel == "amx" and "amx_bf16" not in tuning.cpu_features():
        return ("this CPU has no AMX-BF16",)
    g = torch.Generator().manual_seed(0)
    # Tails of every tile (77 rows, a masked sequence) and full tiles over two key blocks (600 rows).
    for batch, seq, kept in ((2, 77, 50), (1, 600, 600)):
        q, k, v, grad = (torch.randn(batch, 2, seq, 64, generator=g).bfloat16() for _ in range(4))
        mask = torch.arange(seq)[None] < torch.tensor([seq] + [kept] * (batch - 1))[:, None]
        with torch.inference_mode():
            out, lse = _cxx_forward(q, k, v, mask, None, seq, 0.125, 0.0, None)
            ours = (out, lse, *_cxx_backward(grad, q, k, v, out, lse, mask, None, seq, 0.125, 0.0, None))
            try:  # (the amx kernel refuses a CPU without AMX-BF16 itself, or a kernel that keeps the tiles)
                theirs = _brgemm_forward(q, k, v, mask, None, seq, 0.125, 0.0, None, kernel)
            except RuntimeError as e:
                return (f"{kernel} refused to run on this CPU: {e}",)
            theirs = (*theirs, *_brgemm_backward(grad, q, k, v, *theirs, mask, None, seq, 0.125, 0.0, None))
        errs = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(theirs, ours)]
        if not max(errs) <= tolerance(torch.bfloat16, "grad"):
            return (f"{kernel} disagrees with the C++ kernel on this CPU ({batch}x{seq}: rel err of out, logsumexp, "
                    "dq, dk, dv: " + ", ".join(f"{e:.3g}" for e in errs) + ")",)
    return ()


def _brgemm_reasons(f: dispatch.Facts) -> list[str]:
    if any(d != torch.bfloat16 for d in f.dtypes):
        return ["bfloat16 only"]
    if f.head_dim is not None and f.head_dim % 2:
        return [f"odd head_dim {f.head_dim} (it multiplies bfloat16 pairs)"]
    return list(_brgemm_machine_reasons())


def _amx_reasons(f: dispatch.Facts) -> list[str]:
    if any(d != torch.bfloat16 for d in f.dtypes):
        return ["bfloat16 only"]
    if f.head_dim is not None and f.head_dim % 32:
        return [f"head_dim {f.head_dim} is not a multiple of 32 (a tile row holds 32 bfloat16)"]
    return list(_brgemm_machine_reasons("amx"))


def _on_amx(f: dispatch.Facts) -> bool:
    """amx's and brgemm's static default (amx's first, where it serves the head dim): where the CPU has
    AMX-BF16 (on a Xeon with AMX brgemm ran the bf16 forward 2.2-3.1x the C++ kernel's, 1.6-1.9x forward +
    backward, at least level with torch's SDPA; amx's forward 1.02-2.0x brgemm's: RESULTS.md)."""
    return "amx_bf16" in tuning.cpu_features()


MAX_HEAD_DIM = 128  # the triton and cuda kernels' widest head


def _head_dim_reasons(f: dispatch.Facts) -> list[str]:
    if f.head_dim is not None and not 1 <= f.head_dim <= MAX_HEAD_DIM:
        return [f"head_dim {f.head_dim} (supported: 1 to {MAX_HEAD_DIM})"]
    return []


_CPU_SUPPORT = dispatch.Support(("cpu",), (torch.float32, torch.bfloat16))
# CUDA: fp32 FMA tiles for now, no tensor cores.
_CUDA_SUPPORT = dispatch.Support(("cuda",), (torch.float16, torch.bfloat16, torch.float32))
dispatch.register("attention", "cpu", _CPU_SUPPORT)(_cxx)


def _torch_sdpa(q, k, v, attention_mask, dropout_p, scale, need_weights):
    """torch's own CPU attention (flash attention on ATen's brgemm: AMX tiles where the CPU has them);
    a row with no kept key gives zeros there too."""
    mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_reasons(f: dispatch.Facts) -> list[str]:
    return ["dropout_p > 0 (torch's SDPA draws its own dropout mask, not fastbert's seeded one)"] if f.dropout else []


def _attention_class(q, k, v, attention_mask, *_):
    b, h, s, d = q.shape
    return f"s{dispatch.size_class(s)}", f"d{d}", f"bh{dispatch.size_class(b * h)}", (
        "masked" if attention_mask is not None else "unmasked")


def _varlen_class(q, k, v, cu_seqlens, max_seqlen, *_):
    return f"t{dispatch.size_class(q.shape[0])}", f"s{dispatch.size_class(max_seqlen)}", f"d{q.shape[-1]}"


dispatch.register_variants("attention", "cpu", (
    dispatch.Variant("fastbert", _cxx),
    dispatch.Variant("torch", _torch_sdpa, _sdpa_reasons),
    dispatch.Variant("amx", functools.partial(_cxx, pair=AMX), _amx_reasons, _on_amx),
    dispatch.Variant("brgemm", functools.partial(_cxx, pair=BRGEMM), _brgemm_reasons, _on_amx),
), _attention_class)
dispatch.register("varlen_attention", "cpu", _CPU_SUPPORT)(_cxx_varlen)
dispatch.register_variants("varlen_attention", "cpu", (
    dispatch.Variant("fastbert", _cxx_varlen),
    dispatch.Variant("amx", functools.partial(_cxx_varlen, pair=AMX), _amx_reasons, _on_amx),
    dispatch.Variant("brgemm", functools.partial(_cxx_varlen, pair=BRGEMM), _brgemm_reasons, _on_amx),
), _varlen_class)
dispatch.register("attention", "cuda", _CUDA_SUPPORT, _head_dim_reasons)(_cxx)
dispatch.register("varlen_attention", "cuda", _CUDA_SUPPORT, _head_dim_reasons)(_cxx_varlen)


# ------------------------------------------------------------------------- triton (kernels/attention.py)
# Imported on first call: a missing triton never breaks `import fastbert`.


def _key_bytes(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_mask is None else key_mask.view(torch.uint8)  # a bool [B, S] read as bytes, no copy


def _triton_forward(q, k, v, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed):
    from fastbert.kernels import attention as kernels

    out = _empty_output(q)
    lse = _alloc.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    kernels.forward(q, k, v, _key_bytes(key_mask), cu_seqlens, max_seqlen, scale, dropout_p, seed, out, lse)
    return out, lse


def _triton_backward(grad, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, scale, dropout_p, seed):
    from fastbert.kernels import attention as kernels

    dq, dk, dv = _empty_output(q), _empty_output(q), _empty_output(q)
    kernels.backward(grad, q, k, v, out, lse, _key_bytes(key_mask), cu_seqlens, max_seqlen, scale, dropout_p, seed,
                     dq, dk, dv)
    return dq, dk, dv


TRITON = SPEC.kernels("triton", _triton_forward, _triton_backward, "triton")
_TRITON_SUPPORT = dispatch.Support(("cuda", "cpu"), (torch.float16, torch.bfloat16, torch.float32))


@dispatch.register("attention", "triton", _TRITON_SUPPORT, _head_dim_reasons)
def _triton(q, k, v, attention_mask, dropout_p, scale, need_weights):
    key_mask = None if attention_mask is None else attention_mask.bool()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return TRITON(q, k, v, key_mask, None, q.shape[2], scale, dropout_p, dropout_seed(dropout_p, q.device))[0]


@dispatch.register("varlen_attention", "triton", _TRITON_SUPPORT, _head_dim_reasons)
def _triton_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return TRITON(q, k, v, None, cu_seqlens, max_seqlen, scale, dropout_p, dropout_seed(dropout_p, q.device))[0]
