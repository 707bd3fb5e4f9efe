"""The ``somatize-worker`` command line (the agent itself lands with the coordinator)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize-worker",
        description="Connect to a coordinator and run filters for its jobs (not yet available in "
        "this version: only the filter daemon, `python -m worker.daemon`, is).",
    )
    parser.add_argument("--connect", metavar="URL", help="ws://HOST:PORT of the coordinator")
    parser.add_argument("--id", help="this worker's id (kept across reconnects)")
    parser.add_argument("--tag", action="append", default=[], help="a tag jobs can select")
    return parser


def main(argv: list[str] | None = None) -> int:
    _parser().parse_args(argv)
    print("somatize-worker: the worker agent is not available in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
