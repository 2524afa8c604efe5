"""fastbert.encode and `python -m fastbert encode`: sentence-transformers' embeddings, in input order,
token-budget batches, resumable sharded output, clear errors for bad input."""
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastbert
from fastbert.apps.demo import minilm_dir
from fastbert.encode import load, token_budget_batches
from fastbert.testing import INT8, assert_matches

SENTENCES = [line for line in (Path(__file__).parent / "data" / "sentences.txt").read_text("utf-8").split("\n") if line]
ENCODE = sys.modules["fastbert.encode"]  # the module (fastbert.encode is the function)
TEXTS = SENTENCES[:100] + ["", "word " * 400]  # an empty text and one over MiniLM's 256-token limit


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


def test_equals_sentence_transformers_in_input_order(minilm):
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(minilm_dir(), device="cpu").encode(TEXTS, convert_to_tensor=True,
                                                                         normalize_embeddings=True)
    ours = fastbert.encode(minilm_dir(), TEXTS)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert_matches(ours, theirs, name="embeddings")


def test_streaming_windows_and_budgets_give_the_same_embeddings(minilm):
    model, tokenizer = minilm
    whole = fastbert.encode(model, TEXTS, tokenizer)
    streamed = fastbert.encode(model, iter(TEXTS), tokenizer, batch_tokens=300, window=7)
    assert_matches(streamed, whole, name="embeddings")
    cls = fastbert.encode(model, TEXTS[:5], tokenizer, pooling="cls", normalize=False)
    tokens = fastbert.encode(model, TEXTS[:5], tokenizer, pooling="none")
    assert cls.shape == (5, 384) and len(tokens) == 5 and tokens[0].shape[1] == 384
    assert_matches(cls, torch.stack([t[0] for t in tokens]), name="[CLS] states")
    assert fastbert.encode(model, [], tokenizer).shape == (0, 384)


def test_a_model_in_training_mode_is_encoded_without_dropout_and_left_in_it(minilm):
    model, tokenizer = minilm
    expected = fastbert.encode(model.eval(), TEXTS[:8], tokenizer)
    model.train()  # a fresh BertModel(config), or one just fine-tuned: dropout on
    try:
        assert_matches(fastbert.encode(model, TEXTS[:8], tokenizer), expected, name="embeddings")
        assert model.training
    finally:
        model.eval()


def test_token_budget_batches_cover_every_text_once_within_budget():
    lengths = [int(n) for n in torch.randint(1, 300, (500,))] + [900]
    batches = token_budget_batches(lengths, 1024)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024
        assert lengths[b[0]] == max(lengths[i] for i in b)


def test_the_cache_rule_sizes_forwards_by_the_cache_and_the_gemms_dtype(minilm, monkeypatch):
    model, _ = minilm
    tokens = ENCODE.cache_tokens(model, torch.device("cpu"))
    if tokens is not None:  # a power of two, at least 1024, from the machine's cache size
        assert tokens >= 1024 and tokens & (tokens - 1) == 0
    assert ENCODE.cache_tokens(model, torch.device("cuda")) is None  # GPUs: the budget as given
    if tokens is not None:  # sized by the dtype GEMMs write: bf16 halves it, unless they write float32 (onednn-fp32)
        dense_module, bf16 = sys.modules["fastbert.ops.dense"], fastbert.BertModel(model.config).to(torch.bfloat16)
        monkeypatch.setattr(dense_module, "gemm_output_dtype", lambda dtype, device: torch.float32)
        assert ENCODE.cache_tokens(bf16, torch.device("cpu")) == tokens
        monkeypatch.setattr(dense_module, "gemm_output_dtype", lambda dtype, device: dtype)
        assert ENCODE.cache_tokens(bf16, torch.device("cpu")) == 2 * tokens or tokens == 1024


def test_the_forward_width_is_measured_once_per_machine(monkeypatch, tmp_path):
    from fastbert import tuning

    monkeypatch.setenv("FASTBERT_CPU_TUNE", "1")
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    tuning.forget()
    try:
        config = fastbert.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
        model, cpu = fastbert.BertModel(config).eval(), torch.device("cpu")
        timed, measure = [], tuning._medians_ms  # the widths' trials (the layer's ops measure their variants too)
        monkeypatch.setattr(tuning, "_medians_ms",
                            lambda *a, **k: ("2048" in a[0] and timed.append(sorted(a[0]))) or measure(*a, **k))
        width = ENCODE.forward_tokens(model, cpu, 10000)
        assert timed == [["2048", "4096", "8192"]]  # the powers of two up to the budget
        assert width in (2048, 4096, 8192)
        (entry,) = [e for k, e in tuning.entries().items() if k.startswith("encode tokens")]
        assert entry["choice"] == str(width) and all(ms > 0 for ms in entry["ms"].values())
        tuning.forget()  # another process reads the file and measures nothing, and embeds no trial tokens
        embedded = []
        with monkeypatch.context() as patch:
            patch.setattr(model.embeddings, "forward", lambda *a, **k: embedded.append(1))
            assert ENCODE.forward_tokens(model, cpu, 10000) == width and len(timed) == 1 and not embedded
        # A budget past the widest trial: the trials stop there (10**9 random tokens were made and ran out of memory).
        assert ENCODE.forward_tokens(model, cpu, 10**9) <= ENCODE.WIDEST_TRIAL
        assert max(int(size) for size in timed[-1]) == ENCODE.WIDEST_TRIAL and len(timed) == 2
        assert ENCODE.forward_tokens(model, cpu, 3000) == 3000  # one candidate: nothing to measure
        assert ENCODE.forward_tokens(model, torch.device("cuda"), 10000) == 10000  # GPUs: the budget as given
        monkeypatch.setenv("FASTBERT_CPU_TUNE", "0")  # the static default: the cache rule
        assert ENCODE.forward_tokens(model, cpu, 10000) == min(10000, ENCODE.cache_tokens(model, cpu) or 10000)
        assert len(timed) == 2
    finally:
        tuning.forget()


def test_cpu_runs_the_budget_in_forwards_of_the_measured_width(minilm, monkeypatch):
    model, tokenizer = minilm
    monkeypatch.setattr(ENCODE, "forward_tokens", lambda model, device, budget: 256)
    seen = []
    windows = ENCODE.encode_windows(model, SENTENCES[:60], tokenizer, batch_tokens=10**6,
                                    on_batch=lambda texts, tokens: seen.append(tokens))
    embeddings = torch.cat([e for _, e in windows])
    assert len(seen) > 1 and max(seen) <= 256  # (no sentence here is longer than 256 tokens)
    assert_matches(embeddings, fastbert.encode(model, SENTENCES[:60], tokenizer, batch_tokens=10**6), name="embeddings")


def word_tokenizer(directory):
    """A WordPiece tokenizer over the words of SENTENCES: no checkpoint needed (the GPU machine has none)."""
    import transformers

    words = sorted({w for line in SENTENCES for w in re.findall(r"\w+|[^\w\s]", line.lower())})
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n", encoding="utf-8")
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_encode_equals_cpu_on_gpu_kernels(tmp_path):
    """On a GPU: every op on a GPU backend, the embeddings in input order equal to the CPU's in float32,
    and a bfloat16 model's close to them."""
    tokenizer = word_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = fastbert.BertModel(fastbert.BertConfig.tiny(vocab_size=len(tokenizer))).eval()
    want = fastbert.encode(model, TEXTS, tokenizer, batch_tokens=2000)
    gpu = copy.deepcopy(model).cuda()
    with fastbert.dispatch.record() as calls:
        got = fastbert.encode(gpu, TEXTS, tokenizer, batch_tokens=2000)
    assert calls and {c.backend for c in calls} <= {"cuda", "triton"}, sorted(set(calls))
    assert got.device.type == "cpu" and got.shape == want.shape
    assert_matches(got, want, name="embeddings")
    bf16 = fastbert.encode(gpu.to(torch.bfloat16), TEXTS, tokenizer, batch_tokens=2000)
    assert (bf16 * want).sum(-1).min() >= INT8.sentence_cosine


def test_bad_arguments_are_named(minilm):
    model, tokenizer = minilm
    with pytest.raises(ValueError, match="pooling must be one of"):
        fastbert.encode(model, ["a"], tokenizer, pooling="maximum")
    with pytest.raises(ValueError, match="max_length=600 is over the model's 512 positions"):
        fastbert.encode(model, ["a"], tokenizer, max_length=600)
    with pytest.raises(ValueError, match="text 1 is not valid Unicode"):
        fastbert.encode(model, ["a", json.loads('"a\\ud800b"')], tokenizer)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        fastbert.encode(model, ["a"])
    with pytest.raises(TypeError, match="text 1 is a int"):
        fastbert.encode(model, ["a", 3], tokenizer)
    with pytest.raises(ValueError, match="text 1 has 402 tokens, over max_length=256"):
        fastbert.encode(model, TEXTS[-2:], tokenizer, max_length=256, truncate=False)
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        fastbert.encode(model, ["a"], tokenizer, max_length=0)
    with pytest.raises(TypeError, match="got one str"):
        fastbert.encode(model, "a sentence", tokenizer)
    for name, value in (("batch_tokens", "100"), ("batch_tokens", 100.5), ("max_length", 5.5), ("window", True)):
        with pytest.raises(TypeError, match=f"{name} must be an int, got {re.escape(repr(value))}"):
            fastbert.encode(model, ["a"], tokenizer, **{name: value})
    assert fastbert.encode(model, ["a"], tokenizer, batch_tokens=np.int64(64), max_length=np.int32(8)).shape == (1, 384)
    with pytest.raises(TypeError, match="truncate must be True or False, got 'no'"):
        fastbert.encode(model, ["a"], tokenizer, truncate="no")
    with pytest.raises(TypeError, match="normalize must be True, False or None"):
        fastbert.encode(model, ["a"], tokenizer, normalize="no")
    with pytest.raises(ValueError, match="pooling='none' gives each text's token states, which are not normalized"):
        fastbert.encode(model, ["a"], tokenizer, pooling="none", normalize=True)
    # What is not a BERT encoder with weights is named.
    head = fastbert.BertForSequenceClassification(model.config)
    with pytest.raises(TypeError, match="BertForSequenceClassification, a model with a task head: pass its encoder"):
        fastbert.encode(head, ["a"], tokenizer)
    with pytest.raises(TypeError, match="encode\\(\\) takes a BERT encoder .* got dict"):
        fastbert.encode({}, ["a"], tokenizer)
    with torch.device("meta"):
        empty = fastbert.BertModel(model.config)
    with pytest.raises(ValueError, match="on the meta device"):
        fastbert.encode(empty, ["a"], tokenizer)


def test_a_model_whose_config_asks_for_other_outputs(tmp_path, tiny_bert_dir):
    """config.json's return_dict=False / output_attentions=True are a forward's defaults: encode asks for what
    it reads (it got a tuple and failed, or computed every attention probability)."""
    import shutil

    shutil.copytree(tiny_bert_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "return_dict": False, "output_attentions": True}))
    with fastbert.dispatch.record() as calls:
        got = fastbert.encode(str(tmp_path / "m"), SENTENCES[:5])
    assert "reference" not in {backend for _, backend in calls}
    assert torch.equal(got, fastbert.encode(tiny_bert_dir, SENTENCES[:5]))


def test_a_transformers_model_and_a_small_corpus_with_tuning_on(monkeypatch, tmp_path, tiny_bert_dir):
    """With measuring on: a transformers BertModel is encoded (the forward-width trial ran fastbert's layer
    signature on it and failed), and a corpus within the narrowest forward measures no width."""
    import transformers

    from fastbert import tuning

    monkeypatch.setenv("FASTBERT_CPU_TUNE", "1")
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    tuning.forget()
    try:
        model, tokenizer = load(tiny_bert_dir)
        hf = transformers.BertModel.from_pretrained(tiny_bert_dir)
        texts = SENTENCES[:150]  # past the narrowest forward: the width is chosen
        assert_matches(fastbert.encode(hf, texts, tokenizer), fastbert.encode(model, texts, tokenizer), name="embeddings")
        monkeypatch.setattr(ENCODE, "forward_tokens", lambda *a: pytest.fail("measured the width of one short text"))
        assert fastbert.encode(model, ["a short text"], tokenizer, batch_tokens=10**9).shape == (1, 64)
    finally:
        tuning.forget()


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A small random BERT with MiniLM's tokenizer, saved as a transformers directory."""
    import transformers

    directory = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128)
    transformers.BertModel(config).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(directory)
    return str(directory)


def _sentence_transformers_dir(base, path, pooling, normalize=True, prompt=None, include_prompt=True, lower=False,
                               dense=False, max_seq_length=None, truncate_dim=None):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models

    modules = [models.Transformer(base),
               models.Pooling(64, pooling_mode=pooling, include_prompt=include_prompt)]
    modules += [models.Dense(64, 32)] if dense else []
    modules += [models.Normalize()] if normalize else []
    model = st.SentenceTransformer(modules=modules, device="cpu", truncate_dim=truncate_dim)
    if max_seq_length:
        model.max_seq_length = max_seq_length
    if prompt:
        model.prompts, model.default_prompt_name = {"query": prompt}, "query"
    model.save(str(path))
    if lower:  # as hub models say it (sentence-transformers 6 bakes it into tokenizer.json, and loses it there)
        config = json.loads((path / "sentence_bert_config.json").read_text())
        (path / "sentence_bert_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
    return st.SentenceTransformer(str(path), device="cpu")  # what the directory says, as a user loads it


@pytest.mark.parametrize("pooling,options", [
    ("mean", {}), ("mean", dict(normalize=False)), ("cls", dict(normalize=False)), ("max", {}),
    ("mean_sqrt_len_tokens", dict(normalize=False)), ("weightedmean", {}), ("lasttoken", {}),
    ("mean", dict(prompt="query: ")), ("mean", dict(prompt="query: ", include_prompt=False)),
    ("cls", dict(prompt="query: ", include_prompt=False)), ("mean", dict(lower=True)),
    ("mean", dict(prompt="Query: ", include_prompt=False, lower=True)),
    ("mean", dict(prompt="a prompt longer than the texts may be " * 3, include_prompt=False, max_seq_length=12)),
    ("mean", dict(max_seq_length=8, left=True)), ("mean", dict(prompt="query: ", include_prompt=False, max_seq_length=8, left=True)),
    ("mean", dict(truncate_dim=16)), ("cls", dict(truncate_dim=16, normalize=False))],
    ids=str)
def test_a_sentence_transformers_directory_is_run_as_sentence_transformers_runs_it(tmp_path, tiny_bert_dir, pooling,
                                                                                  options):
    """Its pooling, Normalize (or none), default prompt (its tokens pooled or not), do_lower_case and
    truncate_dim, read from the directory: the embeddings sentence-transformers gives."""
    base = tiny_bert_dir
    if options.get("lower"):  # a cased tokenizer (on the uncased vocabulary): lowercasing the text changes its ids
        import shutil

        import transformers

        base = shutil.copytree(tiny_bert_dir, tmp_path / "cased")
        transformers.AutoTokenizer.from_pretrained(tiny_bert_dir, do_lower_case=False).save_pretrained(base)
    options = dict(options)
    if options.pop("left", False):  # a tokenizer that truncates from the start
        import shutil

        import transformers

        base = shutil.copytree(tiny_bert_dir, tmp_path / "left")
        transformers.AutoTokenizer.from_pretrained(tiny_bert_dir, truncation_side="left").save_pretrained(base)
    theirs = _sentence_transformers_dir(str(base), tmp_path / "st", pooling, **options)
    # "[SEP]" in a text is the special token (lowercasing must not make it "[sep]"); the tokenizer lowercases
    # a final sigma as Σ -> σ, where Python's str.lower() gives ς
    texts = ["The Cat sits on the mat.", "", "A longer sentence about the weather in Lisbon and Porto.", "Hi",
             "Before [SEP] after", "ΟΔΟΣ ΣΟΦΟΣ"]
    want = theirs.encode(texts, convert_to_tensor=True)
    ours = fastbert.encode(str(tmp_path / "st"), texts)
    assert ours.shape == want.shape
    assert_matches(ours, want, name="embeddings")
    if options.get("truncate_dim"):  # normalize=True: unit vectors, as sentence-transformers' normalize_embeddings=True
        unit = fastbert.encode(str(tmp_path / "st"), texts, normalize=True)
        assert_matches(unit, theirs.encode(texts, convert_to_tensor=True, normalize_embeddings=True), name="unit")
        assert torch.allclose(unit.norm(dim=1), torch.ones(len(texts)))
    if options.get("truncate_dim"):  # the command writes what the function gives
        from fastbert.apps.encode import run

        run(str(tmp_path / "st"), str(_txt(tmp_path, texts)), str(tmp_path / "out.npy"), progress=False)
        assert_matches(torch.from_numpy(np.load(tmp_path / "out.npy")), want, name="embeddings")


def test_a_sentence_transformers_directory_of_the_older_layout(tmp_path, tiny_bert_dir):
    """Older sentence-transformers saves keep the encoder (weights, tokenizer, sentence_bert_config.json) in a
    subfolder that modules.json names ("0_Transformer")."""
    import shutil

    theirs = _sentence_transformers_dir(tiny_bert_dir, tmp_path / "st", "cls", max_seq_length=9, lower=True)
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "st", old / "0_Transformer", ignore=shutil.ignore_patterns("1_Pooling", "2_Normalize", "modules.json"))
    for module in ("1_Pooling", "2_Normalize", "config_sentence_transformers.json"):
        shutil.move(old / "0_Transformer" / module if module.endswith(".json") else tmp_path / "st" / module, old / module)
    modules = json.loads((tmp_path / "st" / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (old / "modules.json").write_text(json.dumps(modules))
    texts = ["The Cat sits on the mat.", "A longer sentence about the weather in Lisbon and Porto.", ""]
    want = theirs.encode(texts, convert_to_tensor=True)
    assert_matches(pytest.importorskip("sentence_transformers").SentenceTransformer(str(old), device="cpu")
                   .encode(texts, convert_to_tensor=True), want, name="sentence-transformers on the older layout")
    assert_matches(fastbert.encode(str(old), texts), want, name="embeddings")


def test_a_max_seq_length_past_the_positions_stops_at_them(tmp_path, tiny_bert_dir):
    """sentence-transformers takes a max_seq_length over the model's positions (and fails on the first text that
    long); as fastbert's default it failed every run with max_length=1024, a value the user never gave."""
    from fastbert.apps.encode import run

    _sentence_transformers_dir(tiny_bert_dir, tmp_path / "st", "mean")
    config = tmp_path / "st" / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_seq_length": 1024}))
    st = pytest.importorskip("sentence_transformers").SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert st.max_seq_length == 1024
    model, tokenizer = load(str(tmp_path / "st"))
    assert ENCODE.default_max_length(model, tokenizer, str(tmp_path / "st")) == model.config.max_position_embeddings
    texts = SENTENCES[:4]
    assert run(str(tmp_path / "st"), str(_txt(tmp_path, texts)), str(tmp_path / "out.npy"), progress=False) == 4
    assert_matches(torch.from_numpy(np.load(tmp_path / "out.npy")), st.encode(texts, convert_to_tensor=True),
                   name="embeddings")


def test_a_sentence_transformers_pipeline_fastbert_cannot_run_is_refused(tmp_path, tiny_bert_dir):
    _sentence_transformers_dir(tiny_bert_dir, tmp_path, "mean", dense=True)
    with pytest.raises(ValueError, match="Transformer -> Pooling -> Dense -> Normalize"):
        fastbert.encode(str(tmp_path), ["a"])
    done = cli("--input", str(_txt(tmp_path, ["a"])), "--output", str(tmp_path / "out.npy"), model=str(tmp_path))
    assert done.returncode == 2 and "Dense" in done.stderr


def _txt(tmp_path, texts):
    path = tmp_path / "in.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def cli(*args, timeout=600, model=None):
    return subprocess.run([sys.executable, "-m", "fastbert", "encode", "--model", model or minilm_dir(), "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_command_txt_jsonl_parquet(tmp_path, minilm):
    model, tokenizer = minilm
    texts = SENTENCES[:40] + ["", "  spaced  "]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts))
                                       + "\n \n")  # blank lines closing the file are no records
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts}), tmp_path / "in.parquet")
    want = fastbert.encode(model, texts, tokenizer).numpy()
    for source, extra, out in (("in.txt", [], "a.npy"), ("in.jsonl", ["--field", "body"], "b.npy"),
                               ("in.parquet", ["--column", "body"], "c.parquet")):
        done = cli("--input", str(tmp_path / source), "--output", str(tmp_path / out), "--shard-texts", "16", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        got = np.load(tmp_path / out) if out.endswith(".npy") else np.stack(
            pq.read_table(tmp_path / out)["embedding"].to_numpy(zero_copy_only=False))
        assert got.shape == (len(texts), 384), source  # the empty lines are texts too
        assert_matches(torch.from_numpy(got), torch.from_numpy(want), name=source)
        assert not (tmp_path / (out + ".parts")).exists()


def test_command_int8_and_bf16_stay_close_to_fp32(tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES[:60]) + "\n", encoding="utf-8")
    outs = {}
    for dtype in ("fp32", "bf16", "int8"):
        done = cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / f"{dtype}.npy"), "--dtype", dtype)
        assert done.returncode == 0, done.stderr[-2000:]
        outs[dtype] = np.load(tmp_path / f"{dtype}.npy")
    for dtype in ("bf16", "int8"):
        cosine = (outs[dtype] * outs["fp32"]).sum(-1)
        assert cosine.min() >= INT8.sentence_cosine, (dtype, cosine.min())


@pytest.mark.parametrize("content,extra,message", [
    (b"fine\nbad \xff byte\n", [], "in.txt line 2: not UTF-8 \\(byte 0xff at column 5\\)"),
    (b'{"text": "a"}\n{"other": "b"}\n', ["--field", "text"], "in.jsonl line 2: no field 'text'"),
    (b'{"text": "a"}\nnot json\n', ["--field", "text"], "in.jsonl line 2: not JSON"),
    (b'{"text": "a"}\n \n\n{"text": "b"}\n', ["--field", "text"], "in.jsonl line 2: blank \\(a .jsonl line holds one record\\)"),
    (b"short\n" + b"word " * 400 + b"\n", [], "in.txt line 2: 402 tokens, over max_length 256 \\(--truncate"),
    (b'{"text": "a"}\n{"text": "a\\ud800b"}\n', ["--field", "text"], "in.jsonl line 2: field 'text' is not valid Unicode"),
    (b"first\rsecond\rthird\r", [], "in.txt line 1: the file's lines end in a carriage return \\(\\\\r\\) alone"),
])
def test_command_bad_input_names_the_line(tmp_path, content, extra, message):
    name = "in.jsonl" if extra else "in.txt"
    (tmp_path / name).write_bytes(content)
    done = cli("--input", str(tmp_path / name), "--output", str(tmp_path / "out.npy"), *extra)
    assert done.returncode == 2
    assert re.search(message, done.stderr), done.stderr[-1000:]


def test_command_truncate_cuts_long_texts(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"short\n" + b"word " * 400 + b"\n")
    done = cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy"), "--truncate")
    assert done.returncode == 0, done.stderr[-1000:]
    assert np.load(tmp_path / "out.npy").shape == (2, 384)


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    texts = [f"{i}: {s}" for i, s in enumerate(SENTENCES * 6)]  # 1920 distinct texts, 60 shards of 32
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    whole = cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "whole.npy"), "--shard-texts", "32")
    assert whole.returncode == 0, whole.stderr[-2000:]
    out, parts = tmp_path / "part.npy", tmp_path / "part.npy.parts"
    args = [sys.executable, "-m", "fastbert", "encode", "--model", minilm_dir(), "--no-progress",
            "--input", str(tmp_path / "in.txt"), "--output", str(out), "--shard-texts", "32"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(parts.glob("0*.npy"))) < 3 and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    kept = len(list(parts.glob("0*.npy")))
    assert not out.exists() and 3 <= kept < 60, "the run should have been stopped halfway"
    resumed = cli("--input", str(tmp_path / "in.txt"), "--output", str(out), "--shard-texts", "32")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming after {kept} complete shards ({kept * 32} texts)" in resumed.stderr
    a, b = np.load(tmp_path / "whole.npy"), np.load(out)
    assert a.shape == b.shape == (len(texts), 384)
    assert np.array_equal(a, b)  # same shards, same batches: the same numbers, none lost or doubled
    # Other settings on a leftover run are refused, not mixed in.
    os.makedirs(str(out) + ".parts")
    (Path(str(out) + ".parts") / "manifest.json").write_text(json.dumps({"dtype": "bf16"}))
    np.save(Path(str(out) + ".parts") / "000000.npy", a[:32])
    refused = cli("--input", str(tmp_path / "in.txt"), "--output", str(out), "--shard-texts", "32")
    assert refused.returncode == 2 and "--restart" in refused.stderr


def _stopped_after(monkeypatch, shards):
    """Make the next command.run stop (KeyboardInterrupt) once `shards` shards are written (fewer than the run's)."""
    windows = ENCODE.encode_windows

    def stopping(*args, **kwargs):
        for n, item in enumerate(windows(*args, **kwargs)):
            if n == shards:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(ENCODE, "encode_windows", stopping)


@pytest.mark.parametrize("damage", ["empty", "header-only", "cut-short"])
def test_a_damaged_shard_is_encoded_again(tmp_path, tiny_bert_dir, monkeypatch, capfd, damage):
    """A shard renamed before its bytes reached the disk (a crash: the rename went first) was counted as
    complete by its name; the resumed run then died assembling it, and every resume after it."""
    from fastbert.apps.encode import run

    texts, out = _txt(tmp_path, SENTENCES[:12]), tmp_path / "out.npy"
    _stopped_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_bert_dir, str(texts), str(out), shard_texts=4, progress=False)
    monkeypatch.undo()
    shard = Path(str(out) + ".parts") / "000001.npy"
    data = shard.read_bytes()
    shard.write_bytes({"empty": b"", "header-only": data[:128], "cut-short": data[:-4]}[damage])
    capfd.readouterr()
    assert run(tiny_bert_dir, str(texts), str(out), shard_texts=4, progress=False) == 12
    err = capfd.readouterr().err
    assert "000001.npy is damaged" in err and "resuming after 1 complete shards" in err
    run(tiny_bert_dir, str(texts), str(tmp_path / "whole.npy"), shard_texts=4, progress=False)
    assert np.array_equal(np.load(out), np.load(tmp_path / "whole.npy"))  # nothing lost or doubled


def test_another_runs_shards_past_a_gap_are_refused(tmp_path, tiny_bert_dir, monkeypatch):
    """Shards 000001 on of an earlier run whose 000000 is gone (its clean-up interrupted, or deleted by hand)
    were not checked against the run's settings: a new run over other texts, stopped and resumed, took
    them for its own (20 rows out of 8 texts)."""
    from fastbert.apps.encode import InputError, run

    out, parts = tmp_path / "out.npy", Path(str(tmp_path / "out.npy") + ".parts")
    _stopped_after(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_bert_dir, str(_txt(tmp_path, SENTENCES[:20])), str(out), shard_texts=4, progress=False)
    monkeypatch.undo()
    (parts / "000000.npy").unlink()
    other = tmp_path / "other.txt"
    other.write_text("\n".join(SENTENCES[20:28]) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="holds a run with other settings or input \\(input.*--restart"):
        run(tiny_bert_dir, str(other), str(out), shard_texts=4, progress=False)
    assert run(tiny_bert_dir, str(other), str(out), shard_texts=4, restart=True, progress=False) == 8


def test_an_output_that_is_the_input_is_refused(tmp_path, tiny_bert_dir):
    """--output naming the input parquet replaced the corpus with its embeddings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastbert.apps.encode import InputError, run

    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": SENTENCES[:3]}), corpus)
    (tmp_path / "link.parquet").symlink_to(corpus)
    with pytest.raises(InputError, match="is the input: the embeddings would replace the texts"):
        run(tiny_bert_dir, str(corpus), str(tmp_path / "link.parquet"), column="text", progress=False)
    assert pq.read_table(corpus).column_names == ["text"]


@pytest.mark.parametrize("name,options,message", [
    ("in.jsonl", {}, "a .jsonl input needs --field"),
    ("in.txt", {"column": "body"}, "--column is for .parquet inputs"),
    ("in.csv", {}, "the input must be .txt, .jsonl or .parquet"),
    ("missing.txt", {}, "missing.txt: no such file"),
    ("in.txt", {"batch_tokens": 0}, "--batch-tokens must be at least 1, got 0"),
    ("in.txt", {"shard_texts": 0}, "--shard-texts must be at least 1, got 0"),
    ("in.txt", {"max_length": 1}, "--max-length must be at least 2, got 1"),
    ("in.txt", {"max_length": 600}, "--max-length 600 is over the model's 512 positions"),
    ("in.txt", {"pooling": "maximum"}, "pooling must be one of"),
    ("in.parquet", {"column": "text"}, "in.parquet: not a readable parquet file"),
])
def test_command_usage_errors_leave_nothing_behind(tmp_path, name, options, message):
    from fastbert.apps.encode import InputError, run

    for existing in ("in.txt", "in.jsonl", "in.csv", "in.parquet"):
        (tmp_path / existing).write_text("a\n")
    out = tmp_path / "out.npy"
    with pytest.raises(InputError, match=message):
        run(minilm_dir(), str(tmp_path / name), str(out), progress=False, **options)
    assert not Path(str(out) + ".parts").exists()  # so the corrected command is not taken for a changed run


@pytest.mark.parametrize("lacks,message", [
    (("tokenizer.json", "vocab.txt"), "has no tokenizer \\(tokenizer.json or vocab.txt\\)"),
    (("config.json",), "config.json"), (("model.safetensors",), "model.safetensors|weights")])
def test_a_model_directory_missing_files_is_named(tmp_path, tiny_bert_dir, lacks, message):
    """Without its tokenizer files transformers would make one of 5 special tokens from config.json (every
    word [UNK], embeddings of nothing, no error); a missing config or weights file is named, not a traceback."""
    import shutil

    from fastbert.apps.encode import InputError, run

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    for name in lacks:
        (model / name).unlink(missing_ok=True)
    texts = _txt(tmp_path, ["The cat sits on the mat."])
    with pytest.raises(InputError, match=message):
        run(str(model), str(texts), str(tmp_path / "out.npy"), progress=False)
    if "vocab.txt" in lacks:
        with pytest.raises(ValueError, match=message):
            fastbert.encode(str(model), ["a"])
        import transformers  # a tokenizer given with the directory serves

        tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert_dir)
        assert_matches(fastbert.encode(str(model), ["a cat"], tokenizer=tokenizer),
                       fastbert.encode(tiny_bert_dir, ["a cat"]), name="with the tokenizer given")


def test_command_empty_input_and_byte_order_mark(tmp_path, minilm):
    from fastbert.apps.encode import run

    (tmp_path / "empty.txt").write_bytes(b"")
    assert run(minilm_dir(), str(tmp_path / "empty.txt"), str(tmp_path / "empty.npy"), progress=False) == 0
    assert np.load(tmp_path / "empty.npy").shape == (0, 384)
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"t": "a cat"}\n')
    run(minilm_dir(), str(tmp_path / "bom.jsonl"), str(tmp_path / "bom.npy"), field="t", progress=False)
    model, tokenizer = minilm
    assert_matches(torch.from_numpy(np.load(tmp_path / "bom.npy")), fastbert.encode(model, ["a cat"], tokenizer),
                   name="after a byte order mark")


def test_a_model_saved_again_in_place_is_not_resumed_into(tmp_path, capfd):
    import shutil

    from fastbert.apps.encode import InputError, run

    model_dir = tmp_path / "model"
    shutil.copytree(minilm_dir(), model_dir)
    texts = SENTENCES[:7] + ["word " * 400] + SENTENCES[7:10]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    common = dict(progress=False, shard_texts=2)
    # Stopped by the long text (line 8): the shards of lines 1-6 stay, as after an interrupted run.
    with pytest.raises(InputError, match="line 8: 402 tokens"):
        run(str(model_dir), str(tmp_path / "in.txt"), str(out), **common)
    assert len(list(Path(str(out) + ".parts").glob("0*.npy"))) == 3
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    weights.write_bytes(weights.read_bytes())  # saved again: another model as far as the shards can tell
    with pytest.raises(InputError, match="model_files"):
        run(str(model_dir), str(tmp_path / "in.txt"), str(out), truncate=True, **common)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    capfd.readouterr()
    # The same model again, now cutting the long text: the 3 shards hold no long text, so they are kept.
    assert run(str(model_dir), str(tmp_path / "in.txt"), str(out), truncate=True, **common) == len(texts)
    assert "resuming after 3 complete shards" in capfd.readouterr().err
    whole = tmp_path / "whole.npy"
    run(str(model_dir), str(tmp_path / "in.txt"), str(whole), truncate=True, **common)
    assert np.array_equal(np.load(out), np.load(whole))


def test_an_input_replaced_with_its_size_and_mtime_is_not_resumed_into(tmp_path, tiny_bert_dir):
    """A corrected input copied over the old one with cp -p / rsync -a: same size, same mtime, other texts
    (here only in the middle of a 3 MiB file)."""
    from fastbert.apps.encode import InputError, run

    path = tmp_path / "in.txt"
    filler = ["a few more words"] * 200_000
    path.write_text("\n".join(SENTENCES[:7] + ["word " * 600] + filler) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 8"):  # stopped there: the shards of lines 1-6 stay
        run(tiny_bert_dir, str(path), str(tmp_path / "out.npy"), progress=False, shard_texts=2)
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = data.index(b"few", len(data) // 2)
    data[middle:middle + 3] = b"FEW"  # in the filler, after where the run stopped
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(InputError, match="input_sha256"):
        run(tiny_bert_dir, str(path), str(tmp_path / "out.npy"), progress=False, shard_texts=2, truncate=True)


@pytest.mark.parametrize("linked", [None, "model", "output", "resumed"])
def test_an_output_inside_the_model_directory_resumes(tmp_path, tiny_bert_dir, monkeypatch, linked):
    """The run's own shards are not the model's files: a run writing into the model's directory resumes,
    also where the model or the output is named through a symlink to the directory (linked), or the
    resumed run names the model through one."""
    import shutil

    from fastbert.apps import encode as command

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    texts = _txt(tmp_path, SENTENCES[:6])
    via = lambda part: str((tmp_path / "link") if linked == part else model)  # noqa: E731
    out = os.path.join(via("output"), "out.npy")
    stopped = lambda *args: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731  (stops after the last shard)
    monkeypatch.setattr(command, "_assemble", stopped)
    with pytest.raises(KeyboardInterrupt):
        command.run(via("model"), str(texts), out, shard_texts=2, progress=False)
    monkeypatch.undo()
    command.run(via("model") if linked != "resumed" else str(tmp_path / "link"), str(texts), out, shard_texts=2,
                progress=False)
    assert_matches(torch.from_numpy(np.load(out)), fastbert.encode(str(model), SENTENCES[:6]), name="embeddings")


def test_a_directory_saved_int8_is_loaded_as_int8_only(tmp_path, tiny_bert_dir):
    import transformers

    model = fastbert.quantize(fastbert.BertModel.from_pretrained(tiny_bert_dir))
    model.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(tmp_path)
    for dtype in ("fp32", "bf16"):
        with pytest.raises(ValueError, match=f"holds an int8 model \\(saved quantized\\): its dtype is int8, not {dtype}"):
            load(tmp_path, dtype)
    loaded, tokenizer = load(tmp_path, "int8")
    # encode() of the directory runs it as saved.
    assert torch.equal(fastbert.encode(str(tmp_path), SENTENCES[:5]), fastbert.encode(loaded, SENTENCES[:5], tokenizer))
    with torch.inference_mode():
        ids = torch.randint(1000, 2000, (2, 7))
        assert_matches(loaded(ids).last_hidden_state.float(), model.to(loaded.embeddings.word_embeddings.weight.dtype)
                       (ids).last_hidden_state.float(), name="int8 model")
    # So does the command without --dtype (it refused: "its dtype is int8, not fp32").
    texts = tmp_path / "in.txt"
    texts.write_text("\n".join(SENTENCES[:5]) + "\n", encoding="utf-8")
    done = cli("--input", str(texts), "--output", str(tmp_path / "out.npy"), model=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "out.npy")), fastbert.encode(str(tmp_path), SENTENCES[:5]))


def test_a_run_whose_manifest_predates_a_recipe_field_resumes(tmp_path, tiny_bert_dir, capfd):
    """A run started by a fastbert without a recipe field (truncate_dim, unit) ran as that field's default:
    resumed, not refused with "pass --restart"."""
    from fastbert.apps.encode import InputError, run

    texts = SENTENCES[:5] + ["word " * 600] + SENTENCES[5:8]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out, common = tmp_path / "out.npy", dict(progress=False, shard_texts=2, normalize=True)
    with pytest.raises(InputError, match="line 6"):  # stopped there: the shards of lines 1-4 stay
        run(tiny_bert_dir, str(tmp_path / "in.txt"), str(out), **common)
    manifest = Path(str(out) + ".parts") / "manifest.json"
    old = json.loads(manifest.read_text())
    for field in ("truncate_dim", "unit"):
        del old["recipe"][field]
    manifest.write_text(json.dumps(old))
    capfd.readouterr()
    assert run(tiny_bert_dir, str(tmp_path / "in.txt"), str(out), truncate=True, **common) == len(texts)
    assert "resuming after 2 complete shards" in capfd.readouterr().err
    whole = tmp_path / "whole.npy"
    run(tiny_bert_dir, str(tmp_path / "in.txt"), str(whole), truncate=True, **common)
    assert np.array_equal(np.load(out), np.load(whole))


def test_load_fp32_of_a_bfloat16_checkpoint_is_float32(tmp_path, tiny_bert_dir):
    """from_pretrained loads a checkpoint in its own dtype (transformers 5's default); encode's "fp32" asks for
    float32 whatever the checkpoint was saved in."""
    from fastbert.encode import load

    model, tokenizer = load(tiny_bert_dir)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert {p.dtype for p in fastbert.BertModel.from_pretrained(tmp_path).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load(str(tmp_path), "fp32")[0].parameters()} == {torch.float32}
