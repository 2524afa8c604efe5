"""python -m fastbert info | demo | bench | encode | pretrain | finetune"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from fastbert.encode import POOLINGS


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastbert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="ops x backends on this machine, and why a backend is unavailable")
    demo = sub.add_parser("demo", help="encode real sentences with all-MiniLM-L6-v2: fastbert vs transformers")
    demo.add_argument("--model", default=None, help="HF BERT directory (default: the bundled all-MiniLM-L6-v2)")
    demo.add_argument("--repeats", type=positive, default=10, help="timed runs of each model (median reported)")
    bench = sub.add_parser("bench", help="fastbert vs transformers, torch, ONNX Runtime, OpenVINO: medians, ratios, GEMM-rate fraction")
    from fastbert.apps import bench as b
    from fastbert.dispatch import BACKENDS

    def names(known):
        def parse(text):
            chosen = [t.strip() for t in text.split(",") if t.strip()]
            bad = [t for t in chosen if t not in known]
            if not chosen:
                raise argparse.ArgumentTypeError(f"names none (known: {', '.join(known)})")
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (known: {', '.join(known)})")
            return chosen
        return parse

    bench.add_argument("--models", type=names(b.MODELS), default=list(b.MODELS), help="minilm (bundled checkpoint), base")
    bench.add_argument("--dtypes", type=names(tuple(b.DTYPES)), default=["fp32"],
                       help=f"of {', '.join(b.DTYPES)} (int8: fastbert.quantize beside ONNX Runtime and OpenVINO int8)")
    bench.add_argument("--shapes", type=names(b.SHAPES), default=list(b.SHAPES), help=f"of {', '.join(b.SHAPES)} (batch x seq; 1x16: a search query; ragged32: 32 texts of 16-128 tokens)")
    bench.add_argument("--competitors", type=names(b.COMPETITORS), default=list(b.DEFAULT_COMPETITORS),
                       help=f"of {', '.join(b.COMPETITORS)} (default: {', '.join(b.DEFAULT_COMPETITORS)}); compile: "
                       "torch.compile of hf-sdpa; nested: transformers' encoder on nested tensors; fastbert-bf16: "
                       "fastbert in bfloat16 beside every row")
    bench.add_argument("--rounds", type=positive, default=7, help="timed rounds per competitor (median reported)")
    bench.add_argument("--backend", default=None, choices=BACKENDS, help="force one fastbert backend for every op")
    bench.add_argument("--out", default="benchmarks/out", help="folder for bench.json and bench.png")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    bench.add_argument("--keep-freed-memory", action="store_true",
                       help="fastbert.keep_freed_memory() first: large tensors reuse freed pages (every competitor)")
    pretrain = sub.add_parser("pretrain", help="pretrain BERT (masked LM + next sentence) on a text file")
    pretrain.add_argument("--corpus", required=True, help="one sentence per line, blank lines between documents")
    pretrain.add_argument("--tokenizer", default=None,
                          help="HF tokenizer directory (default: --model's, else the bundled all-MiniLM-L6-v2's)")
    pretrain.add_argument("--config", default="tiny",
                          help="preset (tiny, base, large; vocab sized to the tokenizer) or a config.json")
    pretrain.add_argument("--model", default=None, help="HF BERT directory to continue pretraining (instead of --config)")
    pretrain.add_argument("--mlm-probability", type=float, default=0.15, help="fraction of tokens chosen for masking")
    finetune = sub.add_parser("finetune", help="fine-tune a sequence classifier on labelled texts (CSV or JSONL)")
    finetune.add_argument("--train", required=True, help='CSV with text,label columns, or JSONL {"text": ..., "label": ...}')
    finetune.add_argument("--eval", default=None, help="labelled file in the same format: accuracy after training")
    finetune.add_argument("--model", required=True, help="HF BERT directory to start from (e.g. a pretrain --out)")
    finetune.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: the model's, else the bundled)")
    for command in (pretrain, finetune):
        add = command.add_argument
        add("--out", required=True, help="output directory: model, tokenizer, training state, loss.png")
        length = command.add_mutually_exclusive_group()
        length.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
        length.add_argument("--epochs", type=float, default=None, help="passes over the data, instead of --steps")
        add("--batch-size", type=int, default=32, help="examples per optimizer step (all accumulation steps and processes)")
        add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
        add("--lr", type=float, default=1e-4 if command is pretrain else 5e-5, help="peak learning rate")
        add("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases and LayerNorms)")
        add("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 10%% of the steps)")
        add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
        add("--max-length", type=int, default=128, help="tokens per example")
        add("--dropout", type=float, default=None, help="set every dropout rate (default: the config's)")
        add("--bf16", action="store_true", help="bfloat16 autocast")
        add("--gradient-checkpointing", action="store_true", help="recompute layers in backward to save memory")
        add("--seed", type=int, default=0, help="initialization, data order, masking, dropout")
        add("--save-every", type=int, default=0, help="also save OUT/checkpoint-STEP every this many steps")
        add("--resume", default=None, help="checkpoint directory to continue from (same results as not stopping)")
        add("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
        add("--no-progress", action="store_true", help="no progress bar")
    encode = sub.add_parser("encode", help="embed a text file (.txt, .jsonl, .parquet) into .npy or .parquet, resumable")
    encode.add_argument("--model", required=True, help="HF BERT directory (a sentence-transformers one works too)")
    encode.add_argument("--input", required=True, help=".txt (one text a line), .jsonl (with --field), .parquet (with --column)")
    encode.add_argument("--output", required=True, help=".npy or .parquet; shards go to OUTPUT.parts until the end")
    encode.add_argument("--field", default=None, help="the .jsonl field holding the text")
    encode.add_argument("--column", default=None, help="the .parquet column holding the text")
    encode.add_argument("--dtype", default=None, choices=["fp32", "bf16", "int8"],
                        help="the model's precision (default: as saved: fp32, or int8 for a directory saved quantized)")
    encode.add_argument("--batch-tokens", type=int, default=16384, help="token budget of a batch (batch x longest)")
    encode.add_argument("--pooling", default=None, choices=[p for p in POOLINGS if p != "none"],
                        help="how token states become one vector (default: a sentence-transformers directory's, else mean)")
    encode.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction,
                        help="L2-normalize the embeddings (default: as a sentence-transformers directory says, else yes)")
    encode.add_argument("--max-length", type=int, default=None,
                        help="tokens per text (default: sentence-transformers' max_seq_length, else the model's)")
    encode.add_argument("--truncate", action="store_true", help="cut texts over --max-length instead of stopping")
    encode.add_argument("--shard-texts", type=int, default=4096, help="texts per shard (the unit a resumed run skips)")
    encode.add_argument("--restart", action="store_true", help="discard an interrupted run's shards")
    encode.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: this machine has no CUDA GPU torch can use (torch.cuda.is_available() is False)")
    if args.command == "demo" and args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model}: not a directory (an HF BERT directory)")
    if args.command == "info":
        from fastbert.info import report

        print(report())
    elif args.command == "demo":
        from fastbert.apps.demo import run

        run(args.model, args.repeats)
    elif args.command == "bench":
        from fastbert.apps.bench import run

        run(args.models, args.dtypes, args.shapes, args.competitors, args.rounds, args.out, args.backend, args.device,
            args.keep_freed_memory)
    elif args.command == "encode":
        from fastbert.apps.encode import InputError, run

        try:
            run(args.model, args.input, args.output, args.dtype, args.batch_tokens, args.field, args.column,
                args.pooling, args.normalize, args.max_length, args.truncate, args.shard_texts, args.restart,
                not args.no_progress)
        except InputError as e:
            print(f"fastbert encode: {e}", file=sys.stderr)
            return 2
    elif args.command in ("pretrain", "finetune"):
        from fastbert.apps import InputError

        try:
            train_command(args)
        except (InputError, FileNotFoundError) as e:  # not a bug: one line, no traceback
            print(f"fastbert {args.command}: {e}", file=sys.stderr)
            return 2
    return 0


def train_command(args) -> None:
    """pretrain or finetune as the options say, the first process reporting."""
    from fastbert.apps import train

    # The options share TrainArgs' field names (--batch-size -> batch_size, ...).
    fields = {f.name for f in dataclasses.fields(train.TrainArgs)} - {"progress"}
    options = train.TrainArgs(**{name: getattr(args, name) for name in fields}, progress=not args.no_progress)
    first = os.environ.get("RANK", "0") == "0"  # under torchrun, one process reports
    if args.command == "pretrain":
        losses = train.pretrain(args.corpus, options, args.tokenizer, args.config, args.mlm_probability, args.dropout,
                                args.model)
        if first:
            print(f"pretrained {len(losses)} steps, final loss {losses[-1]:.4f}: {args.out}")
    else:
        result = train.finetune(args.train, args.model, options, args.eval, args.tokenizer, args.dropout)
        if first:
            print(f"fine-tuned {len(result['losses'])} steps, final loss {result['losses'][-1]:.4f}: {args.out}")
        if "accuracy" in result:
            print(f"eval accuracy {result['accuracy']:.4f} ({result['correct']}/{result['total']}), "
                  f"loss {result['loss']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
