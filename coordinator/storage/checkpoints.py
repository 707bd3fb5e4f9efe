"""Checkpoints: what a job resumes from, how they are written, and when a run saves one.

A checkpoint is what a strategy needs to go on exactly as if it had never stopped: every node's
state, every optimizer's state, and the position (step, epoch or round) — the strategy decides
what it holds (:class:`Checkpoint`). It is written to
``<state_dir>/checkpoints/<job id>/<seq>.ckpt`` as one :mod:`protocol.codec` frame followed by its
CRC-32 (:data:`TRAILER`; a file written before, with a SHA-256 instead, reads all the same), whole
or not at all (:func:`~coordinator.storage.disk.write_atomically`), around the page cache where the
file system allows it (:class:`~coordinator.storage.disk.DirectStaging`: a checkpoint is read back
rarely, and copying it into new cached pages cost more CPU beside training than the rest of
it). A sharded run's replicas' shards, as torch.distributed.checkpoint wrote them on each, go to
``<seq>.shards/`` first (never joined here): read from where the replicas left them a piece at
a time (:mod:`coordinator.storage.kept_files`, pieces of ``piece_bytes``, two in memory at most),
each piece written as the next is read (:class:`ShardsWriter`), and the frame lists them with
their digests. A torn or damaged file fails its digest and is never used (the one before it
is); the previous checkpoint is removed only once the new one is complete, and the last
``keep`` are kept.

* :class:`CheckpointStore` — the files of every job's checkpoints; its I/O blocks: callers run
  it in a thread.
* :class:`JobCheckpoints` — one running job's checkpoints as its strategy sees them
  (``JobInputs.checkpoints``): the one to resume from, and :meth:`JobCheckpoints.save`, which
  writes the next one off the event loop and says so in the job's events — ``checkpoint`` with
  its position, size and time, or ``checkpoint_failed`` with why (the disk full, say): training
  goes on, the checkpoints before it stand. The write runs while training goes on (the payload
  is the coordinator's own copy): only reading the state can stall the run, and DataParallel
  on the torch collective reads it with the reply of the chunk it ends, the next chunk already
  training (:mod:`coordinator.strategies.data_parallel.torch_collective`). One write is in flight
  at a time, in order; :meth:`JobCheckpoints.flush` waits for it (a run does before it returns,
  the job manager before it records a job's end).
* :class:`CheckpointPolicy` — when a run saves one (pure logic, no I/O).

The job manager makes each run's :class:`JobCheckpoints`
(:meth:`~coordinator.jobs.files.JobFiles.checkpoints_for`); its strategy saves through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.storage.disk import (
    AtomicFile,
    DirectStaging,
    job_path,
    private_directory,
    read_whole,
    write_atomically,
)
from coordinator.storage.kept_files import PIECE_BYTES, WHOLE_BYTES, KeptFileSource, fetch
from protocol.codec import decode, encode
from protocol.errors import FrameError
from protocol.files.shard_files import is_plain_file_name
from protocol.options.strategies import DEFAULT_KEEP_CHECKPOINTS

__all__ = [
    "DEFAULT_CHECKPOINT_SECONDS",
    "DEFAULT_KEEP",
    "Checkpoint",
    "CheckpointPolicy",
    "CheckpointStore",
    "JobCheckpoints",
    "Payload",
    "RunCheckpoints",
    "ShardsWriter",
]

log = logging.getLogger(__name__)

DEFAULT_KEEP = DEFAULT_KEEP_CHECKPOINTS
"""Checkpoints kept per job unless its strategy says otherwise."""

DEFAULT_CHECKPOINT_SECONDS = 60.0
"""With ``checkpoint_every`` unset a run saves at the end of every epoch (round) or after this
many seconds of training since the last checkpoint, whichever comes first."""

SUFFIX = ".ckpt"
SHARDS_SUFFIX = ".shards"
TRAILER = b"crc32"
"""What ends a checkpoint's file after its frame: this tag, then the frame's CRC-32 (4 bytes,
big-endian). A checksum against damage, as torch.save's zip records carry: the file is the
coordinator's own (``0600`` in its private state directory), so no one is defended against by
a cryptographic digest, which cost a SHA-256 of the whole model each checkpoint (11 ms for
23 MB on this project's 2-core machine, against 3 ms for a CRC-32) beside training."""
LEGACY_DIGEST_BYTES = hashlib.sha256().digest_size
"""A file written before :data:`TRAILER` ends with its frame's SHA-256 instead."""


Payload = dict[str, Any] | Callable[[], Awaitable[dict[str, Any]]]
"""What a checkpoint holds beside its position: as it is, or what a coroutine function gives
once the write starts."""


def _trailer(parts: list[bytes | memoryview]) -> bytes:
    """:data:`TRAILER` and the CRC-32 of ``parts`` (a frame)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return TRAILER + crc.to_bytes(4, "big")


def _body(raw: bytearray) -> memoryview:
    """The frame of a checkpoint's file ``raw``, once its trailer says it is whole.

    Raises:
        ValueError: it is too short, or its checksum (or a legacy file's digest) does not match.
    """
    view, tagged = memoryview(raw), len(TRAILER) + 4
    if len(raw) <= tagged:
        raise ValueError("too short to be a checkpoint")
    if view[-tagged:-4] == TRAILER and _trailer([view[:-tagged]]) == view[-tagged:]:
        return view[:-tagged]
    legacy = LEGACY_DIGEST_BYTES
    if hashlib.sha256(view[:-legacy]).digest() == view[-legacy:]:
        return view[:-legacy]
    raise ValueError("its checksum does not match: the file is torn or damaged")


@dataclass(frozen=True)
class Checkpoint:
    """One saved checkpoint of a job.

    Attributes:
        seq: its number (1, 2, ... per job; the latest has the largest).
        position: where the run stood (``{"step": 40, "epoch": 2}``, ``{"round": 3}``), as its
            events say it.
        payload: what the strategy saved (states, optimizer states, its own counters).
        nbytes: the size of its file, and of its shards' files.
        shards: the folder of a sharded run's files, each replica's shards as
            torch.distributed.checkpoint wrote them (``payload["shards"]["files"]`` lists them
            with their sizes and digests); ``None`` for a checkpoint whole in its file.
    """

    seq: int
    position: dict[str, Any]
    payload: dict[str, Any]
    nbytes: int
    shards: Path | None = None

    def shard(self, name: str, verify: bool = False) -> bytes:
        """The bytes of its shards' file ``name``; hashed again with ``verify`` (the store's
        :meth:`~CheckpointStore.latest` and :meth:`~CheckpointStore.read` check every file's
        digest, unless told not to, before they give a checkpoint).

        Raises:
            OSError: it has no such file.
            ValueError: the file is no longer the size (or, with ``verify``, the digest) its
                checkpoint lists.
        """
        path, listed = self._shard(name)
        data = path.read_bytes()
        if len(data) != listed["bytes"]:
            raise ValueError(f"checkpoint {self.seq}'s shards' file {name} is torn")
        if verify and hashlib.sha256(data).hexdigest() != listed["sha256"]:
            raise ValueError(f"checkpoint {self.seq}'s shards' file {name} is damaged")
        return data

    def shard_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of its shards' file ``name`` (fewer where it
        ends); not hashed (the one who joins them checks the digest the checkpoint lists).

        Raises:
            OSError: it has no such file.
            ValueError: the file is no longer the size its checkpoint lists.
        """
        path, listed = self._shard(name)
        with path.open("rb") as file:
            if os.fstat(file.fileno()).st_size != listed["bytes"]:
                raise ValueError(f"checkpoint {self.seq}'s shards' file {name} is torn")
            return os.pread(file.fileno(), length, offset)

    def _shard(self, name: str) -> tuple[Path, dict[str, Any]]:
        """Where its shards' file ``name`` lies, and what the checkpoint lists of it.

        Raises:
            FileNotFoundError: it has no such file.
        """
        listed = self.payload.get("shards", {}).get("files", {})
        if self.shards is None or name not in listed:
            raise FileNotFoundError(f"checkpoint {self.seq} has no shards' file {name!r}")
        return self.shards / name, listed[name]


class CheckpointStore:
    """The checkpoints of every job, one directory each.

    Args:
        directory: ``<state_dir>/checkpoints`` (made ``0700``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.staging = DirectStaging()  # checkpoints are written around the page cache
        private_directory(directory)

    def _job_dir(self, job_id: str) -> Path:
        return job_path(self.directory, job_id)

    def folder(self, job_id: str) -> Path:
        """Where the job's checkpoints are (it may not exist)."""
        return self._job_dir(job_id)

    def shards_writer(self, job_id: str) -> ShardsWriter:
        """Where the job's next checkpoint's shards' files are written, one at a time, before
        :meth:`write` lists them (its folder made afresh).

        Raises:
            OSError: the folder could not be made.
        """
        folder = self._job_dir(job_id)
        folder.mkdir(mode=0o700, exist_ok=True)
        seq = max(self._seqs(folder), default=0) + 1
        return ShardsWriter(seq, folder / f"{seq:08d}{SHARDS_SUFFIX}", self.staging)

    def write(
        self,
        job_id: str,
        position: dict[str, Any],
        payload: dict[str, Any],
        keep: int,
        shards: ShardsWriter | None = None,
    ) -> Checkpoint:
        """Write the job's next checkpoint atomically and keep only its last ``keep``.
        ``shards`` (a sharded run's files, written already by :meth:`shards_writer`'s writer)
        are listed in the checkpoint's file with their digests: the checkpoint counts once
        that file is whole. Where ``keep`` is 2 or more, a whole checkpoint is written over the
        file of the oldest one it retires (:class:`~coordinator.storage.disk.AtomicFile`'s
        ``reuse``): the ``keep - 1`` newest stand while it is written.

        Raises:
            OSError: it could not be written (the disk full, say); the ones before stand, but
                for the oldest where it was due to go.
        """
        folder = self._job_dir(job_id)
        folder.mkdir(mode=0o700, exist_ok=True)
        seqs = sorted(self._seqs(folder))
        seq = max(seqs, default=0) + 1
        retired = [*seqs, seq][:-keep] if keep > 0 else []
        whole = keep > 1 and shards is None  # the keep - 1 newest stand while it is written
        reuse = folder / f"{retired[0]:08d}{SUFFIX}" if retired and whole else None
        written = 0
        if shards is not None:
            if shards.seq != seq:
                raise OSError(f"shards written for checkpoint {shards.seq}, not {seq}")
            written = sum(int(said["bytes"]) for said in shards.listed.values())
            payload = payload | {"shards": payload.get("shards", {}) | {"files": shards.listed}}
        parts = encode({"position": position, "payload": payload})
        path = folder / f"{seq:08d}{SUFFIX}"
        nbytes = write_atomically(path, [*parts, _trailer(parts)], reuse, self.staging)
        for old in retired:  # (the one written over is gone already; its shards' folder not)
            _remove(folder, old)
        where = shards.folder if shards is not None else None
        return Checkpoint(seq, position, payload, nbytes + written, where)

    def latest(self, job_id: str) -> Checkpoint | None:
        """The job's newest checkpoint that reads back whole (a damaged one is skipped, and
        said in the log); ``None`` when it has none."""
        folder = self._job_dir(job_id)
        for seq in sorted(self._seqs(folder), reverse=True):
            path = folder / f"{seq:08d}{SUFFIX}"
            try:
                return _read(path, seq, verify=True)
            except (OSError, FrameError, ValueError) as exc:
                log.warning("job %s: checkpoint %s is not usable: %s", job_id, path.name, exc)
        return None

    def read(self, job_id: str, seq: int, verify: bool = True) -> Checkpoint:
        """The job's checkpoint number ``seq``; without ``verify`` its shards' files are
        checked for their sizes alone (each one read later is checked then:
        :meth:`Checkpoint.shard`).

        Raises:
            OSError: there is no such checkpoint.
            ValueError, protocol.errors.FrameError: it is torn or damaged.
        """
        return _read(self._job_dir(job_id) / f"{seq:08d}{SUFFIX}", seq, verify=verify)

    def positions(self, job_id: str) -> list[tuple[int, dict[str, Any]]]:
        """``(seq, position)`` of each of the job's checkpoints that reads back, oldest first."""
        folder = self._job_dir(job_id)
        found = []
        for seq in sorted(self._seqs(folder)):
            with contextlib.suppress(OSError, FrameError, ValueError):
                found.append((seq, _read(folder / f"{seq:08d}{SUFFIX}", seq).position))
        return found

    def drop(self, job_id: str) -> None:
        """Remove every checkpoint of the job."""
        shutil.rmtree(self._job_dir(job_id), ignore_errors=True)

    def has(self, job_id: str) -> bool:
        """Whether the job has any checkpoint file (not read: one may be damaged)."""
        return bool(self._seqs(self._job_dir(job_id)))

    def sharded(self, job_id: str) -> bool:
        """Whether the job's newest checkpoint holds a sharded run's shards (not read)."""
        folder = self._job_dir(job_id)
        seqs = self._seqs(folder)
        return bool(seqs) and (folder / f"{max(seqs):08d}{SHARDS_SUFFIX}").is_dir()

    def keep_newest(self, job_id: str) -> None:
        """Remove every checkpoint of the job but its newest."""
        folder = self._job_dir(job_id)
        for old in sorted(self._seqs(folder))[:-1]:
            _remove(folder, old)

    @staticmethod
    def _seqs(folder: Path) -> list[int]:
        if not folder.is_dir():
            return []
        return [int(p.stem) for p in folder.glob(f"*{SUFFIX}") if p.stem.isdigit()]


def _read(path: Path, seq: int, verify: bool = False) -> Checkpoint:
    """The checkpoint in ``path``, its shards' files (if any) each there and of its size;
    with ``verify``, of its digest too (every byte read)."""
    raw = read_whole(path)
    data = decode(_body(raw))
    if not isinstance(data, dict) or not {"position", "payload"} <= set(data):
        raise ValueError("it does not hold a position and a payload")
    payload = dict(data["payload"])
    if "shards" not in payload:
        return Checkpoint(seq, dict(data["position"]), payload, len(raw))
    shards = path.with_suffix(SHARDS_SUFFIX)
    listed = payload["shards"]["files"]
    for name, said in listed.items():
        if (shards / name).stat().st_size != said["bytes"]:
            raise ValueError(f"its shards' file {name} is torn")
        if verify:
            digest = hashlib.sha256()
            with (shards / name).open("rb") as file:
                while block := file.read(1 << 22):
                    digest.update(block)
            if digest.hexdigest() != said["sha256"]:
                raise ValueError(f"its shards' file {name} is damaged")
    nbytes = len(raw) + sum(int(said["bytes"]) for said in listed.values())
    return Checkpoint(seq, dict(data["position"]), payload, nbytes, shards)


class ShardsWriter:
    """A sharded checkpoint's files being written into its folder (made afresh: one left by a
    write that never finished goes), each whole or not at all, and what the checkpoint lists
    of them (``listed``: size and digest by name), around the page cache through ``staging``'s
    buffers where it is given. Its I/O blocks.

    Raises:
        OSError: the folder could not be made.
    """

    def __init__(self, seq: int, folder: Path, staging: DirectStaging | None = None) -> None:
        self.seq = seq
        self.folder = folder
        self.staging = staging
        self.listed: dict[str, Any] = {}
        self._open: list[ShardFileWriter] = []
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)

    def open(self, name: str) -> ShardFileWriter:
        """File ``name`` of the shards, to be written.

        Raises:
            OSError: ``name`` is not a plain file name, is written already, or cannot be made.
        """
        if not is_plain_file_name(name) or name in self.listed:
            raise OSError(f"{name!r} is not a shards' file name, or not a new one")
        file = ShardFileWriter(name, AtomicFile(self.folder / name, staging=self.staging))
        self._open.append(file)
        return file

    def close(self, file: ShardFileWriter) -> None:
        """``file`` whole and listed.

        Raises:
            OSError: it could not be made so.
        """
        self._open.remove(file)
        nbytes = file.file.commit()
        self.listed[file.name] = {"bytes": nbytes, "sha256": file.digest.hexdigest()}

    def abandon(self) -> None:
        """Give the checkpoint's files up: the folder gone."""
        for file in self._open:
            file.file.abandon()
        self._open.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class ShardFileWriter:
    """One file of a sharded checkpoint being written, and its digest so far."""

    name: str
    file: AtomicFile
    digest: Any = field(default_factory=hashlib.sha256)

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        """Append ``piece``.

        Raises:
            OSError: it could not be written.
        """
        self.file.write(piece)
        self.digest.update(piece)


def _remove(folder: Path, seq: int) -> None:
    """Checkpoint ``seq``'s file and its shards' folder gone."""
    (folder / f"{seq:08d}{SUFFIX}").unlink(missing_ok=True)
    shutil.rmtree(folder / f"{seq:08d}{SHARDS_SUFFIX}", ignore_errors=True)


@dataclass
class JobCheckpoints:
    """One running job's checkpoints (see the module docstring).

    Attributes:
        job_id: the job.
        store: where they are written.
        keep: how many are kept.
        emit: the job's event callback.
        resume: what the run starts from (``None``: the beginning).
        source: the job ``resume`` is a checkpoint of: this one, or the one it continues.
        piece_bytes: the most of a sharded checkpoint's file read at once
            (:func:`~coordinator.storage.kept_files.piece_bytes`).
        whole_bytes: the most of a file left on a worker that is read whole into memory (a
            DiLoCo replica's snapshot): what one worker's reply may hold.
    """

    job_id: str
    store: CheckpointStore
    keep: int
    emit: Callable[[str, dict[str, Any]], Awaitable[None]]
    resume: Checkpoint | None = None
    source: str | None = None
    piece_bytes: int = PIECE_BYTES
    whole_bytes: int = WHOLE_BYTES
    _writing: asyncio.Task[bool] | None = field(default=None, repr=False)
    _asked: asyncio.Future[bool] | None = field(default=None, repr=False)

    def ask(self) -> asyncio.Future[bool]:
        """Ask the run for a checkpoint at its next safe point (a preemption does, before it
        stops the run): its policy finds one due (:attr:`asked`) until one is saved. The
        future says whether the next one started after this was written."""
        if self._asked is None or self._asked.done():
            self._asked = asyncio.get_running_loop().create_future()
        return self._asked

    @property
    def asked(self) -> bool:
        """Whether a checkpoint was asked for that no save has started since."""
        return self._asked is not None and not self._asked.done()

    def resumed(self) -> dict[str, Any]:
        """What the ``resumed`` event says of ``resume``: its position, its number, and the
        job it comes from when that is another (``from_job``)."""
        assert self.resume is not None
        said = self.resume.position | {"checkpoint": self.resume.seq}
        return said | ({"from_job": self.source} if self.source not in (None, self.job_id) else {})

    async def save(
        self,
        position: dict[str, Any],
        payload: Payload,
        shards: KeptFileSource | None = None,
    ) -> None:
        """Start writing a checkpoint of the run at ``position`` (once the one before is
        written), with a sharded run's ``shards``, read where they were left a piece at a
        time and released once written (or given up); ``payload`` must not change meanwhile,
        or is what a coroutine function gives when the write starts (it may read what the
        replicas left on their workers)."""
        await self.flush()
        answers, self._asked = (self._asked, None) if self.asked else (None, self._asked)
        self._writing = asyncio.create_task(self._write(position, payload, shards, answers))

    async def flush(self) -> bool | None:
        """Wait for the checkpoint being written, if any; whether it was written."""
        task, self._writing = self._writing, None
        return None if task is None else await task

    async def _write(
        self,
        position: dict[str, Any],
        payload: Payload,
        shards: KeptFileSource | None,
        answers: asyncio.Future[bool] | None = None,
    ) -> bool:
        written = await self._written(position, payload, shards)
        if answers is not None and not answers.done():
            answers.set_result(written)
        return written

    async def _written(
        self,
        position: dict[str, Any],
        payload: Payload,
        shards: KeptFileSource | None,
    ) -> bool:
        began = time.perf_counter()
        try:
            if callable(payload):
                payload = await payload()
            written = None if shards is None else await self._fetch(shards)
            saved = await asyncio.to_thread(
                self.store.write, self.job_id, position, payload, self.keep, written
            )
        except (OSError, FrameError, WorkerCallError, StrategyFailed) as exc:
            log.warning("job %s: the checkpoint at %s failed: %s", self.job_id, position, exc)
            await self.emit("checkpoint_failed", position | {"error": f"{exc}"})
            return False
        finally:
            if shards is not None:
                await shards.release()
        seconds = time.perf_counter() - began
        await self.emit(
            "checkpoint",
            position | {"seq": saved.seq, "bytes": saved.nbytes, "seconds": round(seconds, 4)},
        )
        return True

    async def _fetch(self, shards: KeptFileSource) -> ShardsWriter:
        """``shards``' files written to the store, each read in pieces of at most
        :attr:`piece_bytes`, each written as the next is read.

        Raises:
            OSError: one could not be written, or ended short of its size.
            WorkerCallError: one could not be read.
        """
        writer = await asyncio.to_thread(self.store.shards_writer, self.job_id)
        try:
            for name in shards.sizes():
                file = await asyncio.to_thread(writer.open, name)
                await fetch(shards, name, file.write, self.piece_bytes)
                await asyncio.to_thread(writer.close, file)
        except BaseException:
            await asyncio.to_thread(writer.abandon)
            raise
        return writer


@dataclass
class CheckpointPolicy:
    """When a run saves a checkpoint.

    ``every`` steps (or rounds) if it is set; ``0``: never; ``None``: at the end of every epoch
    (``per_epoch`` steps; a federated round is an epoch of one step) or once ``seconds`` of
    training have passed since the last one, whichever comes first. And whenever one is
    ``asked`` for (unless never): a preemption asks before it stops the run. And at the end of
    the run (unless never): the model's optimizer state is kept with its result, so that a job
    can be continued exactly (``resume_from``). ``clock`` gives seconds.
    """

    every: int | None
    per_epoch: int
    clock: Callable[[], float]
    seconds: float = DEFAULT_CHECKPOINT_SECONDS
    asked: Callable[[], bool] = lambda: False  # one was asked for (:meth:`JobCheckpoints.ask`)
    _since: float | None = None

    @classmethod
    def of(
        cls, every: int | None, per_epoch: int, checkpoints: JobCheckpoints | None
    ) -> CheckpointPolicy:
        """The policy of a run saving to ``checkpoints``, on the monotonic clock, that finds
        a checkpoint due as soon as one is asked for."""
        asked = (lambda: checkpoints.asked) if checkpoints is not None else (lambda: False)
        return cls(every, per_epoch, time.monotonic, asked=asked)

    def start(self) -> None:
        """Training (re)starts now: the time since the last checkpoint counts from here."""
        self._since = self.clock()

    def due(self, done: int, total: int) -> bool:
        """Whether to save after ``done`` steps of ``total`` (always after the last, unless
        never)."""
        if self.every == 0:
            return False
        if done >= total or self.asked():
            return True
        if self.every is not None:
            return done % self.every == 0
        if self.per_epoch and done % self.per_epoch == 0:
            return True
        return self._since is not None and self.clock() - self._since >= self.seconds

    def saved(self) -> None:
        """A checkpoint was just saved."""
        self._since = self.clock()

    def next_due(self, done: int, total: int) -> int:
        """The step after ``done`` at which a checkpoint falls due by count (``total`` when
        none does): where a run that trains in chunks stops one."""
        step = total
        if self.every:
            step = min(step, (done // self.every + 1) * self.every)
        elif self.every is None and self.per_epoch:
            step = min(step, (done // self.per_epoch + 1) * self.per_epoch)
        return step


@dataclass
class RunCheckpoints:
    """What every run's checkpoints share, whatever a run saves: the job's checkpoints
    (``None``: it keeps none, and nothing is ever due) and when one is due. A strategy's own
    (:class:`~coordinator.strategies.data_parallel.checkpoints.ReplicaCheckpoints`,
    :class:`~coordinator.strategies.model_parallel.checkpoints.StageCheckpoints`,
    :class:`~coordinator.strategies.rounds.RoundCheckpoints`) says what goes in one."""

    checkpoints: JobCheckpoints | None
    policy: CheckpointPolicy

    def start(self) -> None:
        """Training starts (or goes on, resumed) now."""
        self.policy.start()

    def stop_at(self, done: int, total: int) -> int:
        """The step a chunk of training that starts after ``done`` should end at, at most: the
        next a checkpoint falls due at by count."""
        if self.checkpoints is None:
            return total
        return self.policy.next_due(done, total)

    def due(self, done: int, total: int) -> bool:
        """Whether a checkpoint falls due after step (round) ``done`` of ``total``."""
        return self.checkpoints is not None and self.policy.due(done, total)

    async def flush(self) -> None:
        """Wait for the last checkpoint's write (before the run returns)."""
        if self.checkpoints is not None:
            await self.checkpoints.flush()
