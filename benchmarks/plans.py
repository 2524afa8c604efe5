"""Plans (fastbert.dispatch.Plans) on and off, alternating in one process: a model's eager inference forward
replayed with each encoder layer as one C++ call (fastbert/ops/encoder_layer.py), replayed op by op without
the ops' checks and choices, and every call checked. Medians of 20 rounds.

    .venv/bin/python benchmarks/plans.py [minilm:int8:1x16 base:bf16:1x128 ...]

Each argument is model (minilm, the bundled all-MiniLM-L6-v2; base, random BERT-base) : dtype (fp32, bf16,
int8) : batch x sequence, all tokens real.
"""
import contextlib
import statistics
import sys
import time

import torch

import fastbert
from fastbert import dispatch
from fastbert.apps.demo import minilm_dir
from fastbert.ops import encoder_layer


class NoPlans:
    """Stands in for a model's Plans: every forward runs checked."""

    def run(self, *_):
        return contextlib.nullcontext()

    def clear(self):
        pass


def load(name: str, dtype: str):
    torch.manual_seed(0)
    if name == "minilm":
        model = fastbert.BertModel.from_pretrained(minilm_dir()).eval()
    else:
        model = fastbert.BertModel(fastbert.BertConfig.base()).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    return fastbert.quantize(model) if dtype == "int8" else model


def main(specs):
    for spec in specs:
        name, dtype, shape = spec.split(":")
        b, s = map(int, shape.split("x"))
        model = load(name, dtype)
        ids = torch.randint(1000, 2000, (b, s))
        mask = torch.ones_like(ids)
        # mode -> (the model's plans, the layer programs' builder while it runs)
        modes = {"one call": (model.plans, encoder_layer.program), "op by op": (dispatch.Plans(), lambda *_: None),
                 "checked": (NoPlans(), encoder_layer.program)}
        real = encoder_layer.program
        times = {mode: [] for mode in modes}
        calls = max(1, 300 // (b * s))  # calls per timing, so that short forwards are not timer-bound
        with torch.inference_mode():
            for r in range(23):
                for mode in (modes if r % 2 else reversed(modes)):
                    model.plans, encoder_layer.program = modes[mode]
                    start = time.perf_counter()
                    for _ in range(calls):
                        model(ids, attention_mask=mask)
                    if r >= 3:  # three rounds to record plans and build programs
                        times[mode].append((time.perf_counter() - start) / calls)
        model.plans, encoder_layer.program = modes["one call"][0], real
        ms = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
        print(f"{spec}: one call a layer {ms['one call']:.2f} ms, plans op by op {ms['op by op']:.2f} ms, "
              f"checked {ms['checked']:.2f} ms: {ms['op by op'] / ms['one call']:.2f}x and "
              f"{ms['checked'] / ms['one call']:.2f}x", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["minilm:fp32:1x16", "minilm:bf16:1x16", "minilm:int8:1x16", "base:int8:1x128"])
