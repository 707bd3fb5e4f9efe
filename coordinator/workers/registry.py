"""The worker registry: who is connected, what they have, and whether they are still alive.

A worker keeps its id across reconnects: the id it asked for in its hello, or the one the
coordinator gave it the first time. A record outlives its connection (state ``lost`` or
``offline``) so that a worker coming back is the same worker, and ``somatize status`` can show
what happened to it.

Liveness is the heartbeat: :meth:`Registry.reap` (called periodically by the server,
:meth:`~coordinator.server.worker_sessions.WorkerSessions.reap_forever`) declares a worker
silent for longer than the heartbeat timeout ``lost``, and the server closes its connection,
which fails every command waiting on it — so a job learns within the timeout, not never.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from coordinator.context import WorkerIdentity
from coordinator.errors import DuplicateWorker
from protocol.asyncio.channel import Channel
from protocol.messages import Capabilities, DatasetSummary

__all__ = ["DuplicateWorker", "Registry", "WorkerRecord", "WorkerState"]


class WorkerState(StrEnum):
    IDLE = "idle"  # connected, no job
    BUSY = "busy"  # connected, running a job (or several, one per slot it gives)
    LOST = "lost"  # stopped heartbeating, or its connection broke during a job
    OFFLINE = "offline"  # disconnected cleanly


@dataclass
class WorkerRecord:
    """One worker: identity, capabilities, connection and liveness."""

    id: str
    tags: frozenset[str]
    capabilities: Capabilities
    channel: Channel | None
    state: WorkerState = WorkerState.IDLE
    last_heartbeat: float = field(default_factory=time.monotonic)
    connected_at: float = field(default_factory=time.time)
    jobs: dict[str, int] = field(default_factory=dict)  # job id → the slots it holds here
    reason: str = ""  # why it is lost or offline
    connections: int = 1
    datasets: dict[str, DatasetSummary] = field(default_factory=dict)
    peer_address: str | None = None  # where other workers can dial it for tensors
    remote_host: str | None = None  # the address its connection came from, as seen here

    def heard(self) -> float:
        """When this worker was last heard from: its last heartbeat, or the last message (a
        chunk of one counts) its connection brought — a worker streaming a large reply is
        alive, though its heartbeats wait behind it."""
        received = self.channel.received_at if self.channel is not None else 0.0
        return max(self.last_heartbeat, received)

    @property
    def job_id(self) -> str | None:
        """The job it runs (the first placed, when it runs several); ``None``: none."""
        return next(iter(self.jobs), None)

    @property
    def slots(self) -> int:
        """How many one-slot jobs it runs at once (``--slots``)."""
        return self.capabilities.slots

    @property
    def free_slots(self) -> int:
        """The slots a job may take now: none unless it is idle or busy with jobs of its own
        (lost, offline or held otherwise: none)."""
        if self.state is WorkerState.IDLE or (self.state is WorkerState.BUSY and self.jobs):
            return max(0, self.slots - sum(self.jobs.values()))
        return 0

    def take(self, job_id: str, slots: int) -> None:
        """``job_id`` holds ``slots`` of this worker."""
        self.jobs[job_id] = slots
        self.state = WorkerState.BUSY

    def give_back(self, job_id: str) -> None:
        """``job_id`` ended here: its slots are free (and the worker idle once none runs)."""
        ended = self.jobs.pop(job_id, None) is not None
        if ended and not self.jobs and self.state is WorkerState.BUSY:
            self.state = WorkerState.IDLE

    @property
    def identity(self) -> WorkerIdentity:
        rows = {name: d.rows for name, d in self.datasets.items()}
        capabilities = self.capabilities
        return WorkerIdentity(
            self.id,
            self.tags,
            rows,
            capabilities.device,
            self.host,
            capabilities.sandbox,
            capabilities.network,
        )

    @property
    def host(self) -> str | None:
        """Where other workers can reach this one: its announced peer address's host, else
        the address its connection to the coordinator came from."""
        if self.peer_address is not None:
            return urlsplit(self.peer_address).hostname or self.remote_host
        return self.remote_host

    @property
    def connected(self) -> bool:
        return self.channel is not None and not self.channel.closed.is_set()

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """The record as ``somatize status`` shows it."""
        now = time.monotonic() if now is None else now
        return {
            "id": self.id,
            "tags": sorted(self.tags),
            "state": str(self.state),
            "last_heartbeat_age": round(now - self.last_heartbeat, 3),
            "job_id": self.job_id,
            "jobs": sorted(self.jobs),
            "slots": self.slots,
            "reason": self.reason,
            "connections": self.connections,
            "datasets": {name: d.model_dump() for name, d in self.datasets.items()},
            "capabilities": self.capabilities.model_dump(),
        }


class Registry:
    """Workers by id.

    Args:
        heartbeat_timeout: seconds of silence after which a connected worker is lost.
        on_change: called after any change that can let a queued job start.
    """

    def __init__(self, heartbeat_timeout: float, on_change: Callable[[], None] = lambda: None):
        self.heartbeat_timeout = heartbeat_timeout
        self.on_change = on_change
        self._workers: dict[str, WorkerRecord] = {}

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def attach(
        self,
        worker_id: str | None,
        tags: list[str],
        capabilities: Capabilities,
        channel: Channel,
        datasets: Mapping[str, DatasetSummary] | None = None,
        *,
        peer_address: str | None = None,
        remote_host: str | None = None,
    ) -> WorkerRecord:
        """Register a worker's new connection; a known id gets its record back.

        Raises:
            DuplicateWorker: a worker with that id is connected right now.
        """
        if worker_id is None:
            worker_id = self._new_id()
        record = self._workers.get(worker_id)
        if record is not None and record.connected:
            raise DuplicateWorker(
                f"a worker with id {worker_id!r} is already connected; choose another --id"
            )
        if record is None:
            record = WorkerRecord(worker_id, frozenset(tags), capabilities, channel)
            self._workers[worker_id] = record
        else:
            record.tags = frozenset(tags)
            record.capabilities = capabilities
            record.channel = channel
            record.connections += 1
            record.connected_at = time.time()
        record.datasets = dict(datasets or {})
        record.peer_address = peer_address
        record.remote_host = remote_host
        record.state = WorkerState.IDLE
        record.jobs = {}
        record.reason = ""
        record.last_heartbeat = time.monotonic()
        self.on_change()
        return record

    def heartbeat(self, record: WorkerRecord) -> None:
        record.last_heartbeat = time.monotonic()

    def detach(self, record: WorkerRecord, channel: Channel, reason: str) -> None:
        """The connection ``channel`` of ``record`` ended (unless a newer one replaced it)."""
        if record.channel is not channel:
            return
        record.channel = None
        if record.state is not WorkerState.LOST:
            record.state = WorkerState.LOST if record.jobs else WorkerState.OFFLINE
            record.reason = reason
        self.on_change()

    def thread_share(self, record: WorkerRecord) -> int | None:
        """The torch threads a job daemon of ``record`` gets when nobody says: its machine's
        cores shared among the connected workers that registered from the same host (as many
        cores, the same address), so two workers on one 2-core machine train with one thread
        each rather than both with two (2.6x slower); ``None`` for a worker alone on its host
        (the agent's own default, all its cores)."""
        if record.host is None:
            return None
        sharing = [
            w
            for w in self._workers.values()
            if w.connected
            and w.host == record.host
            and w.capabilities.cpus == record.capabilities.cpus
        ]
        if len(sharing) <= 1:
            return None
        return max(1, record.capabilities.cpus // len(sharing))

    def idle(self) -> list[WorkerRecord]:
        """Connected workers without a job, in registration order."""
        return [w for w in self._workers.values() if w.connected and w.state is WorkerState.IDLE]

    def reap(self, now: float | None = None) -> list[WorkerRecord]:
        """Declare connected workers silent past the heartbeat timeout (not heard from:
        :meth:`WorkerRecord.heard`) lost; returns them.

        The caller closes their connections (which fails their pending commands).
        """
        now = time.monotonic() if now is None else now
        lost = []
        for record in self._workers.values():
            silent = now - record.heard()
            if record.connected and silent > self.heartbeat_timeout:
                record.state = WorkerState.LOST
                record.reason = (
                    f"no heartbeat for {silent:.1f}s (timeout {self.heartbeat_timeout}s)"
                )
                lost.append(record)
        if lost:
            self.on_change()
        return lost

    def counts(self) -> dict[WorkerState, int]:
        counts = dict.fromkeys(WorkerState, 0)
        for record in self._workers.values():
            counts[record.state] += 1
        return counts

    def _new_id(self) -> str:
        while True:
            worker_id = f"w-{secrets.token_hex(3)}"
            if worker_id not in self._workers:
                return worker_id
