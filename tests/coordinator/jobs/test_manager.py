"""The job manager with no sockets and no processes: how jobs end (success, failure, cancel,
shutdown), results and their errors, watching, and recruiting a replacement for a running
job, over in-memory workers and a registry filled by hand (placement: test_jobs_placement.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import weakref

import numpy as np
import pytest
import torch

from coordinator.jobs import manager
from coordinator.storage.store import JobState
from coordinator.strategies import Local, ShardedStates
from coordinator.workers.registry import WorkerState
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorCode, RequestRefused
from protocol.files.shard_pieces import PIECES_FILE
from somatize.remote.jobs import joined_states
from tests.coordinator.jobs.harness import (
    Boom,
    Harness,
    RecruitingContext,
    as_client_reads,
    data,
    graph_epochs,
    make_graph,
    run,
    submit,
)
from tests.utils import UNIT

# -- ends: success, failure, cancel, shutdown -------------------------------------------------


def test_a_job_succeeds_with_the_states_read_back_and_its_events_stored(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
            result = as_client_reads(await h.manager.result(job_id, wait=30 * UNIT))
            x, y = data()
            expected = make_graph().fit(x, y).states
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


def test_an_ended_job_is_freed_by_reference_counting_alone(tmp_path):
    """Nothing of a job outlives it in a reference cycle: the coordinator freezes what is alive
    every second and collects cycles every ten minutes (coordinator.server.collector), so a
    cycle through an ended job would hold its graph and data that long (it did: job → inputs →
    checkpoints → an emit closure → job, 4.5 MB a job of a 1 M-parameter model)."""

    async def main():
        async with Harness(tmp_path, files=True) as h:
            h.worker("a")
            h.worker("b")
            job_id = await h.manager.submit(submit("data_parallel", workers=2))
            job = weakref.ref(h.manager._jobs[job_id])
            inputs = weakref.ref(h.manager._jobs[job_id].inputs)
            await h.manager.result(job_id, wait=30 * UNIT)
            await h.settle()
            h.contexts.clear()  # (the harness's record of them, which the coordinator has not)
            return job, inputs

    gc.collect()
    gc.disable()
    try:
        job, inputs = run(main())
        assert job() is None and inputs() is None
    finally:
        gc.enable()


class KeptPieces:
    """A replica's pieces as its worker keeps them (:class:`ShardedStates`): one frame, read a
    piece at a time (``reads``: the lengths asked for), then released."""

    def __init__(self, pieces, released, replica, cut=0):
        self.frame = encode_frame(pieces)
        self.released, self.replica, self.cut, self.reads = released, replica, cut, []

    def sizes(self):
        return {PIECES_FILE: len(self.frame) + self.cut}  # cut: says more than it holds

    async def read(self, name, offset, length):
        assert name == PIECES_FILE
        self.reads.append(length)
        return self.frame[offset : offset + length]

    async def release(self):
        self.released.append(self.replica)


@pytest.mark.parametrize("files", [True, False], ids=["state-dir", "no-state-dir"])
def test_a_sharded_result_is_kept_as_the_replicas_pieces_and_joined_by_the_client(
    tmp_path, monkeypatch, files
):
    # What a sharded run returns: 5 rows of a weight over 2 replicas (3 and 2), a buffer
    # every replica holds alike, a plain filter's state.
    weight = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    split = [["states", "lin", "weight"]]
    pieces = [
        {"states": {"lin": {"weight": rows, "seen": torch.ones(1)}}, "split": split}
        for rows in (weight[:3], weight[3:])
    ]
    released: list[int] = []
    kept = [KeptPieces(p, released, r) for r, p in enumerate(pieces)]

    async def sharded_run(self, ctx, job, emit):
        async def keep(r):
            assert released == list(range(r)), "each replica's released before the next's kept"
            return kept[r]

        return ShardedStates(2, keep, {"c": {"mean": np.full(2, 0.5)}}, ["c", "lin"])

    monkeypatch.setattr(Local, "run", sharded_run)
    monkeypatch.setattr(manager, "PIECE_BYTES", 256)  # (a manager without files reads so)

    async def main():
        async with Harness(tmp_path, files=files) as h:
            if files:
                h.manager.files.piece_bytes = 256
            h.worker("a")
            job_id = await h.manager.submit(submit())
            result = as_client_reads(await h.manager.result(job_id, wait=30 * UNIT))
            assert h.store.result_kind(job_id) == "pieces"
            folder = tmp_path / "results" / job_id
            if files:  # one file a replica; else in the store's row (a manager without files)
                assert sorted(p.name for p in folder.iterdir()) == ["0.pieces", "1.pieces"]
            else:
                assert not folder.exists()
            assert h.store.events(job_id)[-1].data == {"nodes": ["c", "lin"]}

            async def in_pieces(r, size):  # as the client reads them: 100 bytes at a time
                data = bytearray()
                while len(data) < size:
                    said = await h.manager.result(job_id, replica=r, offset=len(data), length=100)
                    assert said["replica"] == r and 0 < len(said["data"]) <= 100
                    data += said["data"]
                assert len(data) == size
                return decode(data)

            sizes = result["pieces"]["sizes"]
            read = [await in_pieces(r, size) for r, size in enumerate(sizes)]
            each = [as_client_reads(await h.manager.result(job_id, replica=r)) for r in (0, 1)]
            with pytest.raises(RequestRefused, match="of 2 replicas, not 2") as past:
                await h.manager.result(job_id, replica=2)
            monkeypatch.undo()  # Local's own run: a whole result, no replica's pieces in it
            whole = await h.manager.submit(submit())
            with pytest.raises(RequestRefused, match="not a replica's pieces") as unsharded:
                await h.manager.result(whole, wait=30 * UNIT, replica=0)
            assert past.value.code == unsharded.value.code == ErrorCode.BAD_REQUEST
            return result, read, each

    result, read, each = run(main())
    assert released == [0, 1]
    for k in kept:  # read in pieces of at most 256 bytes, every byte once
        assert max(k.reads) <= 256 and sum(k.reads) == len(k.frame) and len(k.reads) > 1
    assert "states" not in result and result["record"]["state"] == "succeeded"
    assert result["pieces"] == {
        "replicas": 2,
        "plain": result["pieces"]["plain"],
        "node_ids": ["c", "lin"],
        "sizes": [len(k.frame) for k in kept],
    }
    assert [e["replica"] for e in each] == [0, 1]
    for joined_here in (read, [e["pieces"] for e in each]):  # the client's join
        states = joined_states(result["pieces"], joined_here)
        assert list(states) == ["c", "lin"]
        torch.testing.assert_close(torch.as_tensor(states["lin"]["weight"]), weight)
        torch.testing.assert_close(torch.as_tensor(states["lin"]["seen"]), torch.ones(1))
        np.testing.assert_array_equal(states["c"]["mean"], [0.5, 0.5])


@pytest.mark.parametrize(
    ("pieces", "cut", "code", "said"),
    [
        (  # other columns
            [{"weight": torch.ones(3, 2)}, {"weight": torch.ones(2, 4)}],
            0,
            ErrorCode.STATE_MISMATCH,
            "rows of states/lin/weight do not stack: replica 0's are ((2,), 'float32'), "
            "replica 1's ((4,)",
        ),
        (  # replica 1's file ends before the size its worker gave
            [{"weight": torch.ones(3, 2)}, {"weight": torch.ones(2, 2)}],
            8,
            ErrorCode.INTERNAL,
            "its sharded result could not be written: the file pieces left on a worker gave 0",
        ),
    ],
    ids=["not-one-model", "torn"],
)
def test_sharded_pieces_not_of_one_model_or_torn_fail_the_job(
    tmp_path, monkeypatch, pieces, cut, code, said
):
    split = [["states", "lin", "weight"]]
    released: list[int] = []
    kept = [
        KeptPieces({"states": {"lin": p}, "split": split}, released, r, cut * r)
        for r, p in enumerate(pieces)
    ]

    async def sharded_run(self, ctx, job, emit):
        async def keep(r):
            return kept[r]

        return ShardedStates(2, keep, {}, ["lin"])

    monkeypatch.setattr(Local, "run", sharded_run)

    async def main():
        async with Harness(tmp_path, files=True) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
            with pytest.raises(RequestRefused) as caught:
                await h.manager.result(job_id, wait=30 * UNIT)
            return caught.value.info, job_id

    info, job_id = run(main())
    assert info.code == code
    assert said in info.message
    assert released == [0, 1]  # released where they were kept, the failed one too
    assert not list((tmp_path / "results" / job_id).glob("*.partial"))


def test_a_filter_that_raises_fails_the_job_naming_the_worker(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit(graph=make_graph(Boom().named("b"))))
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
            job_id = await h.manager.submit(submit())
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


def test_a_job_ended_while_its_run_winds_down_is_not_cancelled_again(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False, closing_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
            await h.until(lambda: h.contexts and h.contexts[0].calls)  # stuck in a command
            await h.manager.cancel(job_id)
            assert h.store.get(job_id).state is JobState.CANCELLED
            assert not h.contexts[0].closed  # its run still winds down
            with pytest.raises(RequestRefused, match=r"already ended \(cancelled\)"):
                await h.manager.cancel(job_id)
            h.closing.event.set()
            await h.until(lambda: h.registry.get("a").state is WorkerState.IDLE)
            kinds = await h.kinds(job_id)
            assert kinds[-1] == "cancelled" and kinds.count("cancelled") == 1

    run(main())


def test_cancel_a_running_job_frees_its_workers_and_closes_its_context(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
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
            job_id = await h.manager.submit(submit())
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
            running = await h.manager.submit(submit())
            queued = await h.manager.submit(submit())
            await h.settle()
            await h.manager.shutdown(0.05 * UNIT)
            for job_id in (running, queued):
                record = h.store.get(job_id)
                assert record.state is JobState.FAILED
                assert record.error["code"] == "shutting_down"
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(submit())
            assert caught.value.info.code is ErrorCode.SHUTTING_DOWN

    run(main())


# -- watching ---------------------------------------------------------------------------------


def test_watch_replays_after_seq_then_follows_live_to_the_end(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
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
            job_id = await h.manager.submit(submit("data_parallel", workers=2, tag="dp"))
            await h.settle()
            queued = await h.manager.submit(submit("local", tag="dp"))
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
            job_id = await h.manager.submit(submit())
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
                submit("data_parallel", graph=graph_epochs(3), workers=2, tag="dp", elastic=True)
            )
            await h.events_until(job_id, "placed")
            spare = h.worker("c", "dp")  # idle until the job asks for it
            result = as_client_reads(await h.manager.result(job_id, wait=30 * UNIT))
            # Recovered exactly: what one process training on the same global batches learns.
            x, y = data()
            expected = graph_epochs(3).fit(x, y).states
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


def test_a_huge_graph_is_checked_off_the_loop_and_refused_in_a_line(tmp_path):
    """A ModelParallel submit of 4,000 nodes (near the most a graph may have) whose partition
    names one more: refused at once, the message naming a few nodes and how many, while the
    event loop keeps running."""
    nodes = [f"n{i}" for i in range(4_000)]
    msg = submit(
        "model_parallel",
        partitions=[{"node_ids": [*nodes, "ghost"], "tag": "s0"}],
    )
    msg = msg.model_copy(
        update={
            "graph": msg.graph.model_copy(
                update={"node_ids": nodes, "filters": dict.fromkeys(nodes, b"-"), "nodes": {}}
            )
        }
    )

    async def main():
        async with Harness(tmp_path) as h:
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            beat = asyncio.create_task(ticker())
            try:
                with pytest.raises(RequestRefused) as caught:
                    await h.manager.submit(msg)
            finally:
                beat.cancel()
            return caught.value.info, ticks

    info, ticks = run(main())
    assert info.code is ErrorCode.BAD_REQUEST
    assert "names 'ghost', which is not in the graph (nodes: ['n0', 'n1'," in info.message
    assert "... (4000 in all)])" in info.message
    assert len(info.message) < 300
    assert ticks > 1  # the loop ran other work while the graph was checked


# -- a store that cannot be written (issue 14, row 9) ------------------------------------------


def test_with_the_store_full_a_running_job_still_ends_for_its_watchers(tmp_path, monkeypatch):
    monkeypatch.setattr(manager, "STORE_RETRIES", (0.01, 0.02))

    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
            seen = []

            async def follow():
                async for event in h.manager.watch(job_id):
                    seen.append(event)

            watcher = asyncio.create_task(follow())
            await h.until(lambda: any(e.kind == "progress" for e in seen))
            # The disk is full: not one page more for the database, and what room its pages
            # had left is taken.
            filler = h.store.create("local", {}).id
            conn = h.store._connection()
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
            for pad in (4000, 400, 40, 4, 0):
                with contextlib.suppress(sqlite3.OperationalError):
                    while True:
                        h.store.add_event(filler, "progress", {"pad": "x" * pad})
            h.gate.event.set()
            await asyncio.wait_for(watcher, 30 * UNIT)
            # What it did could not be stored: the job is not reported succeeded, and its
            # watcher still learns how it ended, numbered after what it saw.
            assert seen[-1].kind == "failed"
            assert seen[-1].data["code"] == "internal"
            assert "database or disk is full" in seen[-1].data["message"]
            assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
            assert h.store.write_failure is not None and "full" in h.store.write_failure
            assert h.store.get(job_id).state is not JobState.SUCCEEDED
            conn.execute("PRAGMA max_page_count = 1073741823")
            h.store.add_event(filler, "progress", {})  # room again: the failure is gone
            assert h.store.write_failure is None

    run(main())


def test_a_job_cancelled_while_the_store_fails_reads_cancelled_and_is_stored_so_later(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(manager, "STORE_RETRIES", (0.01, 0.02))

    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit())
            await h.until(lambda: h.store.get(job_id).state is JobState.RUNNING)
            # Every write fails, as on a full disk where not even the journal can grow.
            conn = h.store._connection()
            conn.execute("PRAGMA query_only = 1")
            await h.manager.cancel(job_id)
            # The store could not take the end: the job has ended all the same, and says so.
            assert h.store.get(job_id).state is JobState.RUNNING
            assert job_id in h.manager.owed_ends
            record = await h.manager.record(job_id)
            assert (record["state"], record["error"]["code"]) == ("cancelled", "cancelled")
            assert [r["state"] for r in await h.manager.records() if r["id"] == job_id] == [
                "cancelled"
            ]
            with pytest.raises(RequestRefused, match="cancelled by the client"):
                await h.manager.result(job_id)
            assert await h.manager.owed_ends.pay() == 1  # still full: still owed
            conn.execute("PRAGMA query_only = 0")  # room again
            assert await h.manager.owed_ends.pay() == 0
            stored = h.store.get(job_id)
            assert (stored.state, stored.error["message"]) == (
                JobState.CANCELLED,
                "cancelled by the client",
            )
            assert job_id not in h.manager.owed_ends

    run(main())
