"""What a federated run keeps: where it stands (:class:`FederatedPosition`), its workers — who is
usable, who must be set up again, who dropped out of a round and why (:class:`Cohort`) — and
what each selected worker answered.

A worker that fails in a round is dropped from that round (:class:`DroppedWorker`, reported in
the round's event as ``{worker id: "code: message"}``). One whose connection is gone
(``worker_lost``) is not selected again; one whose daemon died (``daemon_crashed``, or
``timeout``, after which the agent kills it) is set up again (filters and data) before it next
trains.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.base import JobInputs, concurrently
from coordinator.strategies.federated import server_optimizers as server_opt
from coordinator.strategies.federated.privacy import Privacy
from coordinator.strategies.steps import set_up
from protocol.daemon import StageRequest
from protocol.errors import ErrorCode
from protocol.rules.rows import rows_of, take_rows

Shards = list[tuple[Any, Any]]
"""The client's rows cut in one ``(x, y)`` shard per worker."""

REDO_SETUP = frozenset({ErrorCode.DAEMON_CRASHED, ErrorCode.TIMEOUT})
"""Failures after which the worker's daemon is gone, with the job's filters and data."""


@dataclass
class FederatedPosition:
    """Where a FedAvg run stands: the rounds done, w_t, the server optimizer (its moments), the
    cohort and, for a private job, the clip and the privacy spent. The selection needs no RNG
    state of its own: round t draws with ``default_rng(seed + t)``. The run loop reads and
    advances this; nothing else holds it."""

    global_state: dict[str, Any]  # w_t
    server: server_opt.ServerOptimizer[Any]
    cohort: Cohort
    round: int = 0  # rounds completed
    privacy: Privacy | None = None  # DP-FedAvg's clip and accountant, for a private job


@dataclass(frozen=True)
class ClientUpdate:
    """What one selected client's ClientUpdate gave: its rows n_k, mean loss and the learning
    rate of its last local step."""

    client: int
    rows: int
    loss: float
    lr: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)  # a step function's, last epoch

    @classmethod
    def of(cls, client: int, fit: Mapping[str, Any]) -> ClientUpdate:
        """Client ``client``'s update from its ``batched_fit`` reply (its history's last row
        has the learning rate and the epoch's mean of each metric a step function returned)."""
        last = (fit.get("history") or [{}])[-1]
        metrics = {
            k: float(v)
            for k, v in last.items()
            if k not in _LOOP_FIGURES and not k.startswith("val_")
        }
        return cls(client, int(fit["rows"]), float(fit["loss"]), last.get("lr"), metrics)


_LOOP_FIGURES = frozenset({"epoch", "loss", "lr"})
"""The figures of a training loop's history row that are not a step function's metrics (nor
are its ``val_`` figures)."""


def round_lr(answered: Sequence[ClientUpdate]) -> float | None:
    """A round's learning rate: the mean of its clients' last local steps' (equal when their
    schedules are: epoch-wise, or the same steps an epoch); ``None`` when they have none."""
    lrs = [u.lr for u in answered if u.lr is not None]
    return sum(lrs) / len(lrs) if lrs else None


@dataclass(frozen=True)
class DroppedWorker:
    """A worker left out of a round (or of the run): its id, the error code (``None`` for a
    refusal of the strategy's own, like an empty dataset) and the message."""

    worker_id: str
    code: ErrorCode | None
    message: str

    @classmethod
    def of(cls, error: WorkerCallError) -> DroppedWorker:
        return cls(error.worker_id, error.code, error.info.message)

    @property
    def reason(self) -> str:
        """How job events name it: ``"code: message"``."""
        return self.message if self.code is None else f"{self.code}: {self.message}"


def reasons(dropped: Iterable[DroppedWorker]) -> dict[str, str]:
    """Dropped workers as job events carry them: worker id → reason."""
    return {d.worker_id: d.reason for d in dropped}


def listed(dropped: Iterable[DroppedWorker]) -> str:
    """Dropped workers in a failure's message."""
    named = reasons(dropped)
    if not named:
        return "no worker failed"
    return "dropped: " + "; ".join(f"{w} ({why})" for w, why in named.items())


@dataclass
class Cohort:
    """What the coordinator knows of the job's workers during a run, by position, and of
    their clients: worker i trains clients i·K, ..., i·K + K − 1 (K = ``per_worker``), client
    i·K + j on the j-th of K contiguous partitions of the worker's rows."""

    ids: list[str]
    rows: dict[int, int] = field(default_factory=dict)  # staged rows of each set-up worker
    lost: dict[int, DroppedWorker] = field(default_factory=dict)  # never selected again
    stale: set[int] = field(default_factory=set)  # to be set up again before training
    per_worker: int = 1  # K: the clients each worker trains in turn

    def usable(self) -> list[int]:
        return [i for i in range(len(self.ids)) if i not in self.lost]

    def clients(self) -> list[int]:
        """The clients of the usable workers."""
        k = self.per_worker
        return [i * k + j for i in self.usable() for j in range(k)]

    def worker_of(self, client: int) -> int:
        return client // self.per_worker

    def label(self, client: int) -> str:
        """How events name a client: its worker's id, and ``/j`` when a worker has several."""
        worker_id = self.ids[client // self.per_worker]
        return worker_id if self.per_worker == 1 else f"{worker_id}/{client % self.per_worker}"

    def partition(self, client: int) -> list[int] | None:
        """The rows of its worker's data a client trains on (``None``: all of them)."""
        if self.per_worker == 1:
            return None
        i, j = divmod(client, self.per_worker)
        part: list[int] = np.array_split(np.arange(self.rows[i]), self.per_worker)[j].tolist()
        return part

    def ready(self) -> list[int]:
        """Usable workers whose daemon holds the job's filters and data."""
        return [i for i in self.usable() if i not in self.stale]

    def drop(self, i: int, error: WorkerCallError) -> DroppedWorker:
        """Note what ``error`` means for worker ``i``; return its record."""
        dropped = DroppedWorker.of(error)
        if error.code is ErrorCode.WORKER_LOST:
            self.lost[i] = dropped
        elif error.code in REDO_SETUP:
            self.stale.add(i)
        return dropped

    async def first_answering(
        self, call: Callable[[int], Awaitable[dict[str, Any]]], failure: str
    ) -> dict[str, Any]:
        """``call`` on the ready workers in turn until one answers; each that fails is dropped.
        None answering is ``not_enough_workers``: ``failure`` and why each failed."""
        dropped: list[DroppedWorker] = []
        for i in self.ready():
            try:
                return await call(i)
            except WorkerCallError as exc:
                dropped.append(self.drop(i, exc))
        raise StrategyFailed(
            ErrorCode.NOT_ENOUGH_WORKERS, f"{failure}; {listed(dropped)}", dropped=reasons(dropped)
        )

    def lost_reasons(self) -> dict[str, str]:
        return reasons(self.lost.values())

    async def set_up(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        staged: str,
        shards: Shards | None,
        which: Sequence[int],
    ) -> list[DroppedWorker]:
        """Load the filters and stage the data (a shard, or the worker's own dataset) under
        ``staged`` on ``which``; the workers that failed."""

        async def one(i: int) -> DroppedWorker | None:
            if shards is None:
                data = job.own_data(staged)
            else:
                data = StageRequest(name=staged, x=shards[i][0], y=shards[i][1])
            try:
                answer = await set_up(ctx, i, job.filters, data)
            except WorkerCallError as exc:
                self.rows.pop(i, None)
                self.stale.add(i)
                return self.drop(i, exc)
            rows = int(answer["rows"])
            if rows < self.per_worker:
                why = "its dataset has no rows"
                if rows:
                    why = f"its dataset has {rows} rows, too few for {self.per_worker} clients"
                self.lost[i] = DroppedWorker(self.ids[i], None, why)
                return self.lost[i]
            self.rows[i] = rows
            self.stale.discard(i)
            return None

        return [d for d in await concurrently(*(one(i) for i in which)) if d is not None]

    def check_ready(self, least: int, failed: list[DroppedWorker]) -> None:
        """Refuse to start with fewer than ``least`` workers set up."""
        ready = self.ready()
        if len(ready) < least:
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"setup: {len(ready)} of {len(self.ids)} workers are ready, min_workers "
                f"is {least}; {listed(failed)}",
                dropped=reasons(failed),
            )

    def check_answered(
        self,
        r: int,
        least: int,
        selected: list[int],
        answered: list[int],
        dropped: list[DroppedWorker],
    ) -> None:
        """Fail round ``r`` when fewer than ``least`` of the ``selected`` clients answered."""
        if len(answered) < least:
            counted = "workers" if self.per_worker == 1 else "clients"
            needs = f"min_workers is {least}"
            if self.per_worker > 1:
                needs = f"min_workers × clients_per_worker is {least}"
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"round {r}: {len(answered)} of {len(selected)} selected {counted} answered, "
                f"{needs}; {listed(dropped)}",
                round=r,
                answered=[self.label(c) for c in answered],
                dropped=reasons(dropped),
            )


def contiguous_shards(job: JobInputs, k: int, strategy: str) -> Shards | None:
    """Contiguous shards of the client's rows, one per worker (``None``: WorkerData)."""
    if job.dataset is not None:
        return None
    n = rows_of(job.x)
    if n is None:
        raise StrategyFailed(ErrorCode.BAD_REQUEST, f"{strategy}: x has no rows to split")
    if n < k:
        raise StrategyFailed(
            ErrorCode.BAD_REQUEST,
            f"{strategy}: x has {n} rows, too few to give each of {k} workers a shard",
        )
    bounds = np.cumsum([0, *(len(part) for part in np.array_split(np.arange(n), k))])
    return [
        (take_rows(job.x, slice(start, stop)), take_rows(job.y, slice(start, stop)))
        for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    ]
