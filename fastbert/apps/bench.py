"""`python -m fastbert bench`: fastbert against everyone who runs BERT on this machine, side by side.

One process; for each model x dtype x shape every competitor is checked against transformers' eager
output in float32 first (fastbert.testing's table; in bf16/fp16 also within 2x of eager in that dtype),
then timed in alternating rounds (medians). The machine's GEMM rate (oneDNN, packed weights) is measured
in the same run; each row reports which fraction of it fastbert reaches, counting useful FLOPs only (real
tokens, no padding). Prints a markdown table, writes JSON and a PNG.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import fastbert
from fastbert.apps.timing import alternating_medians
from fastbert.info import cpu, cpu_line
from fastbert.quantization import fast_activation_dtype
from fastbert.testing import INT8, assert_close, rel_err

COMPETITORS = ("fastbert", "hf-eager", "hf-sdpa", "compile", "nested", "onnxruntime", "openvino", "fastbert-bf16")
DEFAULT_COMPETITORS = ("fastbert", "hf-eager", "hf-sdpa", "nested", "onnxruntime", "openvino")
SHAPES = ("1x16", "1x128", "8x128", "8x512", "ragged32")  # 1x16: one search query
MODELS = ("minilm", "base")
# int8 rows: every model's weights quantized by its own tool (fastbert.quantize, ONNX Runtime's dynamic
# quantization, OpenVINO's NNCF post-training quantization); activations and outputs in float32.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}
CALIBRATION_SEEDS = (11, 12, 13, 14)
# Idle time before each timed call where ONNX Runtime or OpenVINO take part: their worker threads keep
# spinning for a while after a call and slowed the next contender by 15-20% (BERT-base 8x128), 2x at 1x16.
# Only then. Every timed call follows an untimed call of the same contender (alternating_medians' `primed`):
# what back-to-back calls of one model see. Unprimed, a settled thread pool woke for up to 10 ms here (a
# microVM whose idle vCPUs halt), more than a short call itself, and each contender ran on caches the one
# before it had filled.
SETTLE_S = 0.3
SPINNING = ("onnxruntime", "openvino")


def settle() -> None:
    time.sleep(SETTLE_S)  # make_batch("8x128") seeds of the static-quantization calibration batches


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- inputs


def make_batch(shape: str, vocab: int, seed: int = 0):
    """input_ids, attention_mask for a named shape; `ragged32` is 32 sentences of U[16, 128] tokens."""
    g = torch.Generator().manual_seed(seed)
    if shape.startswith("ragged"):
        n = int(shape.removeprefix("ragged"))
        lengths = torch.randint(16, 129, (n,), generator=g)
    else:
        b, s = map(int, shape.split("x"))
        lengths = torch.full((b,), s)
    seq = int(lengths.max())
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    ids = torch.randint(1000, vocab, (len(lengths), seq), generator=g) * mask
    ids[:, 0] = 101  # [CLS]
    return ids, mask


def useful_flops(config: fastbert.BertConfig, mask: torch.Tensor) -> float:
    """FLOPs on real tokens: the layers' GEMMs plus attention over each sequence's own length."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    lengths = mask.sum(1).double()
    per_token = 2 * (4 * h * h + 2 * h * i)
    attention = 4 * h * float((lengths**2).sum())
    return layers * (per_token * float(lengths.sum()) + attention)


def gemm_rate(dtype: torch.dtype, device: str = "cpu", quantized: bool = False) -> float:
    """GFLOP/s (GOP/s for int8) of the machine's GEMM, measured now: at BERT-base FFN width on CPU the faster
    of the GEMMs fastbert runs (oneDNN's packed GEMM where it can serve the dtype, its float32 GEMM for bf16
    where it has no bf16 GEMM, else torch's; beside it fastbert's own, on AMX tiles where the CPU has them;
    u8 x s8 for int8), a large cuBLAS matmul on GPU."""
    from fastbert import dispatch
    from fastbert.ops import _onednn

    m, k, n = (1024, 768, 3072) if device == "cpu" else (8192, 8192, 8192)
    x, w = torch.randn(m, k).to(device, dtype), torch.randn(n, k).to(device, dtype)
    own = device == "cpu" and not dispatch.machine_reasons("cpu")  # fastbert._C's GEMMs run here
    if quantized:
        qd = sys.modules["fastbert.ops.quantized_dense"]
        # Both u8 x s8 GEMMs quantized_dense runs: oneDNN's (where its sums are exact) and the own one.
        exact_onednn = not _onednn.missing("onednn", ("qlinear_prepack", "qlinear_pointwise")) and not qd.onednn_inexact()
        q = torch.randint(0, 256, (m, k), dtype=torch.uint8)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        # Scales of a real layer's size: with scale 1 oneDNN ran at half the rate here (another code path).
        scale = torch.rand(n) * 0.01 + 1e-3
        # In the row blocks quantized_dense runs it in: whole, its float32 output spills from cache and
        # oneDNN runs at half this rate (benchmarks/RESULTS.md), which is not the machine's limit.
        step = qd.rows_per_block(n)

        def run_in_blocks(gemm):
            packed = gemm.pack(weight, None, m)
            return lambda: [gemm.run(q[r:r + step], packed, scale) for r in range(0, m, step)]

        gemms = {"own": run_in_blocks(qd.own_gemm_step(0))} if own or not exact_onednn else {}
        if exact_onednn:
            gemms["onednn"] = run_in_blocks(qd.ONEDNN_GEMM)
    elif device == "cpu" and not _onednn.missing() and not _onednn.dtype_missing((dtype,)):
        blocked = _onednn.pack(w, m)
        gemms = {"onednn": lambda: _onednn.linear(x, blocked, None)}
    elif device == "cpu" and not _onednn.missing() and dtype == torch.bfloat16:
        # dense's onednn-fp32 variant: the bf16 values through oneDNN's float32 GEMM, rounded back.
        blocked = _onednn.pack(w.float(), m)
        gemms = {"onednn-fp32": lambda: _onednn.linear(x.float(), blocked, None).to(dtype)}
    else:
        gemms = {"torch": lambda: torch.nn.functional.linear(x, w)}
    if own and not quantized and dtype in (torch.float32, torch.bfloat16):
        packed, out = torch.ops.fastbert_C.dense_pack(w), torch.empty(m, n, dtype=dtype)
        gemms["own"] = lambda: torch.ops.fastbert_C.dense_gemm(x, packed, n, k, None, 0, 0, out)
    ms = min(alternating_medians(gemms, rounds=10, device=device, warmup=2).values())
    return 2 * m * k * n / (ms / 1e3) / 1e9


# ------------------------------------------------------------------------------------ competitors


@dataclass
class Competitor:
    name: str
    run: object = None  # (ids, mask) -> last_hidden_state [B, S, H]
    unavailable: str = ""  # why it cannot run, in words
    # Where it computes in another precision than its row's: checked to that one's bound, and within 2x
    # of `naive` (transformers eager in that precision), as a row in that dtype is.
    dtype: torch.dtype | None = None
    naive: object = None


def load_models(model: str, dtype: torch.dtype, device: str = "cpu"):
    """(fastbert model, transformers eager model, transformers sdpa model, transformers eager model in
    float32: the parity reference), all but the last in `dtype`."""
    import transformers

    if model == "minilm":
        from fastbert.apps.demo import minilm_dir

        directory = minilm_dir()
        ours = fastbert.BertModel.from_pretrained(directory, dtype=torch.float32)
        hf_config = transformers.BertConfig.from_pretrained(directory)
        state = ours.state_dict()
    elif model == "base":
        directory = None
        torch.manual_seed(0)
        ours = fastbert.BertModel(fastbert.BertConfig.base()).eval()
        hf_config = transformers.BertConfig(**ours.config.to_dict())
        state = ours.state_dict()
    else:
        raise ValueError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
    hf = {}
    for impl in ("eager", "sdpa"):
        m = transformers.BertModel._from_config(transformers.BertConfig(**hf_config.to_dict()), attn_implementation=impl)
        m.load_state_dict(state, strict=False)
        hf[impl] = m.eval()
    truth = copy.deepcopy(hf["eager"]).to(device) if dtype != torch.float32 else None
    eager = hf["eager"].to(device, dtype)
    return ours.to(device, dtype), eager, hf["sdpa"].to(device, dtype), truth if truth is not None else eager


def hf_runner(model):
    return lambda ids, mask: model(input_ids=ids, attention_mask=mask).last_hidden_state


def nested_encoder(hf_model, dtype):
    """torch.nn.TransformerEncoder (nested-tensor fast path) carrying the same weights."""
    cfg = hf_model.config
    if cfg.hidden_act != "gelu":
        return None, f"hidden_act {cfg.hidden_act} (torch's fast path has exact gelu only)"
    layer = torch.nn.TransformerEncoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, dropout=0.0,
                                             activation="gelu", layer_norm_eps=cfg.layer_norm_eps, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, cfg.num_hidden_layers, enable_nested_tensor=True)
    for mine, theirs in zip(encoder.layers, hf_model.encoder.layer):
        att = theirs.attention
        with torch.no_grad():
            mine.self_attn.in_proj_weight.copy_(torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight]))
            mine.self_attn.in_proj_bias.copy_(torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias]))
            mine.self_attn.out_proj.weight.copy_(att.output.dense.weight)
            mine.self_attn.out_proj.bias.copy_(att.output.dense.bias)
            mine.norm1.load_state_dict(att.output.LayerNorm.state_dict())
            mine.linear1.load_state_dict(theirs.intermediate.dense.state_dict())
            mine.linear2.load_state_dict(theirs.output.dense.state_dict())
            mine.norm2.load_state_dict(theirs.output.LayerNorm.state_dict())
    encoder = encoder.eval().to(hf_model.device, dtype)  # built on the CPU: moved where the model runs

    def run(ids, mask):
        x = hf_model.embeddings(input_ids=ids)
        out = encoder(x, src_key_padding_mask=~mask.bool())
        return out.to_padded_tensor(0.0, x.shape) if out.is_nested else out

    return run, ""


class KeywordCall(torch.nn.Module):
    """An HF model called with keywords (positional arguments clash with use_cache), returning
    last_hidden_state: what exporters trace."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def calibration_batches(vocab: int):
    return [make_batch("8x128", vocab, seed) for seed in CALIBRATION_SEEDS]


def onnxruntime_runner(hf_model, dtype, workdir, quantized=False):
    """ONNX Runtime on the same weights, exported and fused by ORT's transformer optimizer; for int8,
    then quantized by ORT's dynamic quantization (per-channel int8 weights, as sentence-transformers'
    avx512_vnni export does)."""
    if hf_model.device.type != "cpu":
        return None, "CPU only here (onnxruntime's CPU execution provider)"
    if dtype != torch.float32:
        return None, "fp32 only (ONNX Runtime's CPU kernels have no bf16 BERT path)"
    try:
        import onnxruntime as ort
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as e:
        return None, f"not installed ({e.name}); pip install onnxruntime onnx"

    os.makedirs(workdir, exist_ok=True)
    raw, fused = os.path.join(workdir, "bert.onnx"), os.path.join(workdir, "bert-opt.onnx")
    ids, mask = make_batch("8x128", hf_model.config.vocab_size)
    # Export a copy: the exporter leaves the module it traced in a state whose outputs differ afterwards.
    torch.onnx.export(KeywordCall(copy.deepcopy(hf_model)), (ids, mask), raw, input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"},
                                    "last_hidden_state": {0: "b", 1: "s"}})
    cfg = hf_model.config
    optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size).save_model_to_file(fused)
    if quantized:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        int8 = os.path.join(workdir, "bert-opt-int8.onnx")
        # ORT's fused ops (com.microsoft domain) give the quantizer no value types: every tensor is float.
        quantize_dynamic(fused, int8, weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        fused = int8
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(fused, options, providers=["CPUExecutionProvider"])

    def run(ids, mask):
        out = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        return torch.from_numpy(out)

    return run, ""


def openvino_runner(hf_model, dtype, quantized=False, calibration=None):
    """OpenVINO on the same weights (what Intel-CPU users and sentence-transformers' backend="openvino"
    run): converted from the transformers model, bf16 or f32 inference precision; for int8, quantized
    by NNCF's post-training quantization on `calibration` batches ((ids, mask) pairs; default
    calibration_batches) with model_type TRANSFORMER."""
    if hf_model.device.type != "cpu":
        return None, "CPU only here"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, "fp32, bf16 and int8 only"
    try:
        import openvino as ov
    except ImportError as e:
        return None, f"not installed ({e.name}); pip install openvino"
    example = make_batch("8x128", hf_model.config.vocab_size)
    model = ov.convert_model(KeywordCall(copy.deepcopy(hf_model).float()), example_input=example,
                             input=[("input_ids", [-1, -1], ov.Type.i64), ("attention_mask", [-1, -1], ov.Type.i64)])
    if quantized:
        try:
            import nncf
        except ImportError as e:
            return None, f"not installed ({e.name}); pip install nncf"
        batches = calibration or calibration_batches(hf_model.config.vocab_size)
        data = nncf.Dataset(batches, lambda b: {"input_ids": b[0].numpy(), "attention_mask": b[1].numpy()})
        model = nncf.quantize(model, data, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(batches))
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY"}
    if not quantized:  # int8: OpenVINO's own choice for the layers it keeps in float (bf16 on AMX, else f32)
        config["INFERENCE_PRECISION_HINT"] = "bf16" if dtype == torch.bfloat16 else "f32"
    compiled = ov.Core().compile_model(model, "CPU", config)

    def run(ids, mask):
        return torch.from_numpy(compiled({"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0].copy())

    return run, ""


def build_competitors(names, ours, eager, sdpa, dtype, workdir, quantized=False) -> list[Competitor]:
    """The competitors in `dtype`; with `quantized` (int8 rows), fastbert, onnxruntime and openvino run
    int8 models (activations in fast_activation_dtype() where the engine can), transformers float32, and
    fastbert-bf16 the fastbert model in bfloat16."""
    out = []
    for name in names:
        try:
            if name == "fastbert":
                model = fastbert.quantize(copy.deepcopy(ours)).to(fast_activation_dtype()) if quantized else ours
                out.append(Competitor(name, lambda ids, mask, m=model: m(ids, attention_mask=mask).last_hidden_state))
            elif name == "fastbert-bf16":
                model = copy.deepcopy(ours).to(torch.bfloat16)
                out.append(Competitor(name, lambda ids, mask, m=model: m(ids, attention_mask=mask).last_hidden_state,
                                      dtype=torch.bfloat16, naive=hf_runner(copy.deepcopy(eager).to(torch.bfloat16))))
            elif name == "hf-eager":
                out.append(Competitor(name, hf_runner(eager)))
            elif name == "hf-sdpa":
                out.append(Competitor(name, hf_runner(sdpa)))
            elif name == "compile":
                # A fresh dynamo cache per model and dtype: transformers' models share one forward
                # wrapper, and past the recompile limit dynamo would quietly run it eager (and eager
                # would be timed as "compile"); past it, fail instead.
                torch._dynamo.reset()
                torch._dynamo.config.fail_on_recompile_limit_hit = True
                out.append(Competitor(name, hf_runner(torch.compile(sdpa, dynamic=False))))
            elif name == "nested":
                run, why = nested_encoder(eager, dtype)
                out.append(Competitor(name, run, why))
            elif name == "onnxruntime":
                run, why = onnxruntime_runner(eager, dtype, workdir, quantized)
                out.append(Competitor(name, run, why))
            elif name == "openvino":
                run, why = openvino_runner(eager, dtype, quantized)
                out.append(Competitor(name, run, why))
            else:
                raise ValueError(f"unknown competitor {name!r} (known: {', '.join(COMPETITORS)})")
        except ValueError:
            raise
        except Exception as e:  # a competitor that fails to build is reported, not fatal
            out.append(Competitor(name, None, f"failed to build: {type(e).__name__}: {e}"[:200]))
    return out


# -------------------------------------------------------------------------------------- measuring


@dataclass
class Row:
    model: str
    dtype: str
    shape: str
    tokens: int
    padded_tokens: int
    ms: dict = field(default_factory=dict)  # competitor -> median ms
    skipped: dict = field(default_factory=dict)  # competitor -> reason
    errors: dict = field(default_factory=dict)  # competitor -> rel err of last_hidden_state vs transformers float32
    gflop: float = 0.0
    gemm_fraction: float = 0.0  # fastbert's useful FLOP/s over the oneDNN GEMM rate


def measure(timed: list[Competitor], reference: Competitor, ids, mask, dtype, rounds: int, device: str = "cpu",
            naive: Competitor | None = None, quantized: bool = False):
    """Check each competitor against `reference` (float32) at real tokens, within the table's bound for
    `dtype` (kind "matmul": a model's output carries its GEMMs' and attention's error) and, given `naive`
    (transformers eager in a lower `dtype`), within 2x of its error; int8 models within the table's int8
    row. Then time alternating rounds. Returns medians, reasons for the skipped, and each checked
    competitor's rel err."""
    real = mask.bool()
    ms, skipped, errors, live = {}, {}, {}, []
    with torch.inference_mode():
        truth = reference.run(ids, mask)[real].cpu()
        plain = naive.run(ids, mask)[real].cpu() if naive is not None else None
        for c in timed:
            if c.run is None:
                skipped[c.name] = c.unavailable
                continue
            try:
                out = c.run(ids, mask)
                c.run(ids, mask)  # second warm-up run
            except Exception as e:
                skipped[c.name] = f"failed: {type(e).__name__}: {e}"[:200]
                continue
            got = out[real].cpu().double()
            errors[c.name] = rel_err(got, truth.double())
            try:
                if quantized:
                    assert torch.isfinite(got).all() and errors[c.name] <= INT8.checkpoint_rel_err, (
                        f"rel err {errors[c.name]:.4f} > the int8 row's {INT8.checkpoint_rel_err}")
                else:
                    # In float64 (an engine may hand bf16 results back in float32), held to the dtype it
                    # computes in (fastbert-bf16 beside float32 rows: bfloat16's).
                    own_naive = plain if c.naive is None else c.naive(ids, mask)[real].cpu()
                    assert_close(got, truth, c.dtype or dtype, "matmul", naive=own_naive, name="last_hidden_state")
            except AssertionError as e:
                skipped[c.name] = f"output differs from transformers eager (float32): {e}"[:300]
                continue
            live.append(c)
        # Warmed up by the parity runs above.
        spinning = any(c.name in SPINNING for c in live)
        ms = alternating_medians({c.name: (lambda c=c: c.run(ids, mask)) for c in live}, rounds, device, warmup=0,
                                 before=settle if spinning else None, primed=True)
    return ms, skipped, errors


# -------------------------------------------------------------------------------------- reporting


def markdown(rows: list[Row], names: list[str], rates: dict, backend: str | None = None) -> str:
    others = [n for n in names if n != "fastbert"]
    head = ["model", "dtype", "shape", "tokens (real/padded)", *[f"{n} ms" for n in names],
            *[f"vs {n}" for n in others], "fastbert % of GEMM rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, r.dtype, r.shape, f"{r.tokens}/{r.padded_tokens}"]
        cells += [f"{r.ms[n]:.1f}" if n in r.ms else "n/a" for n in names]
        cells += [f"{r.ms[n] / r.ms['fastbert']:.2f}x" if n in r.ms and "fastbert" in r.ms else "n/a" for n in others]
        cells.append(f"{100 * r.gemm_fraction:.0f}%" if r.gemm_fraction else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(cpu_line() + f", {torch.get_num_threads()} threads; each timed call right after an untimed one "
                 "of the same contender" + (f"; fastbert's ops forced to the {backend} backend" if backend else ""))
    lines.append("GEMM rate (CPU: the faster of the GEMMs fastbert runs at 1024x768x3072, int8 in quantized_dense's "
                 "row blocks; GPU: cuBLAS 8192^3; same run): "
                 + ", ".join(f"{k} {v:.0f} {'GOP' if k == 'int8' else 'GFLOP'}/s" for k, v in rates.items()))
    timed_int8 = {n for r in rows if r.dtype == "int8" for n in r.ms}
    between = {"fastbert": str(fast_activation_dtype()).removeprefix("torch."), "openvino": "its own choice",
               "onnxruntime": "float32"}
    if timed_int8 & between.keys():
        lines.append("int8 rows compute between their int8 GEMMs in: "
                     + ", ".join(f"{n} {how}" for n, how in between.items() if n in timed_int8))
    for r in rows:
        if r.dtype == "int8":
            lines.append(f"- rel err vs transformers float32, {r.model} int8 {r.shape}: "
                         + ", ".join(f"{n} {e:.4f}" for n, e in r.errors.items()))
    notes = {(n, why) for r in rows for n, why in r.skipped.items()}
    for n, why in sorted(notes):
        lines.append(f"- {n} n/a: {why}")
    return "\n".join(lines)


def chart(rows: list[Row], names: list[str], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if os.path.exists(path):
            os.remove(path)  # an earlier run's chart would pass for this one's
        return "matplotlib not installed: no chart"
    others = [n for n in names if n != "fastbert"]
    labels = [f"{r.model}\n{r.dtype}\n{r.shape}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    width = 0.8 / max(len(others), 1)
    for k, n in enumerate(others):
        values = [r.ms[n] / r.ms["fastbert"] if n in r.ms and "fastbert" in r.ms else 0 for r in rows]
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=f"vs {n}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("fastbert speedup (x)")
    ax.set_title("fastbert vs others (higher is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(models=("minilm", "base"), dtypes=("fp32",), shapes=SHAPES, competitors=DEFAULT_COMPETITORS, rounds=7,
        out_dir="benchmarks/out", backend=None, device="cpu", keep_freed_memory=False) -> list[Row]:
    os.makedirs(out_dir, exist_ok=True)
    if keep_freed_memory:  # process-wide: every competitor runs with it
        from fastbert.memory import keep_freed_memory as keep

        log("malloc keeps freed memory (fastbert.keep_freed_memory): " + ("on" if keep() else "not available (not glibc, or glibc refused it)"))
    rates = {d: gemm_rate(DTYPES[d], device, quantized=d == "int8") for d in dtypes}
    log(cpu_line())
    log("GEMM rate: " + ", ".join(f"{k} {v:.0f} {'GOP' if k == 'int8' else 'GFLOP'}/s" for k, v in rates.items()))
    rows = []
    for model in models:
        for dname in dtypes:
            dtype = DTYPES[dname]
            log(f"[{model} {dname}] loading models and building competitors ...")
            quantized = dname == "int8"
            ours, eager, sdpa, truth = load_models(model, dtype, device)
            built = build_competitors(competitors, ours, eager, sdpa, dtype, os.path.join(out_dir, f"onnx-{model}"),
                                      quantized)
            # Parity: against eager in float32 (not timed); in a lower dtype also eager in that dtype, the
            # same-dtype PyTorch that fastbert.testing allows a kernel 2x of.
            reference = Competitor("transformers eager float32", hf_runner(truth))
            naive = Competitor("transformers eager", hf_runner(eager)) if truth is not eager else None
            for shape in shapes:
                ids, mask = (t.to(device) for t in make_batch(shape, ours.config.vocab_size))
                log(f"[{model} {dname} {shape}] checking parity and timing {rounds} alternating rounds ...")
                with fastbert.use_backend(backend) if backend else contextlib.nullcontext():
                    ms, skipped, errors = measure(built, reference, ids, mask, dtype, rounds, device, naive, quantized)
                row = Row(model, dname, shape, int(mask.sum()), mask.numel(), ms, skipped, errors,
                          useful_flops(ours.config, mask) / 1e9)
                if "fastbert" in ms:
                    row.gemm_fraction = row.gflop / (ms["fastbert"] / 1e3) / rates[dname]
                rows.append(row)
                log("    " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    names = list(competitors)
    table = markdown(rows, names, rates, backend)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cpu": cpu(),
            "gemm_gflops": rates, "keep_freed_memory": keep_freed_memory, "backend": backend,
            "command": " ".join(sys.argv)}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": [r.__dict__ for r in rows]}, f, indent=2)
    png = chart(rows, names, os.path.join(out_dir, "bench.png"))
    print(table)
    print(f"\nJSON: {os.path.join(out_dir, 'bench.json')}; chart: {png}")
    return rows
