"""The job store across restarts: reopening, a second coordinator, recovering the jobs a dead
one left live, and a kill in the middle of a write."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
from pathlib import Path

import pytest

from coordinator.storage.store import (
    DB_NAME,
    RESTARTED,
    TERMINAL_STATES,
    InvalidJobTransition,
    JobState,
    JobStore,
    NoResult,
    StoreInUse,
)
from tests.coordinator.storage.store_utils import job_in_state, run_child, running_job

# -- restarts, recovery, crashes --------------------------------------------------------------


def test_reopening_keeps_finished_jobs_events_and_results(tmp_path: Path) -> None:
    blob = random.Random(1).randbytes(3 * 2**20)
    store, recovered = JobStore.open(tmp_path)
    assert recovered == []
    ok = running_job(store, rows=10).id
    store.add_event(ok, "progress", {"loss": 0.25})
    store.succeed(ok, blob)
    finished = [store.get(ok)] + [
        job_in_state(store, state) for state in (JobState.FAILED, JobState.CANCELLED)
    ]
    before = store.list()
    store.close()

    store, recovered = JobStore.open(tmp_path)
    with store:
        assert recovered == []
        assert store.list() == before
        assert [store.get(job.id) for job in finished] == finished
        assert store.result(ok) == blob
        assert [(e.seq, e.data) for e in store.events(ok)] == [(1, {"loss": 0.25})]


def test_a_second_coordinator_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first, _ = JobStore.open(tmp_path)
    with pytest.raises(StoreInUse, match="in use by another coordinator"):
        JobStore.open(tmp_path)
    first.close()
    second, _ = JobStore.open(tmp_path)  # closing released the directory
    second.close()


RECOVERY_CHILD = """
    import json, os, sys
    from coordinator.storage.store import JobState, JobStore

    store, _ = JobStore.open(sys.argv[1])
    ids = {}
    for state in JobState:
        job = store.create("local", {"state": str(state)})
        if state is JobState.CANCELLED:
            store.cancel(job.id)
        elif state is not JobState.QUEUED:
            store.start(job.id, ["w1"])
            store.add_event(job.id, "progress", {"step": 1})
            if state is JobState.SUCCEEDED:
                store.succeed(job.id, b"trained " + job.id.encode())
            elif state is JobState.FAILED:
                store.fail(job.id, "filter_error", "boom")
        ids[str(state)] = job.id
    print(json.dumps(ids), flush=True)
    os._exit(0)  # die without closing anything, mid-flight as far as the store knows
"""


def test_jobs_a_dead_coordinator_left_live_are_failed_on_open(tmp_path: Path, unit: float) -> None:
    child = run_child(RECOVERY_CHILD, str(tmp_path))
    out, err = child.communicate(timeout=20 * unit)
    assert child.returncode == 0, err
    ids = {JobState(state): job_id for state, job_id in json.loads(out).items()}

    with JobStore(tmp_path) as peek:  # no recovery: what the dead process left
        before = {state: peek.get(job_id) for state, job_id in ids.items()}
    assert {state: job.state for state, job in before.items()} == {s: s for s in JobState}

    store, recovered = JobStore.open(tmp_path)
    with store:
        assert [job.id for job in recovered] == [ids[JobState.QUEUED], ids[JobState.RUNNING]]
        for job in recovered:
            was = before[JobState.QUEUED if job.id == ids[JobState.QUEUED] else JobState.RUNNING]
            assert job == store.get(job.id)
            assert job.state is JobState.FAILED and job.finished is not None
            assert job.error == {
                "code": RESTARTED,
                "message": f"the coordinator restarted while the job was {was.state}",
                "detail": {"state": str(was.state)},
            }
            assert (job.started, job.workers, job.summary) == (
                was.started,
                was.workers,
                was.summary,
            )
        for state in TERMINAL_STATES:
            assert store.get(ids[state]) == before[state]
        assert (
            store.result(ids[JobState.SUCCEEDED]) == b"trained " + ids[JobState.SUCCEEDED].encode()
        )
        *_, ended = store.events(ids[JobState.RUNNING])  # its stream ends as it did
        assert (ended.seq, ended.kind) == (2, "failed")
        assert ended.data == store.get(ids[JobState.RUNNING]).error

    store, recovered = JobStore.open(tmp_path)  # recovery happens once
    store.close()
    assert recovered == []


def test_a_resumable_live_job_is_queued_again_and_the_others_fail(tmp_path: Path) -> None:
    crashed = JobStore(tmp_path)
    kept = running_job(crashed).id
    lost = running_job(crashed).id
    waiting = crashed.create("local", {}).id
    crashed.close()
    store, recovered = JobStore.open(tmp_path, resumable={kept, waiting})
    with store:
        states = {job.id: job.state for job in recovered}
        assert states == {kept: JobState.QUEUED, lost: JobState.FAILED, waiting: JobState.QUEUED}
        again = store.get(kept)
        assert again.started is None and again.finished is None and again.error is None
        assert store.events(kept) == []  # nothing ended
        store.start(kept, ["w1"])  # and it runs again


def test_a_store_left_open_in_this_process_is_recovered_by_the_next(tmp_path: Path) -> None:
    crashed = JobStore(tmp_path)  # never closed before the next store opens
    running = running_job(crashed).id
    queued = crashed.create("local", {}).id
    store, recovered = JobStore.open(tmp_path)
    with store, crashed:
        assert {job.id for job in recovered} == {running, queued}
        # The old process, were it still alive, could not succeed a job it lost.
        with pytest.raises(InvalidJobTransition, match="it is failed"):
            crashed.succeed(running, b"late")
        with pytest.raises(NoResult, match=RESTARTED):
            store.result(running)


# Larger than SQLite's page cache (2 MB), so a transaction spills uncommitted pages into the WAL
# before its commit: a kill leaves a torn, half-written transaction on disk, not just in memory.
RESULT_SIZE = 4 * 2**20

# Argv: state dir, "create" (the 400 running jobs first) or "more", result size, and where to die:
# "N:PREFIX" kills the process inside the round's N-th succeed(), as its first SQL statement that
# starts with PREFIX begins; "never" waits for the test's SIGKILL.
SUCCEED_CHILD = """
    import os, signal, sys
    from coordinator.storage.store import JobState, JobStore

    directory, first, size, die_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def payload(job_id):
        return (job_id.encode() * (size // len(job_id) + 1))[:size]

    store = JobStore(directory)
    if first == "create":
        for i in range(400):
            store.start(store.create("local", {"i": i}).id, ["w1"])
    calls = 0
    if die_at != "never":
        nth, prefix = die_at.split(":", 1)

        def trace(statement):
            if calls == int(nth) and statement.startswith(prefix):
                os.kill(os.getpid(), signal.SIGKILL)

        store._conn.set_trace_callback(trace)
    print("ready", flush=True)
    for job in reversed(store.list(states=[JobState.RUNNING], limit=1000)):
        calls += 1
        store.succeed(job.id, payload(job.id))
        print(job.id, flush=True)
"""


def _payload(job_id: str) -> bytes:
    return (job_id.encode() * (RESULT_SIZE // len(job_id) + 1))[:RESULT_SIZE]


def _wal_is_torn(wal: Path) -> bool:
    """True if the write-ahead log ends in frames of a transaction that never committed.

    WAL format (sqlite.org/fileformat.html#the_write_ahead_log): a 32-byte header whose bytes
    16..24 are the salts, then frames of a 24-byte header (page number, "database size after
    commit" which is 0 except in a commit frame, the salts) and one page. Frames whose salts differ
    are left over from before the log restarted.
    """
    data = wal.read_bytes() if wal.exists() else b""
    if len(data) < 32:
        return False
    page_size, salts = int.from_bytes(data[8:12], "big"), data[16:24]
    commit = None
    for offset in range(32, len(data) - 24 - page_size + 1, 24 + page_size):
        if data[offset + 8 : offset + 16] != salts:
            break
        commit = int.from_bytes(data[offset + 4 : offset + 8], "big")
    return commit == 0


@pytest.mark.parametrize(
    "rounds",
    [
        # Deterministic: die inside the 3rd succeed() just before COMMIT, then inside the 2nd just
        # before the state changes (result row and blob written), each time with pages on disk.
        [("3:COMMIT", 2), ("2:UPDATE jobs", 1)],
        # Whenever the kill lands while the writer loops (after two results of the round).
        [("never", 2), ("never", 2)],
    ],
    ids=["inside-the-transaction", "sigkill-from-outside"],
)
def test_a_kill_mid_succeed_never_leaves_a_succeeded_job_without_its_result(
    tmp_path: Path, unit: float, rounds: list[tuple[str, int]]
) -> None:
    succeeded: set[str] = set()
    for round_, (die_at, results) in enumerate(rounds):
        first = "create" if round_ == 0 else "more"
        child = run_child(SUCCEED_CHILD, str(tmp_path), first, str(RESULT_SIZE), die_at)
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n", child.communicate()[1]
            for _ in range(results):
                assert child.stdout.readline().strip()
            if die_at == "never":
                child.send_signal(signal.SIGKILL)
            child.wait(timeout=20 * unit)
        finally:
            if child.returncode is None:
                child.kill()
            child.communicate()
        assert child.returncode == -signal.SIGKILL
        if die_at != "never":  # the half-written transaction really is on disk
            assert _wal_is_torn(tmp_path / (DB_NAME + "-wal"))

        conn = sqlite3.connect(tmp_path / DB_NAME)  # replays the log, dropping the torn tail
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            with_result = {row[0] for row in conn.execute("SELECT job_id FROM results")}
        finally:
            conn.close()
        with JobStore(tmp_path) as store:
            jobs = store.list(limit=1000)
            assert {job.state for job in jobs} == {JobState.SUCCEEDED, JobState.RUNNING}
            now_succeeded = {job.id for job in jobs if job.state is JobState.SUCCEEDED}
            assert with_result == now_succeeded
            if die_at == "never":
                assert len(now_succeeded) >= len(succeeded) + results
            else:
                assert len(now_succeeded) == len(succeeded) + results
            for job_id in now_succeeded:
                assert store.result(job_id) == _payload(job_id)
            succeeded = now_succeeded

    store, recovered = JobStore.open(tmp_path)
    with store:
        assert len(recovered) == 400 - len(succeeded)
        assert store.counts()[JobState.FAILED] == len(recovered)
