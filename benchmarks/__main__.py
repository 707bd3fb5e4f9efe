"""``python -m benchmarks``: every benchmark of the suite, one table, written to ``docs/``.

Each module measures its figures next to a real anchor in the same run (see its docstring) and
turns them into :class:`benchmarks.report.Row` objects (``run()`` then ``rows(results)``); the
suite prints one table of all of them, ours / anchor / ratio / target, and writes it to
``docs/benchmarks.md`` (with the date, the machine and the command) and ``docs/benchmarks.json``
(the rows plus every module's full results).

Usage::

    python -m benchmarks                  # the whole suite; writes docs/benchmarks.{md,json}
    python -m benchmarks codec transport  # a subset: printed only (add --write to write it)
    python -m benchmarks --quick          # small sizes, few repetitions: a smoke run, not written

A module can still be run alone with its own detailed print-out: ``python -m
benchmarks.codec``; the suite runs the heaviest ones with fewer repetitions than that
(:data:`SUITE_ARGS`) to stay under 10 minutes on 2 cores. A benchmark that fails is reported
(and the exit status is 1); the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import (
    Row,
    command_line,
    load_average,
    machine,
    now,
    number,
    render_markdown,
    sections,
    to_json,
    verdict,
)

SUITE = (
    "codec",
    "transport",
    "roundtrip",
    "fleet",
    "allreduce",
    "data_parallel",
    "pipeline",
)
"""The benchmarks of the suite, in the order they run."""

EXTRA = (
    "daemon",
    "worker_data",
    "checkpoints",
    "federated",
    "own_model",
    "sandbox",
    "sharded",
    "sharded_memory",
    "scheduling",
)
"""Benchmarks that run only when named (not part of the suite's table)."""

MODULES = {name: f"benchmarks.{name}" for name in (*SUITE, *EXTRA)} | {
    "fleet": "benchmarks.fleet.bench",
    "federated": "benchmarks.federated.bench",
}
"""The module of each benchmark, its ``run()`` and ``rows()``: ``benchmarks.NAME``, or the
``bench.py`` of a benchmark that is a folder (whose ``python -m benchmarks.NAME`` runs it too)."""

SUITE_ARGS: dict[str, dict[str, Any]] = {
    "transport": {"repeats": 5},
    "allreduce": {"steps": 10, "reps": 10, "rounds": 1},
    "data_parallel": {"steps": 40, "rounds": 1},
    "pipeline": {"steps": 6, "reps": 5, "rounds": 2},
}
"""``run()`` arguments of the suite: fewer repetitions than a module's own default (``python -m
benchmarks.allreduce``) for the heaviest ones, so that the whole suite stays under 10 minutes
on a 2-core machine; the sizes are the full ones."""

QUICK: dict[str, dict[str, Any]] = {
    "codec": {"size_bytes": 16 << 20, "repeats": 2},
    "transport": {"size_bytes": 8 << 20, "repeats": 2},
    "roundtrip": {"n": 200, "warmup": 20, "rounds": 1},
    "fleet": {"n": 50, "hold": 1.0, "state_bytes": 64 << 10},
    "allreduce": {"steps": 3, "reps": 3, "rounds": 1},
    "data_parallel": {"steps": 3, "rounds": 1, "quick": True},
    "pipeline": {"steps": 3, "rounds": 1, "reps": 3},
    "daemon": {"pings": 100, "features": 500, "repeats": 2},
    "worker_data": {"gib": 0.25, "shuffles": (True,)},
    "checkpoints": {"steps": 18, "rounds": 1},
    "federated": {"quick": True},
    "own_model": {"rows": 640},
    "sandbox": {"repeats": 1, "steps": 16},
    "sharded": {"steps": 4, "rounds": 1},
    "sharded_memory": {"replicas": (1, 2), "width": 1024},
    "scheduling": {"day": 20.0, "workers": 10},
}
"""``run()`` arguments of ``--quick``: every code path, a fraction of the time."""

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="the benchmark suite, ours vs anchors"
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {SUITE})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repetitions (a smoke run)"
    )
    write = parser.add_mutually_exclusive_group()
    write.add_argument(
        "--write",
        action="store_true",
        help="write docs/benchmarks.{md,json} (the default for a full, non-quick run)",
    )
    write.add_argument("--no-write", action="store_true", help="never write docs/")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where to write (default: docs/)")
    parser.add_argument("--remark", default="", help="a note to print under the machine")
    return parser.parse_args(argv)


def run_one(name: str, quick: bool) -> tuple[list[Row], dict[str, Any]]:
    """Run benchmark ``name``; its rows and its full results."""
    module = importlib.import_module(MODULES[name])
    results = module.run(**(QUICK if quick else SUITE_ARGS).get(name, {}))
    return list(module.rows(results)), results


def table(rows: Sequence[Row]) -> Table:
    out = Table(title="somatize benchmarks: ours vs anchor, same run, same machine")
    for column, justify in (
        ("bench", "left"),
        ("ours", "left"),
        ("value", "right"),
        ("anchor", "left"),
        ("value", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("", "left"),
        ("note", "left"),
    ):
        out.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        mark = verdict(row)
        style = "" if not mark else "green" if row.met else "bold red"
        out.add_row(
            row.bench,
            row.name,
            f"{number(row.ours)} {row.unit}",
            row.anchor_name,
            f"{number(row.anchor)} {row.unit}" if row.anchor is not None else "",
            f"{number(row.ratio)} x" if row.ratio is not None else "",
            row.target.describe() if row.target is not None else "",
            f"[{style}]{mark}[/{style}]" if style else mark,
            row.note,
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    known = (*SUITE, *EXTRA)
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        print(f"unknown benchmarks {unknown}; choose from {list(known)}", file=sys.stderr)
        return 2
    names = args.names or list(SUITE)
    full = not args.names and not args.quick
    write = not args.no_write and (args.write or full)
    console = Console()
    if not console.is_terminal:  # a log file: room for the whole table
        console = Console(width=200)
    rows: list[Row] = []
    details: dict[str, Any] = {}
    failures: dict[str, str] = {}
    load_start = load_average()
    started = time.monotonic()
    for name in names:
        console.print(f"[bold]{name}[/bold] ...")
        began = time.monotonic()
        try:
            new_rows, results = run_one(name, args.quick)
        except Exception as exc:  # one broken benchmark must not lose the others' figures
            traceback.print_exc()
            failures[name] = f"{type(exc).__name__}: {exc}"
            console.print(f"[bold red]{name} failed[/bold red]: {failures[name]}")
            continue
        rows += new_rows
        details[name] = {"seconds": time.monotonic() - began, "results": results}
        console.print(f"  {name}: {time.monotonic() - began:.0f} s")
    meta = {
        "date": now(),
        "machine": machine(),
        "command": command_line(argv),
        "benchmarks": names,
        "quick": args.quick,
        "seconds": time.monotonic() - started,
        "load_start": load_start,
        "load_end": load_average(),
        "remark": args.remark,
        "failures": failures,
    }
    console.print(table(rows))
    console.print(
        f"{len(names)} benchmarks in {meta['seconds']:.0f} s; load average "
        f"{meta['load_start'][0]:.2f} -> {meta['load_end'][0]:.2f}"
    )
    if write:
        args.docs.mkdir(parents=True, exist_ok=True)
        document = args.docs / "benchmarks.md"
        kept = sections(document.read_text()) if document.exists() else ""  # others' sections
        document.write_text(render_markdown(rows, meta) + ("\n" + kept if kept else ""))
        payload = to_json(rows, meta, details)
        (args.docs / "benchmarks.json").write_text(json.dumps(payload, indent=1, default=str))
        console.print(f"wrote {args.docs / 'benchmarks.md'} and {args.docs / 'benchmarks.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
