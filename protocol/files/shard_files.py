"""The files of a sharded checkpoint as they travel: what may name one, and DCP's index file.

A sharded run's replicas write their shards with torch.distributed.checkpoint; the files go
from each replica to the coordinator's store, from the store back to the replicas that resume,
and to a client that asks for the result. Each hop takes a name from the other end, so each
refuses one that is not a plain file name before it writes anything.

A DiLoCo replica on the torch group leaves its checkpoint's part on its worker the same way, as
one file (:data:`SNAPSHOT_FILE`), which the coordinator reads while the next chunk trains.
"""

from __future__ import annotations

from pathlib import PurePath

__all__ = ["METADATA", "SNAPSHOT_FILE", "is_plain_file_name"]

METADATA = ".metadata"
"""torch.distributed.checkpoint's file that says where each shard lies (replica 0 writes it);
every reader of the shards needs it."""
SNAPSHOT_FILE = "snapshot.frame"
"""A DiLoCo replica's part of a checkpoint, left on its worker: the :mod:`protocol.codec` frame
of what its chunk's reply would have held (:class:`protocol.daemon.DistTrainRequest`'s
``keep``)."""


def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` names a file in a folder and nothing else (no path, not ``.`` or
    ``..``, not empty)."""
    return name not in ("", ".", "..") and PurePath(name).name == name and "\\" not in name
