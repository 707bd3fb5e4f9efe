"""What the job manager's unit tests share: a manager over a real store, a registry filled by
hand with fake connections, and in-memory contexts whose commands can be held."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import torch

import somatize as sz
from coordinator.context import InMemoryContext, NoReplacement
from coordinator.jobs.files import JobFiles
from coordinator.jobs.manager import JobManager, PlacedJob
from coordinator.storage.store import JobStore
from coordinator.workers.registry import Registry
from protocol.codec import decode, encode_frame
from protocol.filters import dump_filter
from protocol.messages import Capabilities, DatasetSummary, GraphSpec, StrategySpec, Submit
from somatize.remote.client import graph_info
from tests.utils import UNIT, Center
from worker.daemon.main import Daemon

CAPS = Capabilities(cpus=2, memory_bytes=1 << 30, torch="2", python="3.11", cloudpickle="3")


class Boom(sz.Filter):
    def fit(self, x, y=None):
        raise ValueError("boom in fit")


class FakeChannel:
    """What the registry reads of a connection: whether it is closed, when it last brought
    a message."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.received_at = 0.0

    def close(self) -> None:
        self.closed.set()


class Gate:
    """Holds every command of the jobs until opened: a job stays running as long as needed."""

    def __init__(self, open_: bool = True) -> None:
        self.event = asyncio.Event()
        if open_:
            self.event.set()


class GatedContext(InMemoryContext):
    def __init__(self, placed: PlacedJob, gate: Gate) -> None:
        super().__init__([w.identity for w in placed.workers], Daemon, timeout=60 * UNIT)
        self.placed = placed
        self.gate = gate
        self.closed = False
        self.calls: list[str] = []

    async def call(self, worker_idx, request, **kwargs):
        self.calls.append(request.cmd)
        await self.gate.event.wait()
        return await super().call(worker_idx, request, **kwargs)


class RecruitingContext(GatedContext):
    """Loses replica 1's worker at its ``lose_at``-th gradient step, and replaces a lost worker
    with the one the job manager recruits, as the live context does."""

    lose_at = 3

    def __init__(self, placed: PlacedJob, gate: Gate) -> None:
        super().__init__(placed, gate)
        self.steps = 0

    async def call(self, worker_idx, request, **kwargs):
        if request.cmd == "gradients" and worker_idx == 1:
            self.steps += 1
            if self.steps == self.lose_at:
                self.lose(1, "killed by the test")
        return await super().call(worker_idx, request, **kwargs)

    async def replace(self, worker_idx, timeout):  # noqa: ASYNC109 - the context's interface
        record = await self.placed.recruit(timeout)
        if record is None:
            raise NoReplacement(f"no worker came within {timeout:g}s")
        self.workers[worker_idx] = record.identity
        self.daemons[worker_idx] = self.make_daemon()
        return record.identity


class Harness:
    """A manager over a real store in ``tmp_path``, a hand-filled registry, gated contexts;
    with ``files``, the job files of a state directory (``tmp_path`` too)."""

    def __init__(
        self,
        tmp_path,
        gate_open: bool = True,
        context=GatedContext,
        files: bool = False,
        closing_open: bool = True,
    ) -> None:
        self.store = JobStore(tmp_path)
        self.registry = Registry(heartbeat_timeout=10.0)
        self.gate = Gate(gate_open)
        self.closing = Gate(closing_open)  # a context's close waits for it (a run winding down)
        self.contexts: list[GatedContext] = []
        self.context_class = context
        self.manager = JobManager(
            self.store,
            self.registry,
            context_factory=self._context,
            files=JobFiles(tmp_path) if files else None,
        )
        self.registry.on_change = self.manager.kick
        self.scheduler: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def _context(self, placed: PlacedJob):
        ctx = self.context_class(placed, self.gate)
        self.contexts.append(ctx)
        try:
            yield ctx
        finally:
            await self.closing.event.wait()
            ctx.closed = True

    def worker(self, worker_id, *tags, datasets=None, device="cpu"):
        caps = CAPS.model_copy(update={"device": device})
        summaries = {name: DatasetSummary(rows=n) for name, n in (datasets or {}).items()}
        return self.registry.attach(worker_id, list(tags), caps, FakeChannel(), summaries)

    async def __aenter__(self) -> Harness:
        self.scheduler = asyncio.create_task(self.manager.place_forever())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.gate.event.set()
        self.closing.event.set()
        await self.manager.shutdown(5 * UNIT)
        assert self.scheduler is not None
        self.scheduler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.scheduler
        self.store.close()

    async def settle(self) -> None:
        """Let the scheduler and the store's threads do what they can now."""
        await asyncio.sleep(0.05 * UNIT)

    async def until(self, condition) -> None:
        """Wait for ``condition()`` to hold."""
        async with asyncio.timeout(30 * UNIT):
            while not condition():  # noqa: ASYNC110 - polls state that no event announces
                await asyncio.sleep(0.01)

    async def events(self, job_id):
        return [e async for e in self.manager.watch(job_id)]

    async def kinds(self, job_id):
        return [e.kind for e in await self.events(job_id)]

    async def events_until(self, job_id, kind):
        """The job's events up to its first ``kind`` one."""
        events = []
        async for event in self.manager.watch(job_id):
            events.append(event)
            if event.kind == kind:
                break
        return events


def as_client_reads(said):
    """A manager's answer as a client reads it: through the codec (the tensors the coordinator
    passed on as bytes, RelayedTensor, are torch tensors again)."""
    return decode(bytearray(encode_frame(said)))


def data(n=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return x, y


def make_graph(*filters):
    torch.manual_seed(0)
    if not filters:
        filters = (
            Center().named("c"),
            sz.TorchFilter(torch.nn.Linear(3, 2), lr=0.1, batch_size=8, epochs=1).named("lin"),
        )
    graph = filters[0]
    for f in filters[1:]:
        graph = graph >> f
    return graph if isinstance(graph, sz.Graph) else sz.Graph([graph])


def submit(strategy="local", graph=None, dataset=None, **options):
    graph = make_graph() if graph is None else graph
    x, y = data()
    return Submit(
        graph=GraphSpec(
            node_ids=graph.node_ids,
            filters={n: dump_filter(f) for n, f in graph.items()},
            nodes=graph_info(graph),
        ),
        x=None if dataset else x,
        y=None if dataset else y,
        dataset=dataset,
        strategy=StrategySpec(name=strategy, options=options),
    )


def run(coro):
    """Run a test's coroutine, bounded."""
    return asyncio.run(asyncio.wait_for(coro, 60 * UNIT))


def graph_epochs(epochs):
    torch.manual_seed(0)
    return Center().named("c") >> sz.TorchFilter(
        torch.nn.Linear(3, 2), lr=0.1, batch_size=8, epochs=epochs, shuffle=False
    ).named("lin")
