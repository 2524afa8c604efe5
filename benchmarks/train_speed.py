"""One training step (forward + backward) of the BERT-base encoder: fastbert against transformers
(sdpa), the same weights, alternating rounds, medians. fp32, and bf16 under torch.autocast. Dropout
as configured (0.1) on both; the gradients are first checked against transformers' with dropout off.

    .venv/bin/python benchmarks/train_speed.py [--shape 8x128] [--rounds 7]
"""
import argparse

import torch
import transformers

import fastbert
from fastbert.apps.bench import make_batch
from fastbert.apps.timing import alternating_medians


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8x128")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    ours = fastbert.BertModel(fastbert.BertConfig.base())
    hf = transformers.BertModel._from_config(transformers.BertConfig(**ours.config.to_dict()), attn_implementation="sdpa")
    hf.load_state_dict(ours.state_dict())
    ids, mask = make_batch(args.shape, ours.config.vocab_size)
    print(f"| BERT-base train step {args.shape} | fastbert ms | transformers sdpa ms | speedup | grad rel err |   "
          f"({args.rounds} alternating rounds)")
    print("|---|---|---|---|---|")
    for name, dtype in (("fp32", torch.float32), ("bf16 autocast", torch.bfloat16)):
        def step(model):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = model(ids, attention_mask=mask)[0]
            loss = (out.float() * mask[..., None]).pow(2).mean()  # pad positions differ by design
            loss.backward()

        grads = {}
        for key, model in (("ours", ours), ("hf", hf)):  # dropout off: both compute the same function
            model.eval().zero_grad(set_to_none=True)
            step(model)
            grads[key] = torch.cat([p.grad.flatten().double() for _, p in sorted(model.named_parameters())
                                    if p.grad is not None])  # the pooler is not in the loss
        err = float((grads["ours"] - grads["hf"]).norm() / grads["hf"].norm())
        for model in (ours, hf):
            model.train()
        ms = alternating_medians({"ours": lambda: step(ours), "hf": lambda: step(hf)}, args.rounds,
                                 before=lambda: (ours.zero_grad(set_to_none=True), hf.zero_grad(set_to_none=True)))
        a, b = ms["ours"], ms["hf"]
        print(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.2f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
