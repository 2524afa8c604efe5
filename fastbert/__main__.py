"""python -m fastbert info | demo | bench"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastbert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="ops x backends on this machine, and why a backend is unavailable")
    demo = sub.add_parser("demo", help="encode real sentences with all-MiniLM-L6-v2: fastbert vs transformers")
    demo.add_argument("--model", default=None, help="HF BERT directory (default: the bundled all-MiniLM-L6-v2)")
    demo.add_argument("--repeats", type=int, default=10, help="timed runs of each model (median reported)")
    bench = sub.add_parser("bench", help="fastbert vs transformers, torch, ONNX Runtime: medians, ratios, GEMM-rate fraction")
    from fastbert import bench as b

    def names(known):
        def parse(text):
            chosen = [t.strip() for t in text.split(",") if t.strip()]
            bad = [t for t in chosen if t not in known]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (known: {', '.join(known)})")
            return chosen
        return parse

    bench.add_argument("--models", type=names(b.MODELS), default=list(b.MODELS), help="minilm (bundled checkpoint), base")
    bench.add_argument("--dtypes", type=names(tuple(b.DTYPES)), default=["fp32"], help="fp32, bf16")
    bench.add_argument("--shapes", type=names(b.SHAPES), default=list(b.SHAPES), help="batch x seq, or ragged32")
    bench.add_argument("--competitors", type=names(b.COMPETITORS), default=list(b.DEFAULT_COMPETITORS),
                       help="fastbert, hf-eager, hf-sdpa, compile (torch.compile of hf-sdpa), nested, onnxruntime")
    bench.add_argument("--rounds", type=int, default=7, help="timed rounds per competitor (median reported)")
    bench.add_argument("--backend", default=None, help="force one fastbert backend for every op")
    bench.add_argument("--out", default="benchmarks/out", help="folder for bench.json and bench.png")
    args = parser.parse_args(argv)
    if args.command == "info":
        from fastbert.info import report

        print(report())
    elif args.command == "demo":
        from fastbert.demo import run

        run(args.model, args.repeats)
    elif args.command == "bench":
        from fastbert.bench import run

        run(args.models, args.dtypes, args.shapes, args.competitors, args.rounds, args.out, args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
