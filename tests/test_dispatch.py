"""The dispatch contract: reasons in words, fallback logged once, forced backends raise, records."""
import copy
import logging
import os

import pytest
import torch

import fastbert
from fastbert import dispatch, ops
from fastbert.ops import _alloc, reference
from fastbert.ops._op import OpSpec, entry
from fastbert.testing import assert_close


def test_reference_always_qualifies_and_reasons_are_words():
    x = torch.randn(4, 8, dtype=torch.float64)
    b = torch.randn(8, dtype=torch.float64)
    with dispatch.record() as calls:
        ops.bias_gelu(x, b)
    assert calls == [("bias_gelu", "reference")]
    skipped = calls[0].skipped
    assert set(skipped) == {"cuda", "triton", "cpu"}
    if not dispatch.machine_reasons("cpu"):
        assert skipped["cpu"] == ["dtype float64 (supported: float32, bfloat16)"]
    for reasons in skipped.values():
        assert reasons and all(isinstance(r, str) and len(r) > 10 for r in reasons)


@pytest.fixture
def restore_registry():
    """Tests that register stand-in backends put the real registry back afterwards."""
    with dispatch.scratch_registry():
        yield


def test_reason_lists_dtype_device_head_dim_and_probabilities(restore_registry):
    impl_support = dispatch.Support(("cuda",), (torch.float16,), head_dims=(32, 64), dropout=False)
    dispatch.register("attention", "cuda", impl_support)(lambda *a: None)
    q = torch.randn(1, 1, 2, 48)
    reasons = dispatch.not_supported_reasons(
        "attention", "cuda", {"tensors": (q,), "head_dim": 48, "dropout_p": 0.1, "need_weights": True})
    if dispatch.machine_reasons("cuda"):
        assert reasons == list(dispatch.machine_reasons("cuda"))
    else:
        text = " | ".join(reasons)
        for words in ("tensors on cpu", "dtype float32", "head_dim 48", "dropout_p > 0", "probabilities"):
            assert words in text


def test_fallback_logged_once_per_op_and_reason(caplog, restore_registry):
    dispatch.register("dense", "cpu", dispatch.Support(("cpu",), (torch.bfloat16,)))(lambda *a: None)
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="fastbert"):
        for _ in range(3):
            ops.dense(x, w)
    fallbacks = [r for r in caplog.records if "falls back" in r.getMessage()]
    if dispatch.machine_reasons("cpu"):
        assert len(fallbacks) == 1 and "fastbert._C was not built" in fallbacks[0].getMessage()
    else:
        assert len(fallbacks) == 1 and "dtype float32" in fallbacks[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fallback_computes_half_precision_statistics_and_scores_in_float32(dtype):
    # A float16 model on a CPU runs on the fallback: its variance and scores in float16 overflowed (a feature 300
    # from its row's mean, scores past 65504) and it returned NaN where transformers' float16 model was finite.
    x, residual = torch.randn(6, 64), torch.randn(6, 64)
    x[:, 5] += 300
    weight, bias = torch.randn(64), torch.randn(64)
    q, k, v = (torch.randn(2, 2, 8, 16) * s for s in (300, 300, 1))
    lengths = torch.tensor([0, 5, 8], dtype=torch.int32)
    cast = [t.to(dtype) for t in (x, residual, weight, bias, q, k, v)]
    for t in cast:
        t.requires_grad_()
    xh, rh, wh, bh, qh, kh, vh = cast
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with fastbert.use_backend("reference"), dispatch.record() as calls:
        outs = {"add_layer_norm": ops.add_layer_norm(xh, rh, wh, bh, 1e-12),
                "attention": ops.attention(qh, kh, vh, mask),
                "probabilities": ops.attention(qh, kh, vh, mask, need_weights=True)[1],
                "varlen_attention": ops.varlen_attention(*(t[0].transpose(0, 1) for t in (qh, kh, vh)), lengths, 5)}
        sum(o.float().sum() for o in outs.values()).backward()
    assert {c.backend for c in calls} == {"reference"} and {c[0] for c in calls} == set(outs) - {"probabilities"}
    up = [t.detach().double() for t in cast]
    truth = {"add_layer_norm": reference.add_layer_norm(*up[:4], 1e-12),
             "attention": reference.attention(*up[4:], mask),
             "probabilities": reference.attention(*up[4:], mask, need_weights=True)[1],
             "varlen_attention": reference.varlen_attention(*(t[0].transpose(0, 1) for t in up[4:]), lengths, 5)}
    for name, out in outs.items():
        assert out.dtype == dtype
        assert_close(out, truth[name], dtype, "elementwise" if name == "add_layer_norm" else "matmul", name=name)
    assert all(bool(torch.isfinite(t.grad).all()) for t in cast)


def test_forced_backend_that_cannot_serve_raises_with_reasons():
    x, b = torch.randn(3, 5), torch.randn(5)
    with pytest.raises(fastbert.BackendUnavailable, match="bias_gelu: backend 'cuda' was forced"):
        with fastbert.use_backend("cuda"):
            ops.bias_gelu(x, b)
    with pytest.raises(fastbert.BackendUnavailable, match="has no attention implementation|unavailable|not built|without CUDA|tensors on cpu"):
        with fastbert.use_backend("cuda", op="attention"):
            ops.attention(*(torch.randn(1, 1, 2, 8) for _ in range(3)))


def test_use_backend_per_op_and_nesting():
    x, b = torch.randn(3, 5), torch.randn(5)
    with fastbert.use_backend("reference", op="bias_gelu"), dispatch.record() as calls:
        ops.bias_gelu(x, b)
        ops.add_layer_norm(x, x, b, b, 1e-5)
    assert calls[0] == ("bias_gelu", "reference")
    with fastbert.use_backend("cuda"), fastbert.use_backend("reference"), dispatch.record() as calls:
        ops.bias_gelu(x, b)  # innermost wins
    assert calls == [("bias_gelu", "reference")]
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        with fastbert.use_backend("gpu"):
            pass
    with pytest.raises(ValueError, match="unknown op 'gelu'"):
        with fastbert.use_backend("reference", op="gelu"):
            pass


def test_environment_overrides(monkeypatch):
    x, b = torch.randn(3, 5), torch.randn(5)
    monkeypatch.setenv("FASTBERT_BACKEND", "reference")
    with dispatch.record() as calls:
        ops.bias_gelu(x, b)
    assert calls == [("bias_gelu", "reference")]
    monkeypatch.setenv("FASTBERT_BACKEND_BIAS_GELU", "cuda")  # per-op beats all-ops
    with pytest.raises(fastbert.BackendUnavailable, match="FASTBERT_BACKEND_BIAS_GELU"):
        ops.bias_gelu(x, b)
    monkeypatch.setenv("FASTBERT_BACKEND_BIAS_GELU", "nonsense")
    with pytest.raises(ValueError, match="FASTBERT_BACKEND_BIAS_GELU: unknown backend 'nonsense'"):
        ops.bias_gelu(x, b)


def test_environment_reads_what_os_environ_holds_now(monkeypatch):
    from fastbert import environment

    name = "FASTBERT_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert environment.get(name) is None and environment.get(name, "1") == "1"
    for value in ("reference", "", "x=y ü"):  # set, empty, and not ASCII
        monkeypatch.setenv(name, value)
        assert environment.get(name) == os.environ.get(name) == value
    monkeypatch.delenv(name)
    assert environment.get(name) is None
    monkeypatch.setattr(os, "environ", {name: "plain"})  # a mapping without CPython's internals
    assert environment.get(name) == "plain" and environment.get("FASTBERT_ABSENT", "d") == "d"


def test_record_sees_forward_and_backward_of_the_same_backend():
    backend = "cpu" if not dispatch.machine_reasons("cpu") else None
    if backend is None:
        pytest.skip("fastbert._C not built: " + "; ".join(dispatch.machine_reasons("cpu")))
    x = torch.randn(4, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    with dispatch.record() as calls:
        ops.bias_gelu(x, b).sum().backward()
    assert calls == [("bias_gelu", "cpu"), ("bias_gelu.backward", "cpu")]


def test_records_nest_and_stop_at_exit():
    x, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with dispatch.record() as outer:
        ops.bias_gelu(x, b)
        with dispatch.record() as inner:
            ops.bias_gelu(x, b)
    ops.bias_gelu(x, b)
    assert len(outer) == 2 and len(inner) == 1


def test_poison_outputs_fills_nan_only_inside_the_block():
    with _alloc.poison_outputs():
        assert torch.isnan(_alloc.empty(3, dtype=torch.float32, device="cpu")).all()
    t = _alloc.empty(3, dtype=torch.float32, device="cpu").fill_(1.0)
    assert torch.equal(t, torch.ones(3))


def test_ops_follow_autocast(monkeypatch):
    """Under autocast the GEMMs and attention run in bf16 and add_layer_norm in float32, as autocast runs
    transformers' BERT (its layer_norm in float32): the residual stream and the output stay float32."""
    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50)).eval()
    ids = torch.randint(0, 50, (2, 6))
    seen, call = [], dispatch.call

    def spy(op, inputs, *args, **kwargs):  # what each op got, after autocast's casts
        seen.append((op, args[0].dtype))
        return call(op, inputs, *args, **kwargs)

    monkeypatch.setattr(dispatch, "call", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16), dispatch.record() as calls:
        out = model(ids).last_hidden_state
    monkeypatch.undo()
    assert out.dtype == torch.float32
    assert {dtype for op, dtype in seen if op == "add_layer_norm"} == {torch.float32}
    assert {dtype for op, dtype in seen if op != "add_layer_norm"} == {torch.bfloat16}
    # Against the model in float64 (not against another bf16 run: that would carry both runs' errors), and
    # within 2x of plain PyTorch under the same autocast.
    truth = copy.deepcopy(model).double()(ids).last_hidden_state
    with fastbert.use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        naive = model(ids).last_hidden_state
    # (held to bf16's bound: rounded to bf16 once more, a float32 result of bf16 GEMMs)
    assert_close(out.bfloat16(), truth, torch.bfloat16, "matmul", naive=naive.bfloat16(),
                 name="last_hidden_state under autocast")
    if not dispatch.machine_reasons("cpu"):  # and every op ran on the kernels, in bf16
        assert calls and all(c.backend == "cpu" for c in calls), calls


def test_forced_backend_with_unsupported_head_dim_raises_before_compute():
    q = torch.randn(1, 1, 2, 160)  # head_dim 160: above the triton kernel's 128
    if dispatch.machine_reasons("triton"):
        pytest.skip("triton unavailable: " + "; ".join(dispatch.machine_reasons("triton")))
    with dispatch.record() as calls, pytest.raises(fastbert.BackendUnavailable, match="head_dim 160 \\(supported: 1 to 128\\)"):
        with fastbert.use_backend("triton", op="attention"):
            ops.attention(q, q, q)
    assert calls == []


_DOUBLE = OpSpec("test_double", forward_schema="(Tensor x) -> Tensor", backward_schema="(Tensor grad) -> Tensor",
                 forward_fake=lambda x: torch.empty_like(x), backward_fake=lambda grad: torch.empty_like(grad),
                 saved=lambda inputs, outputs: (), input_grads=lambda inputs, grads: grads)
_double = _DOUBLE.kernels("python", lambda x: x * 2, lambda grad: grad * 2, "reference").forward


def test_entry_skips_the_custom_op_only_where_nothing_needs_it():
    """Eager calls with nothing to differentiate run the function under the custom op (~5.5 us a call
    less); autograd, torch.func transforms, tensor subclasses and torch.compile get the custom op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(3), torch.nn.Parameter(torch.randn(3))
    assert entry(_double, x, w) is _double  # w requires grad: autograd must see the op
    with torch.no_grad():
        assert entry(_double, x, w) is _double.direct
    with torch.inference_mode():
        assert entry(_double, x, None) is _double.direct
    with FakeTensorMode() as mode, torch.no_grad():
        assert entry(_double, mode.from_tensor(x)) is _double
    seen = []
    torch.func.vmap(lambda row: seen.append(entry(_double, row)) or row)(torch.randn(2, 3))
    assert seen == [_double]
    torch.testing.assert_close(_double.direct(x), _double(x), rtol=0, atol=0)


def test_ops_work_under_vmap():
    """vmap over the public ops: the cpu kernels write into preallocated outputs, which have no
    batching rule, so under a transform they must run through their custom op (per-example fallback)."""
    pytest.importorskip("fastbert._C", reason="the cpu backend is not built")
    x, r = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    w, b = torch.randn(16), torch.randn(16)
    with fastbert.use_backend("cpu", op="add_layer_norm"), torch.no_grad(), dispatch.record() as calls:
        batched = torch.func.vmap(lambda a, c: ops.add_layer_norm(a, c, w, b, 1e-5))(x, r)
        looped = torch.stack([ops.add_layer_norm(x[i], r[i], w, b, 1e-5) for i in range(2)])
    assert calls and {c.backend for c in calls} == {"cpu"}, f"calls: {list(calls)}"
    torch.testing.assert_close(batched, looped, rtol=0, atol=0)


def test_cuda_add_layer_norm_names_its_row_limit():
    """Wider rows than the cuda kernel holds fall to the next backend with the reason, not into the kernel."""
    import fastbert.ops.add_layer_norm  # noqa: F401  (registers it)

    cuda = dispatch.implementations("add_layer_norm")["cuda"]
    wide = dispatch.Facts(("cuda",), (torch.float32,), row_width=8193)
    assert any("at most 8192" in r for r in cuda.extra_reasons(wide))
    assert cuda.extra_reasons(dispatch.Facts(("cuda",), (torch.float32,), row_width=8192)) == []


def test_blocks_of_asyncio_tasks_on_one_thread_stay_their_own():
    """The blocks were one thread's list: a task's block closed while another task's was open popped the
    other's entry (that task's ops ran on a backend it had not forced), and a task that forced nothing ran
    under another's block."""
    import asyncio

    seen = {}

    async def brief():
        with dispatch.use_backend("reference"):
            await asyncio.sleep(0.01)
            seen["brief"] = dispatch.forced_backend("dense")

    async def long():
        await asyncio.sleep(0.005)
        with dispatch.use_backend("cpu"):
            await asyncio.sleep(0.02)  # brief's block closes meanwhile
            seen["long"] = dispatch.forced_backend("dense")

    async def bystander():
        await asyncio.sleep(0.005)  # inside brief's block
        seen["bystander"] = dispatch.forced_backend("dense")

    async def main():
        await asyncio.gather(brief(), long(), bystander())

    asyncio.run(main())
    assert seen == {"brief": ("reference", "use_backend()"), "long": ("cpu", "use_backend()"), "bystander": None}
    # Blocks closed out of order keep each other's entries.
    outer, inner = dispatch.use_variant("dense", "torch"), dispatch.use_variant("dense", "onednn")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert dispatch.forced_variant("dense") == ("onednn", "use_variant()")
    inner.__exit__(None, None, None)
    assert dispatch.forced_variant("dense") is None
