"""Which ended jobs go (coordinator.jobs.retention, by hand-made lists) and their removal from a
real store and state directory (coordinator.jobs.pruning): records, events, results and
checkpoints gone, a live job and another client's kept. Live: test_client_cli.py."""

from __future__ import annotations

import argparse
import asyncio
import sqlite3

import pytest

from coordinator.jobs.files import JobFiles
from coordinator.jobs.pruning import Pruning
from coordinator.jobs.retention import Ended, Retention, expired
from coordinator.storage.store import JobStore, UnknownJob
from protocol.text.quantities import byte_count, seconds
from tests.coordinator.storage.store_utils import Clock, running_job

ENDED = [  # ended at 100, 200, ... 500; 10, 20, ... 50 bytes
    Ended(f"j{k}", 100.0 * k, 10 * k) for k in (3, 1, 5, 2, 4)
]


def test_expired_by_age_count_and_bytes_oldest_first():
    assert expired(ENDED, 600.0, Retention()) == []
    assert expired(ENDED, 600.0, Retention(age=250.0)) == ["j1", "j2", "j3"]  # ended ≤ 350
    assert expired(ENDED, 600.0, Retention(jobs=2)) == ["j1", "j2", "j3"]
    assert expired(ENDED, 600.0, Retention(jobs=0)) == ["j1", "j2", "j3", "j4", "j5"]
    # The oldest go until the rest hold 100 bytes: 150 - 10 - 20 - 30 = 90.
    assert expired(ENDED, 600.0, Retention(bytes=100)) == ["j1", "j2", "j3"]
    # Together: each goes that any says; the bytes count only what the others keep (age
    # leaves j5 and j4, 90 bytes; 45 leaves j5 alone).
    assert expired(ENDED, 600.0, Retention(age=250.0, bytes=50)) == ["j1", "j2", "j3", "j4"]
    with pytest.raises(ValueError, match="a retention's jobs must not be negative"):
        Retention(jobs=-1)
    assert Retention(86400, 100, 10**10).describe() == (
        "older than 86400 s, beyond the 100 newest, beyond 10.0 GB"
    )


def test_sizes_and_durations_as_a_person_writes_them():
    assert [byte_count(t) for t in ("8G", "512M", "1024", "1.5k", "2GiB")] == [
        8 << 30,
        512 << 20,
        1024,
        1536,
        2 << 30,
    ]
    assert [seconds(t) for t in ("30d", "12h", "90m", "45s", "45", "0.5")] == [
        30 * 86400,
        12 * 3600,
        5400,
        45,
        45,
        0.5,
    ]
    for bad in ("lots", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_count(bad)
    for bad in ("soon", "-5m", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            seconds(bad)


def _ended(store: JobStore, owner: str, ok: bool = True) -> str:
    job = running_job(store, owner=owner)
    if ok:
        store.succeed(job.id, b"x" * 1000)
    else:
        store.fail(job.id, "filter_error", "boom")
    store.add_event(job.id, "note", {"k": 1})
    return job.id


def test_pruning_removes_ended_jobs_whole_and_keeps_live_and_others(tmp_path):
    clock = Clock()
    with JobStore(tmp_path, clock=clock) as store:
        files = JobFiles(tmp_path)
        old, failed, new = (_ended(store, "alice", ok) for ok in (True, False, True))
        bobs = _ended(store, "bob")
        live = running_job(store, owner="alice").id
        for job_id in (old, failed):
            files.checkpoints.write(job_id, {"step": 1}, {"states": {}}, keep=2)
        pruning = Pruning(store, files, clock=lambda: clock.now)

        said = asyncio.run(pruning.prune(Retention(jobs=1), owner="alice", dry_run=True))
        assert said["jobs"] == [old, failed] and said["kept"] == []
        assert said["bytes"] >= 1000 + files.bytes_of(failed) > 1000
        assert store.get(old).id == old  # a dry run removes nothing

        asked = [bobs, live, "nosuch"]
        said = asyncio.run(pruning.prune(Retention(jobs=1), asked, owner="alice"))
        assert said["jobs"] == [old, failed] and said["kept"] == asked
        for job_id in (old, failed):
            with pytest.raises(UnknownJob):
                store.get(job_id)
            with sqlite3.connect(store.path) as db:  # nothing of it left in any table
                for table in ("events", "results"):
                    query = f"SELECT count(*) FROM {table} WHERE job_id = ?"
                    assert db.execute(query, (job_id,)).fetchone() == (0,)
            assert not files.checkpoints.folder(job_id).exists()
        assert {j.id for j in store.list()} == {new, bobs, live}

        said = asyncio.run(pruning.prune(Retention(), [bobs, live]))  # an admin's: anyone's
        assert said["jobs"] == [bobs] and said["kept"] == [live]
        assert {j.id for j in store.list()} == {new, live}


def test_removed_jobs_leave_the_disk_and_an_older_store_is_converted(tmp_path):
    with JobStore(tmp_path) as store:
        jobs = [running_job(store, owner="alice").id for _ in range(20)]
        for job_id in jobs:
            store.succeed(job_id, b"r" * 200_000)
        path = store.path
    with sqlite3.connect(path, isolation_level=None) as db:  # as stores were made before
        db.execute("PRAGMA auto_vacuum = NONE")
        db.execute("VACUUM")
        assert db.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    full = path.stat().st_size + _wal(path)
    with JobStore(tmp_path) as store:  # reopened: rewritten to give pages back from now on
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA auto_vacuum").fetchone() == (2,)
        assert asyncio.run(Pruning(store, None).prune(Retention(jobs=2)))["jobs"] == jobs[:18]
        left = path.stat().st_size + _wal(path)
        assert {j.id for j in store.list()} == set(jobs[18:])
        assert store.result(jobs[19]) == b"r" * 200_000
    # 20 results of 200 kB, 18 removed: under a fifth of the size is left
    assert full > 20 * 200_000 and left < full / 5, (full, left)


def _wal(path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0
