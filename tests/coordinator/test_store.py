"""The job store against real SQLite files: lifecycle, events, results, crashes and recovery."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import CoordinatorError
from coordinator.store import (
    DB_NAME,
    RESTARTED,
    TERMINAL_STATES,
    DuplicateJob,
    InvalidTransition,
    JobEvent,
    JobRecord,
    JobState,
    JobStore,
    NoResult,
    ResultTooLarge,
    StoreError,
    StoreInUse,
    UnknownJob,
)

REPO = Path(__file__).resolve().parents[2]


class Clock:
    """A clock that moves one second per reading, so every time in a record is predictable."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "state", clock=Clock()) as store:
        yield store


def _running(store: JobStore, **summary: Any) -> JobRecord:
    job = store.create("local", summary)
    return store.start(job.id, ["w1"])


def _in_state(store: JobStore, state: JobState) -> JobRecord:
    """A job brought to ``state`` through the public API."""
    job = store.create("local", {"state": str(state)})
    if state is JobState.QUEUED:
        return job
    if state is JobState.CANCELLED:
        return store.cancel(job.id)
    job = store.start(job.id, ["w1"])
    if state is JobState.SUCCEEDED:
        return store.succeed(job.id, b"result of " + job.id.encode())
    if state is JobState.FAILED:
        return store.fail(job.id, "filter_error", "boom")
    return job


def _run_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Start ``python -c code args`` with this repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


# -- lifecycle --------------------------------------------------------------------------------


def test_lifecycle_queued_running_succeeded(store: JobStore) -> None:
    summary = {"nodes": ["scale", "net"], "rows": 120, "strategy": {"epochs": 2}}
    job = store.create("data_parallel", summary, job_id="job1")
    assert job == JobRecord(
        id="job1",
        state=JobState.QUEUED,
        strategy="data_parallel",
        created=1001.0,
        started=None,
        finished=None,
        workers=[],
        progress={},
        error=None,
        summary=summary,
    )

    job = store.start("job1", ["w1", "w2"])
    assert (job.state, job.started, job.workers) == (JobState.RUNNING, 1002.0, ["w1", "w2"])

    store.progress("job1", {"step": 1, "loss": 0.5})
    store.progress("job1", {"step": 2, "loss": float("nan")})  # replaced, NaN kept
    progress = store.get("job1").progress
    assert progress["step"] == 2 and math.isnan(progress["loss"])

    job = store.succeed("job1", b"\x00trained states\xff")
    assert (job.state, job.finished, job.error) == (JobState.SUCCEEDED, 1003.0, None)
    assert job.progress["step"] == 2 and job.workers == ["w1", "w2"]
    # NaN != NaN, so compare the rest of the record.
    assert replace(store.get("job1"), progress={}) == replace(job, progress={})
    assert store.result("job1") == b"\x00trained states\xff"


def test_create_picks_unique_ids_and_refuses_a_taken_one(store: JobStore) -> None:
    ids = {store.create("local", {}).id for _ in range(50)}
    assert len(ids) == 50
    assert all(len(job_id) == 12 and int(job_id, 16) >= 0 for job_id in ids)
    store.create("local", {}, job_id="mine")
    with pytest.raises(DuplicateJob, match="'mine'"):
        store.create("fedavg", {"other": True}, job_id="mine")
    assert store.get("mine").strategy == "local"


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.RUNNING])
def test_fail_and_cancel_end_a_live_job(store: JobStore, state: JobState) -> None:
    failed = _in_state(store, state)
    job = store.fail(failed.id, "worker_lost", "w1 stopped heartbeating", {"worker": "w1"})
    assert job.state is JobState.FAILED and job.finished is not None
    assert job.error == {
        "code": "worker_lost",
        "message": "w1 stopped heartbeating",
        "detail": {"worker": "w1"},
    }
    assert job.started == failed.started  # kept: None for a job that failed while queued

    cancelled = _in_state(store, state)
    job = store.cancel(cancelled.id)
    assert job.state is JobState.CANCELLED and job.finished is not None
    assert job.error == {"code": "cancelled", "message": "cancelled by the client", "detail": {}}
    other = store.cancel(_in_state(store, state).id, reason="shutting down")
    assert other.error is not None and other.error["message"] == "shutting down"


# -- events -----------------------------------------------------------------------------------


def test_events_are_numbered_per_job_and_read_after_a_seq(store: JobStore) -> None:
    a = _running(store).id
    b = _running(store).id
    for step in range(5):
        store.add_event(a, "progress", {"step": step})
        if step % 2 == 0:
            store.add_event(b, "worker", {"n": step})

    events = store.events(a)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [e.data["step"] for e in events] == [0, 1, 2, 3, 4]
    assert [e.time for e in events] == sorted(e.time for e in events)
    assert all(e.job_id == a and e.kind == "progress" for e in events)
    assert [e.seq for e in store.events(b)] == [1, 2, 3]

    assert [e.seq for e in store.events(a, after_seq=3)] == [4, 5]
    assert store.events(a, after_seq=5) == []
    assert store.events(store.create("local", {}).id) == []

    # A finished job still takes events: the coordinator logs its end after the state change.
    store.succeed(a, b"r")
    event = store.add_event(a, "done", {"ok": True})
    assert event == JobEvent(a, 6, event.time, "done", {"ok": True})
    assert store.events(a, after_seq=5) == [event]


def test_events_from_many_threads_get_distinct_consecutive_seqs(store: JobStore) -> None:
    job_id = _running(store).id

    def append(worker: int) -> None:
        for i in range(40):
            store.add_event(job_id, "tick", {"worker": worker, "i": i})

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = store.events(job_id)
    assert [e.seq for e in events] == list(range(1, 161))
    for worker in range(4):  # each thread's own events stay in its order
        assert [e.data["i"] for e in events if e.data["worker"] == worker] == list(range(40))


# -- results ----------------------------------------------------------------------------------


def test_a_50_mb_result_round_trips(store: JobStore) -> None:
    blob = random.Random(0).randbytes(50 * 2**20)
    job_id = _running(store).id
    store.succeed(job_id, blob)
    got = store.result(job_id)
    assert type(got) is bytes and len(got) == len(blob)
    assert got == blob


@pytest.mark.parametrize(
    "result", [b"", bytearray(b"from a bytearray"), memoryview(b"--from a view--")[2:-2]]
)
def test_results_of_any_buffer_and_size_come_back_as_bytes(
    store: JobStore, result: bytes | bytearray | memoryview
) -> None:
    job_id = _running(store).id
    store.succeed(job_id, result)
    assert store.result(job_id) == bytes(result)
    assert type(store.result(job_id)) is bytes


def test_a_result_over_sqlites_limit_is_refused_and_the_job_stays_running(
    store: JobStore,
) -> None:
    job_id = _running(store).id
    # Lower SQLite's value limit instead of allocating the 1 GB default.
    assert store._conn is not None
    store._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100_000)
    with pytest.raises(ResultTooLarge, match="200000 bytes"):
        store.succeed(job_id, bytes(200_000))
    assert store.get(job_id).state is JobState.RUNNING
    assert store.succeed(job_id, bytes(1000)).state is JobState.SUCCEEDED


@pytest.mark.parametrize(
    ("state", "says"),
    [
        (JobState.QUEUED, "it is queued"),
        (JobState.RUNNING, "it is running"),
        (JobState.FAILED, "it is failed (filter_error: boom)"),
        (JobState.CANCELLED, "it is cancelled (cancelled: cancelled by the client)"),
    ],
)
def test_no_result_unless_succeeded(store: JobStore, state: JobState, says: str) -> None:
    job = _in_state(store, state)
    with pytest.raises(NoResult) as info:
        store.result(job.id)
    assert str(info.value) == f"job {job.id!r} has no result: {says}"
    assert (info.value.job_id, info.value.state) == (job.id, state)


# -- refusals ---------------------------------------------------------------------------------

ILLEGAL = [
    (JobState.QUEUED, "succeed"),
    (JobState.RUNNING, "start"),
    *[(state, "start") for state in TERMINAL_STATES],
    *[(state, "succeed") for state in TERMINAL_STATES],
    *[(state, "fail") for state in TERMINAL_STATES],
    *[(state, "cancel") for state in TERMINAL_STATES],
    *[(state, "progress") for state in TERMINAL_STATES],
]


@pytest.mark.parametrize(("state", "transition"), sorted(ILLEGAL))
def test_illegal_transitions_are_refused_and_change_nothing(
    store: JobStore, state: JobState, transition: str
) -> None:
    job = _in_state(store, state)
    attempt = {
        "start": lambda: store.start(job.id, ["w9"]),
        "succeed": lambda: store.succeed(job.id, b"late result"),
        "fail": lambda: store.fail(job.id, "late", "too late"),
        "cancel": lambda: store.cancel(job.id),
        "progress": lambda: store.progress(job.id, {"step": 99}),
    }[transition]
    with pytest.raises(InvalidTransition) as info:
        attempt()
    error = info.value
    assert (error.job_id, error.state, error.transition) == (job.id, state, transition)
    assert f"cannot {transition} job {job.id!r}: it is {state}" in str(error)
    assert store.get(job.id) == job
    if state is JobState.SUCCEEDED:
        assert store.result(job.id) == b"result of " + job.id.encode()
    else:
        with pytest.raises(NoResult):
            store.result(job.id)


UNKNOWN_JOB_CALLS = {
    "get": lambda s: s.get("ghost"),
    "start": lambda s: s.start("ghost", []),
    "progress": lambda s: s.progress("ghost", {}),
    "add_event": lambda s: s.add_event("ghost", "x", {}),
    "events": lambda s: s.events("ghost"),
    "succeed": lambda s: s.succeed("ghost", b"r"),
    "fail": lambda s: s.fail("ghost", "c", "m"),
    "cancel": lambda s: s.cancel("ghost"),
    "result": lambda s: s.result("ghost"),
}


@pytest.mark.parametrize("call", UNKNOWN_JOB_CALLS.values(), ids=UNKNOWN_JOB_CALLS.keys())
def test_unknown_job_is_a_key_error_naming_the_id(store: JobStore, call: Any) -> None:
    with pytest.raises(UnknownJob) as info:
        call(store)
    assert isinstance(info.value, KeyError) and isinstance(info.value, CoordinatorError)
    assert str(info.value) == "unknown job 'ghost'" and info.value.job_id == "ghost"
    assert store.list() == []


def test_a_closed_store_refuses_calls_and_closes_twice_quietly(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    store.create("local", {})
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.list()


def test_a_newer_schema_or_a_foreign_file_is_refused(tmp_path: Path) -> None:
    JobStore(tmp_path / "new").close()
    with sqlite3.connect(tmp_path / "new" / DB_NAME) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match="schema version 99, newer than"):
        JobStore(tmp_path / "new")

    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / DB_NAME).write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="cannot open the job store"):
        JobStore(tmp_path / "junk")


def test_the_schema_itself_refuses_to_break_the_invariants(store: JobStore, tmp_path: Path) -> None:
    running = _running(store).id
    done = _in_state(store, JobState.FAILED).id
    conn = sqlite3.connect(tmp_path / "state" / DB_NAME, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    try:
        with pytest.raises(sqlite3.IntegrityError, match="terminal job never changes"):
            conn.execute("UPDATE jobs SET state = 'running' WHERE id = ?", (done,))
        with pytest.raises(sqlite3.IntegrityError, match="succeeds only together with"):
            conn.execute("UPDATE jobs SET state = 'succeeded' WHERE id = ?", (running,))
        conn.execute("BEGIN")
        conn.execute("INSERT INTO results (job_id, data) VALUES (?, x'00')", (running,))
        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            conn.execute("COMMIT")  # a result for a job that is not succeeded
        conn.rollback()
    finally:
        conn.close()
    assert store.get(running).state is JobState.RUNNING


# -- listing and counting ---------------------------------------------------------------------


def test_list_is_newest_first_filtered_and_limited(tmp_path: Path) -> None:
    clock = Clock()
    with JobStore(tmp_path, clock=clock) as store:
        jobs = []
        for state in [*JobState, *JobState]:
            jobs.append(_in_state(store, state))
            clock.now -= 100  # a clock stepping back must not reorder "newest first"
        newest_first = [job.id for job in reversed(jobs)]

        assert [job.id for job in store.list()] == newest_first
        assert store.list() == [store.get(job_id) for job_id in newest_first]
        assert [job.id for job in store.list(limit=3)] == newest_first[:3]
        assert store.list(limit=0) == []
        with pytest.raises(ValueError, match="limit"):
            store.list(limit=-1)

        running = store.list(states=[JobState.RUNNING])
        assert [job.id for job in running] == [jobs[6].id, jobs[1].id]
        live = store.list(states={JobState.QUEUED, "running"}, limit=3)  # type: ignore[arg-type]
        assert [job.state for job in live] == [JobState.RUNNING, JobState.QUEUED, JobState.RUNNING]
        assert store.list(states=[]) == []
        with pytest.raises(ValueError):
            store.list(states=["finished"])  # type: ignore[list-item]


def test_counts_cover_every_state(store: JobStore) -> None:
    assert store.counts() == dict.fromkeys(JobState, 0)
    for state, n in [(JobState.QUEUED, 3), (JobState.SUCCEEDED, 2), (JobState.CANCELLED, 1)]:
        for _ in range(n):
            _in_state(store, state)
    assert store.counts() == {
        JobState.QUEUED: 3,
        JobState.RUNNING: 0,
        JobState.SUCCEEDED: 2,
        JobState.FAILED: 0,
        JobState.CANCELLED: 1,
    }


# -- restarts, recovery, crashes --------------------------------------------------------------


def test_reopening_keeps_finished_jobs_events_and_results(tmp_path: Path) -> None:
    blob = random.Random(1).randbytes(3 * 2**20)
    store, recovered = JobStore.open(tmp_path)
    assert recovered == []
    ok = _running(store, rows=10).id
    store.add_event(ok, "progress", {"loss": 0.25})
    store.succeed(ok, blob)
    finished = [store.get(ok)] + [
        _in_state(store, state) for state in (JobState.FAILED, JobState.CANCELLED)
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
    from coordinator.store import JobState, JobStore

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
    child = _run_child(RECOVERY_CHILD, str(tmp_path))
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
        assert len(store.events(ids[JobState.RUNNING])) == 1

    store, recovered = JobStore.open(tmp_path)  # recovery happens once
    store.close()
    assert recovered == []


def test_a_store_left_open_in_this_process_is_recovered_by_the_next(tmp_path: Path) -> None:
    crashed = JobStore(tmp_path)  # never closed before the next store opens
    running = _running(crashed).id
    queued = crashed.create("local", {}).id
    store, recovered = JobStore.open(tmp_path)
    with store, crashed:
        assert {job.id for job in recovered} == {running, queued}
        # The old process, were it still alive, could not succeed a job it lost.
        with pytest.raises(InvalidTransition, match="it is failed"):
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
    from coordinator.store import JobState, JobStore

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
        child = _run_child(SUCCEED_CHILD, str(tmp_path), first, str(RESULT_SIZE), die_at)
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
