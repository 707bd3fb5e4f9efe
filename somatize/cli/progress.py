"""A job's progress in sentences with units: what ``somatize submit`` shows while it follows a
job, and what a table shows of a job's last progress event.

:class:`Progress` is fed a job's events in order and says where the job is in one line, with
what only a history can tell (the epoch's mean loss so far, the rate, the time left)::

    epoch 3/10 · step 40/66 · loss 0.42 (epoch mean) · 1,250 rows/s · ETA 0:12
    round 3/10 · loss 1.96 (mean of 2 workers) · 1,347 rows · ETA 0:30

An epoch's history row (``phase`` ``"epoch"``, issue 17) adds its validation figures to the
line of its last step (``val_loss 0.3811 · accuracy 0.9125``); the run's last event
(``"trained"``) leaves the line of its last step as it was.

:func:`event_text` says what one event says alone (a table has only the last one): there the
loss is the last step's, and says so. No I/O: times are the events' own (the coordinator's
clock), so the same events give the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Progress", "bar_position", "clock", "event_text"]

SEP = " · "


def event_text(data: dict[str, Any]) -> str:
    """One progress event in words (``epoch 2/5 · step 7/12 · loss 0.5 (last step)``)."""
    phase = data.get("phase")
    if phase == "training" and _int(data.get("step")) is not None:
        parts = _position(data)
        if _num(data.get("loss")) is not None:
            parts.append(f"loss {data['loss']:.4g} (last step)")
        return SEP.join(parts)
    if phase == "round":
        return SEP.join([*_round(data), *_round_rows(data)])
    return _phase_text(data)


@dataclass
class Progress:
    """Where a job is, from its events so far (:meth:`add` each one, in order)."""

    text: str = ""
    _origin: float | None = None  # time of the first step (or round) event: rates count after
    _rows: int = 0  # rows trained since the origin
    _steps: int = 0  # steps (or rounds) since the origin
    _epoch: int | None = None
    _epoch_loss: list[float] = field(default_factory=lambda: [0.0, 0.0])  # Σ loss·rows, Σ rows
    _line: str = ""  # the last step's (round's) line: a history row adds to it

    @property
    def final(self) -> str:
        """The last line without its time left: how the job's training ended."""
        return SEP.join(p for p in self.text.split(SEP) if not p.startswith("ETA "))

    def add(self, time: float, data: dict[str, Any]) -> str:
        """Take one progress event (its time and data); returns :attr:`text`, the line now."""
        phase = data.get("phase")
        if phase == "training" and _int(data.get("step")) is not None:
            self.text = self._line = self._training(time, data)
        elif phase == "round" and _int(data.get("round")) is not None:
            self.text = self._line = self._round(time, data)
        elif phase == "epoch" and _int(data.get("epoch")) is not None:
            self.text = SEP.join([self._line or _row_text(data), *_figures(data)])
        elif phase == "trained" and self._line:
            self.text = SEP.join([self._line, *_figures(_last_row(data))])
        else:
            self.text = _phase_text(data)
        return self.text

    def _training(self, time: float, data: dict[str, Any]) -> str:
        losses, rows = _step_losses(data)
        per_epoch, step = _per_epoch(data), _int(data.get("step")) or 0
        for j, (loss, n) in enumerate(zip(losses, rows, strict=True)):
            # A chunk of steps may cross into the next epoch: each step counts in its own.
            at = step - len(losses) + 1 + j
            epoch = (at - 1) // per_epoch + 1 if per_epoch else _int(data.get("epoch"))
            if epoch != self._epoch:
                self._epoch, self._epoch_loss = epoch, [0.0, 0.0]
            self._epoch_loss[0] += loss * n
            self._epoch_loss[1] += n
        parts = _position(data)
        if self._epoch_loss[1] > 0:
            parts.append(f"loss {self._epoch_loss[0] / self._epoch_loss[1]:.4g} (epoch mean)")
        counted = rows if _int(data.get("rows")) is not None else []
        parts += self._rate(time, len(losses), sum(counted), "rows/s")
        total = _int(data.get("steps"))
        parts += self._eta(time, None if total is None else total - step)
        return SEP.join(parts)

    def _round(self, time: float, data: dict[str, Any]) -> str:
        parts = [*_round(data), *_round_rows(data)]
        rounds, now = _int(data.get("rounds")), _int(data.get("round"))
        self._rate(time, 1, 0, "")
        parts += self._eta(time, None if rounds is None or now is None else rounds - now)
        return SEP.join(parts)

    def _rate(self, time: float, steps: int, rows: int, unit: str) -> list[str]:
        """Counts ``steps`` and ``rows`` done by ``time``; the rate since the origin, if any."""
        if self._origin is None:
            self._origin = time
            return []
        self._steps += steps
        self._rows += rows
        elapsed = time - self._origin
        if elapsed <= 0 or not unit or not self._rows:
            return []
        return [f"{self._rows / elapsed:,.0f} {unit}"]

    def _eta(self, time: float, left: int | None) -> list[str]:
        """``ETA h:mm:ss`` for ``left`` more steps (or rounds) at the pace so far."""
        if left is None or self._origin is None or self._steps <= 0:
            return []
        per_step = (time - self._origin) / self._steps
        return [f"ETA {clock(max(left, 0) * per_step)}"]


def bar_position(data: dict[str, Any]) -> tuple[int, int]:
    """How far a progress bar stands after this event, and its end (``0``: no end known): by
    steps, else rounds, else epochs."""
    for done, total in (("step", "steps"), ("round", "rounds"), ("epoch", "epochs")):
        at, end = _int(data.get(done)), _int(data.get(total))
        if at is not None and end:
            return at, end
    return 0, 0


def clock(seconds: float) -> str:
    """``0:12``, ``3:05``, ``1:02:03``: a duration as a clock shows it (whole seconds)."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _position(data: dict[str, Any]) -> list[str]:
    """``epoch 3/10`` and ``step 40/66`` (the step within its epoch, when the total says)."""
    parts = []
    epoch, epochs = _int(data.get("epoch")), _int(data.get("epochs"))
    if epoch is not None:
        parts.append(f"epoch {epoch}" + (f"/{epochs}" if epochs else ""))
    step, steps, per_epoch = _int(data.get("step")), _int(data.get("steps")), _per_epoch(data)
    if step is not None:
        if per_epoch and epoch is not None:
            parts.append(f"step {step - (epoch - 1) * per_epoch}/{per_epoch}")
        else:
            parts.append(f"step {step}" + (f"/{steps}" if steps else ""))
    return parts


def _per_epoch(data: dict[str, Any]) -> int | None:
    """Steps in each epoch, when the event's totals say (``steps`` over ``epochs``)."""
    steps, epochs = _int(data.get("steps")), _int(data.get("epochs"))
    return steps // epochs if steps and epochs and steps % epochs == 0 else None


def _step_losses(data: dict[str, Any]) -> tuple[list[float], list[int]]:
    """Each step's loss in the event and its rows (1 each when the event does not say)."""
    losses = data.get("losses")
    if isinstance(losses, list) and losses:
        rows = data.get("batch_rows")
        weights = rows if isinstance(rows, list) and len(rows) == len(losses) else [1] * len(losses)
        return [float(v) for v in losses], [int(n) for n in weights]
    loss = _num(data.get("loss"))
    if loss is None:
        return [], []
    return [loss], [_int(data.get("rows")) or 1]


def _round(data: dict[str, Any]) -> list[str]:
    rounds = _int(data.get("rounds"))
    parts = [f"round {data.get('round')}" + (f"/{rounds}" if rounds else "")]
    loss, workers = _num(data.get("loss")), data.get("workers")
    if loss is not None:
        among = f"mean of {len(workers)} workers" if isinstance(workers, list) else "mean"
        parts.append(f"loss {loss:.4g} ({among})")
    dropped = data.get("dropped")
    if isinstance(dropped, dict) and dropped:
        parts.append(f"dropped {', '.join(map(str, dropped))}")
    return parts


def _round_rows(data: dict[str, Any]) -> list[str]:
    rows = _int(data.get("rows"))
    return [f"{rows:,} rows"] if rows is not None else []


def _phase_text(data: dict[str, Any]) -> str:
    """What a job does before and after its steps (loading, fitting, trained...) in words."""
    phase = str(data.get("phase") or "")
    if phase == "loading":
        for key, what in (("replicas", "replicas"), ("stages", "stages"), ("nodes", "nodes")):
            if _int(data.get(key)) is not None:
                return f"loading the filters ({data[key]} {what})"
        if isinstance(data.get("workers"), list):
            return f"loading the filters on {len(data['workers'])} workers"
        return "loading the filters"
    if phase == "fitting":
        nodes = data.get("nodes")
        return "fitting the plain filters" + (f" {nodes}" if nodes else "")
    if phase == "staged" and isinstance(data.get("rows"), dict):
        rows = data["rows"]
        return f"staged {sum(int(n) for n in rows.values()):,} rows on {len(rows)} workers"
    if phase == "linked":
        return f"stages linked ({data.get('transport', '?')})"
    if phase == "sharded":
        held = [v["parameter_bytes"] for v in data.values() if isinstance(v, dict)]
        most = f": at most {max(held):,} bytes of parameters a replica" if held else ""
        return f"model sharded ({data.get('sharding', '?')}){most}"
    if phase == "training":
        rows = _int(data.get("rows"))
        on = f" on {rows:,} rows" if rows is not None else ""
        return f"training{on} (one worker runs the whole loop: its loss comes at the end)"
    if phase == "trained":
        return _trained_text(data)
    if phase == "epoch":
        return SEP.join([_row_text(data), *_figures(data)])
    shown = [
        f"{k} {v}"
        for k, v in data.items()
        if k != "phase" and isinstance(v, str | int | float) and not isinstance(v, bool)
    ]
    return SEP.join([p for p in [phase, *shown] if p])


_NOT_FIGURES = frozenset(
    {"phase", "epoch", "epochs", "round", "rounds", "loss", "lr", "step", "steps", "rows"}
)


def _figures(row: dict[str, Any]) -> list[str]:
    """A history row's validation figures in words (``val_loss 0.3811``, each metric)."""
    return [f"{k} {v:.4g}" for k, v in row.items() if k not in _NOT_FIGURES and _num(v) is not None]


def _trained_text(data: dict[str, Any]) -> str:
    """A run's last event: where it ended (its last step, its last round, or its epochs), the
    last epoch's (round's) mean loss and its history's last figures."""
    last, unit = _last_row(data), "epoch"
    losses = data.get("epoch_losses")
    loss = losses[-1] if isinstance(losses, list) and losses else last.get("loss")
    if _int(data.get("step")) is not None:
        parts = _position(data)
    elif _int(data.get("round")) is not None:
        rounds, unit = _int(data.get("rounds")), "round"
        parts = [f"round {data['round']}" + (f"/{rounds}" if rounds else "")]
    else:
        parts = ["trained" + (f" {data['epochs']} epochs" if _int(data.get("epochs")) else "")]
    if _num(loss) is not None:
        parts.append(f"loss {loss:.4g} (last {unit} mean)")
    return SEP.join([*parts, *_figures(last)])


def _row_text(row: dict[str, Any]) -> str:
    """``epoch 2 · loss 0.41 (epoch mean)``: a history row of a job whose steps say nothing."""
    loss = _num(row.get("loss"))
    said = f"epoch {row.get('epoch')}"
    return said if loss is None else f"{said}{SEP}loss {loss:.4g} (epoch mean)"


def _last_row(data: dict[str, Any]) -> dict[str, Any]:
    """The last row of a ``trained`` event's history (``{}``: none)."""
    history = data.get("history")
    last = history[-1] if isinstance(history, list) and history else {}
    return last if isinstance(last, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
