"""The real checkpoint all-MiniLM-L6-v2, real sentences through its own tokenizer."""
import pytest
import torch
import transformers

import fastbert
from fastbert.apps.demo import SENTENCES, mean_pool, minilm_dir
from fastbert.testing import assert_matches


@pytest.fixture(scope="module")
def models():
    path = minilm_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return tokenizer, fastbert.BertModel.from_pretrained(path), transformers.BertModel.from_pretrained(path).eval()


def test_token_states_and_sentence_embeddings_match_transformers(models):
    tokenizer, ours, theirs = models
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    assert int((mask == 0).sum()) > 0, "the batch should need padding"
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    real = mask.bool()
    assert_matches(a[real], b[real], name="token states")
    ea, eb = mean_pool(a, mask), mean_pool(b, mask)
    assert_matches(ea, eb, name="sentence embeddings")
    # The embeddings mean something: paraphrases score above unrelated pairs.
    sim = ea @ ea.T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[2, 3] > sim[2, 4] + 0.2


def test_demo_runs(capsys):
    from fastbert.apps.demo import run

    run(repeats=2)
    out = capsys.readouterr().out
    assert "parity: cosine(fastbert, transformers)" in out and "speedup" in out


def test_demo_times_nothing_it_has_not_proven(monkeypatch):
    """A disagreement with transformers stops the demo before any timing (it printed the cosine, then speedups)."""
    from fastbert.apps import demo

    monkeypatch.setattr(demo, "alternating_medians", lambda *a, **k: pytest.fail("timed unproven numbers"))
    real = demo.mean_pool
    calls = []

    def off_first(hidden, mask):  # fastbert's embeddings (the first pooled) nudged off transformers'
        calls.append(1)
        pooled = real(hidden, mask)
        return torch.nn.functional.normalize(pooled + 0.01 * (len(calls) == 1), dim=-1)

    monkeypatch.setattr(demo, "mean_pool", off_first)
    with pytest.raises(RuntimeError, match="fastbert and transformers disagree: cosine"):
        demo.run(repeats=1)
