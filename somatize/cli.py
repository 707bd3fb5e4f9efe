"""The ``somatize`` command line."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize", description="Train graphs of filters, in-process or across machines."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="train scikit-learn's digits and print held-out accuracy")
    demo.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from somatize.demo import run_local

        run_local(epochs=args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
