"""A job's history where people look at it: a table, a plot, TensorBoard event files.

The history is a row per epoch (per round for FedAvg/FedProx): ``epoch`` (or ``round``),
``loss`` (the epoch's mean training loss), ``lr`` and, with validation data, ``val_loss`` and
each metric (``FittedGraph.history``; each row is a ``progress`` event with ``phase`` the unit,
and the job's last progress event holds them all). ``somatize result ID`` prints it,
``--plot FILE.png`` draws it (epochs or rounds on the x-axis) beside the training loss of every
step (:func:`loss_curve`, from the job's progress events), ``--tensorboard DIR`` writes both as
TensorBoard scalars (``torch.utils.tensorboard``, the ``tensorboard`` extra: ``step/loss`` by
step, each figure of a row by epoch or round), as ``somatize submit --tensorboard DIR`` does
while the job runs. With ``validate_every``, the validations between epoch ends
(``FittedGraph.validations``: ``step`` and the figures) join the per-step panel and are written
as ``step/val_loss`` (and each metric) by step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "HistoryWriter",
    "curve_unit",
    "history_of",
    "history_table",
    "loss_curve",
    "loss_figure",
    "plot_history",
    "plot_loss",
    "row_of",
    "unit_of",
    "validations_of",
]

UNITS = ("epoch", "round")
"""What a history row can be of."""


def unit_of(rows: Sequence[Mapping[str, Any]]) -> str:
    """``"epoch"`` or ``"round"``: what the rows are of."""
    return "round" if rows and "round" in rows[0] else "epoch"


def row_of(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The history row a progress event carries (``phase`` ``"epoch"`` or ``"round"``), or
    ``None``."""
    unit = data.get("phase")
    if unit not in UNITS or not isinstance(data.get(unit), int) or "loss" not in data:
        return None
    skip = {"phase", "rounds", "selected", "workers", "dropped", "rows", "evaluation"}
    return {
        k: v
        for k, v in data.items()
        if k not in skip and not k.endswith("_dropped") and _number(v) is not None
    }


def history_of(record: Mapping[str, Any], name: str = "history") -> list[dict[str, Any]]:
    """The history a job's record holds (its last progress event's), or ``[]``; ``name``
    ``"validations"``: the validations between epoch ends."""
    progress = record.get("progress")
    rows = progress.get(name) if isinstance(progress, Mapping) else None
    return [dict(r) for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


def validations_of(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The validations between epoch ends a job's record holds (``validate_every``), or
    ``[]``."""
    return history_of(record, "validations")


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    unit, seen = unit_of(rows), []
    for row in rows:
        seen += [k for k in row if k not in seen and k != unit]
    ordered: list[str] = [k for k in ("step", "loss", "val_loss") if k in seen]
    ordered += [k for k in seen if k not in ("step", "loss", "val_loss", "lr")]
    return [unit, *ordered, *(["lr"] if "lr" in seen else [])]


def history_table(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    """The rows as a ``rich`` table: the unit, ``step`` (a validation's), ``loss``,
    ``val_loss``, each metric, ``lr``
    (a metric's name is a filter's: shown as text, its escape sequences written out)."""
    from rich.table import Table
    from rich.text import Text

    from protocol.text.wording import visible

    table = Table(title=Text(title), title_justify="left")
    columns = _columns(rows)
    for column in columns:
        table.add_column(Text(visible(column)), justify="right")
    for row in rows:
        table.add_row(*(_cell(row.get(c), c) for c in columns))
    return table


def _cell(value: Any, column: str) -> str:
    number = _number(value)
    if number is None:
        return ""
    if column in UNITS or column == "step":
        return str(int(number))
    return f"{number:.3g}" if column == "lr" else f"{number:.4f}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def plot_history(
    rows: Sequence[Mapping[str, Any]],
    path: str,
    title: str,
    steps: Sequence[tuple[float, float]] = (),
    validations: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """Save the training and validation curves as an image: the training loss of each of
    ``steps`` (``(step, loss)``, when given) on a panel of its own with the validation loss of
    each of ``validations`` (``validate_every``'s, by step), ``loss`` and ``val_loss`` over the
    epochs (or rounds), and each metric on another panel (matplotlib, no display needed).

    Returns:
        Each panel's ``x-axis label: its curves``, as drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = unit_of(rows)
    metrics = [c for c in _columns(rows)[1:] if c not in ("loss", "val_loss", "lr")]
    panels = 1 + bool(metrics) + bool(steps)
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.5), dpi=100, squeeze=False)
    row_axes = list(axes[0])
    if steps:
        by_step = row_axes.pop(0)
        by_step.plot([p[0] for p in steps], [p[1] for p in steps], label="training loss")
        scored = [(v["step"], v["val_loss"]) for v in validations if "val_loss" in v]
        if scored:
            at = [step for step, _ in scored]
            by_step.plot(at, [v for _, v in scored], "o--", label="validation loss")
        by_step.set_xlabel("step")
        by_step.set_ylabel("loss")
        by_step.set_title(title)
        by_step.legend()
        by_step.grid(alpha=0.3)
    xs = [row[unit] for row in rows]
    losses = row_axes[0]
    for name, label in (("loss", "training loss"), ("val_loss", "validation loss")):
        if any(name in row for row in rows):
            losses.plot(xs, [row.get(name, math.nan) for row in rows], marker="o", label=label)
    losses.set_xlabel(unit)
    losses.set_ylabel("loss")
    losses.set_title(f"{title}, by {unit}" if steps else title)
    losses.legend()
    losses.grid(alpha=0.3)
    if metrics:
        scores = row_axes[1]
        for name in metrics:
            scores.plot(xs, [row.get(name, math.nan) for row in rows], marker="o", label=name)
        scores.set_xlabel(unit)
        scores.set_ylabel("validation")
        scores.legend()
        scores.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    drawn = [
        f"{a.get_xlabel()}: {', '.join(line.get_label() for line in a.get_lines())}"
        for a in axes[0]
    ]
    plt.close(figure)
    return drawn


class HistoryWriter:
    """History rows as TensorBoard scalars in ``directory`` (one tag per figure, the step the
    epoch or round), and the training loss of each step (``step/loss``), written as they come
    (``torch.utils.tensorboard.SummaryWriter``).

    Raises:
        RuntimeError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                "writing TensorBoard files needs the tensorboard package: "
                "pip install 'somatize-coordinator[tensorboard]' (or tensorboard)"
            ) from exc
        self.directory = directory
        self._writer = SummaryWriter(log_dir=directory)
        self.written = 0  # rows
        self.steps = 0

    def add(self, row: Mapping[str, Any]) -> None:
        """Every figure of one row."""
        unit = "round" if "round" in row else "epoch"
        step = int(row[unit])
        for name, value in row.items():
            number = _number(value)
            if name != unit and number is not None:
                self._writer.add_scalar(name, number, global_step=step)
        self.written += 1

    def add_all(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            self.add(row)

    def add_validations(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Each figure of validations between epoch ends (``validate_every``'s), by step:
        ``step/val_loss`` and each metric."""
        for row in rows:
            for name, value in row.items():
                number = _number(value)
                if name not in ("epoch", "step") and number is not None:
                    self._writer.add_scalar(f"step/{name}", number, global_step=int(row["step"]))

    def add_steps(self, points: Iterable[tuple[float, float]]) -> None:
        """The training loss of each ``(step, loss)``, as ``step/loss``."""
        for step, loss in points:
            self._writer.add_scalar("step/loss", loss, global_step=int(step))
            self.steps += 1

    def close(self) -> None:
        self._writer.close()


# -- the loss curve of every step (from a job's progress events) -------------------------------


ROWS_AND_END = ("epoch", "trained")
"""Progress events that are no step of the loss curve: an epoch's history row, the run's end."""


def loss_curve(events: Iterable[Any]) -> list[tuple[float, float]]:
    """``(step, loss)`` of each progress event that carries a loss (a step, a federated round,
    each step of a chunk of them, or an epoch's losses when a job reports only those at its
    end)."""
    points: list[tuple[float, float]] = []
    for event in events:
        data = event.data if hasattr(event, "data") else {}
        if event.event != "progress":
            continue
        losses = data.get("losses")
        if isinstance(losses, list) and isinstance(data.get("step"), int):
            # A chunk of steps in one event: the loss of each, ending at ``step``.
            first = data["step"] - len(losses) + 1
            points.extend((float(first + i), float(v)) for i, v in enumerate(losses))
        elif isinstance(data.get("loss"), int | float) and data.get("phase") not in ROWS_AND_END:
            x = data.get("step") or data.get("round") or len(points) + 1
            points.append((float(x), float(data["loss"])))
        elif isinstance(data.get("epoch_losses"), list):
            points.extend((float(i + 1), float(v)) for i, v in enumerate(data["epoch_losses"]))
    return points


def curve_unit(events: Iterable[Any]) -> str:
    """What the loss curve's x-axis counts: federated ``round``, an ``epoch`` when the job
    reported only its epochs' losses, else a training ``step``."""
    progress = [e.data for e in events if e.event == "progress"]
    if any(d.get("phase") == "round" for d in progress):
        return "round"
    if not any(isinstance(d.get("step"), int) for d in progress):
        return "epoch"
    return "step"


def plot_loss(points: list[tuple[float, float]], path: str, title: str, x_label: str) -> None:
    """Save the loss curve as an image (matplotlib, no display needed)."""
    import matplotlib.pyplot as plt

    figure = loss_figure(points, title, x_label)
    figure.savefig(path)
    plt.close(figure)


def loss_figure(points: list[tuple[float, float]], title: str, x_label: str) -> Any:
    """The loss curve as a matplotlib figure; its x-axis counts ``x_label`` (steps, rounds,
    epochs) on whole-number ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    if points:
        axes.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue")
    axes.set_xlabel(x_label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return figure
