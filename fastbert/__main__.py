"""python -m fastbert info | demo"""
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
    args = parser.parse_args(argv)
    if args.command == "info":
        from fastbert.info import report

        print(report())
    elif args.command == "demo":
        from fastbert.demo import run

        run(args.model, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
