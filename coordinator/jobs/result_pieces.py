"""A sharded run's result as its replicas held it: each replica's pieces of the model, one file
a replica, which the client reads a piece at a time and joins (:mod:`protocol.files.shard_pieces`).

A DataParallel run sharded by FSDP2 ends with every replica's rows of each parameter
(:class:`~coordinator.strategies.base.ShardedStates`). The job has each replica in turn leave
its pieces on its worker's disk, one codec frame, and reads that file a piece at a time
(:mod:`coordinator.storage.kept_files`) into
``<state_dir>/results/<job id>/<replica>.pieces`` (written atomically, ``0600`` in ``0700``
directories), checks it stacks onto replica 0's (its outline, read over a memory map: no
tensor of it in memory, :func:`~protocol.codec.decode`) and has the worker drop it before the
next replica's is read (:func:`kept`); the job's result row in the store is then of kind
``pieces``: a small frame of the replicas' count, the plain filters' states and the nodes,
written once every file is. So no SQLite value, no message and no memory bounds a sharded
model's size: the coordinator holds two pieces of one replica's file at most, and gives the
client each file in pieces too (:func:`answer`). A job manager without a state
directory (in tests) keeps the files in the frame itself.

The files are kept as long as the job's record (results are never dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from coordinator.errors import StrategyFailed
from coordinator.storage.disk import (
    AtomicFile,
    job_path,
    private_directory,
    read_whole,
)
from coordinator.storage.kept_files import KeptFileSource, fetch
from coordinator.strategies.base import ShardedStates
from protocol.codec import decode
from protocol.errors import ErrorCode, FrameError, PiecesMismatch
from protocol.files.shard_pieces import PIECES_FILE, Layout
from protocol.messages import MAX_READ_BYTES

__all__ = ["ResultPieces", "answer", "kept"]

SUFFIX = ".pieces"


async def kept(
    states: ShardedStates, files: ResultPieces | None, job_id: str, piece_bytes: int
) -> dict[str, Any]:
    """Have each replica in turn leave its pieces on its worker, read them there
    ``piece_bytes`` at a time into their file (without ``files``: into the frame), check they
    stack onto replica 0's (:class:`~protocol.files.shard_pieces.Layout`) and release them before
    the next replica's are read; what the store's row of kind ``pieces`` then holds: the
    replicas' count, the plain filters' states, the nodes (and the pieces' frames, kept in
    it).

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: the replicas' pieces are not of one model.
        OSError: a file could not be written, or a replica's ended short.
        coordinator.context.WorkerCallError: a replica could not be read.
    """
    first: Layout | None = None
    inline: list[bytes] = []
    for replica in range(states.replicas):
        source = await states.keep(replica)
        try:
            if files is None:
                frame = bytearray()
                await fetch(source, PIECES_FILE, frame.extend, piece_bytes)
                outlined = partial(decode, frame, outline=True)
                layout = await asyncio.to_thread(_layout, replica, outlined)
                inline.append(bytes(frame))
            else:
                await _fetch_into(files, job_id, replica, source, piece_bytes)
                layout = await asyncio.to_thread(files.layout, job_id, replica)
        finally:
            await source.release()
        first = first or layout
        try:
            first.fits(layout, replica)
        except PiecesMismatch as exc:
            raise StrategyFailed(
                ErrorCode.STATE_MISMATCH, f"the sharded model's pieces: {exc}"
            ) from exc
    said: dict[str, Any] = {
        "replicas": states.replicas,
        "plain": states.plain,
        "node_ids": states.node_ids,
    }
    return said | ({"pieces": inline} if files is None else {})


async def _fetch_into(
    files: ResultPieces, job_id: str, replica: int, source: KeptFileSource, piece_bytes: int
) -> None:
    """Replica ``replica``'s file read from ``source`` into its own, whole or not at all."""
    file = await asyncio.to_thread(files.writer, job_id, replica)
    try:
        await fetch(source, PIECES_FILE, file.write, piece_bytes)
        await asyncio.to_thread(file.commit)
    except BaseException:
        await asyncio.to_thread(file.abandon)
        raise


def _layout(replica: int, pieces: Callable[[], Any]) -> Layout:
    """The layout of replica ``replica``'s ``pieces()`` (decoded from its frame).

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: they are not a frame of pieces.
    """
    try:
        return Layout.of(pieces())
    except (FrameError, PiecesMismatch, KeyError, TypeError) as exc:
        raise StrategyFailed(
            ErrorCode.STATE_MISMATCH, f"replica {replica}'s pieces of the sharded model: {exc}"
        ) from exc


def answer(
    said: dict[str, Any],
    replica: int | None,
    files: ResultPieces | None,
    job_id: str,
    offset: int | None = None,
    length: int = MAX_READ_BYTES,
) -> dict[str, Any]:
    """What ``get_result`` answers of a row of kind ``pieces`` (:func:`kept`'s ``said``):
    with ``replica`` ``None``, ``{"pieces": {"replicas", "plain", "node_ids", "sizes"}}``
    (``sizes``: each replica's file's bytes); with ``offset``, ``{"replica", "offset",
    "data"}``: bytes ``[offset, offset + length)`` of that replica's file (fewer where it
    ends), which the client asks for in turn and decodes once it has them all; else
    ``{"replica", "pieces"}``: that replica's pieces whole, in one message.

    Raises:
        IndexError: no such replica.
        OSError: its file is gone or cannot be read.
        FrameError: it is not a frame (read whole).
    """
    count = int(said["replicas"])
    if replica is None:
        sizes = [_size(said, r, files, job_id) for r in range(count)]
        listed = {k: said[k] for k in ("replicas", "plain", "node_ids")}
        return {"pieces": listed | {"sizes": sizes}}
    if not 0 <= replica < count:
        raise IndexError(f"the result has the pieces of {count} replicas, not {replica}")
    if offset is not None:
        if "pieces" in said:
            data = said["pieces"][replica][offset : offset + length]
        else:
            data = _files(files, job_id).read_range(job_id, replica, offset, length)
        return {"replica": replica, "offset": offset, "data": data}
    if "pieces" in said:
        return {
            "replica": replica,
            "pieces": decode(bytearray(said["pieces"][replica]), relay=True),
        }
    return {"replica": replica, "pieces": _files(files, job_id).read(job_id, replica)}


def _size(said: dict[str, Any], replica: int, files: ResultPieces | None, job_id: str) -> int:
    if "pieces" in said:
        return len(said["pieces"][replica])
    return _files(files, job_id).size(job_id, replica)


def _files(files: ResultPieces | None, job_id: str) -> ResultPieces:
    if files is None:
        raise FileNotFoundError(f"job {job_id}'s pieces are kept in files, and none are here")
    return files


class ResultPieces:
    """``<state_dir>/results``: each sharded job's pieces, one file a replica.

    Every method blocks on file I/O: callers run them in a thread.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_directory(directory)

    def _folder(self, job_id: str) -> Path:
        return job_path(self.directory, job_id)

    def folder(self, job_id: str) -> Path:
        """Where the job's result's pieces are (it may not exist)."""
        return self._folder(job_id)

    def drop(self, job_id: str) -> None:
        """Remove the job's result's pieces."""
        shutil.rmtree(self._folder(job_id), ignore_errors=True)

    def _path(self, job_id: str, replica: int) -> Path:
        return self._folder(job_id) / f"{replica}{SUFFIX}"

    def writer(self, job_id: str, replica: int) -> AtomicFile:
        """Replica ``replica``'s file, to be written in pieces and committed (whole or not at
        all).

        Raises:
            OSError: it could not be made (those written before stay, unreferenced).
        """
        private_directory(self._folder(job_id))
        return AtomicFile(self._path(job_id, replica))

    def layout(self, job_id: str, replica: int) -> Layout:
        """What must agree of replica ``replica``'s pieces with the others' (their frame's
        outline over a memory map: none of its tensors read).

        Raises:
            OSError: the file is gone or cannot be read.
            StrategyFailed: ``STATE_MISMATCH``: it is not a frame of pieces.
        """
        with self._path(job_id, replica).open("rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _layout(replica, partial(decode, memoryview(mapped), outline=True))
        finally:
            with contextlib.suppress(BufferError):  # a view still held: unmapped when freed
                mapped.close()

    def size(self, job_id: str, replica: int) -> int:
        """The bytes of replica ``replica``'s file.

        Raises:
            OSError: it is gone.
        """
        return self._path(job_id, replica).stat().st_size

    def read_range(self, job_id: str, replica: int, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of replica ``replica``'s file (fewer where it
        ends).

        Raises:
            OSError: it is gone or cannot be read.
        """
        with self._path(job_id, replica).open("rb") as file:
            return os.pread(file.fileno(), length, offset)

    def read(self, job_id: str, replica: int) -> Any:
        """Replica ``replica``'s pieces, decoded whole (their tensors relayed: sent on as they
        are).

        Raises:
            OSError: the file is gone or cannot be read.
            FrameError: it is not a frame.
        """
        return decode(read_whole(self._path(job_id, replica)), relay=True)
