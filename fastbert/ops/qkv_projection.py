"""qkv_projection: one GEMM for query, key and value, returned head-major."""
from __future__ import annotations

import torch

from fastbert import dispatch
from fastbert.ops import _checks, _onednn, reference
from fastbert.ops import dense as _dense  # noqa: F401  (registers fastbert::dense_cpu)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int):
    """x [B, S, H] or [T, H]; weight [3H, H] (rows: q, k, v); bias [3H].
    Returns q, k, v, each [B, heads, S, d] (or [T, heads, d])."""
    _checks.tensor("x", x, (2, 3))
    _checks.tensor("weight", weight, (2,))
    _checks.same_dtype_device(x=x, weight=weight, bias=bias)
    hidden = x.shape[-1]
    _checks.shape("weight", weight, (3 * hidden, hidden), "3 x hidden rows for q, k, v; hidden columns")
    if bias is not None:
        _checks.shape("bias", bias, (3 * hidden,), "3 x hidden")
    if not isinstance(num_heads, int) or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"num_heads must be a positive divisor of hidden size {hidden}, got {num_heads}")
    inputs = {"tensors": (x, weight, bias), "head_dim": hidden // num_heads}
    return dispatch.call("qkv_projection", inputs, x, weight, bias, num_heads)


dispatch.register("qkv_projection", "reference", dispatch.Support(("cpu", "cuda"), dispatch.FLOATS))(
    reference.qkv_projection
)


# ------------------------------------------------------------------------------ cpu (oneDNN GEMM)


@dispatch.register("qkv_projection", "cpu", dispatch.Support(("cpu",), (torch.float32, torch.bfloat16)),
                   extra_reasons=lambda facts: _onednn.missing())
def _cpu(x, weight, bias, num_heads):
    qkv = torch.ops.fastbert.dense_cpu(x, weight, bias, "none")  # [..., 3H], one GEMM
    head_dim = x.shape[-1] // num_heads
    if x.dim() == 3:
        b, s, _ = x.shape
        # [B, S, 3, heads, d] -> 3 x [B, heads, S, d]: strided views; attention kernels read them in place.
        return qkv.view(b, s, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return qkv.view(-1, 3, num_heads, head_dim).unbind(1)  # 3 x [T, heads, d]
