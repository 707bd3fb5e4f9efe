"""The files of a sharded checkpoint a replica is sent, kept until its shards load them
(:meth:`engine.data_parallel.modes.sharded.ShardedMode.load_shards`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from engine.errors import EngineError
from protocol.errors import ErrorCode
from protocol.files.shard_files import is_plain_file_name

__all__ = ["ShardFiles"]


class ShardFiles:
    """The files of a sharded checkpoint that ``dist_shard_file`` gives a replica, kept until
    ``dist_load_shards`` takes them (:meth:`take`) or its group is left (:meth:`drop`)."""

    def __init__(self) -> None:
        self.folder: tempfile.TemporaryDirectory[str] | None = None

    def add(self, name: str, data: bytes, offset: int = 0) -> None:
        """Keep a piece of one file of a sharded checkpoint, ``data`` at ``offset``: the
        coordinator sends them one at a time, this replica's own shards and the ``.metadata``,
        each in pieces in order (the first, at ``0``, starts the file afresh; each next one
        goes on where the last ended).

        Raises:
            EngineError: ``BAD_REQUEST`` for a name that is not a plain file name, or a piece
                that does not go on where the file ends.
        """
        if not is_plain_file_name(name):
            raise EngineError(ErrorCode.BAD_REQUEST, f"{name!r} is not a checkpoint file's name")
        if self.folder is None:
            self.folder = tempfile.TemporaryDirectory(prefix="somatize-shards-")
        path = Path(self.folder.name) / name
        held = path.stat().st_size if offset and path.exists() else 0
        if offset != held:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"a piece of checkpoint file {name} at {offset}, where {held} bytes of it are here",
            )
        with path.open("ab" if offset else "wb") as file:
            file.write(data)

    def take(self) -> tempfile.TemporaryDirectory[str] | None:
        """The folder of the files kept, now the taker's to clean up; none kept: ``None``."""
        folder, self.folder = self.folder, None
        return folder

    def drop(self) -> None:
        """The files never loaded go."""
        folder = self.take()
        if folder is not None:
            folder.cleanup()
