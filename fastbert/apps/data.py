"""Training data for BERT: masked-LM masking, next-sentence pairs, padding, with a transformers tokenizer.

Everything random takes a torch.Generator, so the same seed gives the same batches (and a resumed
run the same batches as an uninterrupted one).

Corpus format for pretraining: a text file with one sentence per line; blank lines separate documents.
"""
from __future__ import annotations

import io

import torch

from fastbert.apps import InputError

IGNORE = -100  # label of positions that are not scored (cross_entropy's ignore_index)


def utf8_text(path) -> str:
    """The file's text (a UTF-8 byte order mark dropped); bytes that are not UTF-8 are named by line and
    column (a decoder reading in chunks counted its offset from the chunk's start)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise InputError(f"{path} line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column})") from None


def read_corpus(path) -> list[list[str]]:
    """Documents (lists of sentences) from a file with one sentence per line, documents separated by
    blank lines."""
    documents, current = [], []
    for line in io.StringIO(utf8_text(path), newline=None):  # lines as open() splits them (\n, \r\n, \r)
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    return documents


def tokenize_documents(documents: list[list[str]], tokenizer) -> list[list[list[int]]]:
    """Token ids of every sentence, without special tokens; sentences that tokenize to nothing are dropped."""
    sentences = [s for doc in documents for s in doc]
    ids = tokenizer(sentences, add_special_tokens=False)["input_ids"] if sentences else []  # one call: fast
    tokenized, start = [], 0
    for doc in documents:
        sentence_ids = [t for t in ids[start : start + len(doc)] if t]
        start += len(doc)
        if sentence_ids:
            tokenized.append(sentence_ids)
    return tokenized


def _truncate_pair(a: list[int], b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the end of the longer segment until both fit (transformers' 'longest_first')."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        (a if len(a) >= len(b) else b).pop()
    return a, b


def nsp_pairs(documents: list[list[list[int]]], tokenizer, max_length: int = 128,
              generator: torch.Generator | None = None) -> list[dict]:
    """One next-sentence-prediction example per sentence that has a successor in its document.

    Segment A is the sentence; segment B is, with probability 1/2, the next sentence (label 0, IsNext)
    and otherwise a random sentence from another document (label 1, NotNext), as in BERT. Examples are
    `[CLS] A [SEP] B [SEP]`, cut to max_length by trimming the longer segment.
    """
    if max_length < 5:
        raise InputError(f"max_length must be at least 5 ([CLS] a [SEP] b [SEP]), got {max_length}")
    sentences = [(d, s) for d, doc in enumerate(documents) for s in range(len(doc))]  # all, by document
    first = [0]  # where each document starts in `sentences`
    for doc in documents[:-1]:
        first.append(first[-1] + len(doc))
    if len(documents) < 2:
        raise InputError("next-sentence prediction needs at least 2 documents (separate them with blank lines)")
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    examples = []
    for d, doc in enumerate(documents):
        for s in range(len(doc) - 1):
            a = doc[s]
            if torch.rand((), generator=generator) < 0.5:
                b, label = doc[s + 1], 0
            else:
                # A random sentence of another document: draw among the others, skipping document d's.
                i = int(torch.randint(len(sentences) - len(doc), (), generator=generator))
                d2, s2 = sentences[i if i < first[d] else i + len(doc)]
                b, label = documents[d2][s2], 1
            a, b = _truncate_pair(a, b, max_length - 3)
            examples.append({"input_ids": [cls, *a, sep, *b, sep],
                             "token_type_ids": [0] * (len(a) + 2) + [1] * (len(b) + 1),
                             "next_sentence_label": label})
    if not examples:
        raise InputError("no sentence pairs: every document has a single sentence")
    return examples


def pad(sequences: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ints to the longest: [B, S] int64."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), value, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Examples with input_ids (and optional token_type_ids, next_sentence_label, label) -> padded tensors."""
    ids = [e["input_ids"] for e in examples]
    batch = {"input_ids": pad(ids, pad_token_id), "attention_mask": pad([[1] * len(s) for s in ids], 0)}
    if "token_type_ids" in examples[0]:
        batch["token_type_ids"] = pad([e["token_type_ids"] for e in examples], 0)
    for key in ("next_sentence_label", "label"):
        if key in examples[0]:
            batch[key] = torch.tensor([e[key] for e in examples], dtype=torch.long)
    return batch


def mask_tokens(input_ids: torch.Tensor, maskable: torch.Tensor, mask_token_id: int, random_ids: torch.Tensor,
                mlm_probability: float = 0.15, generator: torch.Generator | None = None):
    """BERT's masking: each maskable token is chosen with probability mlm_probability; a chosen token
    becomes [MASK] 80% of the time, a random token (drawn from `random_ids`) 10%, and stays 10%.
    Returns (masked input_ids, labels): labels hold the original id at chosen positions, -100 elsewhere."""
    chosen = (torch.rand(input_ids.shape, generator=generator) < mlm_probability) & maskable
    labels = torch.where(chosen, input_ids, IGNORE)
    r = torch.rand(input_ids.shape, generator=generator)  # one draw decides mask / random / keep
    to_mask = chosen & (r < 0.8)
    to_random = chosen & (r >= 0.8) & (r < 0.9)
    random_tokens = random_ids[torch.randint(len(random_ids), input_ids.shape, generator=generator)]
    masked = torch.where(to_mask, mask_token_id, input_ids)
    masked = torch.where(to_random, random_tokens, masked)
    return masked, labels


class MLMCollator:
    """Pads examples into a batch and masks it for masked-LM training.

    Examples are strings (tokenized here, with special tokens, cut to max_length) or dicts with
    input_ids that already carry [CLS]/[SEP] (e.g. from nsp_pairs). Special tokens and padding are
    never masked; random replacements are drawn from the non-special vocabulary.

        collator = MLMCollator(tokenizer, seed=0)
        batch = collator(["a sentence", "another one"])  # input_ids, attention_mask, token_type_ids, labels
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, max_length: int = 128, seed: int | None = None):
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise InputError("the tokenizer needs a mask token and a pad token for masked-LM training")
        if not 0.0 < mlm_probability < 1.0:
            raise InputError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.max_length = max_length
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
        vocab = torch.arange(len(tokenizer))
        self.random_ids = vocab[~torch.isin(vocab, self.special_ids)]
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def __call__(self, examples: list, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if examples and isinstance(examples[0], str):
            enc = self.tokenizer(examples, truncation=True, max_length=self.max_length)
            examples = [{"input_ids": i, "token_type_ids": t} for i, t in zip(enc["input_ids"], enc["token_type_ids"])]
        batch = collate(examples, self.tokenizer.pad_token_id)
        ids = batch["input_ids"]
        maskable = batch["attention_mask"].bool() & ~torch.isin(ids, self.special_ids)
        batch["input_ids"], batch["labels"] = mask_tokens(ids, maskable, self.tokenizer.mask_token_id, self.random_ids,
                                                          self.mlm_probability, generator or self.generator)
        return batch
