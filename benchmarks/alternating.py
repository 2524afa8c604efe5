"""Kernel ratios measured alternately: fastbert's cpu backend and torch's built-in take turns call by
call (medians), so a VM whose speed drifts over seconds cannot favour either. The pytest-benchmark
suites beside this file time contenders one after another; use this for the ratios.

    .venv/bin/python benchmarks/alternating.py [--rounds 30]
"""
import argparse

import torch
import torch.nn.functional as F

import fastbert
from fastbert import ops
from fastbert.apps.timing import alternating_medians


def cases():
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1024, 4096):
            x, b = torch.randn(tokens, 3072).to(dtype), torch.randn(3072).to(dtype)
            yield f"bias_gelu {tokens}x3072", dtype, lambda x=x, b=b: ops.bias_gelu(x, b), lambda x=x, b=b: F.gelu(x + b)
            h, r = torch.randn(tokens, 768).to(dtype), torch.randn(tokens, 768).to(dtype)
            w, c = torch.randn(768).to(dtype), torch.randn(768).to(dtype)
            yield (f"add_layer_norm {tokens}x768", dtype, lambda h=h, r=r, w=w, c=c: ops.add_layer_norm(h, r, w, c, 1e-12),
                   lambda h=h, r=r, w=w, c=c: F.layer_norm(h + r, (768,), w, c, 1e-12))
            wd = (torch.randn(3072, 768) * 0.03).to(dtype)
            bd = torch.randn(3072).to(dtype)
            pw = ops.PreparedWeights()  # as the model's module keeps the packed weight
            yield (f"dense+gelu {tokens}x768->3072", dtype, lambda h=h, wd=wd, bd=bd, pw=pw: ops.dense(h, wd, bd, "gelu", prepared=pw),
                   lambda h=h, wd=wd, bd=bd: F.gelu(F.linear(h, wd, bd)))
        for batch, seq in ((8, 128), (2, 512)):
            q, k, v = torch.randn(batch, seq, 3, 12, 64).to(dtype).permute(2, 0, 3, 1, 4).unbind(0)
            mask = torch.arange(seq)[None] < torch.randint(seq // 4, seq + 1, (batch,), generator=torch.Generator().manual_seed(0))[:, None]
            qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
            yield (f"attention {batch}x{seq} padded", dtype, lambda q=q, k=k, v=v, m=mask: ops.attention(q, k, v, m),
                   lambda q=qc, k=kc, v=vc, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, None, :]))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"| kernel | dtype | fastbert-cpu ms | torch built-in ms | fastbert vs torch |   ({args.rounds} alternating rounds)")
    print("|---|---|---|---|---|")
    with fastbert.use_backend("cpu"), torch.inference_mode():
        for name, dtype, ours, theirs in cases():
            ms = alternating_medians({"ours": ours, "theirs": theirs}, args.rounds, warmup=2)
            a, b = ms["ours"], ms["theirs"]
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {a:.3g} | {b:.3g} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
