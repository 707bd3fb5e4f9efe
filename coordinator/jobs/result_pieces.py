"""A sharded run's result as its replicas held it: each replica's pieces of the model, one file
a replica, which the client joins (:mod:`protocol.shard_pieces`).

A DataParallel run sharded by FSDP2 ends with every replica's rows of each parameter
(:class:`~coordinator.strategies.base.ShardedStates`). The job's result row in the store is
then of kind ``pieces``: a small frame (:func:`pieces_frame`) of the replicas' count, the plain
filters' states and the nodes, while each replica's pieces go to
``<state_dir>/results/<job id>/<replica>.pieces`` (one :mod:`protocol.codec` frame, written
atomically, ``0600`` in ``0700`` directories) before the job is marked succeeded. So no
SQLite value bounds a sharded model's size, and neither the whole model nor its joining is
ever in the coordinator's memory. A store without a state directory (a job manager in tests)
keeps the pieces in the frame itself.

The files are kept as long as the job's record (results are never dropped).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.jobs.disk import job_path, write_atomically
from coordinator.strategies.base import ShardedStates
from protocol.codec import decode, encode

__all__ = ["ResultPieces", "pieces_frame", "pieces_of"]

SUFFIX = ".pieces"


def pieces_frame(states: ShardedStates, inline: bool) -> dict[str, Any]:
    """What the store's result row of kind ``pieces`` holds of ``states``: the replicas'
    count, the plain filters' states, the nodes; the pieces too when ``inline`` (no files)."""
    said: dict[str, Any] = {
        "replicas": len(states.pieces),
        "plain": states.plain,
        "node_ids": states.node_ids,
    }
    return said | ({"pieces": states.pieces} if inline else {})


def pieces_of(said: dict[str, Any], files: ResultPieces | None, job_id: str) -> dict[str, Any]:
    """The result a client joins from a row of kind ``pieces`` (:func:`pieces_frame`'s
    ``said``): every replica's pieces in rank order (``replicas``), ``plain``, ``node_ids``.

    Raises:
        OSError: a replica's file is gone or cannot be read.
    """
    pieces = said.get("pieces")
    if pieces is None:
        if files is None:
            raise FileNotFoundError(f"job {job_id}'s pieces are kept in files, and none are here")
        pieces = [files.read(job_id, r) for r in range(int(said["replicas"]))]
    return {"replicas": pieces, "plain": said["plain"], "node_ids": said["node_ids"]}


class ResultPieces:
    """``<state_dir>/results``: each sharded job's pieces, one file a replica.

    Every method blocks on file I/O: callers run them in a thread.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    def _folder(self, job_id: str) -> Path:
        return job_path(self.directory, job_id)

    def save(self, job_id: str, pieces: Sequence[Any]) -> int:
        """Write replica ``r``'s ``pieces[r]``, each file whole or not at all; the bytes
        written.

        Raises:
            OSError: a file could not be written (those written stay, unreferenced).
        """
        folder = self._folder(job_id)
        folder.mkdir(mode=0o700, exist_ok=True)
        return sum(
            write_atomically(folder / f"{r}{SUFFIX}", encode(piece))
            for r, piece in enumerate(pieces)
        )

    def read(self, job_id: str, replica: int) -> Any:
        """Replica ``replica``'s pieces as :meth:`save` wrote them.

        Raises:
            OSError: the file is gone or cannot be read.
        """
        with (self._folder(job_id) / f"{replica}{SUFFIX}").open("rb") as file:
            frame = bytearray(os.fstat(file.fileno()).st_size)
            file.readinto(frame)
        return decode(frame)
