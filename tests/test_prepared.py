"""PreparedWeights: a prepared form is served only while its sources are the same tensors, unchanged."""
import copy
import pickle

import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import PreparedWeights, reference
from fastbert.testing import assert_close


def counting():
    made = []

    def make(w):
        made.append(1)
        return w * 2

    return made, make


def test_served_while_unchanged_and_made_again_after_any_change():
    prepared, (made, make) = PreparedWeights(), counting()
    w = torch.randn(4, 3)
    prepared.get("w", (w,), make)
    prepared.get("w", (w,), make)
    assert len(made) == 1
    w.add_(1)  # in place: version
    assert torch.equal(prepared.get("w", (w,), make), w * 2) and len(made) == 2
    w.data = torch.randn(4, 3)  # new storage, same version
    assert torch.equal(prepared.get("w", (w,), make), w * 2) and len(made) == 3
    other = torch.randn(4, 3)  # another tensor under the same name
    assert torch.equal(prepared.get("w", (other,), make), other * 2) and len(made) == 4
    assert torch.equal(prepared.get("w", (w.t().contiguous().t(),), make), w * 2)  # same values, other storage


def test_a_dead_tensor_address_is_never_served_to_a_new_one():
    """Temporaries made one after another often land at the address the last one freed; the entry keeps
    its source alive, so a new tensor never matches it."""
    prepared = PreparedWeights()
    for _ in range(20):
        w = torch.randn(8, 8)
        assert torch.equal(prepared.get("w", (w,), lambda t: t.clone()), w)
        del w


def test_copies_and_pickles_start_empty_and_never_hold_opaque_tensors():
    prepared = PreparedWeights()
    prepared.get("w", (torch.randn(2, 2),), lambda t: t)
    assert len(prepared) == 1
    assert len(copy.deepcopy(prepared)) == 0
    assert len(pickle.loads(pickle.dumps(prepared))) == 0


def test_inference_tensors_and_compiled_code_keep_nothing():
    prepared, (made, make) = PreparedWeights(), counting()
    with torch.inference_mode():
        w = torch.randn(3, 3)  # an inference tensor: no version counter to tell a change
    prepared.get("w", (w,), make)
    prepared.get("w", (w,), make)
    assert len(made) == 2 and len(prepared) == 0

    @torch.compile(fullgraph=True)
    def f(t):
        return prepared.get("t", (t,), lambda s: s + 1)

    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)) and len(prepared) == 0


def test_a_model_of_inference_tensors_says_why_it_is_slow(monkeypatch, recwarn):
    """A model made or converted inside torch.inference_mode() re-prepares its weights at every call (MiniLM
    at one query ran 4x slower): the first such call warns, once, with the cause and the fix; a model made
    outside and run inside does not."""
    import fastbert
    from fastbert.ops import prepared as prepared_module

    config = fastbert.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64)
    ids = torch.randint(0, 50, (2, 6))
    monkeypatch.setattr(prepared_module, "_WARNED", [False])
    plain = fastbert.BertModel(config).eval()
    with torch.inference_mode():
        plain(ids)
    assert not [w for w in recwarn if "inference tensors" in str(w.message)]
    with torch.inference_mode():
        made_inside = copy.deepcopy(plain)
        with pytest.warns(UserWarning, match=r"inference tensors .* outside torch\.inference_mode\(\)"):
            made_inside(ids)
        recwarn.clear()
        made_inside(ids)  # once a process
    assert not [w for w in recwarn if "inference tensors" in str(w.message)]


@pytest.mark.parametrize("op", ["dense", "qkv_projection"])
def test_the_cpu_backend_packs_into_the_owners_prepared_weights(op):
    if dispatch.not_supported_reasons(op, "cpu", {"tensors": (torch.ones(1),)}):
        pytest.skip("; ".join(dispatch.not_supported_reasons(op, "cpu", {"tensors": (torch.ones(1),)})))
    prepared = PreparedWeights()
    x = torch.randn(5, 32)
    for _ in range(3):  # a fresh weight each time: each result must be its own
        w, b = torch.randn(96, 32) * 0.2, torch.randn(96)
        with torch.no_grad(), dispatch.record() as calls, dispatch.use_backend("cpu"):
            if op == "dense":
                out, ref = ops.dense(x, w, b, prepared=prepared), reference.dense(x.double(), w.double(), b.double())
            else:
                out = torch.stack(ops.qkv_projection(x, w, b, 4, prepared))
                ref = torch.stack(reference.qkv_projection(x.double(), w.double(), b.double(), 4))
        assert calls == [(op, "cpu")]
        assert "onednn" in repr(prepared)
        assert_close(out, ref, torch.float32, "matmul", name=op)
    with pytest.raises(ValueError, match="prepared must be a fastbert.ops.PreparedWeights"):
        ops.dense(x, w, b, prepared={})


def test_moves_drop_prepared_weights_and_data_writes_have_a_way_to():
    import fastbert

    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50)).eval()
    ids = torch.randint(0, 50, (2, 5))
    prepared = model.encoder.layer[0].attention.self.prepared
    with torch.no_grad():
        model(ids)
        assert len(prepared) > 0
        model.to(torch.float32)  # a move, even to the same dtype, drops what was prepared (and its storage)
        assert len(prepared) == 0
        before = model(ids).last_hidden_state
        model.encoder.layer[0].attention.self.query.weight.data.mul_(2)  # no version bump: unseen by a stamp
        model.clear_prepared_weights()
        after = model(ids).last_hidden_state
        fresh = fastbert.BertModel(model.config).eval()
        fresh.load_state_dict(model.state_dict())
        assert not torch.equal(before, after)
        assert_close(after, fresh(ids).last_hidden_state, torch.float32, "elementwise", name="after clear")


def test_a_switch_to_eval_forgets_weights_written_unseen_in_training():
    """What a training loop's evaluation meets: weights written in training by what moves no version
    counter (dist.broadcast / all_reduce of parameters, model averaging; `.data` here) are read afresh
    after model.eval(), with no call to clear_prepared_weights()."""
    import fastbert

    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50)).eval()
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        model(ids)  # prepares
        model.train()
        for p in model.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
        after = model.eval()(ids).last_hidden_state
    fresh = fastbert.BertModel(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_close(after, fresh(ids).last_hidden_state, torch.float32, "elementwise", name="after eval()")


def test_an_optimizer_step_leaves_parameters_without_a_gradient_alone():
    """The step hook moves the versions of the parameters a step wrote, not of frozen ones (a frozen weight
    saved for a backward still to come stays usable, and keeps what was prepared from it)."""
    frozen, trained = torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW([*frozen.parameters(), *trained.parameters()], fused=True)
    pending = trained(frozen(torch.randn(2, 4))).sum()  # frozen's weight is saved for this backward
    trained(torch.randn(2, 4)).sum().backward()
    versions = [p._version for p in trained.parameters()]
    optimizer.step()
    assert [p._version for p in trained.parameters()] > versions
    pending.backward()


def test_clearing_reaches_fastbert_models_inside_any_module():
    import fastbert

    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=50)).eval()
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 5)))
    prepared = model.encoder.layer[0].attention.self.prepared
    assert len(prepared) > 0
    fastbert.clear_prepared_weights(torch.nn.ModuleList([model]))  # as DistributedDataParallel holds it
    assert len(prepared) == 0
