"""Training: the loop behind `python -m fastbert pretrain` and `python -m fastbert finetune`.

One loop for both: AdamW, linear warmup then linear decay, gradient accumulation, gradient clipping,
optional bf16 autocast and gradient checkpointing, DistributedDataParallel under torchrun, a progress
bar, HF-format checkpoints that resume exactly, and a loss-curve PNG.

Each optimizer step takes `batch_size` examples. They are split into `grad_accum` micro-batches, and
each micro-batch into one piece per process. Losses are sums over the piece divided by counts over
the whole step batch (masked tokens, examples), so accumulation and DDP compute the gradient of the
same loss as one process on the whole batch: runs differ only in rounding.

    from fastbert.apps.train import TrainArgs, pretrain, finetune
    pretrain("corpus.txt", TrainArgs(out="runs/mlm", steps=1000))
    finetune("train.csv", "runs/mlm", TrainArgs(out="runs/cls", epochs=3), eval_file="dev.csv")
"""
from __future__ import annotations

import atexit
import contextlib
import csv
import io
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastbert.apps import InputError, data, files
from fastbert.config import PRESETS, BertConfig

STATE_FILE = "training_state.pt"  # optimizer, scheduler, data position, history: tensors and plain containers
LOSS_PLOT = "loss.png"


@dataclass
class TrainArgs:
    out: str  # directory for the final model and checkpoint-<step>/ folders
    steps: int = 1000  # optimizer steps (ignored when epochs is given)
    epochs: float | None = None  # passes over the training data, instead of steps
    batch_size: int = 32  # examples per optimizer step: all micro-batches and processes together
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4  # peak learning rate
    weight_decay: float = 0.01  # AdamW decay of matrices (biases and LayerNorm weights are not decayed)
    warmup_steps: int | None = None  # linear warmup to lr; default 10% of the steps
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    max_length: int = 128  # tokens per example
    bf16: bool = False  # torch.autocast to bfloat16 (weights and optimizer stay float32)
    gradient_checkpointing: bool = False  # recompute encoder layers in backward: less memory, more compute
    seed: int = 0  # initialization, data order, masking and dropout
    save_every: int = 0  # also save out/checkpoint-<step> every this many steps (0: only at the end)
    resume: str | None = None  # a checkpoint directory to continue from
    device: str | None = None  # default: cuda if available, else cpu
    progress: bool = True  # show a progress bar (on the first process)


# ------------------------------------------------------------------------------ data


def mix_seed(*numbers: int) -> int:
    """One 63-bit seed from several integers (seed, epoch, step, rank), different for different tuples
    (a multiplicative hash: collisions are possible in principle, harmless, and vanishingly rare)."""
    h = 0
    for n in numbers:
        h = (h * 0x9E3779B97F4A7C15 + n + 1) % (1 << 63)
    return h


class BatchStream:
    """Endless, seeded batches. Epoch e draws its examples (`make_epoch`, e.g. new NSP pairs) and their
    order from a generator seeded by (seed, e), which then also drives `collate` (e.g. masking). The
    state (epoch, position, generator state) lets a resumed run see exactly the batches an
    uninterrupted run would have seen. An epoch's last incomplete batch is dropped."""

    def __init__(self, make_epoch, collate, batch_size: int, seed: int):
        self.make_epoch, self.collate, self.batch_size, self.seed = make_epoch, collate, batch_size, seed
        self._start(0)

    def _start(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self.generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        self.examples = self.make_epoch(self.generator)
        if len(self.examples) < self.batch_size:
            raise InputError(f"the data has {len(self.examples)} examples per epoch, fewer than one batch "
                             f"({self.batch_size}): use a smaller --batch-size or more data")
        self.order = torch.randperm(len(self.examples), generator=self.generator).tolist()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def next(self) -> dict[str, torch.Tensor]:
        if self.position + self.batch_size > len(self.order):
            self._start(self.epoch + 1)
        chosen = [self.examples[i] for i in self.order[self.position : self.position + self.batch_size]]
        self.position += self.batch_size
        return self.collate(chosen, self.generator)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._start(state["epoch"])  # the same examples and order as before
        self.position = state["position"]
        self.generator.set_state(state["generator"])


def split_rows(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """`parts` equal row slices of a batch, each without the columns that are padding in all its rows."""
    rows = len(batch["input_ids"])
    if rows % parts:
        raise ValueError(f"a batch of {rows} examples does not split into {parts} equal parts")
    size = rows // parts
    pieces = []
    for i in range(parts):
        piece = {k: v[i * size : (i + 1) * size] for k, v in batch.items()}
        length = int(piece["attention_mask"].sum(1).max())
        pieces.append({k: v[:, :length] if v.dim() == 2 else v for k, v in piece.items()})
    return pieces


def step_counts(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """What the losses of one optimizer step are averaged over: examples, and scored (masked) tokens."""
    counts = {"examples": len(batch["input_ids"])}
    if "labels" in batch:
        counts["scored"] = max(int((batch["labels"] != data.IGNORE).sum()), 1)
    return counts


# ------------------------------------------------------------------------------ losses


def _model_inputs(batch):
    """The model's arguments: the batch's tensors, and the outputs the loss reads whatever config.json says."""
    return {**{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch},
            "output_hidden_states": False, "output_attentions": False, "return_dict": True}


def pretraining_loss(model, batch, counts) -> torch.Tensor:
    """BERT's loss, MLM + NSP, as transformers' BertForPreTraining computes it over the whole step batch:
    sums over this piece, divided by the step's counts. Logits go to float32 first (bf16 autocast)."""
    out = model(**_model_inputs(batch))
    logits = out.prediction_logits.float()  # [B, S, V]
    mlm = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=data.IGNORE, reduction="sum")
    nsp = F.cross_entropy(out.seq_relationship_logits.float(), batch["next_sentence_label"], reduction="sum")
    return mlm / counts["scored"] + nsp / counts["examples"]


def classification_loss(model, batch, counts) -> torch.Tensor:
    """Single-label cross entropy, a mean over the step's examples."""
    logits = model(**_model_inputs(batch)).logits.float()  # [B, L]
    return F.cross_entropy(logits, batch["label"], reduction="sum") / counts["examples"]


# ------------------------------------------------------------------------------ optimizer


def make_optimizer(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; as in BERT, biases and LayerNorm weights (every 1-D parameter) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def linear_schedule(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning rate rising linearly to its peak over warmup_steps, then falling linearly to 0 at total_steps."""
    peak = max(warmup_steps - 1, 0)  # the one step at the peak rate: the warmup's last, or the first

    def factor(step: int) -> float:  # step: optimizer steps taken so far
        if step < warmup_steps:
            return (step + 1) / warmup_steps  # the first step already moves (no wasted step at lr 0)
        return max(0.0, (total_steps - step) / max(1, total_steps - peak))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------ processes and checkpoints


def distributed() -> tuple[int, int]:
    """(rank, world size). Under torchrun with more than one process, joins the process group
    (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        # Left at exit, not after each run: a caller's later runs (pretrain, then finetune) reuse it (joining
        # gloo again could hang), and a group the caller made is the caller's.
        atexit.register(_leave_distributed)
    return dist.get_rank(), world


def _leave_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_device(args: TrainArgs) -> torch.device:
    if args.device is not None:
        return torch.device(args.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def plot_losses(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_checkpoint(directory, model, tokenizer, optimizer, scheduler, stream, history, args, recipe=None) -> None:
    """A directory transformers can load (config.json, model.safetensors, tokenizer files) plus the
    training state for --resume and the loss curve. history: per-step lists loss, grad_norm, lr.
    The training state is the checkpoint's seal: removed first, written last, once every other file is on
    the disk, under its name in one step. A save cut short (a kill, a crash) leaves no state, so --resume
    refuses the directory, never a mix of two saves' files or a state cut short."""
    state_file = os.path.join(directory, STATE_FILE)
    if os.path.exists(state_file):
        os.remove(state_file)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "training_args.json"), "w", encoding="utf-8") as f:
        json.dump({**asdict(args), "recipe": recipe or {}}, f, indent=2, default=str)  # paths as strings
    plot_losses(history["loss"], os.path.join(directory, LOSS_PLOT))
    for name in os.listdir(directory):
        if os.path.isfile(path := os.path.join(directory, name)):
            files.sync(path)
    state = {"step": len(history["loss"]), **history, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "data": stream.state_dict()}
    torch.save(state, state_file + ".tmp")
    files.replace_durably(state_file + ".tmp", state_file)


def state_path(directory) -> str:
    """The training state file of a checkpoint to resume from; a clear error when there is none."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cannot resume from {directory}: no {STATE_FILE} (was it saved by fastbert.apps.train?)")
    return path


# What a run's course depends on: a resumed run must keep them (another schedule, batch or seed is
# another run: start it from the checkpoint's weights instead).
RUN_ARGS = ("steps", "epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup_steps", "max_grad_norm",
            "max_length", "bf16", "seed")


def same_run(directory, args: TrainArgs, recipe: dict | None = None) -> None:
    """Refuse to resume from `directory` with arguments that change the run, or a recipe (what else the run
    depends on: its data files' digests, the masking probability, dropout) other than the saved one; named
    in the error."""
    path = os.path.join(directory, "training_args.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        raise InputError(f"cannot resume from {directory}: its training_args.json is missing or unreadable, so the "
                         "run's settings cannot be checked") from None
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(args, k)}" for k in RUN_ARGS
               if k in saved and saved[k] != getattr(args, k)]
    before = saved.get("recipe", {})
    changed += [f"{k} {before.get(k)} -> {v}" for k, v in (recipe or {}).items() if "recipe" in saved and before.get(k) != v]
    if changed:
        raise InputError(f"cannot resume from {directory} with other settings ({', '.join(changed)}): a resumed run "
                         "continues the same run; start a new one from its weights (--model) to change them")


def load_training_state(directory) -> dict:
    return torch.load(state_path(directory), map_location="cpu", weights_only=True)  # tensors and plain containers only


# ------------------------------------------------------------------------------ the loop


def train(model, tokenizer, stream: BatchStream, loss_fn, args: TrainArgs, recipe: dict | None = None) -> list[float]:
    """Train `model` on batches from `stream` with `loss_fn(model, piece, counts)`; save to args.out.
    Resumes from args.resume (a checkpoint this function saved; the model must already hold its
    weights) when `recipe` (what else the run depends on, kept in training_args.json) is the saved one.
    Returns the loss of every optimizer step, from step 1; the checkpoints also keep each step's gradient
    norm (before clipping) and learning rate."""
    from tqdm import tqdm

    rank, world = distributed()
    for name, bad in (("steps", args.epochs is None and args.steps < 1), ("epochs", args.epochs is not None and args.epochs <= 0),
                      ("batch-size", args.batch_size < 1), ("grad-accum", args.grad_accum < 1), ("lr", not args.lr > 0)):
        if bad:
            value = getattr(args, name.replace("-", "_"))
            raise InputError(f"--{name} must be positive, got {value}")
    # (a negative clipping norm turned the steps around: gradient ascent)
    for name in ("weight_decay", "warmup_steps", "max_grad_norm", "save_every"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise InputError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
    if args.resume:
        same_run(args.resume, args, recipe)
    if args.batch_size % (args.grad_accum * world):
        raise InputError(f"--batch-size {args.batch_size} must be divisible by --grad-accum ({args.grad_accum}) "
                         f"x processes ({world})")
    total_steps = math.ceil(args.epochs * stream.batches_per_epoch) if args.epochs is not None else args.steps
    warmup = args.warmup_steps if args.warmup_steps is not None else total_steps // 10
    device = pick_device(args)
    model.to(device).train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    scheduler = linear_schedule(optimizer, warmup, total_steps)
    history = {"loss": [], "grad_norm": [], "lr": []}
    if args.resume:
        state = load_training_state(args.resume)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        stream.load_state_dict(state["data"])
        history = {k: list(state[k]) for k in history}
    step = len(history["loss"])
    wrapped = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    progress = tqdm(total=total_steps, initial=step, desc="training", file=sys.stderr, dynamic_ncols=True,
                    disable=not (args.progress and rank == 0))
    while step < total_steps:
        # Dropout draws from torch's global generator: seeding it per (step, process) makes a resumed
        # run draw what an uninterrupted one would, and gives each process its own masks.
        torch.manual_seed(mix_seed(args.seed, step, rank))
        batch = stream.next()
        counts = step_counts(batch)
        micro_batches = split_rows(batch, args.grad_accum)
        step_loss = torch.zeros((), device=device)
        for k, micro in enumerate(micro_batches):
            piece = {name: t.to(device) for name, t in split_rows(micro, world)[rank].items()}
            # DDP averages gradients over processes at the last micro-batch's backward only.
            sync = k == len(micro_batches) - 1 or world == 1
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                with autocast:
                    loss = loss_fn(wrapped, piece, counts)
                (loss * world).backward()  # x world: DDP divides by it, and the loss is already a global mean
            step_loss += loss.detach()
        if world > 1:
            dist.all_reduce(step_loss)  # the pieces' shares add up to the step batch's loss
        # The global gradient norm, clipped to max_grad_norm (0: measured only).
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
        history["lr"].append(scheduler.get_last_lr()[0])  # the rate this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        history["loss"].append(float(step_loss))
        history["grad_norm"].append(float(grad_norm))
        progress.update(1)
        progress.set_postfix(loss=f"{history['loss'][-1]:.4f}", lr=f"{history['lr'][-1]:.2e}")
        if rank == 0 and args.save_every and step % args.save_every == 0 and step < total_steps:
            save_checkpoint(os.path.join(args.out, f"checkpoint-{step}"), model, tokenizer, optimizer, scheduler,
                            stream, history, args, recipe)
    progress.close()
    if rank == 0:
        save_checkpoint(args.out, model, tokenizer, optimizer, scheduler, stream, history, args, recipe)
    model.eval()
    return history["loss"]


def _finish_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()  # nobody leaves while the first process still saves


# ------------------------------------------------------------------------------ tokenizers and configs


def load_tokenizer(directory: str | None):
    """A transformers tokenizer from `directory` (default: the bundled all-MiniLM-L6-v2's)."""
    import transformers

    from fastbert.apps.demo import minilm_dir

    # Local directories only, without touching the process's environment.
    directory = directory or minilm_dir()
    if not os.path.isdir(directory):
        raise InputError(f"the tokenizer {directory} is not a directory (a transformers tokenizer's files)")
    return files_as_input(lambda: transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True),
                          f"the tokenizer {directory}")


def files_as_input(load, where: str | None = None):
    """load()'s result; a file it cannot read (missing, damaged, invalid settings) is an input problem:
    InputError (naming `where`), which the commands print as one line."""
    try:
        return load()
    except (ValueError, OSError) as e:  # json's and config validation's ValueError; transformers' OSError
        if isinstance(e, InputError):
            raise
        raise InputError(f"{where}: {e}" if where else str(e)) from None


def tokenizer_source(resume: str | None, tokenizer: str | None, model_dir: str | None) -> str | None:
    """Where the tokenizer comes from: a resumed checkpoint's own, else the one asked for, else the
    model directory's (when it has one), else None (the bundled one)."""
    if resume:
        return resume
    if tokenizer:
        return tokenizer
    if model_dir and any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "vocab.txt")):
        return model_dir
    return None


def check_vocab(model, tokenizer) -> None:
    if len(tokenizer) > model.config.vocab_size:
        raise InputError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}")


def pretraining_config(name_or_path: str, vocab_size: int) -> BertConfig:
    """A preset (tiny, base, large) sized to the tokenizer, or a config.json (file or its directory)."""
    if name_or_path in PRESETS:
        return BertConfig.preset(name_or_path, vocab_size=vocab_size)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    with open(path, encoding="utf-8") as f:
        config = files_as_input(lambda: BertConfig.from_dict(json.load(f)), path)
    if config.vocab_size < vocab_size:
        raise InputError(f"{path}: vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab_size} tokens")
    return config


def dropouts(model) -> dict:
    """The model's dropout rates as its modules hold them: part of a run's recipe."""
    return {"dropout": sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)})}


def set_dropout(model, p: float | None) -> None:
    """Every dropout rate of a built model (and its config, so a saved checkpoint says the same) to p."""
    if p is None:
        return
    cfg = model.config
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = p
    if cfg.classifier_dropout is not None:
        cfg.classifier_dropout = p
    cfg.validate()
    for module in model.modules():  # the modules copied their rates from the config when built
        if isinstance(module, torch.nn.Dropout):
            module.p = p


# ------------------------------------------------------------------------------ pretraining


def pretrain(corpus: str, args: TrainArgs, tokenizer: str | None = None, config: str = "tiny",
             mlm_probability: float = 0.15, dropout: float | None = None, model: str | None = None) -> list[float]:
    """Pretrain BertForPreTraining (MLM + NSP) on a corpus file: one sentence per line, blank lines
    between documents. A fresh model of `config`, or the checkpoint `model` (continued pretraining).
    When resuming, the checkpoint's model and tokenizer are used."""
    from fastbert.heads import BertForPreTraining

    if args.resume:
        state_path(args.resume)  # fail before any loading
    tok = load_tokenizer(tokenizer_source(args.resume, tokenizer, model))
    torch.manual_seed(args.seed)  # the initial weights (of missing heads, for a checkpoint)
    if args.resume or model:
        # Float32 weights and optimizer state whatever the checkpoint's dtype (bf16: autocast).
        model = files_as_input(lambda: BertForPreTraining.from_pretrained(args.resume or model, dtype=torch.float32))
    else:
        model = BertForPreTraining(pretraining_config(config, len(tok)))
    check_vocab(model, tok)
    set_dropout(model, dropout)
    if args.max_length > model.config.max_position_embeddings:
        raise InputError(f"--max-length {args.max_length} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    documents = data.tokenize_documents(data.read_corpus(corpus), tok)
    collator = data.MLMCollator(tok, mlm_probability, args.max_length)
    stream = BatchStream(lambda g: data.nsp_pairs(documents, tok, args.max_length, g), collator, args.batch_size, args.seed)
    recipe = {"corpus_sha256": files.sha256(corpus), "config": config, "mlm_probability": mlm_probability,
              **dropouts(model)}
    losses = train(model, tok, stream, pretraining_loss, args, recipe)
    _finish_distributed()
    return losses


# ------------------------------------------------------------------------------ fine-tuning


def read_labelled(path: str) -> list[tuple[str, str, str]]:
    """(text, label, where) from a CSV with text and label columns, or JSONL with {"text": ..., "label": ...};
    `where` is "path:line". Labels come back as strings ("1", "positive"); a text must be a string and a
    label a non-empty string or an integer, else the error names the line."""
    path = os.fspath(path)
    rows = []

    def add(where, text, label):
        if not isinstance(text, str):
            raise InputError(f"{where}: the text must be a string, got {type(text).__name__}")
        if isinstance(label, bool) or not isinstance(label, (str, int)) or not str(label).strip():
            raise InputError(f"{where}: the label must be a non-empty string or an integer, got {label!r}")
        rows.append((text, str(label).strip(), where))

    text = data.utf8_text(path)  # bytes not UTF-8 named by line; a byte order mark (Excel's "CSV UTF-8") dropped
    if path.endswith((".jsonl", ".json")):
        with io.StringIO(text, newline=None) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}:{n}: not JSON ({e.msg})") from None
                    if not isinstance(record, dict) or "text" not in record or "label" not in record:
                        raise InputError(f"{path}:{n}: each line needs \"text\" and \"label\"")
                    add(f"{path}:{n}", record["text"], record["label"])
    else:
        with io.StringIO(text, newline="") as f:
            reader = csv.DictReader(f)
            if not {"text", "label"} <= set(reader.fieldnames or ()):
                raise InputError(f"{path}: a CSV needs text and label columns, found {reader.fieldnames}")
            for r in reader:
                if None in r:  # fields past the header's: the label read from the wrong one
                    raise InputError(f"{path}:{reader.line_num}: more fields than the header's "
                                     f"{len(reader.fieldnames)} (a comma in the text? quote the text)")
                add(f"{path}:{reader.line_num}", r["text"], r["label"])
    if not rows:
        raise InputError(f"{path} holds no examples")
    return rows


def label_names(labels: list[str], config: BertConfig) -> list[str]:
    """Class names by id: the model's own (config label2id) when it knows every label; else 0..max for
    integer labels, or the sorted names."""
    known = config.extra.get("label2id") or {}
    if known and set(labels) <= set(known):
        return [name for name, _ in sorted(known.items(), key=lambda kv: kv[1])]
    if all(label.isascii() and label.lstrip("-").isdigit() and label == str(int(label)) for label in labels):
        values = [int(label) for label in labels]
        if min(values) < 0:
            raise InputError("integer labels must be 0 or more")
        if len(set(values)) < 2:
            raise InputError(f"classification needs at least 2 classes, the data has only {values[0]}")
        return [str(i) for i in range(max(values) + 1)]
    return sorted(set(labels))


def classifier_for(model_dir: str, labels: list[str], resuming: bool = False):
    """BertForSequenceClassification from a checkpoint, its head sized and named for `labels` (`resuming`:
    the checkpoint's own head, or an error: its optimizer state is the trained head's)."""
    from torch import nn

    from fastbert.heads import BertForSequenceClassification

    model = files_as_input(lambda: BertForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32))
    cfg = model.config
    names = label_names(labels, cfg)
    if len(names) < 2:
        raise InputError(f"classification needs at least 2 classes, the data has {names}")
    known = [name for name, _ in sorted((cfg.extra.get("label2id") or {}).items(), key=lambda kv: kv[1])]
    generic = known == [f"LABEL_{i}" for i in range(len(known))]  # transformers' default names: none given
    # Another number of classes, or other classes (a trained row must not serve another name): a new head.
    if cfg.num_labels != len(names) or (known and not generic and known != names):
        if resuming:
            raise InputError(f"cannot resume from {model_dir}: it was trained on the classes {known}, the data "
                             f"has {names} (resume with the same labelled data, or start a new run from it)")
        model.classifier = nn.Linear(cfg.hidden_size, len(names))
        model.init_weights(model.classifier)
        model.num_labels = cfg.num_labels = len(names)
    cfg.extra["id2label"] = {str(i): name for i, name in enumerate(names)}
    cfg.extra["label2id"] = {name: i for i, name in enumerate(names)}
    cfg.problem_type = "single_label_classification"
    cfg.validate()
    return model


def classification_examples(rows, tokenizer, label2id: dict[str, int], max_length: int) -> list[dict]:
    unknown = {}  # label -> where it first occurs
    for _, label, where in rows:
        if label not in label2id:
            unknown.setdefault(label, where)
    if unknown:
        raise InputError(f"labels {sorted(unknown)} are not among the model's classes {sorted(label2id)} (first "
                         f"at {', '.join(f'{label!r} {where}' for label, where in sorted(unknown.items()))})")
    enc = tokenizer([text for text, _, _ in rows], truncation=True, max_length=max_length)
    return [{"input_ids": ids, "token_type_ids": types, "label": label2id[label]}
            for ids, types, (_, label, _) in zip(enc["input_ids"], enc["token_type_ids"], rows)]


@torch.no_grad()
def evaluate(model, examples: list[dict], pad_token_id: int, batch_size: int = 64, bf16: bool = False) -> dict:
    """Accuracy and mean cross entropy of a sequence classifier on labelled examples."""
    model.eval()
    device = next(model.parameters()).device
    correct, loss = 0, 0.0
    for i in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in data.collate(examples[i : i + batch_size], pad_token_id).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**_model_inputs(batch)).logits.float()
        correct += int((logits.argmax(-1) == batch["label"]).sum())
        loss += float(F.cross_entropy(logits, batch["label"], reduction="sum"))
    return {"accuracy": correct / len(examples), "correct": correct, "total": len(examples), "loss": loss / len(examples)}


def finetune(train_file: str, model_dir: str, args: TrainArgs, eval_file: str | None = None,
             tokenizer: str | None = None, dropout: float | None = None) -> dict:
    """Fine-tune BertForSequenceClassification from `model_dir` on labelled texts (CSV or JSONL).
    The tokenizer defaults to the model directory's, else the bundled one. Returns {"losses": [...]}
    plus the --eval file's accuracy, loss and counts (also written to out/eval_results.json)."""
    rows = read_labelled(train_file)
    eval_rows = read_labelled(eval_file) if eval_file else None  # its errors before the training, not after
    if args.resume:
        state_path(args.resume)  # fail before any loading
    tok = load_tokenizer(tokenizer_source(args.resume, tokenizer, model_dir))
    torch.manual_seed(args.seed)  # a fresh head's initial weights
    model = classifier_for(args.resume or model_dir, [label for _, label, _ in rows], resuming=bool(args.resume))
    check_vocab(model, tok)
    set_dropout(model, dropout)
    label2id = model.config.extra["label2id"]
    if not 2 <= args.max_length <= model.config.max_position_embeddings:
        raise InputError(f"--max-length must be in [2, the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings}], got {args.max_length}")
    examples = classification_examples(rows, tok, label2id, args.max_length)
    eval_examples = classification_examples(eval_rows, tok, label2id, args.max_length) if eval_rows else None
    stream = BatchStream(lambda g: examples, lambda chosen, g: data.collate(chosen, tok.pad_token_id),
                         args.batch_size, args.seed)
    recipe = {"train_sha256": files.sha256(train_file), **dropouts(model)}
    result = {"losses": train(model, tok, stream, classification_loss, args, recipe)}
    rank, _ = distributed()
    if eval_examples and rank == 0:
        result.update(evaluate(model, eval_examples, tok.pad_token_id, bf16=args.bf16))
        with open(os.path.join(args.out, "eval_results.json"), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in result.items() if k != "losses"}, f, indent=2)
    _finish_distributed()
    return result
