"""Masked-LM masking and next-sentence pairs: BERT's rates, specials untouched, seeded."""
import math
import random

import pytest
import torch

from fastbert.apps import data
from training_data import sentences, small_tokenizer, write_corpus


def within(count, n, p, sigmas=5.0):
    """Is count out of n consistent with probability p (a binomial, `sigmas` standard deviations)?"""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def tokenized_examples(tokenizer, n, seed=0):
    """n sentence pairs as the collator receives them: [CLS] a [SEP] b [SEP], unequal lengths."""
    rng = random.Random(seed)
    enc = tokenizer(sentences(n, rng), sentences(n, rng))
    return [{"input_ids": i, "token_type_ids": t} for i, t in zip(enc["input_ids"], enc["token_type_ids"])]


def test_masking_rates():
    tok = small_tokenizer()
    examples = tokenized_examples(tok, 400)  # ~10k tokens
    original = data.collate(examples, tok.pad_token_id)
    batch = data.MLMCollator(tok, seed=0)(examples)
    ids, labels = original["input_ids"], batch["labels"]
    maskable = original["attention_mask"].bool() & ~torch.isin(ids, torch.tensor(tok.all_special_ids))
    chosen = labels != -100
    n, n_chosen = int(maskable.sum()), int(chosen.sum())
    assert n > 5000
    assert within(n_chosen, n, 0.15), f"{n_chosen} of {n} tokens chosen, expected ~15%"
    assert torch.equal(labels[chosen], ids[chosen])  # labels: the original token
    assert torch.equal(batch["input_ids"][~chosen], ids[~chosen])  # nothing else changes
    new = batch["input_ids"][chosen]
    masked = int((new == tok.mask_token_id).sum())
    kept = int((new == ids[chosen]).sum())
    replaced = n_chosen - masked - kept
    # A random replacement equals the original 1 time in ~60 (this vocabulary): counted as kept.
    p_same = 0.1 / (len(tok) - len(tok.all_special_ids))
    assert within(masked, n_chosen, 0.8), f"[MASK] {masked} of {n_chosen}"
    assert within(kept, n_chosen, 0.1 + p_same), f"kept {kept} of {n_chosen}"
    assert within(replaced, n_chosen, 0.1 - p_same), f"random {replaced} of {n_chosen}"
    assert torch.equal(batch["attention_mask"], original["attention_mask"])
    assert torch.equal(batch["token_type_ids"], original["token_type_ids"])


def test_specials_and_padding_are_never_masked():
    tok = small_tokenizer()
    # "zebra" is not in the vocabulary: [UNK], a special token too.
    examples = tokenized_examples(tok, 50) + [{"input_ids": tok("zebra cat zebra")["input_ids"], "token_type_ids": [0] * 5}]
    original = data.collate(examples, tok.pad_token_id)
    batch = data.MLMCollator(tok, mlm_probability=0.9, seed=1)(examples)  # nearly everything else is chosen
    specials = torch.tensor(tok.all_special_ids)
    protected = torch.isin(original["input_ids"], specials) | (original["attention_mask"] == 0)
    assert int(protected.sum()) > 200 and int((original["attention_mask"] == 0).sum()) > 50
    assert bool((batch["labels"][protected] == -100).all())
    assert torch.equal(batch["input_ids"][protected], original["input_ids"][protected])
    # Random replacements are regular tokens: a special id appears only where one was.
    changed = batch["input_ids"] != original["input_ids"]
    assert int(changed.sum()) > 0
    assert not bool(torch.isin(batch["input_ids"][changed], specials[specials != tok.mask_token_id]).any())


def test_strings_are_tokenized_with_special_tokens():
    tok = small_tokenizer()
    batch = data.MLMCollator(tok, mlm_probability=0.5, max_length=8, seed=0)(["the cat sat on the mat .", "a dog"])
    assert batch["input_ids"].shape == (2, 8)  # cut to max_length, padded to the longest
    assert batch["input_ids"][:, 0].tolist() == [tok.cls_token_id] * 2
    assert batch["attention_mask"].sum(1).tolist() == [8, 4]


def test_same_seed_same_batch():
    tok = small_tokenizer()
    examples = tokenized_examples(tok, 64)
    a = data.MLMCollator(tok, seed=7)(examples)
    b = data.MLMCollator(tok, seed=7)(examples)
    c = data.MLMCollator(tok, seed=8)(examples)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["labels"], c["labels"])
    # A generator passed per call wins over the collator's own.
    collator = data.MLMCollator(tok, seed=123)
    d = collator(examples, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(a[k], d[k]) for k in a)


# ------------------------------------------------------------------------------ next sentence prediction


def numbered_documents(n_docs, per_doc, tokenizer):
    """Token-id documents whose sentences say where they come from: [first word id + doc, one + index]."""
    base = tokenizer.convert_tokens_to_ids("the")
    return [[[base + d, base + 20 + s] for s in range(per_doc)] for d in range(n_docs)]


def test_nsp_pairs_balance_and_structure():
    tok = small_tokenizer()
    docs = numbered_documents(20, 101, tok)
    pairs = data.nsp_pairs(docs, tok, max_length=16, generator=torch.Generator().manual_seed(0))
    assert len(pairs) == 20 * 100  # every sentence with a successor starts one pair
    labels = [p["next_sentence_label"] for p in pairs]
    assert within(labels.count(0), len(labels), 0.5), f"{labels.count(0)} IsNext of {len(labels)}"
    cls, sep = tok.cls_token_id, tok.sep_token_id
    for p in pairs:
        ids = p["input_ids"]
        assert ids[0] == cls and ids[3] == sep and ids[6] == sep and len(ids) == 7
        assert p["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
        (doc_a, sent_a), (doc_b, sent_b) = ids[1:3], ids[4:6]
        if p["next_sentence_label"] == 0:  # IsNext: the following sentence of the same document
            assert doc_b == doc_a and sent_b == sent_a + 1
        else:  # NotNext: a sentence from another document
            assert doc_b != doc_a


def test_nsp_pairs_are_seeded():
    tok = small_tokenizer()
    docs = numbered_documents(5, 30, tok)
    a = data.nsp_pairs(docs, tok, generator=torch.Generator().manual_seed(3))
    b = data.nsp_pairs(docs, tok, generator=torch.Generator().manual_seed(3))
    c = data.nsp_pairs(docs, tok, generator=torch.Generator().manual_seed(4))
    assert a == b and a != c


def test_nsp_pairs_truncate_the_longer_segment():
    tok = small_tokenizer()
    long, short = list(range(10, 40)), [7, 8, 9]
    pairs = data.nsp_pairs([[long, short], [short, long]] * 5, tok, max_length=12,
                           generator=torch.Generator().manual_seed(0))
    for p in pairs:
        ids, types = p["input_ids"], p["token_type_ids"]
        assert len(ids) == len(types) and ids[-1] == tok.sep_token_id
        n_a = types.count(0) - 2  # [CLS] a [SEP] | b [SEP]
        a, b = ids[1 : 1 + n_a], ids[2 + n_a : -1]
        if a == b == short:
            assert len(ids) == 9  # fits: nothing cut
            continue
        assert len(ids) == 12
        # "longest first": the 3-token sentence survives whole and the long one gives way, or two
        # long ones share the room.
        if short in (a, b):
            assert sorted((a, b)) == sorted((short, long[:6]))
        else:
            assert (a, b) in ((long[:5], long[:4]), (long[:4], long[:5]))


def test_nsp_needs_two_documents():
    tok = small_tokenizer()
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.nsp_pairs([[[5, 6], [7, 8]]], tok)


def test_read_corpus_and_tokenize(tmp_path):
    path = write_corpus(tmp_path / "corpus.txt", documents=4, per_document=3)
    docs = data.read_corpus(path)
    assert [len(d) for d in docs] == [3, 3, 3, 3]
    (tmp_path / "odd.txt").write_text("\n\n  first doc one\nfirst doc two  \n\n\n\nsecond doc\n", encoding="utf-8")
    assert data.read_corpus(tmp_path / "odd.txt") == [["first doc one", "first doc two"], ["second doc"]]
    tok = small_tokenizer()
    ids = data.tokenize_documents(docs, tok)
    assert ids[0][0] == tok(docs[0][0], add_special_tokens=False)["input_ids"]
    assert data.tokenize_documents([["the cat", ""], [""]], tok) == [[tok("the cat", add_special_tokens=False)["input_ids"]]]
