"""The command line the scenario benchmarks share (:mod:`benchmarks.faults`,
:mod:`benchmarks.attacks`): pick scenarios, run them in a scratch directory, write the page.

``python -m benchmarks.<name> [--out PAGE] [--keep DIR] [SCENARIO ...]``: every scenario (or the
named ones) is run, the total time printed, and the page written only when none failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["scenario_main"]

Run = Callable[[Sequence[str], Path], tuple[list[Any], dict[str, str], int]]
"""``run(names, scratch)`` → the rows, the skipped scenarios (name → why), the failures."""
Render = Callable[[list[Any], dict[str, str], dt.datetime, str, float, float], str]
"""``render(rows, skipped, started_at, command, load_at_start, took)`` → the page."""


def scenario_main(
    module: str,
    description: str | None,
    page: Path,
    scenarios: Mapping[str, Any],
    run: Run,
    render: Render,
    *,
    argv: list[str] | None,
    keep_help: str,
) -> int:
    """Parse ``argv``, run the scenarios, write ``page`` (or ``--out``); the exit status."""
    prog = f"python -m {module}"
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("names", nargs="*", metavar="SCENARIO", help=f"of {list(scenarios)}")
    parser.add_argument("--out", type=Path, default=page, help=f"default {page}")
    parser.add_argument("--keep", type=Path, metavar="DIR", help=keep_help)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(scenarios))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {list(scenarios)}")
    began = dt.datetime.now(dt.UTC)
    load_at_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        scratch = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rows, skipped, failures = run(args.names or list(scenarios), scratch)
    took = (dt.datetime.now(dt.UTC) - began).total_seconds()
    print(f"total {took:.0f} s")
    if failures:
        print(f"{failures} scenario(s) failed: {args.out} not written", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join([prog, *given])
    args.out.write_text(render(rows, skipped, began, command, load_at_start, took))
    print(f"wrote {args.out}")
    return 0
