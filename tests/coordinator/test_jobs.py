"""The job manager with no sockets and no processes: queueing, placement, cancel, recruiting
a replacement, results and the store, over in-memory workers and a registry filled by hand."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext, NoReplacement
from coordinator.jobs import JobManager, PlacedJob
from coordinator.registry import Registry, WorkerState
from coordinator.store import JobState, JobStore
from protocol.errors import ErrorCode, RequestRefused
from protocol.filters import dump_filter
from protocol.messages import Capabilities, GraphSpec, StrategySpec, Submit
from somatize.client import graph_info
from tests.conftest import timeout_unit
from worker.daemon import Daemon

UNIT = timeout_unit()
CAPS = Capabilities(cpus=2, memory_bytes=1 << 30, torch="2", python="3.11", cloudpickle="3")


class Center(sz.Filter):
    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Boom(sz.Filter):
    def fit(self, x, y=None):
        raise ValueError("boom in fit")


class FakeChannel:
    """What the registry reads of a connection: whether it is closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()


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

    async def call(self, worker_idx, request):
        self.calls.append(request["cmd"])
        await self.gate.event.wait()
        return await super().call(worker_idx, request)


class RecruitingContext(GatedContext):
    """Loses replica 1's worker at its ``lose_at``-th gradient step, and replaces a lost worker
    with the one the job manager recruits, as the live context does."""

    lose_at = 3

    def __init__(self, placed: PlacedJob, gate: Gate) -> None:
        super().__init__(placed, gate)
        self.steps = 0

    async def call(self, worker_idx, request):
        if request["cmd"] == "gradients" and worker_idx == 1:
            self.steps += 1
            if self.steps == self.lose_at:
                self.lose(1, "killed by the test")
        return await super().call(worker_idx, request)

    async def replace(self, worker_idx, timeout):  # noqa: ASYNC109 - the context's interface
        record = await self.placed.recruit(timeout)
        if record is None:
            raise NoReplacement(f"no worker came within {timeout:g}s")
        self.workers[worker_idx] = record.identity
        self.daemons[worker_idx] = self.make_daemon()
        return record.identity


class Harness:
    """A manager over a real store in ``tmp_path``, a hand-filled registry, gated contexts."""

    def __init__(self, tmp_path, gate_open: bool = True, context=GatedContext) -> None:
        self.store = JobStore(tmp_path)
        self.registry = Registry(heartbeat_timeout=10.0)
        self.gate = Gate(gate_open)
        self.contexts: list[GatedContext] = []
        self.context_class = context
        self.manager = JobManager(self.store, self.registry, context_factory=self._context)
        self.registry.on_change = self.manager.kick
        self.scheduler: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def _context(self, placed: PlacedJob):
        ctx = self.context_class(placed, self.gate)
        self.contexts.append(ctx)
        try:
            yield ctx
        finally:
            ctx.closed = True

    def worker(self, worker_id, *tags, datasets=None):
        return self.registry.attach(worker_id, list(tags), CAPS, FakeChannel(), datasets)

    async def __aenter__(self) -> Harness:
        self.scheduler = asyncio.create_task(self.manager.schedule_forever())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.gate.event.set()
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


def _data(n=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return x, y


def _graph(*filters):
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


def _submit(strategy="local", graph=None, dataset=None, **options):
    graph = _graph() if graph is None else graph
    x, y = _data()
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
    return asyncio.run(asyncio.wait_for(coro, 60 * UNIT))


# -- queueing and placement -------------------------------------------------------------------


def test_a_job_waits_queued_with_its_reason_until_its_workers_come(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            h.worker("b", "dp")
            job_id = await h.manager.submit(_submit("data_parallel", workers=2, tag="dp"))
            await h.settle()
            record = await h.manager.record(job_id)
            assert record["state"] == "queued"
            assert record["summary"]["placement"] == "2 workers tagged 'dp'"
            events = await h.events_until(job_id, "queued")
            assert events[0].data == {"placement": "2 workers tagged 'dp'"}
            assert h.contexts == []

            h.worker("c", "dp")  # the second one tagged dp: now it can start
            result = await h.manager.result(job_id, wait=30 * UNIT)
            assert sorted(result["states"]) == ["c", "lin"]
            assert result["record"]["workers"] == ["b", "c"]
            assert [w.id for w in h.contexts[0].placed.workers] == ["b", "c"]
            assert h.contexts[0].closed

    run(main())


def test_a_job_that_cannot_start_does_not_hold_up_a_later_one_that_can(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            first = await h.manager.submit(_submit("local", tag="gpu"))  # no gpu idle
            h.worker("g", "gpu")
            h.registry.get("g").state = WorkerState.BUSY  # taken elsewhere
            second = await h.manager.submit(_submit("local", tag="cpu"))
            await h.manager.result(second, wait=30 * UNIT)
            assert (await h.manager.record(first))["state"] == "queued"
            assert (await h.manager.record(second))["workers"] == ["a"]

            h.registry.get("g").state = WorkerState.IDLE
            h.manager.kick()
            await h.manager.result(first, wait=30 * UNIT)
            assert (await h.manager.record(first))["workers"] == ["g"]

    run(main())


def test_jobs_are_placed_in_submission_order(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            first = await h.manager.submit(_submit())
            second = await h.manager.submit(_submit())
            h.worker("a")
            await h.settle()
            assert (await h.manager.record(first))["state"] == "running"
            assert (await h.manager.record(second))["state"] == "queued"
            assert h.registry.get("a").job_id == first
            h.gate.event.set()
            await h.manager.result(second, wait=30 * UNIT)
            assert (await h.manager.record(second))["workers"] == ["a"]
            # Freed after each job.
            assert h.registry.get("a").state is WorkerState.IDLE
            assert h.registry.get("a").job_id is None

    run(main())


def test_placement_by_worker_id_and_dataset(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", datasets={"mnist": 10})
            h.worker("b")
            by_id = await h.manager.submit(_submit("local", worker="b"))
            await h.manager.result(by_id, wait=30 * UNIT)
            assert (await h.manager.record(by_id))["workers"] == ["b"]

            h.worker("c")
            msg = _submit("local", graph=_graph(Center().named("c")), dataset="mnist")
            on_data = await h.manager.submit(msg)
            record = await h.manager.record(on_data)
            assert record["summary"]["placement"] == "1 worker with dataset 'mnist'"
            await h.events_until(on_data, "placed")
            assert (await h.manager.record(on_data))["workers"] == ["a"]

    run(main())


def test_slots_take_one_distinct_worker_each_in_slot_order(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("x", "s1")
            h.worker("y", "s0", "s1")
            msg = _submit(
                "model_parallel",
                partitions=[{"node_ids": ["c"], "tag": "s0"}, {"node_ids": ["lin"], "tag": "s1"}],
            )
            job_id = await h.manager.submit(msg)
            await h.settle()
            # y is the only s0: it takes slot 0, and x the s1 slot although y also has s1.
            assert [w.id for w in h.contexts[0].placed.workers] == ["y", "x"]
            record = await h.manager.record(job_id)
            assert record["summary"]["placement"] == "2 workers: tag 's0', tag 's1'"

    run(main())


def test_all_matching_takes_every_idle_worker_that_qualifies(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            for name in ("a", "b", "c"):
                h.worker(name, "fl")
            h.worker("d", "other")
            busy = h.worker("e", "fl")
            busy.state = WorkerState.BUSY
            job_id = await h.manager.submit(_submit("fedavg", rounds=1, tag="fl", min_workers=2))
            await h.settle()
            assert [w.id for w in h.contexts[0].placed.workers] == ["a", "b", "c"]
            record = await h.manager.record(job_id)
            assert record["summary"]["placement"] == "every idle worker (at least 2) tagged 'fl'"
            assert {w.id for w in h.registry if w.job_id == job_id} == {"a", "b", "c"}

    run(main())


def test_a_pinned_placement_no_known_worker_answers_is_refused(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            msg = _submit(
                "model_parallel",
                partitions=[
                    {"node_ids": ["c"], "tag": "cpu"},
                    {"node_ids": ["lin"], "worker": "z"},
                ],
            )
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(msg)
            assert caught.value.info.code is ErrorCode.NO_WORKERS
            assert str(caught.value.info.message) == (
                "no worker answers to worker 'z': workers ['a'], tags ['cpu']"
            )
            assert h.store.list(None, 10) == []

    run(main())


def test_bad_submissions_are_refused_before_they_are_stored(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            bad = [
                _submit("nonsense"),
                _submit("local", bogus=1),
                _submit("data_parallel", graph=_graph(Center().named("c")), workers=2),
            ]
            for msg in bad:
                with pytest.raises(RequestRefused) as caught:
                    await h.manager.submit(msg)
                assert caught.value.info.code is ErrorCode.BAD_REQUEST
            neither = _submit().model_copy(update={"x": None, "y": None})
            with pytest.raises(RequestRefused, match="exactly one of the two"):
                await h.manager.submit(neither)
            assert h.store.list(None, 10) == []

    run(main())


# -- ends: success, failure, cancel, shutdown -------------------------------------------------


def test_a_job_succeeds_with_the_states_read_back_and_its_events_stored(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit())
            result = await h.manager.result(job_id, wait=30 * UNIT)
            x, y = _data()
            expected = _graph().fit(x, y).states
            np.testing.assert_allclose(result["states"]["c"]["mean"], expected["c"]["mean"])
            for k, v in expected["lin"].items():
                torch.testing.assert_close(result["states"]["lin"][k], v, rtol=0, atol=1e-6)
            assert result["record"]["state"] == "succeeded"
            kinds = await h.kinds(job_id)
            assert kinds[:2] == ["queued", "placed"]
            assert kinds[-1] == "succeeded"
            assert set(kinds[2:-1]) == {"progress"}
            events = h.store.events(job_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            assert events[-1].data == {"nodes": ["c", "lin"]}
            assert h.store.get(job_id).progress["phase"] == "trained"

    run(main())


def test_a_filter_that_raises_fails_the_job_naming_the_worker(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit(graph=_graph(Boom().named("b"))))
            with pytest.raises(RequestRefused) as caught:
                await h.manager.result(job_id, wait=30 * UNIT)
            info = caught.value.info
            assert info.message.startswith(f"job {job_id} failed: worker 'a': ")
            assert "boom in fit" in info.message
            assert info.detail["worker_id"] == "a"
            assert info.detail["state"] == "failed"
            record = h.store.get(job_id)
            assert record.state is JobState.FAILED
            assert record.error["detail"]["worker_id"] == "a"
            assert (await h.kinds(job_id))[-1] == "failed"
            assert h.contexts[0].closed
            assert h.registry.get("a").state is WorkerState.IDLE

    run(main())


def test_cancel_a_queued_job(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            job_id = await h.manager.submit(_submit())
            await h.manager.cancel(job_id)
            assert await h.kinds(job_id) == ["queued", "cancelled"]
            record = h.store.get(job_id)
            assert record.state is JobState.CANCELLED
            h.worker("a")  # nothing is placed any more
            await h.settle()
            assert h.contexts == []
            with pytest.raises(RequestRefused, match=r"already ended \(cancelled\)"):
                await h.manager.cancel(job_id)

    run(main())


def test_cancel_a_running_job_frees_its_workers_and_closes_its_context(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit())
            await h.settle()
            assert h.registry.get("a").state is WorkerState.BUSY
            await h.until(lambda: h.contexts and h.contexts[0].calls)  # stuck in a command
            await h.manager.cancel(job_id)
            assert h.store.get(job_id).state is JobState.CANCELLED
            assert (await h.kinds(job_id))[-1] == "cancelled"
            assert h.contexts[0].closed
            worker = h.registry.get("a")
            assert worker.state is WorkerState.IDLE and worker.job_id is None
            with pytest.raises(RequestRefused) as caught:
                await h.manager.result(job_id)
            assert caught.value.info.code is ErrorCode.CANCELLED
            assert caught.value.info.message == f"job {job_id} cancelled: cancelled by the client"

    run(main())


def test_result_of_a_job_still_running_or_unknown(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit())
            with pytest.raises(RequestRefused) as caught:
                await h.manager.result(job_id, wait=0.05 * UNIT)
            assert caught.value.info.code is ErrorCode.NOT_FINISHED
            assert caught.value.info.detail == {"job_id": job_id, "state": "running"}
            with pytest.raises(RequestRefused) as caught:
                await h.manager.result("nope")
            assert caught.value.info.code is ErrorCode.UNKNOWN_JOB
            with pytest.raises(RequestRefused, match="no job 'nope'"):
                await h.events("nope")

    run(main())


def test_shutdown_fails_queued_and_running_jobs_and_refuses_new_ones(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            running = await h.manager.submit(_submit())
            queued = await h.manager.submit(_submit())
            await h.settle()
            await h.manager.shutdown(0.05 * UNIT)
            for job_id in (running, queued):
                record = h.store.get(job_id)
                assert record.state is JobState.FAILED
                assert record.error["code"] == "shutting_down"
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(_submit())
            assert caught.value.info.code is ErrorCode.SHUTTING_DOWN

    run(main())


# -- watching ---------------------------------------------------------------------------------


def test_watch_replays_after_seq_then_follows_live_to_the_end(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit())
            await h.settle()
            seen = []

            async def follow():
                async for event in h.manager.watch(job_id, after_seq=1):
                    seen.append(event)

            watcher = asyncio.create_task(follow())
            await h.until(lambda: len(seen) == 2)
            await h.settle()
            # seq 1 (queued) skipped; then what happened until the first command, held.
            assert [(e.seq, e.kind) for e in seen] == [(2, "placed"), (3, "progress")]
            assert seen[1].data == {"phase": "loading", "nodes": 2}
            h.gate.event.set()
            await asyncio.wait_for(watcher, 30 * UNIT)
            assert seen[-1].kind == "succeeded"
            assert [e.seq for e in seen] == list(range(2, len(seen) + 2))
            # After the end the history is all a watcher gets.
            assert [e.seq for e in await h.events(job_id)] == [1, *(e.seq for e in seen)]

    run(main())


# -- recruiting a replacement -----------------------------------------------------------------


def test_recruit_reserves_a_matching_worker_ahead_of_queued_jobs(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a", "dp")
            h.worker("b", "dp")
            job_id = await h.manager.submit(_submit("data_parallel", workers=2, tag="dp"))
            await h.settle()
            queued = await h.manager.submit(_submit("local", tag="dp"))
            # No idle worker: the wait ends empty-handed.
            assert await h.manager.recruit(job_id, 0.05 * UNIT) is None

            waiting = asyncio.create_task(h.manager.recruit(job_id, 30 * UNIT))
            await h.settle()
            h.worker("other", "cpu")  # does not match the placement
            await h.settle()
            assert not waiting.done()
            h.worker("c", "dp")  # the queued job would take it, but the recruit comes first
            found = await asyncio.wait_for(waiting, 30 * UNIT)
            assert found.id == "c"
            assert found.state is WorkerState.BUSY and found.job_id == job_id
            assert [w.id for w in h.contexts[0].placed.workers] == ["a", "b", "c"]
            assert (await h.manager.record(queued))["state"] == "queued"

            h.gate.event.set()
            await h.manager.result(job_id, wait=30 * UNIT)
            await h.manager.result(queued, wait=30 * UNIT)
            assert {w.id: w.state for w in h.registry} == dict.fromkeys(
                ["a", "b", "other", "c"], WorkerState.IDLE
            )

    run(main())


def test_an_idle_worker_is_recruited_at_once(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(_submit())
            await h.settle()
            spare = h.worker("b")
            found = await h.manager.recruit(job_id, 30 * UNIT)
            assert found is spare and spare.job_id == job_id

    run(main())


def test_an_elastic_job_gets_its_replacement_from_the_registry(tmp_path):
    async def main():
        async with Harness(tmp_path, context=RecruitingContext) as h:
            h.worker("a", "dp")
            h.worker("b", "dp")
            job_id = await h.manager.submit(
                _submit("data_parallel", graph=_graph_epochs(3), workers=2, tag="dp", elastic=True)
            )
            await h.events_until(job_id, "placed")
            spare = h.worker("c", "dp")  # idle until the job asks for it
            result = await h.manager.result(job_id, wait=30 * UNIT)
            # Recovered exactly: what one process training on the same global batches learns.
            x, y = _data()
            expected = _graph_epochs(3).fit(x, y).states
            for k, v in expected["lin"].items():
                torch.testing.assert_close(result["states"]["lin"][k], v, rtol=0, atol=1e-5)
            events = await h.events(job_id)
            lost = [e.data for e in events if e.kind == "worker_lost"]
            replaced = [e.data for e in events if e.kind == "worker_replaced"]
            assert [(d["replica"], d["worker"], d["code"]) for d in lost] == [
                (1, "b", "worker_lost")
            ]
            assert [(d["replica"], d["lost"], d["worker"]) for d in replaced] == [(1, "b", "c")]
            assert [w.id for w in h.contexts[0].placed.workers] == ["a", "b", "c"]
            # Freed with the job's others.
            assert spare.state is WorkerState.IDLE and spare.job_id is None
            assert h.store.get(job_id).state is JobState.SUCCEEDED

    run(main())


def _graph_epochs(epochs):
    torch.manual_seed(0)
    return Center().named("c") >> sz.TorchFilter(
        torch.nn.Linear(3, 2), lr=0.1, batch_size=8, epochs=epochs, shuffle=False
    ).named("lin")
