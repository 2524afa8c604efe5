"""Training: transformers' loss and gradients, gradient checkpointing, the pretrain / finetune commands,
exact resume, gradient accumulation and DDP equal to one process on the whole batch."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import fastbert
from fastbert import testing
from fastbert.apps import data, train
from fastbert.__main__ import main
from fastbert.testing import assert_matches
from hf_twins import padded_batch, twins
from training_data import small_tokenizer, sentiment_rows, write_corpus, write_csv, write_jsonl

# A small BERT over the small tokenizer's vocabulary (about 60 tokens).
SMALL = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(autouse=True)
def one_thread():
    # These shapes are tiny: on a busy machine, waiting for a second OpenMP thread costs ~100x the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pretraining_stream(tmp_path, tok, batch_size, seed=0, max_length=32):
    """The pretrain command's batches (NSP pairs, masked) over a small corpus file."""
    documents = data.tokenize_documents(data.read_corpus(write_corpus(tmp_path / "corpus.txt")), tok)
    return train.BatchStream(lambda g: data.nsp_pairs(documents, tok, max_length, g), data.MLMCollator(tok),
                             batch_size, seed)


def assert_same_gradients(ours, theirs):
    testing.assert_same_gradients(ours, theirs)


# ------------------------------------------------------------------------------ parity with transformers


def test_training_step_matches_transformers(tmp_path):
    tok = small_tokenizer()
    ours, theirs = twins(model_class="BertForPreTraining", vocab_size=len(tok), **SMALL)
    ours.train(), theirs.train()  # dropout is 0: training mode changes no number
    batch = pretraining_stream(tmp_path, tok, batch_size=8).next()
    assert 0 < int((batch["labels"] != -100).sum()) and int(batch["next_sentence_label"].sum()) not in (0, 8)
    counts = train.step_counts(batch)
    loss_ours = train.pretraining_loss(ours, batch, counts)
    loss_theirs = train.pretraining_loss(theirs, batch, counts)
    assert_matches(loss_ours, loss_theirs, name="loss")
    # The loop's loss on a whole batch is the one BertForPreTraining computes from labels.
    builtin = theirs(**batch_inputs(batch), labels=batch["labels"], next_sentence_label=batch["next_sentence_label"]).loss
    assert_matches(loss_theirs, builtin, name="loss vs BertForPreTraining's own")
    loss_ours.backward()
    loss_theirs.backward()
    assert_same_gradients(ours, theirs)


def batch_inputs(batch):
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


def test_adamw_steps_match_transformers(tmp_path):
    """20 AdamW steps (warmup, decay, clipping) on the same batches: the loss curves agree step by step."""
    tok = small_tokenizer()
    ours, theirs = twins(model_class="BertForPreTraining", vocab_size=len(tok), **SMALL)
    curves = {}
    for name, model in (("fastbert", ours), ("transformers", theirs)):
        model.train()
        optimizer = train.make_optimizer(model, lr=1e-3, weight_decay=0.01)
        scheduler = train.linear_schedule(optimizer, warmup_steps=4, total_steps=20)
        stream = pretraining_stream(tmp_path, tok, batch_size=8)  # a fresh stream: the same 20 batches
        curves[name] = []
        for _ in range(20):
            batch = stream.next()
            loss = train.pretraining_loss(model, batch, train.step_counts(batch))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            curves[name].append(float(loss.detach()))
    a, b = curves["fastbert"], curves["transformers"]
    assert sum(a[-5:]) < sum(a[:5]), f"the loss did not go down: {a}"
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    print(f"20 AdamW steps: loss curves differ by at most {worst:.3g} (relative)")
    assert_matches(torch.tensor(a), torch.tensor(b), name="loss curve")


# ------------------------------------------------------------------------------ gradient checkpointing


def saved_activation_bytes(model, batch) -> int:
    """Bytes of the distinct tensors autograd keeps for backward over one forward, parameters excluded
    (with checkpointing: each layer's input, and what the layers outside the encoder save)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = train.pretraining_loss(model, batch, train.step_counts(batch))
    loss.backward()
    return sum(kept.values())


def masked_batch(vocab_size, batch_size, seq, seed=0):
    """A random pretraining batch: padded rows, ~15% of tokens scored, NSP labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, seq // 2 :] = 0
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.15) & (mask == 1), ids, -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": labels, "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=g)}


CHECKPOINTING = {  # (enable, every n-th layer recomputed), as transformers' methods of these names take them
    "every layer": (lambda m: m.activation_checkpointing_enable(), 1),
    "every 2nd, reentrant": (lambda m: m.activation_checkpointing_enable({"use_reentrant": True}, every_n_layers=2), 2),
    "offloaded": (lambda m: m.activation_checkpointing_enable(offload=True), 1),
    "transformers 4 name": (lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}), 1),
}


@pytest.mark.parametrize("enable,every", CHECKPOINTING.values(), ids=CHECKPOINTING.keys())
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_gives_the_same_gradients(dropout, enable, every):
    cfg = fastbert.BertConfig(vocab_size=100, **SMALL, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = fastbert.BertForPreTraining(cfg).train()
    batch = masked_batch(100, 4, 16)
    grads = {}
    for checkpointing in (False, True):
        if checkpointing:
            enable(model)
            runs = [0] * len(model.bert.encoder.layer)
            for i, layer in enumerate(model.bert.encoder.layer):
                layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        assert model.is_gradient_checkpointing == model.is_activation_checkpointing == checkpointing
        model.zero_grad()
        torch.manual_seed(0)  # the same dropout masks; checkpointing replays them in the recomputation
        train.pretraining_loss(model, batch, train.step_counts(batch)).backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_same_gradients(grads[True], grads[False])
    assert runs == [2 if i % every == 0 else 1 for i in range(len(runs))]  # checkpointed layers run again
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="every_n_layers"):
            model.activation_checkpointing_enable(every_n_layers=bad)


def test_gradient_checkpointing_keeps_less_for_backward():
    cfg = fastbert.BertConfig(vocab_size=100, hidden_size=64, num_attention_heads=2, num_hidden_layers=4,
                              intermediate_size=256, **NO_DROPOUT)
    model = fastbert.BertForPreTraining(cfg).train()
    batch = masked_batch(100, 4, 64)
    plain = saved_activation_bytes(model, batch)
    model.gradient_checkpointing_enable()
    checkpointed = saved_activation_bytes(model, batch)
    print(f"bytes saved for backward: {plain} without checkpointing, {checkpointed} with")
    # Four layers of activations against four layer inputs: well under half.
    assert checkpointed < 0.5 * plain, f"{checkpointed} bytes with checkpointing, {plain} without"
    # Only while training with gradients: evaluation is a plain forward.
    model.eval()
    assert saved_activation_bytes(model, batch) == plain


# ------------------------------------------------------------------------------ the commands


def run(*argv):
    """python -m fastbert ARGV, in this process."""
    assert main([str(a) for a in argv]) == 0


def refused(capsys, message, *argv):
    """python -m fastbert ARGV stops with one line naming the problem (exit status 2), no traceback."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastbert {argv[0]}: ") and err.count("\n") == 1 and re.search(message, err), err


@pytest.fixture
def corpus(tmp_path):
    """A corpus file and a tokenizer directory for it."""
    small_tokenizer().save_pretrained(tmp_path / "tok")
    return write_corpus(tmp_path / "corpus.txt"), tmp_path / "tok"


def pretrain_args(corpus, out, *extra):
    path, tok = corpus
    return ["pretrain", "--corpus", path, "--tokenizer", tok, "--out", out, "--steps", 6, "--batch-size", 8,
            "--max-length", 32, "--lr", 1e-3, "--no-progress", *extra]


def weights(directory):
    return load_file(os.path.join(directory, "model.safetensors"))


def test_pretrain_writes_an_hf_checkpoint(tmp_path, corpus):
    out = tmp_path / "run"
    run(*pretrain_args(corpus, out))
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_state.pt", "loss.png"} <= names
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = torch.load(out / "training_state.pt", weights_only=True)  # tensors and plain containers only
    assert state["step"] == 6 and len(state["loss"]) == 6
    assert all(torch.isfinite(torch.tensor(state["loss"])))
    # transformers reads the directory: the same weights and the same predictions.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(small_tokenizer())
    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    ours = fastbert.BertForPreTraining.from_pretrained(out)
    assert ours.config.vocab_size == len(tok) and ours.config.hidden_size == fastbert.BertConfig.tiny().hidden_size
    enc = tok(["the cat sat on the mat ."], return_tensors="pt")
    a, b = ours(**enc), theirs(**enc)
    assert_matches(a.prediction_logits, b.prediction_logits, name="prediction_logits")
    for name, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


def test_pretrain_resume_matches_an_uninterrupted_run(tmp_path, corpus, capsys):
    """N steps straight, and N/2 + resume + N/2, give the same parameters (dropout on: it is replayed too)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(*pretrain_args(corpus, straight, "--save-every", 3, "--grad-accum", 2))
    half = straight / "checkpoint-3"
    assert torch.load(half / "training_state.pt", weights_only=True)["step"] == 3
    run(*pretrain_args(corpus, resumed, "--resume", half, "--grad-accum", 2))
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max diff {float((a[name] - b[name]).abs().max()):.3g}"
    # The resumed run's record continues the first half's.
    states = [torch.load(d / "training_state.pt", weights_only=True) for d in (straight, half, resumed)]
    for key in ("loss", "grad_norm", "lr"):
        assert states[2][key] == states[0][key] and states[1][key] == states[0][key][:3], key
    # And the halfway weights are not the final ones: the second half did train.
    assert not torch.equal(weights(half)["cls.seq_relationship.weight"], a["cls.seq_relationship.weight"])
    # Resuming with what changes the run is refused, naming it, before anything trains.
    refused(capsys, r"with other settings \(--lr 0.001 -> 1.0, --seed 0 -> 3\)",
            *pretrain_args(corpus, tmp_path / "other", "--resume", half, "--grad-accum", 2, "--lr", 1, "--seed", 3))
    assert not (tmp_path / "other").exists()
    # So is other data, masking or dropout (they went unchecked: another loss, no word).
    other_corpus = tmp_path / "other.txt"
    other_corpus.write_text(Path(corpus[0]).read_text() + "one more sentence .\n")
    for extra, message in ((("--mlm-probability", 0.5), "mlm_probability 0.15 -> 0.5"),
                           (("--dropout", 0.0), r"dropout \[0.1\] -> \[0.0\]")):
        refused(capsys, message,
                *pretrain_args(corpus, tmp_path / "other", "--resume", half, "--grad-accum", 2, *extra))
    refused(capsys, "corpus_sha256",
            *pretrain_args((other_corpus, corpus[1]), tmp_path / "other", "--resume", half, "--grad-accum", 2))


def test_a_checkpoint_cut_short_or_without_its_settings_is_not_resumed(tmp_path, corpus, monkeypatch, capsys):
    """Checkpoints were written in place, the training state among the first files: a save cut short left a
    state that --resume took (an empty one: a bare EOFError; over an earlier save: its state with new
    weights, trained on without a word), and one without training_args.json resumed with any settings."""
    from fastbert.apps import train

    out = tmp_path / "run"
    run(*pretrain_args(corpus, out, "--save-every", 3))
    half = out / "checkpoint-3"
    monkeypatch.setattr(train, "plot_losses", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))  # cut short
    with pytest.raises(KeyboardInterrupt):
        run(*pretrain_args(corpus, out, "--resume", half, "--save-every", 1))
    monkeypatch.undo()
    assert not (out / "checkpoint-4" / "training_state.pt").exists()
    refused(capsys, "no training_state.pt", *pretrain_args(corpus, tmp_path / "b", "--resume", out / "checkpoint-4"))
    (half / "training_args.json").unlink()
    refused(capsys, "training_args.json is missing or unreadable",
            *pretrain_args(corpus, tmp_path / "c", "--resume", half))


@pytest.fixture
def start(tmp_path):
    """A checkpoint to continue pretraining from, with random non-zero biases and LayerNorms.

    Comparing two runs parameter by parameter needs it: a zero-initialized bias after a few AdamW
    steps holds nothing but a few updates of about +-lr, and AdamW's update of an element whose
    gradient is rounding-sized is itself arbitrary, so one such element dominates its tensor's
    relative error. Against parameters of realistic size those elements are what they are: rounding."""
    directory = tmp_path / "start"
    model = fastbert.BertForPreTraining(fastbert.BertConfig(vocab_size=len(small_tokenizer()), **SMALL, **NO_DROPOUT))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return directory


def assert_same_parameters(a, b):
    """Every parameter of run `a` equals run `b`'s (the table, as two float32 implementations), the key
    biases aside: their gradient is zero in exact arithmetic (softmax ignores a shift shared by a row), so
    each run's AdamW steps on them are the ratio of its own rounding noise to its square root, arbitrary
    to the last step: nothing the two runs compute determines them (measured: 2e-5 to 4e-5 apart after 4
    steps, every other parameter ~1e-7). That their gradients are noise on both sides is what
    test_training_step_matches_transformers and assert_same_gradients check."""
    compared = 0
    for name in a:
        if name.endswith("attention.self.key.bias"):
            continue
        assert_matches(a[name], b[name], name=name)
        compared += 1
    assert compared > len(a) / 2, f"only {compared} of {len(a)} parameters compared"


def test_gradient_accumulation_matches_the_whole_batch(tmp_path, corpus, start):
    """Losses are averaged over the whole step batch (masked tokens, examples), so 4 micro-batches give
    the gradient of one batch of 8."""
    run(*pretrain_args(corpus, tmp_path / "one", "--model", start, "--steps", 4))
    run(*pretrain_args(corpus, tmp_path / "four", "--model", start, "--steps", 4, "--grad-accum", 4))
    assert_same_parameters(weights(tmp_path / "one"), weights(tmp_path / "four"))
    one, four = (torch.load(tmp_path / d / "training_state.pt", weights_only=True) for d in ("one", "four"))
    for key in ("loss", "grad_norm"):  # AdamW hardly sees a gradient's scale: the norms show it is right
        assert_matches(torch.tensor(four[key]), torch.tensor(one[key]), name=key)


def torchrun(*program) -> str:
    """stdout of `program` (a script, or -m module and its arguments) run by torchrun in 2 processes (gloo, CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *program]
    done = subprocess.run(command, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_ddp_matches_one_process(tmp_path, corpus, start):
    """torchrun with 2 processes (gloo, CPU), each on half of every batch, ends where one process on the
    whole batches ends."""
    run(*pretrain_args(corpus, tmp_path / "single", "--model", start, "--steps", 4))
    stdout = torchrun("-m", "fastbert", *map(str, pretrain_args(corpus, tmp_path / "ddp", "--model", start, "--steps", 4)))
    assert stdout.count("pretrained 4 steps") == 1  # one process reports
    single, ddp = (torch.load(tmp_path / d / "training_state.pt", weights_only=True) for d in ("single", "ddp"))
    # AdamW hardly sees a gradient's scale: the gradient norms show it is right.
    for key in ("loss", "grad_norm"):
        assert_matches(torch.tensor(ddp[key]), torch.tensor(single[key]), name=key)
    assert_same_parameters(weights(tmp_path / "single"), weights(tmp_path / "ddp"))


def test_runs_from_python_keep_the_callers_process_group(tmp_path, corpus):
    """Under torchrun, a script that joined the process group itself runs pretrain twice: both runs use the
    group, and it is still there for the script afterwards (the runs once destroyed it)."""
    path, tok = corpus
    script = tmp_path / "two_runs.py"
    script.write_text(f"""
import torch, torch.distributed as dist
from fastbert.apps.train import TrainArgs, pretrain
dist.init_process_group("gloo")
for run in ("a", "b"):
    pretrain({str(path)!r}, TrainArgs(out={str(tmp_path)!r} + "/" + run, steps=2, batch_size=8, max_length=32,
             progress=False), tokenizer={str(tok)!r})
    assert dist.is_initialized(), "a run left the caller's process group"
total = torch.ones(1)
dist.all_reduce(total)
with open({str(tmp_path)!r} + f"/summed_{{dist.get_rank()}}", "w") as f:  # a file each: the ranks' prints interleave
    f.write(str(int(total)))
""")
    torchrun(str(script))
    assert [(tmp_path / f"summed_{rank}").read_text() for rank in (0, 1)] == ["2", "2"]


def test_ddp_static_graph_reduces_the_first_steps_gradients(tmp_path):
    """DistributedDataParallel(static_graph=True) finds the tensors in fastbert's outputs (pytree nodes, as
    transformers' are): each rank's first gradient equals one process's on the whole batch (an opaque output
    left them unreduced, and the ranks trained apart)."""
    script = tmp_path / "static_graph.py"
    script.write_text("""
import copy, torch, torch.distributed as dist, fastbert
from fastbert.testing import assert_same_gradients
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = fastbert.BertConfig.tiny(vocab_size=100, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = fastbert.BertForSequenceClassification(config).train()
single = copy.deepcopy(model)
ids, labels = torch.randint(5, 100, (8, 12)), torch.randint(0, 3, (8,))
ddp = torch.nn.parallel.DistributedDataParallel(model, static_graph=True)
half = slice(4 * rank, 4 * rank + 4)
torch.nn.functional.cross_entropy(ddp(ids[half]).logits, labels[half]).backward()
torch.nn.functional.cross_entropy(single(ids).logits, labels).backward()
assert_same_gradients(model, single)
print("reduced", rank)
""")
    assert torchrun(str(script)).count("reduced") == 2


def test_pretrain_learns(tmp_path, corpus):
    out = tmp_path / "run"
    run(*pretrain_args(corpus, out, "--steps", 40, "--lr", 2e-3, "--warmup-steps", 4))
    losses = torch.load(out / "training_state.pt", weights_only=True)["loss"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_bf16_autocast(tmp_path, corpus):
    model = fastbert.BertForPreTraining(fastbert.BertConfig(vocab_size=len(small_tokenizer()), **SMALL)).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(5, len(small_tokenizer()), (2, 8))).prediction_logits
    assert logits.dtype == torch.bfloat16  # fastbert.ops run in the autocast dtype, as transformers' BERT does
    out = tmp_path / "run"
    run(*pretrain_args(corpus, out, "--bf16", "--steps", 4))
    losses = torch.load(out / "training_state.pt", weights_only=True)["loss"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(v.dtype == torch.float32 for v in weights(out).values())  # autocast: float32 weights


def test_gradient_checkpointing_flag_changes_no_result(tmp_path, corpus):
    run(*pretrain_args(corpus, tmp_path / "plain", "--steps", 3))
    run(*pretrain_args(corpus, tmp_path / "ckpt", "--steps", 3, "--gradient-checkpointing"))
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "ckpt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_linear_schedule():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = train.linear_schedule(optimizer, warmup_steps=4, total_steps=10)
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    expected = [0.25, 0.5, 0.75, 1.0, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7]  # the peak once
    assert rates == pytest.approx(expected), rates
    assert scheduler.get_last_lr()[0] == 0.0
    no_warmup = train.linear_schedule(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 0, 4)
    assert no_warmup.get_last_lr() == [1.0]  # without warmup the first step is at the peak


def test_default_tokenizer_and_module_entry_point(tmp_path):
    """`python -m fastbert pretrain` as a user runs it: the bundled tokenizer, the tiny preset."""
    corpus = write_corpus(tmp_path / "corpus.txt", documents=4, per_document=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fastbert", "pretrain", "--corpus", str(corpus), "--out",
                           str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--max-length", "32"],
                          env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pretrained 2 steps" in done.stdout
    assert "training" in done.stderr  # the progress bar
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["vocab_size"] == 30522 and config["hidden_size"] == 128
    assert (tmp_path / "run" / "vocab.txt").exists() or (tmp_path / "run" / "tokenizer.json").exists()


# ------------------------------------------------------------------------------ fine-tuning


@pytest.fixture
def base_model(tmp_path):
    """A small untrained BERT checkpoint with its tokenizer, as pretrain writes one."""
    directory = tmp_path / "base"
    fastbert.BertForPreTraining(fastbert.BertConfig(vocab_size=len(small_tokenizer()), **SMALL)).save_pretrained(directory)
    small_tokenizer().save_pretrained(directory)
    return directory


def finetune_args(train_file, model, out, *extra):
    return ["finetune", "--train", train_file, "--model", model, "--out", out, "--batch-size", 16, "--lr", 2e-3,
            "--max-length", 16, "--no-progress", *extra]


def test_finetune_learns_and_reports_accuracy(tmp_path, base_model, capsys):
    names = ["negative", "positive"]
    train_file = write_csv(tmp_path / "train.csv", sentiment_rows(128), names)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", sentiment_rows(64, seed=1), names)
    out = tmp_path / "cls"
    run(*finetune_args(train_file, base_model, out, "--eval", eval_file, "--epochs", 5, "--warmup-steps", 4))
    printed = capsys.readouterr().out
    results = json.loads((out / "eval_results.json").read_text())
    assert f"eval accuracy {results['accuracy']:.4f} ({results['correct']}/64)" in printed
    assert results["total"] == 64 and results["accuracy"] >= 0.9, results
    state = torch.load(out / "training_state.pt", weights_only=True)
    assert state["step"] == 5 * 128 // 16
    # transformers loads the classifier with its class names and gives the same logits.
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert theirs.config.id2label == {0: "negative", 1: "positive"}
    ours = fastbert.BertForSequenceClassification.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok(["a good movie", "an awful day"], padding=True, return_tensors="pt")
    assert_matches(ours(**enc).logits, theirs(**enc).logits, name="logits")
    assert theirs(**enc).logits.argmax(-1).tolist() == [1, 0]


def test_finetune_resume_matches_an_uninterrupted_run(tmp_path, base_model, capsys):
    train_file = write_jsonl(tmp_path / "train.jsonl", [(t, 3 * y) for t, y in sentiment_rows(48)])  # labels 0 and 3
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(*finetune_args(train_file, base_model, straight, "--steps", 6, "--save-every", 3))
    run(*finetune_args(train_file, base_model, resumed, "--steps", 6, "--resume", straight / "checkpoint-3"))
    a, b = weights(straight), weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    config = json.loads((straight / "config.json").read_text())
    assert config["num_labels"] == 4 and config["id2label"] == {"0": "0", "1": "1", "2": "2", "3": "3"}
    # Data with other classes needs another head, which the checkpoint's optimizer state does not fit.
    other = write_jsonl(tmp_path / "other.jsonl", sentiment_rows(48), ["neg", "pos"])
    refused(capsys, r"cannot resume from .*checkpoint-3: it was trained on the classes",
            *finetune_args(other, base_model, tmp_path / "other", "--steps", 6, "--resume", straight / "checkpoint-3"))


def test_training_a_bfloat16_checkpoint_keeps_float32_weights(tmp_path, base_model):
    """from_pretrained loads a checkpoint in its dtype (transformers 5's default); the trainer's weights and
    optimizer state stay float32 (bf16 is autocast's), whatever the checkpoint was saved in."""
    fastbert.BertForPreTraining.from_pretrained(base_model, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    small_tokenizer().save_pretrained(tmp_path / "bf16")
    train_file = write_csv(tmp_path / "train.csv", sentiment_rows(32), ["negative", "positive"])
    run(*finetune_args(train_file, tmp_path / "bf16", tmp_path / "cls", "--steps", 2))
    assert {t.dtype for t in weights(tmp_path / "cls").values() if t.is_floating_point()} == {torch.float32}


def test_finetune_rejects_unknown_eval_labels(tmp_path, base_model, capsys):
    train_file = write_csv(tmp_path / "train.csv", sentiment_rows(16), ["neg", "pos"])
    eval_file = write_csv(tmp_path / "eval.csv", sentiment_rows(4), ["neg", "neutral"])
    refused(capsys, r"labels \['neutral'\] are not among the model's classes \['neg', 'pos'\] "
            r"\(first at 'neutral' .*eval.csv:2\)",
            *finetune_args(train_file, base_model, tmp_path / "out", "--steps", 1, "--eval", eval_file))
    assert not (tmp_path / "out").exists()  # refused before any training
    refused(capsys, r"--max-length must be in \[2, the model's max_position_embeddings",
            *finetune_args(train_file, base_model, tmp_path / "out", "--steps", 1, "--max-length", 0))


@pytest.mark.parametrize("content,message", [
    (b"text,label\nfine,pos\njustatext\n", "bad.csv:3: the label must be a non-empty string or an integer, got None"),
    (b"text,label\nfine,pos\nempty label,\n", "bad.csv:3: the label must be a non-empty string or an integer, got ''"),
    (b'{"text": "a", "label": 1}\n{"text": null, "label": 0}\n', "bad.jsonl:2: the text must be a string"),
    (b'{"text": "a", "label": 1}\n{"text": "b", "label": null}\n', "bad.jsonl:2: the label must be"),
    (b'{"text": "a", "label": 1}\n{"text": "b", "label": 1.0}\n', "bad.jsonl:2: the label must be"),
    (b'{"text": "a", "label": 1}\nnot json\n', "bad.jsonl:2: not JSON"),
    # An unquoted comma in a text: its tail was taken for the label, the label dropped.
    (b"text,label\nfine,pos\na good, fun movie,pos\n", "bad.csv:3: more fields than the header's 2 \\(a comma in the text"),
    (b"text,label\nfine,pos\ncaf\xe9,pos\n", "bad.csv line 3: not UTF-8 \\(byte 0xe9 at column 4\\)"),
])
def test_labelled_rows_are_checked_line_by_line(tmp_path, content, message):
    path = tmp_path / ("bad.jsonl" if content.startswith(b"{") else "bad.csv")
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        train.read_labelled(str(path))


def test_labelled_files_with_a_byte_order_mark_and_a_single_integer_class(tmp_path):
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbftext,label\r\na,pos\r\nb,neg\r\n")
    assert [row[:2] for row in train.read_labelled(str(tmp_path / "bom.csv"))] == [("a", "pos"), ("b", "neg")]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a", "label": 2}\n')
    assert train.read_labelled(str(tmp_path / "bom.jsonl")) == [("a", "2", f"{tmp_path / 'bom.jsonl'}:1")]
    with pytest.raises(ValueError, match="at least 2 classes, the data has only 1"):
        train.label_names(["1", "1"], fastbert.BertConfig.tiny())


def test_other_classes_get_a_new_head(tmp_path, base_model):
    train_file = write_csv(tmp_path / "train.csv", sentiment_rows(16), ["neg", "pos"])
    run(*finetune_args(train_file, base_model, tmp_path / "run", "--steps", 1))
    trained = train.classifier_for(str(tmp_path / "run"), ["neg", "pos"]).classifier.weight
    again = train.classifier_for(str(tmp_path / "run"), ["pos", "neg"])  # the same classes: the same head
    assert torch.equal(again.classifier.weight, trained)
    other = train.classifier_for(str(tmp_path / "run"), ["pos", "zzz"])  # "pos" must not take "neg"'s row
    assert other.config.extra["label2id"] == {"pos": 0, "zzz": 1} and not torch.equal(other.classifier.weight, trained)


def test_bad_arguments_fail_clearly(tmp_path, corpus, capsys):
    refused(capsys, "must be divisible by --grad-accum", *pretrain_args(corpus, tmp_path / "a", "--grad-accum", 3))
    refused(capsys, "fewer than one batch", *pretrain_args(corpus, tmp_path / "b", "--batch-size", 512))
    refused(capsys, "no training_state.pt", *pretrain_args(corpus, tmp_path / "c", "--resume", corpus[1]))
    for flag, message in (("--steps", "--steps must be positive, got 0"), ("--grad-accum", "--grad-accum must be positive, got 0"),
                          ("--batch-size", "--batch-size must be positive, got 0")):
        refused(capsys, message, *pretrain_args(corpus, tmp_path / "d", flag, 0))
    # Negative ones were taken: a clipping norm of -1 turned training into gradient ascent.
    for flag in ("--max-grad-norm", "--save-every", "--warmup-steps", "--weight-decay"):
        refused(capsys, f"{flag} must be 0 or more, got -1", *pretrain_args(corpus, tmp_path / "d", flag, -1))
    # Bytes that are not UTF-8 are named by line and column (the corpus's offset was counted from a chunk's start).
    (tmp_path / "latin1.txt").write_bytes(b"fine\n" * 30000 + b"caf\xe9 au lait\n\nanother one\n")
    # A config or tokenizer that cannot be read is named too (a traceback before).
    (tmp_path / "odd.json").write_text('{"hidden_size": 65, "num_attention_heads": 2}')
    refused(capsys, "odd.json: BertConfig.hidden_size \\(65\\) must be divisible", *pretrain_args(
        corpus, tmp_path / "f", "--config", tmp_path / "odd.json"))
    refused(capsys, "the tokenizer .*nowhere is not a directory", *pretrain_args(
        (corpus[0], tmp_path / "nowhere"), tmp_path / "g"))
    refused(capsys, "latin1.txt line 30001: not UTF-8 \\(byte 0xe9 at column 4\\)",
            *pretrain_args((str(tmp_path / "latin1.txt"), corpus[1]), tmp_path / "e"))


def test_a_transformers_trainer_trains_a_fastbert_model_with_activation_checkpointing(tmp_path):
    """transformers' Trainer with activation_checkpointing=True calls activation_checkpointing_enable(kwargs,
    every_n_layers=, offload=) on the model: fastbert's takes them, and the losses are those without it."""
    pytest.importorskip("accelerate")  # the Trainer needs it
    torch.manual_seed(0)
    cfg = fastbert.BertConfig(vocab_size=120, num_labels=3, **SMALL)
    ids, mask, types = padded_batch(120, [12, 9, 4, 1, 7, 12, 3, 5])
    rows = [dict(input_ids=i, attention_mask=m, token_type_ids=t, labels=int(l))
            for i, m, t, l in zip(ids, mask, types, torch.randint(0, 3, (8,)))]
    start = fastbert.BertForSequenceClassification(cfg).state_dict()
    losses = []
    for checkpointing in (False, True):
        model = fastbert.BertForSequenceClassification(cfg)
        model.load_state_dict(start)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(checkpointing)), max_steps=3, per_device_train_batch_size=4, optim="sgd",
            learning_rate=0.1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            logging_strategy="no", activation_checkpointing=checkpointing,
            activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2})
        with fastbert.dispatch.record() as calls:
            losses.append(torch.tensor(transformers.Trainer(model=model, args=args, train_dataset=rows).train().training_loss))
        assert any(op in ("attention", "varlen_attention") and backend != "reference" for op, backend in calls)
        assert [layer.gradient_checkpointing for layer in model.bert.encoder.layer] == [checkpointing, False]
    assert_matches(losses[1], losses[0], name="training loss with activation checkpointing")
