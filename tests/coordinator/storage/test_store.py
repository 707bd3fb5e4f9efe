"""The job store against real SQLite files: lifecycle, events, results, refusals, listing
(restarts and crashes: ``test_store_recovery.py``)."""

from __future__ import annotations

import math
import random
import sqlite3
import stat
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import CoordinatorError
from coordinator.storage.store import (
    DB_NAME,
    TERMINAL_STATES,
    DuplicateJob,
    EventRecord,
    InvalidJobTransition,
    JobRecord,
    JobState,
    JobStore,
    NoResult,
    ResultTooLarge,
    StoreError,
    UnknownJob,
)
from tests.coordinator.storage.store_utils import Clock, job_in_state, running_job


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "state", clock=Clock()) as store:
        yield store


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
    failed = job_in_state(store, state)
    job = store.fail(failed.id, "worker_lost", "w1 stopped heartbeating", {"worker": "w1"})
    assert job.state is JobState.FAILED and job.finished is not None
    assert job.error == {
        "code": "worker_lost",
        "message": "w1 stopped heartbeating",
        "detail": {"worker": "w1"},
    }
    assert job.started == failed.started  # kept: None for a job that failed while queued

    cancelled = job_in_state(store, state)
    job = store.cancel(cancelled.id)
    assert job.state is JobState.CANCELLED and job.finished is not None
    assert job.error == {"code": "cancelled", "message": "cancelled by the client", "detail": {}}
    other = store.cancel(job_in_state(store, state).id, reason="shutting down")
    assert other.error is not None and other.error["message"] == "shutting down"


def test_an_error_of_megabytes_is_kept_capped(store: JobStore) -> None:
    """A filter may raise with megabytes of text: the record keeps the first 4,096 characters
    of the message and 65,536 of each text of the detail, and says how many more there were."""
    job = job_in_state(store, JobState.RUNNING)
    said = "x" * 3_000_000
    failed = store.fail(job.id, "filter_error", said, {"full_traceback": said, "line": 9})
    assert failed.error is not None
    assert failed.error["message"] == "x" * 4096 + f"… ({3_000_000 - 4096} more characters)"
    traceback = failed.error["detail"]["full_traceback"]
    assert traceback == "x" * 65536 + f"… ({3_000_000 - 65536} more characters)"
    assert failed.error["detail"]["line"] == 9


# -- events -----------------------------------------------------------------------------------


def test_events_are_numbered_per_job_and_read_after_a_seq(store: JobStore) -> None:
    a = running_job(store).id
    b = running_job(store).id
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
    assert event == EventRecord(a, 6, event.time, "done", {"ok": True})
    assert store.events(a, after_seq=5) == [event]


def test_events_from_many_threads_get_distinct_consecutive_seqs(store: JobStore) -> None:
    job_id = running_job(store).id

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
    job_id = running_job(store).id
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
    job_id = running_job(store).id
    store.succeed(job_id, result)
    assert store.result(job_id) == bytes(result)
    assert type(store.result(job_id)) is bytes


def test_a_result_over_sqlites_limit_is_refused_and_the_job_stays_running(
    store: JobStore,
) -> None:
    job_id = running_job(store).id
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
    job = job_in_state(store, state)
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
    job = job_in_state(store, state)
    attempt = {
        "start": lambda: store.start(job.id, ["w9"]),
        "succeed": lambda: store.succeed(job.id, b"late result"),
        "fail": lambda: store.fail(job.id, "late", "too late"),
        "cancel": lambda: store.cancel(job.id),
        "progress": lambda: store.progress(job.id, {"step": 99}),
    }[transition]
    with pytest.raises(InvalidJobTransition) as info:
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
    running = running_job(store).id
    done = job_in_state(store, JobState.FAILED).id
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
            jobs.append(job_in_state(store, state))
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
            job_in_state(store, state)
    assert store.counts() == {
        JobState.QUEUED: 3,
        JobState.RUNNING: 0,
        JobState.SUCCEEDED: 2,
        JobState.FAILED: 0,
        JobState.CANCELLED: 1,
    }


def test_a_worker_id_is_bound_to_the_first_key_it_presents_until_forgotten(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    assert not store.is_enrolled("w1")
    assert store.identify("w1", "a" * 64)  # trust on first use
    assert store.is_enrolled("w1")
    assert store.identify("w1", "a" * 64)
    assert not store.identify("w1", "b" * 64)
    assert store.identify("w2", "b" * 64)  # another id, its own key
    assert store.forget_worker("w1") and not store.forget_worker("w1")
    assert store.identify("w1", "b" * 64)  # enrolled again, with the new key
    store.close()
    reopened = JobStore(tmp_path)
    assert not reopened.identify("w1", "a" * 64) and reopened.identify("w1", "b" * 64)
    reopened.close()


def _as_version(path: Path, version: int) -> None:
    """Turn the store at ``path`` back into what schema ``version`` (1 or 2) left."""
    with sqlite3.connect(path / DB_NAME) as conn:
        conn.execute("ALTER TABLE results DROP COLUMN kind")  # version 3's
        if version < 2:
            conn.execute("DROP TABLE workers")
        conn.execute(f"PRAGMA user_version = {version}")
    conn.close()


def _version(path: Path) -> int:
    with sqlite3.connect(path / DB_NAME) as conn:
        found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    conn.close()
    return found


def test_a_version_1_store_gains_the_workers_table_and_keeps_its_jobs(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job_id = store.create("local", {"n": 1}).id
    store.close()
    _as_version(tmp_path, 1)
    upgraded = JobStore(tmp_path)
    assert upgraded.get(job_id).summary == {"n": 1}
    assert upgraded.identify("w1", "c" * 64) and not upgraded.identify("w1", "d" * 64)
    upgraded.close()
    assert _version(tmp_path) == 3


def test_a_version_2_stores_results_are_states_and_new_ones_say_their_kind(
    tmp_path: Path,
) -> None:
    store = JobStore(tmp_path)
    old = store.create("local", {}).id
    store.start(old, ["w1"])
    store.succeed(old, b"states of old")
    store.close()
    _as_version(tmp_path, 2)
    upgraded = JobStore(tmp_path)
    assert upgraded.result(old) == b"states of old"
    assert upgraded.result_kind(old) == "states"
    new = upgraded.create("data_parallel", {}).id
    upgraded.start(new, ["w1", "w2"])
    upgraded.succeed(new, b"where the pieces are", kind="pieces")
    assert upgraded.result_kind(new) == "pieces"
    assert upgraded.result(new) == b"where the pieces are"
    with pytest.raises(sqlite3.IntegrityError):  # the schema knows no other kind
        another = upgraded.create("local", {}).id
        upgraded.start(another, ["w1"])
        upgraded.succeed(another, b"?", kind="joined")
    upgraded.close()
    assert _version(tmp_path) == 3


def test_the_state_directory_and_its_files_are_private_to_their_user(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / DB_NAME).touch(mode=0o644)  # as an older coordinator left them
    store, _ = JobStore.open(state)
    store.create("local", {"rows": "private"})
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [state, *state.iterdir()]}
    store.close()
    assert modes.pop("state") == 0o700
    assert {DB_NAME, f"{DB_NAME}-wal", "jobs.lock"} <= set(modes)
    assert set(modes.values()) == {0o600}, modes


def test_a_damaged_store_is_refused_at_open_naming_what_is_wrong(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    for n in range(300):
        store.create("local", {"n": n, "pad": "x" * 200})
    store.close()
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.close()
    with open(tmp_path / DB_NAME, "r+b") as f:  # garbage over a page in the middle
        f.seek(page_size * (pages - 2))
        f.write(b"\xde\xad\xbe\xef" * (page_size // 4))
    with pytest.raises(StoreError, match=r"is damaged \(.+\): restore it"):
        JobStore(tmp_path)
