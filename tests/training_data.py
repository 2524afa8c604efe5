"""Small tokenizers and corpus files for the data and training tests (written locally, nothing downloaded)."""
import json
import random

import transformers

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a one two cat dog bird fish horse cow sat ran flew swam jumped slept on under over near beside "
         "mat tree house river field barn quickly slowly happily sadly big small red green blue old young "
         "good bad great awful fine movie film book song day night was is").split()


def small_tokenizer():
    """A BERT WordPiece tokenizer over WORDS (vocab of about 60): fast, with BERT's special tokens."""
    vocab = SPECIALS + ["."] + WORDS
    return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})


def sentences(n, rng, min_words=3, max_words=12):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + " ." for _ in range(n)]


def write_corpus(path, documents=12, per_document=6, seed=0):
    """One sentence per line, a blank line (sometimes two) between documents. Sentences follow a
    template (determiner, adjective, noun, verb, preposition, place) and each document keeps to one
    noun, so a model can learn both tasks: which word fits where, and which sentences belong together."""
    rng = random.Random(seed)
    words = {k: v.split() for k, v in dict(det="the a one two", adj="big small red green blue old young",
                                           noun="cat dog bird fish horse cow", verb="sat ran flew swam jumped slept",
                                           prep="on under over near beside", place="mat tree house river field barn").items()}
    with open(path, "w", encoding="utf-8") as f:
        for d in range(documents):
            noun = rng.choice(words["noun"])
            lines = [f"{rng.choice(words['det'])} {rng.choice(words['adj'])} {noun} {rng.choice(words['verb'])} "
                     f"{rng.choice(words['prep'])} the {rng.choice(words['place'])} ." for _ in range(per_document)]
            f.write("\n".join(lines) + "\n\n" + ("\n" if d % 3 == 0 else ""))
    return path


def sentiment_rows(n, seed=0):
    """(text, label) pairs a tiny model can learn: label 1 iff the text says "good" or "great"."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        positive = i % 2 == 0
        cue = rng.choice(["good", "great"] if positive else ["bad", "awful"])
        words = sentences(1, rng, 2, 5)[0].split()[:-1]
        words = [w for w in words if w not in ("good", "great", "bad", "awful")]
        words.insert(rng.randint(0, len(words)), cue)
        rows.append((" ".join(words), int(positive)))
    return rows


def write_csv(path, rows, label_names=None):
    with open(path, "w", encoding="utf-8") as f:
        f.write("text,label\n")
        for text, label in rows:
            f.write(f"\"{text}\",{label_names[label] if label_names else label}\n")
    return path


def write_jsonl(path, rows, label_names=None):
    with open(path, "w", encoding="utf-8") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": label_names[label] if label_names else label}) + "\n")
    return path
