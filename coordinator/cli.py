"""The ``somatize-coordinator`` command line (the daemon itself lands with the coordinator)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize-coordinator",
        description="Coordinate worker agents and run training jobs (not yet available in this "
        "version: only the in-process SDK and the filter daemon are).",
    )
    parser.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:8765")
    parser.add_argument("--state-dir", metavar="DIR", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    _parser().parse_args(argv)
    print("somatize-coordinator: the coordinator is not available in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
