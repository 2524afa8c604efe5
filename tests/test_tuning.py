"""Variants and per-machine tuning: dispatch measures a backend's implementations of an op once per kind
of call, keeps the fastest in a cache file per machine, and lets users force or switch off the choice."""
import json
import re
import sys
import threading
import time

import pytest
import torch

import fastbert
from fastbert import dispatch, ops, tuning
from fastbert.testing import assert_close
from grids import skip_unless_runnable, skip_unless_variant


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Measuring on, into a cache directory of this test's own."""
    monkeypatch.setenv("FASTBERT_CPU_TUNE", "1")
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    tuning.forget()
    dispatch._picked.clear()
    yield tmp_path
    tuning.forget()
    dispatch._picked.clear()


def _stand_ins(calls):
    """bias_gelu's cpu backend replaced by two variants: "slow" (the static default) and "fast"."""
    def variant(name, pause):
        def fn(x, bias, approximate):
            calls.append(name)
            torch.rand(1)  # draws, as a dropout seed would
            time.sleep(pause)
            return torch.nn.functional.gelu(x + bias, approximate=approximate)
        return dispatch.Variant(name, fn)

    dispatch.register("bias_gelu", "cpu", dispatch.Support(("cpu",), (torch.float32,)))(lambda *a: None)
    dispatch.register_variants("bias_gelu", "cpu", (variant("slow", 0.004), variant("fast", 0.0)),
                               lambda x, *_: (f"m{dispatch.size_class(x.shape[0])}",))


def test_the_fastest_variant_is_measured_once_and_cached(tuned, monkeypatch):
    x, bias = torch.randn(6, 8), torch.randn(8)
    with dispatch.scratch_registry():
        ran = []
        _stand_ins(ran)
        with dispatch.record() as calls:
            first = ops.bias_gelu(x, bias)
        assert [(c, c.variant) for c in calls] == [(("bias_gelu", "cpu"), "fast")]
        # Measured both after a warm-up call each, in alternating rounds of an untimed and a timed call each,
        # then ran fast.
        assert ran == ["slow", "fast"] + ["slow", "slow", "fast", "fast"] * tuning.REPEATS + ["fast"]
        assert torch.equal(first, torch.nn.functional.gelu(x + bias))
        saved = json.loads((tuned / "variants.json").read_text())[tuning.machine()]
        (key, entry), = saved.items()
        assert key == "bias_gelu cpu float32 infer m8" and entry["choice"] == "fast"
        assert entry["ms"]["slow"] > entry["ms"]["fast"] and entry["ms"]["slow"] >= 4

        # Another process (here: forgetting what this one remembers) reads the file and measures nothing.
        tuning.forget()
        dispatch._picked.clear()
        monkeypatch.setattr(tuning, "_medians_ms", lambda *a: pytest.fail("measured again"))
        ran.clear()
        ops.bias_gelu(torch.randn(5, 8), bias)  # 5 rows: the same size class as 6
        assert ran == ["fast"]
        # Another size class is a new measurement.
        with pytest.raises(pytest.fail.Exception, match="measured again"):
            ops.bias_gelu(torch.randn(40, 8), bias)


def test_threads_calling_an_op_at_once_measure_it_once(tuned, monkeypatch):
    """Each thread measured the op beside the other threads' trials and ran its own pick: one input gave
    outputs that differed thread to thread (a bf16 model: rel err 1.3e-3)."""
    measured, medians = [], tuning._medians_ms
    monkeypatch.setattr(tuning, "_medians_ms", lambda *a, **k: measured.append(a[0].keys()) or medians(*a, **k))
    x, bias = torch.randn(6, 8), torch.randn(8)
    start, picks, failures = threading.Barrier(4), {}, []

    def call(thread):
        try:
            start.wait()
            with dispatch.record() as calls:
                ops.bias_gelu(x, bias)
            picks[thread] = [c.variant for c in calls]
        except Exception as e:  # noqa: BLE001  (reported below, in the test's thread)
            failures.append(e)

    with dispatch.scratch_registry():
        _stand_ins([])
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
    assert len(measured) == 1, f"measured {len(measured)} times"
    assert len(picks) == 4 and {v for p in picks.values() for v in p} == {"fast"}  # (record() sees every thread)


def test_an_entry_that_measured_other_variants_is_measured_again(tuned):
    x, bias = torch.randn(6, 8), torch.randn(8)
    with dispatch.scratch_registry():
        ran = []
        _stand_ins(ran)
        # Cached before "fast" existed (an older fastbert, or a CPU feature it lacked then): "slow" alone.
        tuning._store("bias_gelu cpu float32 infer m8", {"choice": "slow", "ms": {"slow": 4.0}})
        tuning.forget()
        with dispatch.record() as calls:
            ops.bias_gelu(x, bias)
        assert calls[0].variant == "fast" and ran.count("slow") == 2 * tuning.REPEATS + 1
        assert set(tuning.entries()["bias_gelu cpu float32 infer m8"]["ms"]) == {"slow", "fast"}
        # Measured with one more than this call may use (a kind of call the key does not tell apart):
        # the fastest of those it may use, measured nothing.
        tuning._store("bias_gelu cpu float32 infer m16", {"choice": "gone", "ms": {"slow": 4.0, "fast": 2.0, "gone": 1.0}})
        tuning.forget()
        dispatch._picked.clear()
        ran.clear()
        with dispatch.record() as calls:
            ops.bias_gelu(torch.randn(12, 8), bias)
        assert calls[0].variant == "fast" and ran == ["fast"]


def test_measuring_leaves_the_random_stream_as_it_was(tuned):
    x, bias = torch.randn(6, 8), torch.randn(8)
    with dispatch.scratch_registry():
        _stand_ins([])
        torch.manual_seed(7)
        ops.bias_gelu(x, bias)  # measures: 2 x (1 + 2 REPEATS) trial calls
        after_measuring = torch.rand(4)
        torch.manual_seed(7)
        ops.bias_gelu(x, bias)  # cached
        assert torch.equal(torch.rand(4), after_measuring)


def test_ops_that_read_weights_time_inference_with_the_caches_swept(tuned, monkeypatch):
    # A model's forward meets each layer's weights out of cache, its Python path warm; back-to-back trials
    # would find the weights in L2. So every timed inference call of such an op comes after an untimed call
    # of the same variant (its memory back from the allocator), an eviction and a call of the same variant on
    # no rows, and its entries say so.
    log = []
    monkeypatch.setattr(tuning, "evict", lambda sweep: log.append(("sweep", sweep.numel())))

    def variant(name):
        def fn(x, bias, approximate):
            log.append((name, x.shape[0]))
            return torch.nn.functional.gelu(x + bias, approximate=approximate)
        return dispatch.Variant(name, fn)

    bias = torch.randn(8)
    with dispatch.scratch_registry():
        dispatch.register("bias_gelu", "cpu", dispatch.Support(("cpu",), (torch.float32,)))(lambda *a: None)
        dispatch.register_variants("bias_gelu", "cpu", (variant("a"), variant("b")),
                                   lambda x, *_: (f"m{dispatch.size_class(x.shape[0])}",), weights=True)
        ops.bias_gelu(torch.randn(6, 8), bias)
        assert log[:2] == [("a", 6), ("b", 6)]  # the warm-up calls
        timed = [log[i:i + 4] for i in range(2, len(log) - 1, 4)]
        assert len(timed) == 2 * tuning.REPEATS and log[-1] in (("a", 6), ("b", 6))  # (the call itself)
        assert [round_[0][0] for round_ in timed] == ["a", "b"] * tuning.REPEATS  # alternating
        for before, (sweep, size), (empty, rows), call in timed:
            assert sweep == "sweep" and size * 4 >= min(tuning.cache_bytes(3) or 0, tuning.EVICT_CAP)
            assert before == call == (empty, 6) and rows == 0
        assert set(tuning.entries()) == {"bias_gelu cpu float32 infer cold m8"}
        log.clear()
        x = torch.randn(6, 8, requires_grad=True)
        ops.bias_gelu(x, bias).sum().backward()  # training: its activations are as hot as the trials'
        assert log and all(kind != "sweep" for kind, _ in log) and "bias_gelu cpu float32 train m8" in tuning.entries()
        rounds = log[2:-1]  # after the warm-ups, before the call itself: untimed and timed calls in pairs
        assert len(rounds) == 4 * tuning.REPEATS and rounds[0::2] == rounds[1::2]


def test_without_tuning_the_static_default_runs(tuned, monkeypatch):
    monkeypatch.setenv("FASTBERT_CPU_TUNE", "0")
    with dispatch.scratch_registry():
        ran = []
        _stand_ins(ran)
        with dispatch.record() as calls:
            ops.bias_gelu(torch.randn(6, 8), torch.randn(8))
        assert ran == ["slow"] and calls[0].variant == "slow"
    assert not (tuned / "variants.json").exists()


def fp32_dense_variants(gelu: bool = False) -> tuple[str, ...]:
    """The dense variants that can serve a float32 call (with GELU) here (onednn-fp32 serves bf16 only,
    onednn+bias_gelu GELU calls only)."""
    f = dispatch.Facts(("cpu",), (torch.float32,), gelu=gelu)
    return tuple(v.name for v in dispatch.usable_variants("dense", "cpu", f)[0])


def test_forced_variants_run_or_say_why_not(monkeypatch):
    skip_unless_runnable("dense", "cpu", torch.float32)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    for name in fp32_dense_variants(gelu=True):
        with dispatch.use_variant("dense", name), dispatch.record() as calls:
            y = ops.dense(x, w, b, "gelu")
        assert calls[0].variant == name
        assert_close(y, torch.nn.functional.gelu(x.double() @ w.double().T + b.double()), torch.float32, "matmul")
    monkeypatch.setenv("FASTBERT_VARIANT_DENSE", "torch")
    with dispatch.record() as calls:
        ops.dense(x, w, b)
    assert calls[0].variant == "torch"
    with dispatch.use_variant("dense", "cublas"), pytest.raises(
            dispatch.BackendUnavailable, match=re.escape("has only " + ", ".join(dispatch.variant_names("dense", "cpu")))):
        ops.dense(x, w, b)
    if "onednn" in fp32_dense_variants():  # onednn-fp32 serves bf16 only: forcing it on float32 says so
        with dispatch.use_variant("dense", "onednn-fp32"), pytest.raises(dispatch.BackendUnavailable, match="bfloat16 only"):
            ops.dense(x, w, b)
    if "onednn" in fp32_dense_variants():  # onednn+bias_gelu serves GELU calls only: forcing it on others says so
        with dispatch.use_variant("dense", "onednn+bias_gelu"), pytest.raises(dispatch.BackendUnavailable, match="GELU"):
            ops.dense(x, w, b)
    q = torch.randn(2, 2, 8, 16)
    with dispatch.use_variant("attention", "torch"), pytest.raises(dispatch.BackendUnavailable, match="dropout"):
        ops.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="unknown op"):
        with dispatch.use_variant("densee", "torch"):
            pass
    # A name no backend of the op has (a typo) is an error also where the backend that runs has no variants:
    # it was ignored without a word.
    monkeypatch.setenv("FASTBERT_VARIANT_ADD_LAYER_NORM", "bogus")
    with pytest.raises(dispatch.BackendUnavailable, match="'bogus' was forced \\(FASTBERT_VARIANT_ADD_LAYER_NORM\\) "
                                                          "but no backend has it \\(add_layer_norm has no variants\\)"):
        ops.add_layer_norm(x, x, torch.ones(16), torch.zeros(16), 1e-12)
    with dispatch.use_backend("reference"), dispatch.use_variant("dense", "bogus"), pytest.raises(
            dispatch.BackendUnavailable, match="'bogus' was forced \\(use_variant\\(\\)\\) but no backend has it \\(.*torch"):
        ops.dense(x, w, b)
    # A model with padding asks whether varlen_attention can serve before it unpads: a forced variant that
    # cannot is named there too (the model ran padded attention instead, without a word).
    monkeypatch.delenv("FASTBERT_VARIANT_ADD_LAYER_NORM")
    model = fastbert.BertModel(fastbert.BertConfig(vocab_size=50, hidden_size=32, num_attention_heads=2,
                                                   num_hidden_layers=1, intermediate_size=64)).eval()
    with dispatch.use_variant("varlen_attention", "bogus"), pytest.raises(
            dispatch.BackendUnavailable, match="varlen_attention: variant 'bogus' was forced"):
        model(torch.randint(0, 50, (2, 6)), attention_mask=torch.tensor([[1] * 6, [1] * 3 + [0] * 3]))


def test_training_calls_are_measured_with_their_backward(tuned):
    skip_unless_runnable("dense", "cpu", torch.float32)
    x = torch.randn(64, 32, requires_grad=True)
    w, b = torch.randn(48, 32, requires_grad=True), torch.randn(48, requires_grad=True)
    with dispatch.record() as calls:
        y = ops.dense(x, w, b)
    y.sum().backward()
    assert x.grad is not None and calls[0].variant in fp32_dense_variants()
    (key, entry), = tuning.entries().items()
    assert key == "dense cpu float32 train m64 k32 n48 none" and entry["choice"] == calls[0].variant
    assert set(entry["ms"]) == set(fp32_dense_variants())
    assert_close(x.grad, torch.ones(64, 48, dtype=torch.float64) @ w.detach().double(), torch.float32, "grad")


def test_a_variant_that_differs_only_in_its_backward_is_timed_for_training_only(tuned):
    # onednn+torch_backward runs onednn's code forward: timed beside it for inference, it won or lost by noise,
    # and dispatch.record() then named the training variant for an inference call.
    ran = []

    def variant(name, pause, training_only=False):
        def fn(x, bias, approximate):
            ran.append(name)
            time.sleep(pause)
            return torch.nn.functional.gelu(x + bias, approximate=approximate)
        return dispatch.Variant(name, fn, training_only=training_only)

    bias = torch.randn(8)
    with dispatch.scratch_registry():
        dispatch.register("bias_gelu", "cpu", dispatch.Support(("cpu",), (torch.float32,)))(lambda *a: None)
        dispatch.register_variants("bias_gelu", "cpu", (
            variant("slow", 0.004), variant("fast", 0.0), variant("fast+backward", 0.0, training_only=True)),
            lambda x, *_: (f"m{dispatch.size_class(x.shape[0])}",))
        with dispatch.record() as calls:
            ops.bias_gelu(torch.randn(6, 8), bias)
        assert "fast+backward" not in ran and calls[0].variant == "fast"
        assert set(tuning.entries()["bias_gelu cpu float32 infer m8"]["ms"]) == {"slow", "fast"}
        ran.clear()
        x = torch.randn(6, 8, requires_grad=True)
        ops.bias_gelu(x, bias).sum().backward()
        assert "fast+backward" in ran
        assert set(tuning.entries()["bias_gelu cpu float32 train m8"]["ms"]) == {"slow", "fast", "fast+backward"}
        # Forced, it serves inference too.
        ran.clear()
        with dispatch.use_variant("bias_gelu", "fast+backward"), torch.no_grad():
            ops.bias_gelu(torch.randn(6, 8), bias)
        assert ran == ["fast+backward"]


def test_the_variants_whose_forward_is_another_ones_are_training_only():
    for op in ("dense", "qkv_projection"):
        flagged = {v.name for v in dispatch._VARIANTS[(op, "cpu")].options if v.training_only}
        assert flagged == {"onednn+torch_backward"}, (op, flagged)


def test_measuring_a_training_call_leaves_the_callers_graph_whole(tuned):
    """A weight that is also an ancestor of the input (a decoder tied to the embeddings), and a call inside
    a checkpointed region: the trials' backward must not free the caller's graph, nor add to what the
    region saved (the recomputation, finding the choice made, runs no trials)."""
    skip_unless_runnable("dense", "cpu", torch.float32)
    from torch.utils.checkpoint import checkpoint

    ids = torch.randint(0, 40, (6,))
    w, b = torch.randn(40, 16, requires_grad=True), torch.randn(40, requires_grad=True)
    x = torch.nn.functional.embedding(ids, w).tanh()
    ops.dense(x, w, b).sum().backward()
    expected = torch.autograd.grad(torch.nn.functional.linear(torch.nn.functional.embedding(ids, w).tanh(), w, b).sum(), w)[0]
    assert_close(w.grad, expected.double(), torch.float32, "grad")
    w.grad = None
    x = torch.randn(20, 16, requires_grad=True)  # another size class: measured inside the region
    checkpoint(lambda t: ops.dense(t, w, b).tanh(), x, use_reentrant=False).sum().backward()
    assert_close(x.grad, torch.autograd.grad(torch.nn.functional.linear(x, w, b).tanh().sum(), x)[0].double(),
                 torch.float32, "grad")
    assert set(tuning.entries()) == {"dense cpu float32 train m8 k16 n40 none", "dense cpu float32 train m32 k16 n40 none"}


def test_a_masked_lm_trains_while_its_ops_are_measured(tuned, monkeypatch):
    """The decoder tied to the word embeddings: the case that crashed pretraining on a fresh machine."""
    skip_unless_runnable("dense", "cpu", torch.float32)
    config = fastbert.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fastbert.BertForMaskedLM(config).train()
    ids = torch.randint(1, 120, (2, 9))

    def decoder_grad():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return model.bert.embeddings.word_embeddings.weight.grad.clone()

    measured = decoder_grad()
    assert any(key.startswith("dense cpu float32 train") for key in tuning.entries())
    monkeypatch.setenv("FASTBERT_CPU_TUNE", "0")
    assert_close(measured, decoder_grad().double(), torch.float32, "grad")


def test_a_cache_file_of_another_shape_is_ignored(tuned):
    """Also one whose arrays nest past Python's stack, or whose times are past float's range: those raised
    out of every forward (RecursionError, OverflowError)."""
    skip_unless_runnable("dense", "cpu", torch.float32)
    from fastbert.info import variants_report

    key = "dense cpu float32 infer cold m4 k16 n8 none"
    for mine in (None, [1], {key: "onednn", key.replace("m4", "m5"): {"choice": "torch", "ms": {"torch": "x"}}},
                 "[" * 200_000, {key: {"choice": "torch", "ms": {name: 10**400 for name in fp32_dense_variants()}}}):
        (tuned / "variants.json").write_text(mine if isinstance(mine, str) else json.dumps({tuning.machine(): mine}))
        tuning.forget()
        dispatch._picked.clear()
        with torch.no_grad():
            ops.dense(torch.randn(4, 16), torch.randn(8, 16), None)
        assert "dense cpu float32 infer cold m4 k16 n8 none" in "\n".join(variants_report())
        assert all(isinstance(e, dict) for e in json.loads((tuned / "variants.json").read_text())[tuning.machine()].values())


def test_two_processes_measuring_at_once_keep_each_others_entries(tuned):
    import subprocess

    code = ("import sys, time; from fastbert import tuning\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # both start storing at once\n"
            "for i in range(200): tuning._store(f'{sys.argv[1]} {i}', {'choice': 'torch', 'ms': {'torch': 1.0}})")
    start = str(time.time() + 8)
    runs = [subprocess.Popen([sys.executable, "-c", code, name, start]) for name in ("a", "b")]
    assert [r.wait(timeout=120) for r in runs] == [0, 0]
    tuning.forget()
    assert len(tuning.entries()) == 400
    assert not [p for p in tuned.iterdir() if p.name.startswith(".variants-")]  # no temporary file left


def test_an_unknown_tuning_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("FASTBERT_CPU_TUNE", "off")
    with pytest.raises(ValueError, match="FASTBERT_CPU_TUNE must be 0 .* or 1 .*, got 'off'"):
        tuning.enabled()


def test_a_model_tuned_on_this_machine_gives_the_untuned_numbers(tuned):
    skip_unless_runnable("attention", "cpu", torch.float32)
    config = fastbert.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=64)
    model = fastbert.BertModel(config).eval()
    ids, mask = torch.randint(0, 300, (3, 20)), torch.ones(3, 20, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.inference_mode():
        tuned_out = model(ids, attention_mask=mask).last_hidden_state
        with fastbert.use_backend("reference"):
            ref = model(ids, attention_mask=mask).last_hidden_state
    measured = tuning.entries()
    assert {key.split()[0] for key in measured} >= {"qkv_projection", "dense"}
    real = mask.bool()  # padding positions: fastbert leaves zeros where the reference computes garbage
    assert_close(tuned_out[real], ref[real].double(), torch.float32, "matmul")


def test_only_the_chosen_variant_keeps_prepared_weights(tuned, monkeypatch):
    skip_unless_runnable("dense", "cpu", torch.float32)
    # The trials run for real (onednn and fastbert pack their weight into `prepared`), then torch is declared
    # faster.
    real = tuning._medians_ms
    monkeypatch.setattr(tuning, "_medians_ms", lambda candidates, *rest: {
        name: 1.0 if name == "torch" else 5.0 for name in real(candidates, *rest)})
    prepared = ops.PreparedWeights()
    with torch.no_grad(), dispatch.record() as calls:
        ops.dense(torch.randn(256, 64), torch.randn(96, 64), torch.randn(96), prepared=prepared)
    assert {"onednn", "torch"} <= set(fp32_dense_variants()) and calls[0].variant == "torch"
    assert len(prepared) == 0  # the losing trial's packed copy is not kept


@pytest.mark.parametrize("onednn_ms,expected", [(0.99, "torch"), (0.96, "onednn")])
def test_the_builtin_stays_unless_another_variant_is_clearly_faster(tuned, monkeypatch, onednn_ms, expected):
    skip_unless_runnable("dense", "cpu", torch.float32)
    assert tuning.BUILTIN_MARGIN == 0.03
    real = tuning._medians_ms
    monkeypatch.setattr(tuning, "_medians_ms", lambda candidates, *rest: {
        name: {"torch": 1.0, "onednn": onednn_ms}.get(name, 5.0) for name in real(candidates, *rest)})
    x, weight, bias = torch.randn(256, 64), torch.randn(96, 64), torch.randn(96)
    with torch.no_grad(), dispatch.record() as calls:
        ops.dense(x, weight, bias)
    assert {"onednn", "torch"} <= set(fp32_dense_variants()) and calls[0].variant == expected
    (key, entry), = tuning.entries().items()
    assert entry["choice"] == expected
    # A cached entry is read by the same rule.
    tuning._store(key, {"choice": "onednn", "ms": {**entry["ms"], "onednn": 0.99}})
    tuning.forget()
    dispatch._picked.clear()
    monkeypatch.setattr(tuning, "_medians_ms", lambda *a: pytest.fail("measured again"))
    with torch.no_grad(), dispatch.record() as calls:
        ops.dense(x, weight, bias)
    assert calls[0].variant == "torch"


def test_info_lists_variants_and_measurements(tuned):
    skip_unless_runnable("dense", "cpu", torch.float32)
    from fastbert.info import variants_report

    with torch.no_grad():
        ops.dense(torch.randn(4, 16), torch.randn(8, 16), None)
    text = "\n".join(variants_report())
    # A variant some dtype or CPU cannot use says so in parentheses ("onednn (fp32 only)" on AVX2).
    dense = next(line for line in text.splitlines() if line.strip().startswith("dense: "))
    assert re.fullmatch(r"dense: onednn( \(.*?\))?, onednn\+bias_gelu( \(.*?\))?, onednn-fp32 \(.*?\), torch, "
                        r"fastbert( \(.*?\))?, onednn-rows( \(.*?\))?, onednn\+torch_backward( \(.*?\))?",
                        dense.strip()), dense
    assert "attention: fastbert, torch" in text
    assert "dense cpu float32 infer cold m4 k16 n8 none" in text


def test_compiling_never_measures(tuned, monkeypatch):
    skip_unless_runnable("dense", "cpu", torch.float32)
    monkeypatch.setattr(tuning, "_medians_ms", lambda *a: pytest.fail("measured while tracing"))
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    compiled = torch.compile(lambda a: ops.dense(a, w, None), backend="eager", fullgraph=True)
    with torch.no_grad():
        assert_close(compiled(x), x.double() @ w.double().T, torch.float32, "matmul")


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_the_static_default_follows_the_cpus_features(monkeypatch, amx, head_dim):
    """With measuring off, bfloat16 attention runs on amx where the CPU has AMX and the head dim suits its
    tiles, else on brgemm (the variants it prefers, in that order), on the C++ kernel without AMX (the first
    registered)."""
    skip_unless_variant("attention", "brgemm", torch.bfloat16)
    attention_module = sys.modules["fastbert.ops.attention"]
    amx_runs = not attention_module._brgemm_machine_reasons("amx")  # on the real CPU
    monkeypatch.setenv("FASTBERT_CPU_TUNE", "0")
    monkeypatch.setattr(tuning, "cpu_features", lambda: frozenset({"amx_tile", "amx_bf16"} if amx else ()))
    attention_module._brgemm_machine_reasons.cache_clear()
    dispatch._choices.clear()
    q, k, v = (torch.randn(2, 2, 8, head_dim).to(torch.bfloat16) for _ in range(3))
    try:
        with torch.inference_mode(), dispatch.record() as calls:
            ops.attention(q, k, v)
    finally:
        attention_module._brgemm_machine_reasons.cache_clear()  # (judged under the patched features)
        dispatch._choices.clear()
    expected = "fastbert" if not amx else "amx" if head_dim % 32 == 0 and amx_runs else "brgemm"
    assert [(c.op, c.variant) for c in calls] == [("attention", expected)]


def test_each_thread_count_has_its_own_measurements(tuned, monkeypatch):
    """What is fastest on 2 threads may not be on 1: after torch.set_num_threads a model's next forward
    measures again (its replayed plan too), and going back needs no new measurement."""
    skip_unless_runnable("dense", "cpu", torch.float32)
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    real = tuning._medians_ms

    def medians(candidates, *rest):  # the real trials, then "torch" declared fastest on `before` threads only
        fastest = "torch" if torch.get_num_threads() == before else "onednn"
        return {name: 1.0 if name == fastest else 5.0 for name in real(candidates, *rest)}

    monkeypatch.setattr(tuning, "_medians_ms", medians)
    model = fastbert.BertModel(fastbert.BertConfig(vocab_size=50, hidden_size=64, num_attention_heads=2,
                                                   num_hidden_layers=2, intermediate_size=128)).eval()
    ids = torch.randint(0, 50, (2, 24))

    def dense_variants():
        with torch.no_grad(), dispatch.record() as calls:
            model(ids)
        return {c.variant for c in calls if c[0] == "dense"}

    try:
        assert dense_variants() == dense_variants() == {"torch"}  # the second forward replays a plan
        torch.set_num_threads(other)
        assert dense_variants() == dense_variants() == {"onednn"}
        assert len(json.loads((tuned / "variants.json").read_text())) == 2  # a table per thread count
        torch.set_num_threads(before)
        monkeypatch.setattr(tuning, "_medians_ms", lambda *a: pytest.fail("measured again"))
        assert dense_variants() == {"torch"}
    finally:
        torch.set_num_threads(before)


def test_a_rebuild_measures_afresh_and_drops_the_old_builds_table(tuned, monkeypatch):
    """A cache written by another build of the kernels on this machine is not trusted (its timings are of
    other code), and the first store under this build drops it; other machines' tables stay."""
    x, bias = torch.randn(6, 8), torch.randn(8)
    here = tuning.machine()
    assert f" build {tuning.build()} " in here
    old_build = here.replace(f" build {tuning.build()} ", " build 0123456789 ")
    other_machine = here.replace(" torch ", " (another CPU) torch ", 1)
    stale = {"bias_gelu cpu float32 infer m8": {"choice": "slow", "ms": {"slow": 0.1, "fast": 9.0}}}
    (tuned / "variants.json").write_text(json.dumps({old_build: stale, other_machine: stale}))
    with dispatch.scratch_registry():
        ran = []
        _stand_ins(ran)
        with dispatch.record() as calls:
            ops.bias_gelu(x, bias)
        assert [c.variant for c in calls] == ["fast"] and "slow" in ran  # measured, not the old build's pick
    saved = json.loads((tuned / "variants.json").read_text())
    assert set(saved) == {here, other_machine}
    assert saved[here]["bias_gelu cpu float32 infer m8"]["choice"] == "fast"
