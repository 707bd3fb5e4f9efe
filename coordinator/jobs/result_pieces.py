"""A sharded run's result as its replicas held it: each replica's pieces of the model, one file
a replica, which the client joins (:mod:`protocol.shard_pieces`).

A DataParallel run sharded by FSDP2 ends with every replica's rows of each parameter
(:class:`~coordinator.strategies.base.ShardedStates`). The job reads them one replica at a
time (:func:`kept`), checks each stacks onto replica 0's, and writes it to
``<state_dir>/results/<job id>/<replica>.pieces`` (one :mod:`protocol.codec` frame, written
atomically, ``0600`` in ``0700`` directories) before it reads the next; the job's result row
in the store is then of kind ``pieces``: a small frame of the replicas' count, the plain
filters' states and the nodes, written once every file is. So no SQLite value bounds a
sharded model's size, and the coordinator holds one replica's share of the model at a time
while it keeps them (the whole of it again while it sends them to a client that asks). A job
manager without a state directory (in tests) keeps the pieces in the frame itself.

The files are kept as long as the job's record (results are never dropped).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coordinator.errors import StrategyFailed
from coordinator.jobs.disk import job_path, private_directory, read_whole, write_atomically
from coordinator.strategies.base import ShardedStates
from protocol.codec import decode, encode
from protocol.errors import ErrorCode, PiecesMismatch
from protocol.shard_pieces import Layout

__all__ = ["ResultPieces", "answer", "kept"]

SUFFIX = ".pieces"


async def kept(states: ShardedStates, files: ResultPieces | None, job_id: str) -> dict[str, Any]:
    """Read each replica's pieces in turn, check they stack onto replica 0's
    (:class:`~protocol.shard_pieces.Layout`) and write them to their file before the next is
    read (without ``files``: keep them, in the frame); what the store's row of kind
    ``pieces`` then holds: the replicas' count, the plain filters' states, the nodes (and
    the pieces, kept in it).

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: the replicas' pieces are not of one model.
        OSError: a file could not be written.
        coordinator.context.WorkerCallError: a replica could not be read.
    """
    first: Layout | None = None
    inline: list[dict[str, Any]] = []
    for replica in range(states.replicas):
        pieces = await states.read(replica)
        try:
            layout = Layout.of(pieces)
            first = first or layout
            first.fits(layout, replica)
        except (PiecesMismatch, KeyError, TypeError) as exc:
            raise StrategyFailed(
                ErrorCode.STATE_MISMATCH, f"the sharded model's pieces: {exc}"
            ) from exc
        if files is None:
            inline.append(pieces)
        else:
            await asyncio.to_thread(files.save, job_id, replica, pieces)
        del pieces  # (the next replica's are read once these are written)
    said: dict[str, Any] = {
        "replicas": states.replicas,
        "plain": states.plain,
        "node_ids": states.node_ids,
    }
    return said | ({"pieces": inline} if files is None else {})


def answer(
    said: dict[str, Any], replica: int | None, files: ResultPieces | None, job_id: str
) -> dict[str, Any]:
    """What ``get_result`` answers of a row of kind ``pieces`` (:func:`kept`'s ``said``):
    with ``replica`` ``None``, ``{"pieces": {"replicas", "plain", "node_ids"}}``; else
    ``{"replica", "pieces"}``: that replica's pieces, read from its file (one replica's share
    of the model in memory at a time, as the client asks for them one after another).

    Raises:
        IndexError: no such replica.
        OSError: its file is gone or cannot be read.
    """
    if replica is None:
        return {"pieces": {k: said[k] for k in ("replicas", "plain", "node_ids")}}
    if not 0 <= replica < int(said["replicas"]):
        raise IndexError(f"the result has the pieces of {said['replicas']} replicas, not {replica}")
    if "pieces" in said:
        return {"replica": replica, "pieces": said["pieces"][replica]}
    if files is None:
        raise FileNotFoundError(f"job {job_id}'s pieces are kept in files, and none are here")
    return {"replica": replica, "pieces": files.read(job_id, replica)}


class ResultPieces:
    """``<state_dir>/results``: each sharded job's pieces, one file a replica.

    Every method blocks on file I/O: callers run them in a thread.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_directory(directory)

    def _folder(self, job_id: str) -> Path:
        return job_path(self.directory, job_id)

    def save(self, job_id: str, replica: int, pieces: Any) -> int:
        """Write replica ``replica``'s ``pieces``, whole or not at all; the bytes written.

        Raises:
            OSError: the file could not be written (those written before stay, unreferenced).
        """
        folder = private_directory(self._folder(job_id))
        return write_atomically(folder / f"{replica}{SUFFIX}", encode(pieces))

    def read(self, job_id: str, replica: int) -> Any:
        """Replica ``replica``'s pieces as :meth:`save` wrote them.

        Raises:
            OSError: the file is gone or cannot be read.
        """
        return decode(read_whole(self._folder(job_id) / f"{replica}{SUFFIX}"))
