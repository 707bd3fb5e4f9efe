"""The job store's files: the SQLite schema, its migrations, and the state directory's lock.

Schema version 3 (``PRAGMA user_version``)::

    jobs     pk INTEGER PRIMARY KEY         insertion order: "newest first" never trusts clocks
             id TEXT UNIQUE                 the public job id
             state TEXT                     queued | running | succeeded | failed | cancelled
             strategy TEXT
             created REAL, started REAL?, finished REAL?      Unix times
             workers TEXT                   JSON list of worker ids (set by start)
             progress TEXT                  JSON object, replaced by each progress() call
             error TEXT?                    JSON {"code", "message", "detail"} of failed/cancelled
             summary TEXT                   JSON object the client gave at submission

    events   (job_id, seq) PRIMARY KEY      seq counts from 1 per job
             time REAL, kind TEXT, data TEXT (JSON object)

    results  job_id TEXT PRIMARY KEY        one row per succeeded job, none for any other
             state TEXT                     always 'succeeded': (job_id, state) is a deferred
                                            foreign key to jobs (id, state)
             data BLOB                      the opaque result frame
             kind TEXT                      'states': the frame holds the states by node;
                                            'pieces': a sharded run's, which the client joins
                                            (the frame says where each replica's pieces are)

    workers  id TEXT PRIMARY KEY            a worker id, enrolled by its first keyed hello
             key_sha256 TEXT                SHA-256 of its identity key, hex (never the key)
             enrolled REAL                  Unix time

Invariants the schema enforces again (triggers, the deferred foreign key): a job in a terminal
state never changes; a result row exists exactly for the succeeded jobs.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from coordinator.errors import StoreError, StoreInUse

SCHEMA_VERSION = 3
LOCK_NAME = "jobs.lock"
"""The file whose lock says a coordinator holds the state directory."""

SCHEMA = """
CREATE TABLE jobs (
    pk       INTEGER PRIMARY KEY,
    id       TEXT NOT NULL UNIQUE,
    state    TEXT NOT NULL
             CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    strategy TEXT NOT NULL,
    created  REAL NOT NULL,
    started  REAL,
    finished REAL,
    workers  TEXT NOT NULL DEFAULT '[]',
    progress TEXT NOT NULL DEFAULT '{}',
    error    TEXT,
    summary  TEXT NOT NULL,
    UNIQUE (id, state)  -- the parent key of results' foreign key
);
CREATE INDEX jobs_by_state ON jobs (state, pk);

CREATE TABLE events (
    job_id TEXT NOT NULL REFERENCES jobs (id),
    seq    INTEGER NOT NULL,
    time   REAL NOT NULL,
    kind   TEXT NOT NULL,
    data   TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;

-- Not WITHOUT ROWID: blobopen() addresses a blob by rowid. The deferred foreign key on
-- (job_id, state) lets a transaction commit a result only if its job is succeeded by then.
CREATE TABLE results (
    job_id TEXT PRIMARY KEY,
    state  TEXT NOT NULL DEFAULT 'succeeded' CHECK (state = 'succeeded'),
    data   BLOB NOT NULL,
    kind   TEXT NOT NULL DEFAULT 'states' CHECK (kind IN ('states', 'pieces')),
    FOREIGN KEY (job_id, state) REFERENCES jobs (id, state) DEFERRABLE INITIALLY DEFERRED
);

-- The invariants again, so that a bug here or a hand edit cannot break them silently. (No
-- trigger on results: one would make SQLite materialize the whole zeroblob in memory.)
CREATE TRIGGER terminal_jobs_are_final BEFORE UPDATE ON jobs
WHEN OLD.state IN ('succeeded', 'failed', 'cancelled')
BEGIN
    SELECT RAISE(ABORT, 'a terminal job never changes');
END;

CREATE TRIGGER succeeded_jobs_have_results BEFORE UPDATE OF state ON jobs
WHEN NEW.state = 'succeeded' AND NOT EXISTS (SELECT 1 FROM results WHERE job_id = NEW.id)
BEGIN
    SELECT RAISE(ABORT, 'a job succeeds only together with its result');
END;
""" + (
    WORKERS := """
CREATE TABLE workers (
    id         TEXT PRIMARY KEY,
    key_sha256 TEXT NOT NULL,
    enrolled   REAL NOT NULL
) WITHOUT ROWID;
"""
)

RESULT_KIND = """
ALTER TABLE results ADD COLUMN
    kind TEXT NOT NULL DEFAULT 'states' CHECK (kind IN ('states', 'pieces'));
"""

# Schema upgrades: MIGRATIONS[v] turns version v into v + 1.
MIGRATIONS: dict[int, str] = {1: WORKERS, 2: RESULT_KIND}


def statements(script: str) -> Iterator[str]:
    """The statements of ``script`` one by one (triggers hold ``;`` inside, so no plain split).

    ``executescript`` would do it, but it commits any open transaction first, and the schema must
    be created inside the transaction that checked the version.
    """
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending.strip()
            pending = ""
    if pending.strip():
        raise ValueError(f"incomplete SQL statement: {pending.strip()!r}")


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema in a new database, or bring an older one up to this version.

    Raises:
    StoreError: the database was written by a newer schema version.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the job store {path} has schema version {version}, newer than this "
                f"coordinator's {SCHEMA_VERSION}: upgrade the coordinator"
            )
        if version < SCHEMA_VERSION:
            if version == 0:
                script = SCHEMA
            else:
                script = "".join(MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))
            for statement in statements(script):
                conn.execute(statement)
            # user_version lives in the database header, so it commits with the schema.
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.rollback()
        raise


def make_private(state_dir: Path, database: Path) -> None:
    """The state directory ``0700`` and the database with its WAL and lock files ``0600``
    (created so when new; tightened when an older coordinator left them readable by others):
    they hold the jobs' inputs and results, which may be private rows.

    Raises:
        OSError: a file cannot be created or its mode changed (not ours, say).
    """
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(state_dir, 0o700)
    for path in (database, state_dir / LOCK_NAME):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # SQLite copies its mode
    for suffix in ("", "-wal", "-shm"):
        _tighten(database.with_name(database.name + suffix), 0o600)
    _tighten(state_dir / LOCK_NAME, 0o600)


def _tighten(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_IMODE(path.stat().st_mode) & ~mode:
            path.chmod(mode)


def check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """``PRAGMA quick_check`` at open: a damaged database is refused now, not at the first
    submit that touches the damaged page.

    Raises:
        StoreError: the check found problems (the first few are named).
    """
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
    except sqlite3.DatabaseError as exc:  # too damaged to even be checked
        problems = [str(exc)]
    if problems != ["ok"]:
        raise StoreError(
            f"the job store {path} is damaged ({'; '.join(problems)}): restore it from a "
            "backup, or move it away to start with an empty store"
        )


class DirLock:
    """An exclusive, non-blocking lock on a file, held until released or the process dies.

    ``flock`` locks belong to the open file, so a second open of the same directory conflicts
    even inside one process, and the kernel drops the lock when a crashed process's files close.
    """

    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] | None = open(path, "a+b")  # noqa: SIM115 - held while open
        if sys.platform != "win32":
            import fcntl

            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                self._file = None
                raise StoreInUse(
                    f"the state directory {path.parent} is in use by another coordinator "
                    f"(lock {path.name} is held)"
                ) from None
        # Elsewhere there is no flock: the directory is simply not guarded.

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file drops the lock
            self._file = None
