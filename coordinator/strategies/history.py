"""A run's history: one row per epoch (per round for FedAvg), as ``graph.fit`` keeps it.

A row holds the epoch's number, ``loss`` — its mean training loss, each step's (the mean loss
of its global batch) weighted by the step's rows, which is what ``graph.fit`` averages — the
learning rate of its last step (``lr``) and, when the job has validation data, what evaluating
the model as it stands at the epoch's end gave: ``val_loss`` and each metric of the last
TorchFilter. Each row is a ``progress`` event (``phase``: ``"epoch"``) when its epoch ends,
and the run's last event (``phase``: ``"trained"``) carries them all, so a finished job's
record holds its history (``FittedGraph.history``, ``somatize result``).

With ``validate_every`` (a TorchFilter's), the model is also evaluated between epoch ends: each
such evaluation is a row of :attr:`History.validations` (``epoch``, ``step`` and the figures), a
``progress`` event (``phase``: ``"validation"``) when it is made, and the last event carries them
(``validations``: ``FittedGraph.validations``), as ``graph.fit`` keeps them.

Validation data is staged in the workers' daemons under :data:`VALIDATION` (sent with the
job, or each worker's own split of its dataset) and evaluated there
(:class:`~protocol.daemon.EvaluateRequest`); figures evaluated on several workers' own data
are combined by :func:`row_weighted`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.strategies.base import Emit, JobInputs
from coordinator.strategies.steps import StepBoundaries
from protocol.daemon import StageRequest
from protocol.rules.row_means import RowMeans

__all__ = ["VALIDATION", "Evaluate", "History", "ended", "row_weighted", "validation_stage"]

VALIDATION = "validation"
"""The name validation data is staged under in a daemon."""

Evaluate = Callable[[], Awaitable[dict[str, Any]]]
"""Evaluates the model as it stands on the validation data: ``val_loss``, each metric, rows."""


def validation_stage(job: JobInputs) -> StageRequest | None:
    """What stages the job's validation data in a daemon: the rows it sent, or the worker's
    own split of its dataset; ``None`` without validation data."""
    if job.val_split is not None:
        return StageRequest(
            name=VALIDATION, dataset=job.dataset, loader=job.loader, split=job.val_split
        )
    if job.x_val is not None:
        return StageRequest(name=VALIDATION, x=job.x_val, y=job.y_val)
    return None


def row_weighted(scores: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean of each figure of ``scores`` (each with its ``rows``) weighted by rows, and the
    rows in all: what one evaluation over all their rows gives of a mean (a loss, accuracy)."""
    total = sum(int(s["rows"]) for s in scores)
    names = [k for k in scores[0] if k != "rows"] if scores else []
    out: dict[str, Any] = {
        k: sum(float(s[k]) * int(s["rows"]) for s in scores) / total if total else float("nan")
        for k in names
    }
    return out | {"rows": total}


def ended(epochs: int, steps: int) -> dict[str, int]:
    """Where a run that trained ``epochs`` in ``steps`` ends, as its progress says it."""
    return {"epoch": epochs, "epochs": epochs, "step": steps, "steps": steps}


@dataclass
class History:
    """The rows of a run (module docstring), built as its steps land.

    Args:
        emit: the job's events.
        unit: what a row is of: ``"epoch"``, or ``"round"``.
    """

    emit: Emit
    unit: str = "epoch"
    rows: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)  # validate_every's rows
    _loss: float = 0.0
    _rows: int = 0
    _lr: float | None = None
    _metrics: RowMeans = field(default_factory=RowMeans)  # a step function's, this epoch

    def add(
        self,
        loss: float,
        rows: int,
        lr: float | None = None,
        metrics: Sequence[tuple[Mapping[str, float], int]] = (),
    ) -> None:
        """One step of the current epoch: its global batch's mean loss and rows; with a step
        function, the metrics each replica's slice gave and the slice's rows."""
        self._loss += float(loss) * rows
        self._rows += rows
        if lr is not None:
            self._lr = float(lr)
        for figures, slice_rows in metrics:
            self._metrics.add(figures, slice_rows)

    async def close(
        self,
        number: int,
        scores: Mapping[str, Any] | None = None,
        said: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """End epoch ``number`` (from 1): its row, with ``scores`` (an evaluation's figures but
        its rows), recorded and emitted (its event also says ``said``)."""
        loss = self._loss / self._rows if self._rows else float("nan")
        row: dict[str, Any] = {self.unit: number, "loss": loss}
        if self._lr is not None:
            row["lr"] = self._lr
        row |= self._metrics.means()
        row |= {k: v for k, v in (scores or {}).items() if k != "rows"}
        self.rows.append(row)
        self._loss, self._rows, self._metrics = 0.0, 0, RowMeans()
        await self.emit("progress", {"phase": self.unit} | dict(said or {}) | row)
        return row

    async def validated(self, epoch: int, step: int, scores: Mapping[str, Any]) -> None:
        """The model evaluated after step ``step`` of epoch ``epoch`` (``validate_every``):
        recorded and emitted."""
        row = {"epoch": epoch, "step": step} | {k: v for k, v in scores.items() if k != "rows"}
        self.validations.append(row)
        await self.emit("progress", {"phase": "validation"} | row)

    async def steps(
        self,
        start: int,
        losses: Sequence[float],
        rows: Sequence[int],
        lrs: Sequence[float],
        bounds: StepBoundaries,
        *,
        evaluate: Evaluate | None = None,
        metrics: Sequence[Sequence[tuple[Mapping[str, float], int]]] = (),
    ) -> None:
        """A chunk of steps ``start + 1 ...`` (each global batch's mean loss, rows and learning
        rate): each added, each epoch that ends with one closed — evaluated by ``evaluate``,
        which sees the model after the chunk (with it, a chunk ends wherever ``bounds`` reads
        the model: an epoch's end, a validation); ``metrics``: by step, a step function's
        figures of each replica's slice with its rows."""
        for j, (loss, n) in enumerate(zip(losses, rows, strict=True)):
            self.add(loss, n, lrs[j] if j < len(lrs) else None, metrics[j] if metrics else ())
            done = start + j + 1
            if bounds.ends_epoch(done):
                scores = await evaluate() if evaluate is not None else None
                await self.close(bounds.epoch(done), scores)
            elif evaluate is not None and bounds.validates_after(done):
                await self.validated(bounds.epoch(done), done, await evaluate())

    def state_dict(self) -> dict[str, Any]:
        """Where the history stands (a checkpoint's): its rows, the open epoch's sums."""
        return {
            "rows": [dict(r) for r in self.rows],
            "open": [self._loss, self._rows, self._lr],
            "metrics": self._metrics.state_dict(),
            "validations": [dict(r) for r in self.validations],
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Back to ``state`` (:meth:`state_dict`'s; ``None``: empty, a run from the start)."""
        if state is None:
            self.rows, self._loss, self._rows, self._lr = [], 0.0, 0, None
            self.validations, self._metrics = [], RowMeans()
            return
        self.rows = [dict(r) for r in state["rows"]]
        self.validations = [dict(r) for r in state.get("validations") or []]
        self._metrics = RowMeans.of(state.get("metrics"))
        loss, rows, lr = state["open"]
        self._loss, self._rows = float(loss), int(rows)
        self._lr = None if lr is None else float(lr)

    async def record(self, row: dict[str, Any]) -> None:
        """A row made elsewhere (a worker's whole training loop), recorded and emitted."""
        self.rows.append(dict(row))
        await self.emit("progress", {"phase": self.unit} | row)

    async def finish(self, said: Mapping[str, Any] | None = None) -> None:
        """The run's last event: every row (what the job's record keeps), and where the run
        ended (``said``: its last epoch and step, say, as its last progress event had them)."""
        if self.rows:
            last = self.rows[-1]
            trained = {"phase": "trained"} | dict(said or {}) | {"loss": last["loss"]}
            validations = {"validations": self.validations} if self.validations else {}
            await self.emit("progress", trained | {"history": self.rows} | validations)
