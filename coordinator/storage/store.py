"""The coordinator's job store: every job, its events and its result, in SQLite.

The coordinator records each job here so that ``somatize jobs`` and ``somatize result ID`` work
after the client has disconnected and after a coordinator restart. The store is plain synchronous
code with no asyncio: the coordinator calls it through :func:`asyncio.to_thread`. One connection
(``check_same_thread=False``) is shared by every call and guarded by a lock, so any thread may use
the store, one call at a time.

The file is ``<state_dir>/jobs.sqlite3`` (WAL, ``synchronous=NORMAL``; ``FULL`` for the writes that
end a job, so a job reported finished stays finished across a power cut); its tables are drawn
in :mod:`coordinator.storage.schema`.

Invariants, enforced by the code and again by the schema (triggers, the deferred foreign key):
a job in a terminal state (succeeded, failed, cancelled) never changes; a result row exists
exactly for the succeeded jobs.
:meth:`JobStore.succeed` writes the result and the state change in one transaction, so a crash at
any point leaves either a running job without a result or a succeeded job with its whole result.

Results can be hundreds of MB. They are written and read through SQLite's incremental blob I/O
(:meth:`sqlite3.Connection.blobopen`) so neither direction makes a second full-size copy in
memory; SQLite caps one value at ``SQLITE_LIMIT_LENGTH`` (1 GB by default).

:meth:`JobStore.open` is the coordinator's entry point: it locks the state directory for as long
as the store is open (a second coordinator on the same directory gets :class:`StoreInUse`), then
queues again every job a previous process left queued or running that can be resumed (the
coordinator kept what it was submitted with: :mod:`coordinator.jobs.files`), and marks the others
failed with the code ``coordinator_restarted``, that end added to their events.
"""

from __future__ import annotations

import builtins
import hmac
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from coordinator.errors import (
    DuplicateJob,
    InvalidJobTransition,
    NoResult,
    ResultTooLarge,
    StoreError,
    StoreInUse,
    UnknownJob,
)
from coordinator.storage.schema import LOCK_NAME, DirLock, check_integrity, make_private, migrate
from protocol.text.wording import capped

__all__ = [
    "TERMINAL_STATES",
    "DuplicateJob",
    "EventRecord",
    "InvalidJobTransition",
    "JobRecord",
    "JobState",
    "JobStore",
    "NoResult",
    "ResultTooLarge",
    "StoreError",
    "StoreInUse",
    "UnknownJob",
]

DB_NAME = "jobs.sqlite3"
RESTARTED = "coordinator_restarted"  # error code of the jobs recovered by JobStore.open
CANCELLED = "cancelled"  # error code recorded with a cancelled job's reason

# Seconds a write waits for another connection (a tool reading the file, say) to let go.
_BUSY_TIMEOUT = 10.0
_INCREMENTAL = 2
"""``PRAGMA auto_vacuum`` of a store that gives removed jobs' pages back (``INCREMENTAL``)."""


class JobState(StrEnum):
    """Where a job is in its life: queued → running → succeeded | failed | cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for the states a job never leaves."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
_LIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})

# The transition table: request -> (states it is allowed from, state it leads to).
_TRANSITIONS: dict[str, tuple[frozenset[JobState], JobState]] = {
    "start": (frozenset({JobState.QUEUED}), JobState.RUNNING),
    "succeed": (frozenset({JobState.RUNNING}), JobState.SUCCEEDED),
    "fail": (_LIVE_STATES, JobState.FAILED),
    "cancel": (_LIVE_STATES, JobState.CANCELLED),
    "requeue": (_LIVE_STATES, JobState.QUEUED),  # resumed by a restarted coordinator or job
}


def _allowed(transition: str) -> frozenset[JobState]:
    """The states ``transition`` may start from (a live one for any other request)."""
    return _TRANSITIONS[transition][0] if transition in _TRANSITIONS else _LIVE_STATES


@dataclass(frozen=True)
class JobRecord:
    """One job as stored. ``error`` is ``{"code", "message", "detail"}`` or None."""

    id: str
    state: JobState
    strategy: str
    created: float
    started: float | None
    finished: float | None
    workers: list[str]
    progress: dict[str, Any]
    error: dict[str, Any] | None
    summary: dict[str, Any]


@dataclass(frozen=True)
class EventRecord:
    """One entry of a job's event log; ``seq`` counts from 1 per job."""

    job_id: str
    seq: int
    time: float
    kind: str
    data: dict[str, Any]


_COLUMNS = "id, state, strategy, created, started, finished, workers, progress, error, summary"


def _dumps(value: Any) -> str:
    # The stdlib keeps NaN and ±inf (a diverged loss) where orjson would turn them into null.
    return json.dumps(value, separators=(",", ":"))


def _record(row: tuple[Any, ...]) -> JobRecord:
    job_id, state, strategy, created, started, finished, workers, progress, error, summary = row
    return JobRecord(
        id=job_id,
        state=JobState(state),
        strategy=strategy,
        created=created,
        started=started,
        finished=finished,
        workers=json.loads(workers),
        progress=json.loads(progress),
        error=None if error is None else json.loads(error),
        summary=json.loads(summary),
    )


ERROR_CHARACTERS = 4096
"""The most characters of an error's message a job record keeps (a filter may raise with
megabytes of text)."""
DETAIL_CHARACTERS = 65536
"""The most characters of each text in an error's detail (a traceback, say) it keeps."""


def error_record(code: str, message: str, detail: dict[str, Any] | None) -> dict[str, Any]:
    """A job's ``error`` as the store keeps it: its message and detail texts capped."""
    kept = {
        key: capped(value, DETAIL_CHARACTERS) if isinstance(value, str) else value
        for key, value in (detail or {}).items()
    }
    return {"code": code, "message": capped(message, ERROR_CHARACTERS), "detail": kept}


class JobStore:
    """Jobs, their events and their results in ``<state_dir>/jobs.sqlite3``.

    Every method is safe to call from any thread; calls are serialized by one lock. Methods that
    change a job return its record as stored afterwards.

    Args:
        state_dir: The directory of the database; created if missing.
        clock: Where times come from (Unix seconds); tests may pass a fake one.

    Raises:
        StoreError: The database was written by a newer schema version, or cannot be opened.
    """

    def __init__(self, state_dir: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / DB_NAME
        self._clock = clock
        self._lock = threading.Lock()
        self._dir_lock: DirLock | None = None
        self.write_failure: str | None = None
        """Why the last write failed (a full disk, a damaged file), until one succeeds;
        ``/healthz`` reports it."""
        try:
            make_private(self.state_dir, self.path)
        except OSError as exc:
            raise StoreError(
                f"cannot make the state directory {self.state_dir} private: {exc}"
            ) from exc
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=_BUSY_TIMEOUT,
                # Transactions are begun and ended explicitly (see _write), never implicitly.
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the job store {self.path}: {exc}") from exc
        self._conn: sqlite3.Connection | None = conn
        try:
            # Pages freed by a removal go back to the file system (delete): set before the
            # first table of a new store; an older store is rewritten once to take it.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            # A large result passes through the WAL; let it shrink back after the checkpoint.
            conn.execute("PRAGMA journal_size_limit = 67108864")
            migrate(conn, self.path)
            check_integrity(conn, self.path)
            if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != _INCREMENTAL:
                conn.execute("VACUUM")
        except BaseException as exc:
            conn.close()
            self._conn = None
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open the job store {self.path}: {exc}") from exc
            raise

    @classmethod
    def open(
        cls,
        state_dir: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        resumable: Iterable[str] = (),
    ) -> tuple[JobStore, builtins.list[JobRecord]]:
        """Open the store as the coordinator does: lock the directory, then recover.

        Every job a previous process left queued or running is queued again if it is
        ``resumable`` (the coordinator kept what it was submitted with), else marked failed with
        the error code ``coordinator_restarted`` and that end added to its events.

        Returns:
            The store and the records of the jobs it just recovered (queued or failed), oldest
            first.

        Raises:
            StoreInUse: Another store opened with :meth:`open` holds the directory.
        """
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        # Lock before anything else: recovering the jobs of a live coordinator would fail them.
        dir_lock = DirLock(state_dir / LOCK_NAME)
        try:
            store = cls(state_dir, clock=clock)
        except BaseException:
            dir_lock.release()
            raise
        store._dir_lock = dir_lock
        try:
            recovered = store._recover(set(resumable))
        except BaseException:
            store.close()
            raise
        return store, recovered

    # -- transactions -----------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the job store {self.path} is closed")
        return self._conn

    @contextmanager
    def _write(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; ``durable`` syncs it to disk on commit. A
        failure of the database itself is kept in :attr:`write_failure` until a write works."""
        try:
            with self._transaction(durable) as conn:
                yield conn
        except sqlite3.IntegrityError:
            raise  # a refused change (an invariant), not a store that fails
        except sqlite3.DatabaseError as exc:  # full, read-only, an I/O error, damaged
            self.write_failure = f"{type(exc).__name__}: {exc}"
            raise
        self.write_failure = None

    @contextmanager
    def _transaction(self, durable: bool) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._connection()
            if durable:
                conn.execute("PRAGMA synchronous = FULL")
            try:
                # IMMEDIATE takes the write lock now, so the checks we read stay true until commit.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    conn.rollback()
                    raise
            finally:
                if durable:
                    conn.execute("PRAGMA synchronous = NORMAL")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction under the lock: a consistent snapshot across statements."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.rollback()

    def _get(self, conn: sqlite3.Connection, job_id: str) -> JobRecord:
        row = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJob(job_id)
        return _record(row)

    def _transition(
        self, conn: sqlite3.Connection, job_id: str, transition: str, **columns: Any
    ) -> JobRecord:
        """Check ``transition`` against the table and apply it with the extra ``columns``."""
        allowed, target = _TRANSITIONS[transition]
        record = self._get(conn, job_id)
        if record.state not in allowed:
            raise InvalidJobTransition(job_id, record.state, transition, _allowed(transition))
        columns["state"] = str(target)
        assignments = ", ".join(f"{name} = ?" for name in columns)
        conn.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*columns.values(), job_id))
        return self._get(conn, job_id)

    def _recover(self, resumable: set[str]) -> builtins.list[JobRecord]:
        with self._write(durable=True) as conn:
            rows = conn.execute(
                "SELECT id, state FROM jobs WHERE state IN ('queued', 'running') ORDER BY pk"
            ).fetchall()
            now = self._clock()
            recovered = []
            for job_id, state in rows:
                if job_id in resumable:
                    recovered.append(self._transition(conn, job_id, "requeue", started=None))
                    continue
                error = error_record(
                    RESTARTED,
                    f"the coordinator restarted while the job was {state}",
                    {"state": state},
                )
                recovered.append(
                    self._transition(conn, job_id, "fail", finished=now, error=_dumps(error))
                )
                self._append_event(conn, job_id, "failed", error)  # its stream ends too
            return recovered

    # -- the API ----------------------------------------------------------------------------

    def create(
        self, strategy: str, summary: dict[str, Any], job_id: str | None = None
    ) -> JobRecord:
        """Record a new queued job.

        Args:
            strategy: The strategy's name.
            summary: Small JSON the client gave (node ids, rows, strategy config).
            job_id: The id to use; by default 12 random hex digits.

        Raises:
            DuplicateJob: ``job_id`` is already taken.
        """
        job_id = uuid.uuid4().hex[:12] if job_id is None else job_id
        summary_json = _dumps(summary)
        with self._write() as conn:
            try:
                conn.execute(
                    "INSERT INTO jobs (id, state, strategy, created, summary) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (job_id, str(JobState.QUEUED), strategy, self._clock(), summary_json),
                )
            except sqlite3.IntegrityError as exc:
                raise DuplicateJob(job_id) from exc
            return self._get(conn, job_id)

    def start(self, job_id: str, workers: builtins.list[str]) -> JobRecord:
        """Queued → running, on these workers."""
        workers_json = _dumps(list(workers))
        with self._write() as conn:
            return self._transition(
                conn, job_id, "start", started=self._clock(), workers=workers_json
            )

    def requeue(self, job_id: str) -> JobRecord:
        """Running → queued again: a job restarting from its last checkpoint after a fault."""
        with self._write() as conn:
            return self._transition(conn, job_id, "requeue")

    def progress(self, job_id: str, progress: dict[str, Any]) -> None:
        """Replace the job's progress (round, step, loss, ...).

        Raises:
            InvalidJobTransition: The job is terminal: its last progress stays as it was.
        """
        progress_json = _dumps(progress)
        with self._write() as conn:
            record = self._get(conn, job_id)
            if record.state.terminal:
                raise InvalidJobTransition(job_id, record.state, "progress", _allowed("progress"))
            conn.execute("UPDATE jobs SET progress = ? WHERE id = ?", (progress_json, job_id))

    def add_event(self, job_id: str, kind: str, data: dict[str, Any]) -> EventRecord:
        """Append an event to the job's log; any state, so a terminal job can log its end."""
        with self._write() as conn:
            self._get(conn, job_id)
            return self._append_event(conn, job_id, kind, data)

    def _append_event(
        self, conn: sqlite3.Connection, job_id: str, kind: str, data: dict[str, Any]
    ) -> EventRecord:
        data_json = _dumps(data)
        # Under BEGIN IMMEDIATE no other writer can take the same seq between these two.
        (last,) = conn.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?", (job_id,)
        ).fetchone()
        event = EventRecord(job_id, last + 1, self._clock(), kind, json.loads(data_json))
        conn.execute(
            "INSERT INTO events (job_id, seq, time, kind, data) VALUES (?, ?, ?, ?, ?)",
            (job_id, event.seq, event.time, kind, data_json),
        )
        return event

    def events(self, job_id: str, after_seq: int = 0) -> builtins.list[EventRecord]:
        """The job's events with ``seq > after_seq``, in order."""
        with self._read() as conn:
            self._get(conn, job_id)
            rows = conn.execute(
                "SELECT seq, time, kind, data FROM events WHERE job_id = ? AND seq > ? "
                "ORDER BY seq",
                (job_id, after_seq),
            ).fetchall()
        return [EventRecord(job_id, seq, t, kind, json.loads(data)) for seq, t, kind, data in rows]

    def succeed(
        self, job_id: str, result: bytes | bytearray | memoryview, kind: str = "states"
    ) -> JobRecord:
        """Running → succeeded, storing ``result`` (a frame of the ``kind`` the schema names)
        in the same transaction.

        Raises:
            InvalidJobTransition: The job is not running.
            ResultTooLarge: SQLite cannot hold ``result`` in one value; the job is unchanged.
        """
        with (
            memoryview(result) as raw,
            raw.cast("B") as view,
            self._write(durable=True) as conn,
        ):
            record = self._get(conn, job_id)
            if record.state not in _TRANSITIONS["succeed"][0]:
                raise InvalidJobTransition(job_id, record.state, "succeed", _allowed("succeed"))
            limit = conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
            if view.nbytes > limit:
                raise ResultTooLarge(
                    f"the result of job {job_id!r} is {view.nbytes} bytes; "
                    f"the store holds at most {limit}"
                )
            # Reserve the space, then copy the caller's buffer straight into the database pages:
            # binding it as a parameter would make SQLite take a full private copy first.
            cursor = conn.execute(
                "INSERT INTO results (job_id, data, kind) VALUES (?, zeroblob(?), ?)",
                (job_id, view.nbytes, kind),
            )
            if view.nbytes:
                assert cursor.lastrowid is not None
                with conn.blobopen("results", "data", cursor.lastrowid) as blob:
                    blob.write(view)
            return self._transition(conn, job_id, "succeed", finished=self._clock())

    def fail(
        self, job_id: str, code: str, message: str, detail: dict[str, Any] | None = None
    ) -> JobRecord:
        """Queued or running → failed, with ``error{code, message, detail}``."""
        error_json = _dumps(error_record(code, message, detail))
        with self._write(durable=True) as conn:
            return self._transition(conn, job_id, "fail", finished=self._clock(), error=error_json)

    def cancel(self, job_id: str, reason: str = "cancelled by the client") -> JobRecord:
        """Queued or running → cancelled; the reason is kept as ``error{"code": "cancelled"}``."""
        error_json = _dumps(error_record(CANCELLED, reason, None))
        with self._write(durable=True) as conn:
            return self._transition(
                conn, job_id, "cancel", finished=self._clock(), error=error_json
            )

    def get(self, job_id: str) -> JobRecord:
        """The job's record.

        Raises:
            UnknownJob: No job has this id.
        """
        with self._read() as conn:
            return self._get(conn, job_id)

    def list(
        self, states: Iterable[JobState] | None = None, limit: int = 100
    ) -> builtins.list[JobRecord]:
        """Up to ``limit`` jobs, newest (last created) first, only in ``states`` if given."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        query = f"SELECT {_COLUMNS} FROM jobs"
        params: builtins.list[Any] = []
        if states is not None:
            wanted = sorted({str(JobState(state)) for state in states})
            query += f" WHERE state IN ({', '.join('?' * len(wanted))})"
            params.extend(wanted)
        query += " ORDER BY pk DESC LIMIT ?"
        params.append(limit)
        with self._read() as conn:
            rows = conn.execute(query, params).fetchall()
        return [_record(row) for row in rows]

    def result(self, job_id: str) -> bytes:
        """The stored result of a succeeded job.

        Raises:
            UnknownJob: No job has this id.
            NoResult: The job has not succeeded; the message says its state and error.
        """
        with self._read() as conn:
            rowid, _ = self._result_row(conn, job_id)
            # Blob.read() fills one new bytes object directly; SELECT would copy it twice.
            with conn.blobopen("results", "data", rowid, readonly=True) as blob:
                return blob.read()

    def result_kind(self, job_id: str) -> str:
        """What the stored result of a succeeded job holds: ``"states"`` or ``"pieces"``.

        Raises:
            UnknownJob: No job has this id.
            NoResult: The job has not succeeded.
        """
        with self._read() as conn:
            return self._result_row(conn, job_id)[1]

    def _result_row(self, conn: sqlite3.Connection, job_id: str) -> tuple[int, str]:
        """The rowid and kind of a succeeded job's result.

        Raises:
            UnknownJob: No job has this id.
            NoResult: The job has not succeeded.
        """
        record = self._get(conn, job_id)
        if record.state is not JobState.SUCCEEDED:
            raise NoResult(record.id, record.state, record.error)
        rowid, kind = conn.execute(
            "SELECT rowid, kind FROM results WHERE job_id = ?", (job_id,)
        ).fetchone()
        return int(rowid), str(kind)

    def ended(self) -> builtins.list[tuple[str, float, str | None, int]]:
        """Every ended job, the oldest end first: its id, when it ended, its owner and the
        bytes of its stored result (0 without one)."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT jobs.id, jobs.finished, json_extract(jobs.summary, '$.owner'), "
                "COALESCE(length(results.data), 0) FROM jobs "
                "LEFT JOIN results ON results.job_id = jobs.id "
                "WHERE jobs.state IN ('succeeded', 'failed', 'cancelled') "
                "ORDER BY jobs.finished, jobs.pk"
            ).fetchall()
        return [(str(i), float(f or 0.0), o, int(n)) for i, f, o, n in rows]

    def delete(self, job_ids: Iterable[str]) -> builtins.list[str]:
        """Remove ended jobs — their records, event logs and results — in one transaction;
        those removed (a live job, or one not here, stays)."""
        removed = []
        with self._write() as conn:
            for job_id in job_ids:
                row = conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None or not JobState(row[0]).terminal:
                    continue
                for table, column in (("results", "job_id"), ("events", "job_id")):
                    conn.execute(f"DELETE FROM {table} WHERE {column} = ?", (job_id,))
                conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                removed.append(job_id)
        if removed:
            self._shrink()
        return removed

    def _shrink(self) -> None:
        """Give the free pages back and cut the WAL: what a removal freed leaves the disk now.
        (A reader in the way of the checkpoint: at the next one.)"""
        with self._lock:
            conn = self._connection()
            # run to its end: stepped once, as execute() does, it frees a single page
            conn.executescript("PRAGMA incremental_vacuum;")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def counts(self) -> dict[JobState, int]:
        """How many jobs are in each state (every state present, zeros included)."""
        with self._read() as conn:
            rows = conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        counts = dict.fromkeys(JobState, 0)
        counts.update((JobState(state), n) for state, n in rows)
        return counts

    # -- worker identities ------------------------------------------------------------------

    def identify(self, worker_id: str, key_sha256: str) -> bool:
        """Whether ``key_sha256`` is the identity of ``worker_id``: the one it enrolled with,
        or — for an id not enrolled yet — this one, enrolled now (trust on first use)."""
        with self._write() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO workers (id, key_sha256, enrolled) VALUES (?, ?, ?)",
                (worker_id, key_sha256, self._clock()),
            )
            row = conn.execute("SELECT key_sha256 FROM workers WHERE id = ?", (worker_id,))
            enrolled: str = row.fetchone()[0]
        return hmac.compare_digest(enrolled, key_sha256)

    def bind(self, worker_id: str, key_sha256: str) -> bool:
        """Enrol ``worker_id`` with ``key_sha256`` whatever it had (its operator said so:
        ``--enroll ID=FINGERPRINT``); whether that changed its key."""
        with self._write() as conn:
            row = conn.execute("SELECT key_sha256 FROM workers WHERE id = ?", (worker_id,))
            had = row.fetchone()
            conn.execute(
                "INSERT OR REPLACE INTO workers (id, key_sha256, enrolled) VALUES (?, ?, ?)",
                (worker_id, key_sha256, self._clock()),
            )
        return had is None or had[0] != key_sha256

    def is_enrolled(self, worker_id: str) -> bool:
        """Whether ``worker_id`` has an identity key."""
        with self._read() as conn:
            row = conn.execute("SELECT 1 FROM workers WHERE id = ?", (worker_id,)).fetchone()
        return row is not None

    def forget_worker(self, worker_id: str) -> bool:
        """Drop ``worker_id``'s identity (its next keyed hello enrols again); whether it had
        one."""
        with self._write() as conn:
            gone = conn.execute("DELETE FROM workers WHERE id = ?", (worker_id,)).rowcount
        return bool(gone)

    def close(self) -> None:
        """Close the database and release the directory; later calls raise :class:`StoreError`."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._dir_lock is not None:
                self._dir_lock.release()
                self._dir_lock = None

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
