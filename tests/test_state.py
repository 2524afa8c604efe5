"""Copying, pickling, moving and reloading a model gives what the same action on a plain model gives, and
the result still runs fastbert's kernels.

Each case warms the model up first (so any prepared weights exist), acts on it, changes its weights
where a stale copy would show, and compares it with a twin built afresh from its state_dict: a
transformers model for optimized transformers / sentence-transformers models, a new fastbert model for
fastbert's own (nothing prepared, nothing shared). bfloat16 results are compared with the twin in
float64 on the same (bfloat16-rounded) weights.
"""
import copy
import io

import pytest
import torch
import transformers

import fastbert
from fastbert.apps.demo import minilm_dir
from fastbert.testing import assert_close
from hf_twins import padded_batch

SMALL = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
KINDS = ("fastbert", "fastbert-classifier", "fastbert-masked-lm", "transformers", "transformers-classifier",
         "sentence-transformers")
FASTBERT_CLASSES = {"fastbert": "BertModel", "fastbert-classifier": "BertForSequenceClassification",
                    "fastbert-masked-lm": "BertForMaskedLM"}


class Subject:
    """A model of one kind, how to run it, and how to build its plain twin from a state_dict."""

    def __init__(self, kind):
        self.kind = kind
        if kind.startswith("fastbert"):
            cls = getattr(fastbert, FASTBERT_CLASSES[kind])
            self.model = cls(fastbert.BertConfig(**SMALL, num_labels=3)).eval()
            self.vocab = SMALL["vocab_size"]
        elif kind.startswith("transformers"):
            cls = transformers.BertForSequenceClassification if kind.endswith("classifier") else transformers.BertModel
            self.model = fastbert.optimize(cls(transformers.BertConfig(**SMALL, num_labels=3)).eval())
            self.vocab = SMALL["vocab_size"]
        else:
            st = pytest.importorskip("sentence_transformers")
            self.model = fastbert.optimize(st.SentenceTransformer(minilm_dir(), device="cpu"))
            self.vocab = 30522
        self.ids, self.mask, _ = padded_batch(self.vocab, [9, 4, 1])

    def run(self, model):
        """The model's main output, at real tokens; with the backends that ran."""
        with fastbert.dispatch.record() as calls, torch.no_grad():
            if self.kind == "sentence-transformers":
                out = model({"input_ids": self.ids, "attention_mask": self.mask})["sentence_embedding"]
            elif self.kind.endswith("classifier"):
                out = model(input_ids=self.ids, attention_mask=self.mask).logits
            elif self.kind.endswith("masked-lm"):  # pad positions are the kernels' choice (zeros when unpadded)
                out = model(input_ids=self.ids, attention_mask=self.mask).logits[self.mask.bool()]
            else:
                out = model(input_ids=self.ids, attention_mask=self.mask).last_hidden_state[self.mask.bool()]
        return out, calls

    def twin(self, model, dtype=None):
        """A plain model of the same kind holding `model`'s weights (in `dtype` if given)."""
        if self.kind.startswith("fastbert"):
            fresh = type(model)(model.config)
        elif self.kind.startswith("transformers"):
            fresh = type(model)(model.config)
        else:
            import sentence_transformers

            fresh = sentence_transformers.SentenceTransformer(minilm_dir(), device="cpu")
        fresh.load_state_dict(model.state_dict())
        return fresh.to(dtype or next(model.parameters()).dtype).eval()


def perturb(model):
    """Move every weight, so an output computed from stale (prepared or closed-over) state differs."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))


def assert_kernels_ran(calls):
    ran = {b for op, b in calls if op in ("qkv_projection", "attention", "varlen_attention", "dense")}
    assert ran and "reference" not in ran, f"fastbert's kernels no longer run: {calls}"


def assert_matches_twin(subject, model):
    out, calls = subject.run(model)
    assert_kernels_ran(calls)
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        ref, _ = subject.run(subject.twin(model))
    else:  # the twin in float64 on the same rounded weights: the truth for this dtype's table bound
        ref, _ = subject.run(subject.twin(model, torch.float64))
    assert out.dtype == dtype, f"output dtype {out.dtype}, model dtype {dtype}"
    assert_close(out, ref, dtype, "elementwise", name=f"{subject.kind} output")


def deepcopy(model):
    return copy.deepcopy(model)


def pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, as users do for quick snapshots (their own file)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def fused_optimizer_step(model):
    """One step of torch's fused AdamW (transformers' Trainer default), which moves no version counter."""
    for p in model.parameters():
        p.grad = 0.02 * torch.randn_like(p)
    torch.optim.AdamW(model.parameters(), lr=0.05, fused=True).step()
    return model


def written_through_data(model):
    """Weights written through `.data` (as transformers' own init code does), then the documented remedy."""
    for p in model.parameters():
        p.data.add_(0.02 * torch.randn_like(p))
    fastbert.clear_prepared_weights(model)
    return model


ACTIONS = {
    "deepcopy": lambda m: perturb_and_return(deepcopy(m)),
    "fused-optimizer-step": fused_optimizer_step,
    "written-through-data": written_through_data,
    "pickle": lambda m: perturb_and_return(pickled(m)),
    "to-bfloat16": lambda m: m.to(torch.bfloat16),
    "deepcopy-to-bfloat16": lambda m: deepcopy(m).to(torch.bfloat16),
    "perturb-in-place": lambda m: perturb_and_return(m),
    "bfloat16-and-back": lambda m: perturb_and_return(m.to(torch.bfloat16).float()),
}


def perturb_and_return(model):
    perturb(model)
    return model


@pytest.fixture(params=KINDS)
def subject(request):
    return Subject(request.param)


@pytest.mark.parametrize("action", ACTIONS)
def test_action_gives_what_a_plain_model_gives(subject, action):
    before, _ = subject.run(subject.model)  # prepares whatever the kernels prepare
    result = ACTIONS[action](subject.model)
    subject.run(result)
    assert_matches_twin(subject, result)
    if result is not subject.model:  # the original is untouched by what happened to its copy
        after, _ = subject.run(subject.model)
        assert torch.equal(before, after), "acting on a copy changed the original"


def test_load_state_dict_is_followed(subject):
    subject.run(subject.model)
    other = copy.deepcopy(subject.model)
    perturb(other)
    subject.model.load_state_dict(other.state_dict())
    assert_matches_twin(subject, subject.model)
    assign = {k: v.clone() + 0.01 for k, v in other.state_dict().items() if v.is_floating_point()}
    subject.model.load_state_dict(assign, strict=False, assign=True)  # new Parameter objects
    assert_matches_twin(subject, subject.model)


def test_train_and_eval_are_followed(subject):
    subject.model.train()
    a, _ = subject.run(subject.model)
    b, _ = subject.run(subject.model)
    assert not torch.equal(a, b), "train(): dropout should make two calls differ"
    subject.model.eval()
    assert_matches_twin(subject, subject.model)


def test_save_pretrained_then_from_pretrained(subject, tmp_path):
    subject.run(subject.model)
    perturb(subject.model)
    expected, _ = subject.run(subject.model)
    if subject.kind.startswith("fastbert"):
        subject.model.save_pretrained(tmp_path)
        loaded = type(subject.model).from_pretrained(tmp_path)
    elif subject.kind.startswith("transformers"):
        subject.model.save_pretrained(tmp_path)
        loaded = type(subject.model).from_pretrained(tmp_path).eval()
        assert not hasattr(loaded.base_model, "_fastbert_encoder")  # a plain transformers model comes back
        loaded = fastbert.optimize(loaded)
    else:
        import sentence_transformers

        subject.model.save(str(tmp_path))
        loaded = fastbert.optimize(sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu"))
    got, calls = subject.run(loaded)
    assert_kernels_ran(calls)
    assert_close(got, expected, torch.float32, "elementwise", name=f"{subject.kind} reloaded")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_device_is_followed(subject):
    subject.run(subject.model)
    model = subject.model.to("cuda")
    subject.ids, subject.mask = subject.ids.cuda(), subject.mask.cuda()
    out, _ = subject.run(model)
    ref, _ = subject.run(subject.twin(model))
    assert out.device.type == "cuda"
    assert_close(out, ref, torch.float32, "elementwise", name=f"{subject.kind} on cuda")
