"""encoder_layer: a planned forward runs each encoder layer as one C++ call (fastbert/ops/encoder_layer.py)
that makes the kernel calls the layer's ops made, so it gives what op by op gives, bit for bit, for every
implementation it knows; it serves only while the weights and the layer's settings are the ones it was
made from."""
import importlib

import pytest
import torch

import fastbert
from fastbert import dispatch
from fastbert.ops import encoder_layer
from fastbert.testing import poison_outputs

pytest.importorskip("fastbert._C", reason="encoder_layer is a fastbert._C op")

# Head dim 32: every attention variant serves it (amx's tiles need a multiple of 32).
CONFIG = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
              max_position_embeddings=64)
SHAPES = ("padded", "unmasked", "batch of one")  # padding -> varlen (packed tokens); none -> padded kernels


def model_of(dtype, approximate="none"):
    """A small model in fp32, bf16, int8 (float32 between the GEMMs) or int8-bf16."""
    torch.manual_seed(0)
    config = fastbert.BertConfig(**CONFIG, hidden_act="gelu" if approximate == "none" else "gelu_new")
    model = fastbert.BertModel(config).eval()
    if dtype.startswith("int8"):
        model = fastbert.quantize(model)
    return model.to(torch.bfloat16 if dtype.endswith("bf16") else torch.float32)


def inputs(shape):
    b, s = (1, 9) if shape == "batch of one" else (3, 12)
    ids = torch.randint(1, CONFIG["vocab_size"], (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    if shape == "padded":
        mask[0, 5:] = 0
        mask[2, 9:] = 0
    return ids, (None if shape == "unmasked" else mask)


class Runs:
    """Counts the layer programs' calls."""

    def __init__(self, monkeypatch):
        self.count, real = 0, encoder_layer.LayerProgram.__call__

        def counted(program, *args):
            self.count += 1
            return real(program, *args)

        monkeypatch.setattr(encoder_layer.LayerProgram, "__call__", counted)


def choose(monkeypatch, variants: dict):
    """Tuning's choice replaced by `variants` (op -> variant name) where the name is usable: plans still run
    (a forced variant would turn them off)."""
    real = dispatch._choose_variant

    def chosen(op, backend, usable, key, args):
        return next((v for v in usable if v.name == variants.get(op)), None) or real(op, backend, usable, key, args)

    monkeypatch.setattr(dispatch, "_choose_variant", chosen)


def forward(model, ids, mask):
    with torch.inference_mode(), poison_outputs(), dispatch.record() as calls:
        out = model(ids, attention_mask=mask).last_hidden_state
    return out, [(c.op, c.backend, c.variant, c.skipped) for c in calls]


def check_one_call_equals_op_by_op(model, ids, mask, runs):
    op_by_op, recorded = forward(model, ids, mask)  # the first forward records the plan
    before = runs.count
    one_call, replayed = forward(model, ids, mask)
    assert runs.count - before == CONFIG["num_hidden_layers"], "the layers did not run as one call each"
    assert torch.isfinite(one_call.float()).all()
    assert torch.equal(one_call, op_by_op)
    assert replayed == recorded  # dispatch.record() sees the calls the one call stands for, with their reasons
    return recorded


FLOAT_CHOICES = {
    "onednn": {"qkv_projection": "onednn", "dense": "onednn", "attention": "fastbert", "varlen_attention": "fastbert"},
    "torch": {"qkv_projection": "torch", "dense": "torch", "attention": "torch"},
    "onednn+bias_gelu": {"dense": "onednn+bias_gelu"},
    "brgemm": {"attention": "brgemm", "varlen_attention": "brgemm"},
    "amx": {"attention": "amx", "varlen_attention": "amx"},
    "own-gemm": {"qkv_projection": "fastbert", "dense": "fastbert"},
    "onednn-rows": {"qkv_projection": "onednn-rows", "dense": "onednn-rows"},
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("choice", list(FLOAT_CHOICES))
def test_float_layers_in_one_call_equal_op_by_op(monkeypatch, choice, dtype, shape):
    if choice in ("brgemm", "amx") and dtype == "fp32":
        pytest.skip(f"{choice} attention is bfloat16 only")
    if choice == "own-gemm" and not torch.ops.fastbert_C.dense_isa_supported(2, torch.bfloat16 if dtype == "bf16" else torch.float32):
        pytest.skip("this CPU lacks the own GEMM's AVX-512 tiles: dispatch never picks it")
    choose(monkeypatch, FLOAT_CHOICES[choice])
    runs = Runs(monkeypatch)
    recorded = check_one_call_equals_op_by_op(model_of(dtype), *inputs(shape), runs)
    ran = {variant for op, _, variant, _ in recorded if op in ("dense", "qkv_projection", "attention", "varlen_attention")}
    if choice in ("brgemm", "amx") and choice not in ran:
        pytest.skip(f"{choice} attention cannot run on this machine (no AMX, or its one-time check refused it)")
    linears = {variant for op, _, variant, _ in recorded if op in ("dense", "qkv_projection")}
    if choice in ("own-gemm", "onednn-rows"):
        assert linears == {FLOAT_CHOICES[choice]["dense"]}
    elif choice == "onednn":
        assert linears == {"onednn"} and ran - linears <= {"fastbert"}  # (attention's own kernel)
    else:
        assert choice in ran


def _layer_records(model):
    """The plan records of the first encoder layer of `model`'s one recorded forward."""
    (plan,) = model.plans._plans.values()
    start, (module, end, _) = next((start, entry) for start, entry in plan.blocks.items()
                                   if entry[0] is model.encoder.layer[0])
    return plan.calls[start:end]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cuda_plans_layers_map_to_torchs_linears_and_fastberts_attention(monkeypatch, shape):
    """What the cuda backend records (linears on its one "torch" variant, attention on its one kernel,
    without a variant name) becomes a program of torch's linears and fastbert's attention kernel, which the
    C++ layer reaches through the device-dispatched ops. Checked here by relabelling a CPU plan of those very
    implementations as cuda's: the program built from it runs (on the CPU kernels) equal to op by op."""
    choose(monkeypatch, {"qkv_projection": "torch", "dense": "torch", "attention": "fastbert",
                         "varlen_attention": "fastbert"})
    model, (ids, mask) = model_of("fp32"), inputs(shape)
    with torch.inference_mode(), poison_outputs():
        op_by_op = model(ids, attention_mask=mask).last_hidden_state
    records = _layer_records(model)
    assert [(r[0][0], r[4]) for r in records][:3] == [("qkv_projection", "torch"), (records[1][0][0], "fastbert"),
                                                      ("dense", "torch")]
    as_cuda = [(signature, fn, "cuda", skipped, None if signature[0] in ("attention", "varlen_attention", "add_layer_norm")
                else variant) for signature, fn, _, skipped, variant in records]
    program = encoder_layer.program(model.encoder.layer[0], as_cuda)
    assert program.codes[:7] == [0, CONFIG["num_attention_heads"], encoder_layer.ATTENTION["fastbert"],
                                 *[encoder_layer.LINEARS["torch"]] * 4]
    # Mixed backends are not one C++ layer's calls.
    mixed = [as_cuda[0], (as_cuda[1][0], as_cuda[1][1], "cpu", {}, "fastbert"), *as_cuda[2:]]
    assert encoder_layer.program(model.encoder.layer[0], mixed) is None
    # The program's output is the layer's, op by op (the plan's own programs, built from the cpu records,
    # run the same codes).
    runs = Runs(monkeypatch)
    with torch.inference_mode(), poison_outputs():
        one_call = model(ids, attention_mask=mask).last_hidden_state
    assert runs.count == CONFIG["num_hidden_layers"] and torch.equal(one_call, op_by_op)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_layers_in_one_call_equal_op_by_op(monkeypatch, dtype, shape):
    """On a GPU (the GPU check runs it): the layers of a replayed forward run as one C++ call each, which
    launches what op by op launched and gives the same output, bit for bit."""
    if not torch.cuda.is_available() or not getattr(importlib.import_module("fastbert._C"), "WITH_CUDA", False):
        pytest.skip("needs a CUDA GPU and fastbert._C built with CUDA")
    runs = Runs(monkeypatch)
    ids, mask = inputs(shape)
    recorded = check_one_call_equals_op_by_op(model_of(dtype).cuda(), ids.cuda(), None if mask is None else mask.cuda(),
                                              runs)
    assert {backend for _, backend, _, _ in recorded} == {"cuda"}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["int8", "int8-bf16"])
@pytest.mark.parametrize("gemm", ["fastbert", "onednn"])
def test_int8_layers_in_one_call_equal_op_by_op(monkeypatch, gemm, dtype, shape):
    choose(monkeypatch, {"quantized_dense": gemm})
    runs = Runs(monkeypatch)
    recorded = check_one_call_equals_op_by_op(model_of(dtype), *inputs(shape), runs)
    gemms = {variant for op, _, variant, _ in recorded if op == "quantized_dense"}
    if gemm == "onednn" and gemms != {"onednn"}:
        pytest.skip("oneDNN's int8 GEMM cannot serve on this CPU (quantized_dense's onednn variant is refused)")
    assert gemms == {gemm}


@pytest.mark.parametrize("gemm", ["fastbert", "onednn"])
def test_int8_gemms_in_blocks_of_rows(monkeypatch, gemm):
    """quantized_dense splits a GEMM into blocks of rows that stay in cache (32 at the least): so does the one
    call, at the same rows."""
    quantized_dense = importlib.import_module("fastbert.ops.quantized_dense")  # (fastbert.ops has its function)
    monkeypatch.setattr(quantized_dense, "_cache_bytes", lambda: 1024)  # blocks of 32 rows
    choose(monkeypatch, {"quantized_dense": gemm})
    ids, mask = inputs("unmasked")  # 36 rows: two blocks
    check_one_call_equals_op_by_op(model_of("int8"), ids, mask, Runs(monkeypatch))


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_gelu_tanh_layers(monkeypatch, dtype):
    runs = Runs(monkeypatch)
    check_one_call_equals_op_by_op(model_of(dtype, approximate="tanh"), *inputs("padded"), runs)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_weight_written_in_place_is_never_served_stale(monkeypatch, dtype):
    """The one call reads packed copies of the weights: written in place, the next forward runs op by op
    (repacking them) and gives the fresh model's result; the one after runs as one call again."""
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of(dtype), inputs("padded")
    check_one_call_equals_op_by_op(model, ids, mask, runs)
    dense = model.encoder.layer[1].output.dense
    with torch.no_grad():
        (dense.weight_scale if dtype == "int8" else dense.weight).mul_(1.5)
    before = runs.count
    written, _ = forward(model, ids, mask)
    assert runs.count - before == CONFIG["num_hidden_layers"] - 1  # layer 0's weights are as they were
    fresh = model_of(dtype)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(written, forward(fresh, ids, mask)[0])
    again, _ = forward(model, ids, mask)
    assert runs.count - before == 2 * CONFIG["num_hidden_layers"] - 1 and torch.equal(again, written)


def test_attention_probabilities_run_op_by_op(monkeypatch):
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("padded")
    with torch.inference_mode():
        for _ in range(3):
            out = model(ids, attention_mask=mask, output_attentions=True)
    assert runs.count == 0 and len(out.attentions) == CONFIG["num_hidden_layers"]


def test_a_strided_layer_input_from_a_hook(monkeypatch):
    """A forward hook may hand the next layer a valid view that is not contiguous: the one call takes it too."""
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("unmasked")
    model.encoder.layer[0].register_forward_hook(
        lambda module, args, out: (out[0].transpose(0, 1).contiguous().transpose(0, 1), *out[1:]))
    with torch.inference_mode():
        outs = [model(ids).last_hidden_state for _ in range(3)]
    assert runs.count > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="20 weight slots"):
        torch.ops.fastbert_C.encoder_layer(x, None, None, None, None, None, 0, 0, [], [0] * 10, 1e-12, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.fastbert_C.encoder_layer(x.t(), None, None, None, None, None, 0, 0, [None] * 20, [0] * 10, 1e-12,
                                           False)


def test_weights_written_before_the_first_replay(monkeypatch):
    """Written between the forward that records the plan and the first that replays it, the packed copies
    are missing then: that forward runs op by op (packing them again) and the next ones as one call."""
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("padded")
    forward(model, ids, mask)
    with torch.no_grad():
        model.encoder.layer[0].intermediate.dense.weight.mul_(0.5)
    first, _ = forward(model, ids, mask)
    assert runs.count == CONFIG["num_hidden_layers"] - 1
    check = model_of("fp32")
    check.load_state_dict(model.state_dict())
    assert torch.equal(first, forward(check, ids, mask)[0])
    later, _ = forward(model, ids, mask)
    assert runs.count == 2 * CONFIG["num_hidden_layers"] - 1 and torch.equal(later, first)


def test_hooks_training_and_own_forwards_inside_a_layer_run_op_by_op(monkeypatch):
    """The one call runs no module inside the layer: a hook there, a module switched to training, or an
    instance's own forward makes that layer run op by op again."""
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("padded")
    check_one_call_equals_op_by_op(model, ids, mask, runs)
    expected, _ = forward(model, ids, mask)
    seen = []
    handle = model.encoder.layer[1].intermediate.register_forward_hook(lambda *_: seen.append(1))
    before = runs.count
    out, _ = forward(model, ids, mask)
    assert seen == [1] and runs.count - before == 1 and torch.equal(out, expected)
    handle.remove()
    global_handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    before = runs.count
    forward(model, ids, mask)
    assert runs.count == before
    global_handle.remove()
    layer_norm = model.encoder.layer[0].output.LayerNorm
    layer_norm.forward = lambda *a: (seen.append(2), torch.nn.LayerNorm.forward(layer_norm, *a))[1]
    before = runs.count
    forward(model, ids, mask)
    assert runs.count - before == 1
    del layer_norm.forward
    model.encoder.layer[1].attention.train()  # dropout 0.1 in training: the op-by-op calls differ
    before = runs.count
    forward(model, ids, mask)
    assert runs.count - before <= 1


def test_parametrized_layer_norms_and_inference_tensors_run_op_by_op(monkeypatch):
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("padded")
    torch.nn.utils.parametrize.register_parametrization(model.encoder.layer[0].output.LayerNorm, "weight",
                                                        torch.nn.Identity())
    op_by_op, _ = forward(model, ids, mask)
    assert torch.equal(forward(model, ids, mask)[0], op_by_op) and runs.count == 1  # layer 1 only
    with torch.inference_mode():
        made = model_of("fp32")  # parameters made in inference mode: inference tensors, no version counter
    first = forward(made, ids, mask)[0]
    assert torch.equal(forward(made, ids, mask)[0], first) and runs.count == 1


@pytest.mark.parametrize("setting", ["approximate", "heads", "eps"])
def test_a_layer_setting_changed_after_its_program_is_seen(monkeypatch, setting):
    """Plain attributes no hook sees: the one call checks them, and the forward gives the fresh model's
    result for the new setting."""
    runs = Runs(monkeypatch)
    model, (ids, mask) = model_of("fp32"), inputs("padded")
    check_one_call_equals_op_by_op(model, ids, mask, runs)
    layer = model.encoder.layer[1]
    if setting == "approximate":
        layer.intermediate.approximate = "tanh"
    elif setting == "heads":
        layer.attention.self.num_attention_heads = 2 * CONFIG["num_attention_heads"]
    else:
        layer.output.LayerNorm.eps = 1e-3
    changed, _ = forward(model, ids, mask)
    fresh = model_of("fp32")
    fresh.load_state_dict(model.state_dict())
    fresh_layer = fresh.encoder.layer[1]
    fresh_layer.intermediate.approximate = layer.intermediate.approximate
    fresh_layer.attention.self.num_attention_heads = layer.attention.self.num_attention_heads
    fresh_layer.output.LayerNorm.eps = layer.output.LayerNorm.eps
    assert torch.equal(changed, forward(fresh, ids, mask)[0])
    assert not torch.equal(changed, forward(model_of("fp32"), ids, mask)[0])
