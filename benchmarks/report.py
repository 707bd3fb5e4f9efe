"""One result type for every benchmark, the suite's table, and the files it is written to.

Each benchmark module turns what its ``run()`` measured into :class:`Row` objects (its
``rows(results)``): our figure, the anchor's figure measured in the same run, their ratio
``ours / anchor`` and, where the row is held to one, a :class:`Target` on that ratio or on our
figure. :func:`render_markdown` and :func:`to_json` write what ``python -m benchmarks``
measured, with the date, the machine (:func:`machine`) and the exact command.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import math
import os
import platform
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Op = Literal[">=", "<=", "<"]


@dataclass(frozen=True)
class Target:
    """A bound a row is held to: on the ratio ``ours / anchor`` or on our figure.

    Args:
        op: ``">="``, ``"<="`` or ``"<"``.
        bound: the bound, in the unit of what is bounded.
        on: ``"ratio"`` or ``"ours"``.
        text: how the report states it ("≥ 0.5 × memcpy").
    """

    op: Op
    bound: float
    on: Literal["ratio", "ours"] = "ratio"
    text: str = ""

    def met(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        return value < self.bound

    def margin(self, value: float) -> str:
        """By how much ``value`` meets or misses the bound, as a relative figure."""
        if math.isnan(value) or self.bound == 0:
            return "n/a"
        slack = (value / self.bound - 1) if self.op == ">=" else (1 - value / self.bound)
        word = "met" if self.met(value) else "missed"
        return f"{word} by {abs(slack) * 100:.0f} %"

    def describe(self) -> str:
        return self.text or f"{'ratio' if self.on == 'ratio' else 'ours'} {self.op} {self.bound:g}"


@dataclass(frozen=True)
class Row:
    """One line of the suite's table.

    Args:
        bench: the module that measured it (``"codec"``).
        name: what ours is (``"encode+decode 256 MB float32"``).
        ours: our figure, in ``unit``.
        unit: ``"GB/s"``, ``"ms"``, ``"µs"``, ``"MiB"``, ``"s"``...
        anchor: the anchor's figure in the same unit, measured in the same run (``None`` when
            the row has no anchor, e.g. a figure bounded by its target alone).
        anchor_name: what the anchor is (``"np.copyto"``).
        target: the bound this row is held to, if any.
        note: context printed beside the row (a bubble fraction, a p99...).
    """

    bench: str
    name: str
    ours: float
    unit: str
    anchor: float | None = None
    anchor_name: str = ""
    target: Target | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.anchor is None:
            return None
        return self.ours / self.anchor if self.anchor else math.nan

    @property
    def met(self) -> bool | None:
        """Whether the target is met (``None``: the row has no target)."""
        if self.target is None:
            return None
        value = self.ratio if self.target.on == "ratio" else self.ours
        return self.target.met(math.nan if value is None else value)

    def target_value(self) -> float:
        value = self.ratio if self.target is not None and self.target.on == "ratio" else self.ours
        return math.nan if value is None else value

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ratio"] = self.ratio
        out["met"] = self.met
        return out


def number(value: float | None) -> str:
    """A figure with 3 significant digits (``1.23``, ``45.6``, ``1,234``)."""
    if value is None:
        return ""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def verdict(row: Row) -> str:
    if row.target is None:
        return ""
    return "met" if row.met else "MISSED"


# -- the machine ---------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """What the figures were measured on (read without importing torch)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(_memory_bytes() / 2**30, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "websockets": _version("websockets"),
        "uvloop": _version("uvloop"),
    }


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where unknown)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


# -- output --------------------------------------------------------------------------------------


def render_markdown(
    rows: Sequence[Row],
    meta: dict[str, Any],
) -> str:
    """``docs/benchmarks.md``: when, where, how, the table, and one line per target."""
    m = meta["machine"]
    lines = [
        "# Benchmarks",
        "",
        "Written by `python -m benchmarks` (see `benchmarks/__main__.py`); every anchor is "
        "measured in the same run on the same machine, and *ratio* is ours / anchor.",
        "",
        f"- **date**: {meta['date']}",
        f"- **machine**: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, "
        f"{m['kernel']}; Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, "
        f"websockets {m['websockets']}, uvloop {m['uvloop']}",
        f"- **command**: `{meta['command']}`",
        f"- **benchmarks**: {', '.join(meta['benchmarks'])} in {meta['seconds']:.0f} s",
        f"- **load average** (1 min) at start / end: {meta['load_start'][0]:.2f} / "
        f"{meta['load_end'][0]:.2f} on {m['cores']} cores",
    ]
    if meta.get("remark"):
        lines.append(f"- **note**: {meta['remark']}")
    lines += [
        "",
        "| benchmark | ours | value | anchor | value | ratio | target | |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for row in rows:
        target = row.target.describe() if row.target is not None else ""
        anchor = f"{number(row.anchor)} {row.unit}" if row.anchor is not None else ""
        ratio = f"{number(row.ratio)} ×" if row.ratio is not None else ""
        name = row.name + (f" ({row.note})" if row.note else "")
        lines.append(
            f"| {row.bench} | {name} | {number(row.ours)} {row.unit} | {row.anchor_name} | "
            f"{anchor} | {ratio} | {target} | {verdict(row)} |"
        )
    lines += ["", "## Targets", ""]
    for row in rows:
        if row.target is None:
            continue
        what = "ratio" if row.target.on == "ratio" else "figure"
        lines.append(
            f"- {row.bench}, {row.name}: {what} {number(row.target_value())} "
            f"{'×' if row.target.on == 'ratio' else row.unit}, target {row.target.describe()}: "
            f"**{row.target.margin(row.target_value())}**"
        )
    failures = meta.get("failures") or {}
    if failures:
        lines += ["", "## Failed benchmarks", ""]
        lines += [f"- {name}: {why}" for name, why in failures.items()]
    return "\n".join(lines) + "\n"


def to_json(rows: Sequence[Row], meta: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
    """``docs/benchmarks.json``: the metadata, the rows and every module's full results."""
    return {**meta, "rows": [row.to_dict() for row in rows], "details": details}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, as one would type it."""
    return shlex.join(["python", "-m", "benchmarks", *argv])


SECTION = re.compile(r"<!-- section: (?P<name>[\w.]+) -->\n.*?<!-- end: (?P=name) -->\n", re.S)
"""A block of ``docs/benchmarks.md`` that another benchmark writes (its module's name), which
``python -m benchmarks`` keeps when it writes the rest."""


def with_section(document: str, name: str, body: str) -> str:
    """``document`` with the section ``name`` (:data:`SECTION`) replaced by ``body``, or added
    at its end."""
    block = f"<!-- section: {name} -->\n{body.rstrip()}\n<!-- end: {name} -->\n"
    for found in SECTION.finditer(document):
        if found.group("name") == name:
            return document[: found.start()] + block + document[found.end() :]
    return document.rstrip("\n") + "\n\n" + block


def sections(document: str) -> str:
    """Every section of ``document`` that another benchmark wrote, as they stand."""
    return "".join(found.group(0) for found in SECTION.finditer(document))
