"""attention at BERT-base shapes (12 heads, d 64), with padding: fastbert vs F.scaled_dot_product_attention
(same mask) vs the naive reference. fastbert reads q, k, v as the strided views its QKV projection makes."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, DTYPES, dtype_id, fastbert_contenders, time_it
from fastbert import ops
from fastbert.ops import reference


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


CONTENDERS = [("torch SDPA", sdpa), ("reference", reference.attention), *fastbert_contenders("attention", ops.attention)]
SHAPES = [(8, 128), (2, 512)]  # batch x seq: 1024 tokens each


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch,seq", SHAPES, ids=[f"{b}x{s}" for b, s in SHAPES])
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_attention(benchmark, name, fn, batch, seq, dtype):
    qkv = torch.randn(batch, seq, 3, 12, 64).to(DEVICE, dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # strided [B, heads, S, d], as the QKV GEMM leaves them
    if name == "torch SDPA":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # what transformers hands SDPA
    lengths = torch.randint(seq // 4, seq + 1, (batch,))
    mask = (torch.arange(seq)[None] < lengths[:, None]).to(DEVICE)  # padded batch, unequal lengths
    time_it(benchmark, f"attention {batch}x{seq} h12 d64 padded {dtype_id(dtype)}", fn, q, k, v, mask)
