"""Plans (dispatch.Plans): a model's eager inference forward, replayed without its ops' checks and choices,
gives what the checked forward gives, runs the same implementations, and is dropped whenever it could be
stale."""
import copy
import pickle

import pytest
import torch

import fastbert
from fastbert import dispatch
from fastbert.ops import _checks
from fastbert.testing import assert_matches, poison_outputs

CONFIG = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=64)


def small_model(dtype="fp32"):
    model = fastbert.BertModel(fastbert.BertConfig(**CONFIG)).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if dtype == "int8":
        model = fastbert.quantize(model)
    return model


def batch(b=2, s=12, padded=True):
    ids = torch.randint(1, CONFIG["vocab_size"], (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask[0, s // 2:] = 0  # padding: the encoder runs packed tokens
    return ids, mask


class CheckCounter:
    """Counts the ops' shared dtype/device check: every checked op call makes one."""

    def __init__(self, monkeypatch):
        self.count, real = 0, _checks.same_dtype_device

        def counted(**tensors):
            self.count += 1
            return real(**tensors)

        monkeypatch.setattr(_checks, "same_dtype_device", counted)


def planned(model, ids, mask):
    """Three inference forwards: the first records a plan (making any new choices), the others replay it."""
    with torch.inference_mode():
        for _ in range(3):
            model(ids, attention_mask=mask)


def forward(model, ids, mask):
    with dispatch.record() as calls:
        out = model(ids, attention_mask=mask)
    return out, [(c.op, c.backend, c.variant) for c in calls]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("padded", [True, False], ids=["packed", "unpadded"])
def test_a_replayed_forward_equals_the_checked_one_and_runs_the_same_kernels(monkeypatch, dtype, padded):
    model, (ids, mask) = small_model(dtype), batch(padded=padded)
    checks = CheckCounter(monkeypatch)
    with torch.inference_mode(), poison_outputs():  # a kernel output the replay forgot to write stays NaN
        outs = [forward(model, ids, mask) for _ in range(4)]
        first_checks = checks.count
        checks.count = 0
        replayed, calls = forward(model, ids, mask)
    assert len(model.plans) >= 1
    assert first_checks > 0 and checks.count <= 1  # only the embeddings' LayerNorm, outside the plan, is checked
    for out, checked_calls in outs:
        assert checked_calls == calls
        assert torch.equal(out.last_hidden_state, replayed.last_hidden_state)
        assert torch.equal(out.pooler_output, replayed.pooler_output)
    assert not replayed.last_hidden_state.isnan().any()


def test_new_shapes_and_flags_make_new_plans(monkeypatch):
    model = small_model()
    with torch.inference_mode():
        for s in (8, 12, 8, 12):
            for _ in range(3):
                ids, mask = batch(s=s)
                out = model(ids, attention_mask=mask, output_hidden_states=s == 12)
                reference = model(ids, attention_mask=mask, output_hidden_states=s == 12, allow_unpadding=False)
                real = mask.bool()
                assert_matches(out.last_hidden_state[real], reference.last_hidden_state[real])
                assert (out.hidden_states is not None) == (s == 12)


def test_inputs_are_still_checked_on_every_forward():
    model, (ids, mask) = small_model(), batch()
    planned(model, ids, mask)
    with torch.inference_mode():
        bad = ids.clone()
        bad[0, 0] = CONFIG["vocab_size"]
        with pytest.raises(ValueError, match="input_ids must lie in"):
            model(bad, attention_mask=mask)
        with pytest.raises(ValueError, match="attention_mask must hold only 0"):
            model(ids, attention_mask=mask * 2)


def test_a_forward_that_goes_another_way_drops_the_plan_and_runs_checked(monkeypatch):
    """GELU's form is a plain attribute: no hook sees it change, the op's flags do."""
    model, (ids, mask) = small_model(), batch()
    planned(model, ids, mask)
    with torch.inference_mode():
        assert any(p is not dispatch._UNPLANNABLE for p in model.plans._plans.values())
        for layer in model.encoder.layer:
            layer.intermediate.approximate = "tanh"
        checks = CheckCounter(monkeypatch)
        out = model(ids, attention_mask=mask).last_hidden_state
        assert checks.count > 1
        fresh = copy.deepcopy(model)  # a copy starts without plans: every call checked
        assert len(fresh.plans) == 0
        assert torch.equal(out, fresh(ids, attention_mask=mask).last_hidden_state)


def test_conversions_replacements_and_data_writes_drop_plans(monkeypatch):
    model, (ids, mask) = small_model(), batch()
    planned(model, ids, mask)
    checks = CheckCounter(monkeypatch)

    def checked_forward():
        checks.count = 0
        with torch.inference_mode():
            out = model(ids, attention_mask=mask).last_hidden_state
        assert checks.count > 1, "a stale plan was replayed"
        return out

    model.to(torch.bfloat16)
    assert checked_forward().dtype == torch.bfloat16
    model.to(torch.float32)
    checked_forward()
    layer = model.encoder.layer[0]
    layer.output.dense = torch.nn.Linear(CONFIG["intermediate_size"], CONFIG["hidden_size"])  # a new module
    checked_forward()
    with torch.no_grad():
        layer.output.dense.weight.data = torch.randn(CONFIG["hidden_size"], CONFIG["intermediate_size"])
    expected = copy.deepcopy(model)  # no plans: every call checked
    with torch.inference_mode():
        assert torch.equal(checked_forward(), expected(ids, attention_mask=mask).last_hidden_state)


def test_no_plans_in_training_with_gradients_or_when_a_backend_is_forced():
    model, (ids, mask) = small_model(), batch()
    for _ in range(2):
        model(ids, attention_mask=mask)  # gradients on
    assert len(model.plans) == 0
    with torch.inference_mode(), dispatch.use_backend("reference"):
        for _ in range(2):
            _, calls = forward(model, ids, mask)
    assert len(model.plans) == 0 and {backend for _, backend, _ in calls} == {"reference"}
    model.train()
    with torch.inference_mode():
        model(ids, attention_mask=mask)
    assert len(model.plans) == 0


def test_plans_are_bounded_and_never_copied_pickled_or_saved(tmp_path):
    model = small_model()
    with torch.inference_mode():
        for b in range(1, dispatch.Plans.LIMIT + 9):
            model(*batch(b=b, s=4, padded=False))
    assert len(model.plans) == dispatch.Plans.LIMIT
    assert len(copy.deepcopy(model).plans) == 0
    assert len(pickle.loads(pickle.dumps(model.plans))) == 0
    assert not any("plans" in name for name in model.state_dict())
    model.clear_prepared_weights()
    assert len(model.plans) == 0


def test_replaced_weights_are_not_kept_alive_by_old_plans():
    import gc
    import weakref

    model, (ids, mask) = small_model(), batch()
    dense = model.encoder.layer[0].output.dense
    planned(model, ids, mask)
    old = weakref.ref(dense.weight)
    dense.weight = torch.nn.Parameter(torch.randn_like(dense.weight))  # a reload, as load_state_dict(assign=True)
    planned(model, ids, mask)
    gc.collect()
    assert old() is None and len(model.plans) == 1


def test_functional_call_with_other_tensors_is_checked():
    model, (ids, mask) = small_model(), batch()
    planned(model, ids, mask)
    with torch.inference_mode():
        name = "encoder.layer.1.output.dense.weight"
        wrong = model.get_parameter(name).detach().double()
        with pytest.raises(ValueError, match="dtype torch.float64"):
            torch.func.functional_call(model, {name: wrong}, (ids,), {"attention_mask": mask})


def test_packed_batches_of_one_token_count_but_other_longest_sequences_have_their_own_plans():
    model = small_model()
    ids = torch.randint(1, CONFIG["vocab_size"], (2, 30))
    masks = [torch.zeros(2, 30, dtype=torch.long) for _ in range(2)]
    masks[0][:, :16] = 1  # 32 tokens, longest 16
    masks[1][0, :30], masks[1][1, :2] = 1, 1  # 32 tokens, longest 30
    with torch.inference_mode():
        for _ in range(3):
            for mask in masks:
                model(ids, attention_mask=mask)
    assert len(model.plans) == 2


def test_a_model_called_inside_another_forward_runs_checked_and_unrecorded(monkeypatch):
    outer, (ids, mask) = small_model(), batch(padded=False)
    inner = fastbert.BertModel(fastbert.BertConfig(**CONFIG, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)).train()  # no plan: training
    with torch.inference_mode():
        alone = inner(ids, attention_mask=mask).last_hidden_state
    seen = []
    outer.encoder.layer[0].register_forward_hook(lambda *_: seen.append(inner(ids, attention_mask=mask)))
    checks = CheckCounter(monkeypatch)
    with torch.inference_mode():
        for _ in range(4):
            checks.count = 0
            outer(ids, attention_mask=mask)
    assert checks.count >= 7 * CONFIG["num_hidden_layers"]  # the inner model's ops, every time
    assert all(torch.equal(out.last_hidden_state, alone) for out in seen)


def test_modules_built_elsewhere_leave_plans_alone(monkeypatch):
    model, (ids, mask) = small_model(), batch()
    planned(model, ids, mask)
    with torch.inference_mode():
        checks = CheckCounter(monkeypatch)
        torch.nn.Linear(4, 4)  # registers parameters of a module no plan knows
        model(ids, attention_mask=mask)
    assert checks.count <= 1
