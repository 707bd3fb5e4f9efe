"""Files a run's replicas left on their workers' disks, read into the coordinator a piece at a
time: a sharded checkpoint's (DCP's files of each replica's shards) and a sharded result's
(each replica's pieces of the model).

A replica's share of a sharded model may be larger than any message the coordinator takes
(``--max-message-bytes``), and all of them together larger than its memory. So a call that
produces such files asks its worker to keep them
(:meth:`~coordinator.context.StrategyContext.call_keeping`), and the coordinator reads each
(:class:`KeptFileSource`) in pieces of at most ``piece_bytes``, each handed on (written to the
store's file) as the next is read (:func:`fetch`): never more than two pieces of one file in
its memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "MIN_PIECE_BYTES",
    "PIECE_BYTES",
    "WHOLE_BYTES",
    "KeptFileSource",
    "fetch",
    "piece_bytes",
]

PIECE_BYTES = 16 << 20
"""The most of a file left on a worker one read asks for (two are in memory at most)."""
MIN_PIECE_BYTES = 64 << 10
WHOLE_BYTES = 1 << 30
"""The most of a file left on a worker the coordinator reads whole into memory, where it is not
told otherwise (it is: a worker's share of the replies' reassembly pool,
:class:`~coordinator.server.reassembly_shares.ReassemblyShares`)."""


def piece_bytes(room: int) -> int:
    """How much of a file left on a worker a coordinator whose workers' replies may hold
    ``room`` bytes together (``--max-reassembly-bytes``) asks for at once: a quarter of that
    room (two are read at once: half of it), the rest left to the replies of its jobs, and at
    most :data:`PIECE_BYTES`."""
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, room // 4))


class KeptFileSource(Protocol):
    """Files a call left on a worker's disk (or on several: a sharded checkpoint's), read a
    piece at a time."""

    def sizes(self) -> dict[str, int]:
        """Every file's size, by name."""
        ...

    async def read(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of file ``name``.

        Raises:
            WorkerCallError: its worker could not give them.
        """
        ...

    async def release(self) -> None:
        """The files are no longer needed where they were left (never raises)."""
        ...


async def fetch(
    files: KeptFileSource, name: str, write: Callable[[bytes], object], piece_bytes: int
) -> int:
    """File ``name`` of ``files`` read in pieces of at most ``piece_bytes``, each passed to
    ``write`` (called in a thread: it may block on disk) in order, the next piece asked for
    while one is written (two in memory at most); the bytes read.

    Raises:
        OSError: the file ended short of its size (or a piece was longer than asked for), or
            ``write`` raised it.
        WorkerCallError: a piece could not be read.
    """
    size = files.sizes()[name]

    def ask(offset: int) -> tuple[int, asyncio.Future[bytes]]:
        asked = min(piece_bytes, size - offset)
        return asked, asyncio.ensure_future(files.read(name, offset, asked))

    offset = 0
    pending = ask(offset) if size else None
    try:
        while pending is not None:
            asked, reading = pending
            piece = await reading
            if not piece or len(piece) > asked:
                raise OSError(
                    f"the file {name} left on a worker gave {len(piece)} bytes at {offset} of "
                    f"its {size}, asked for {asked}"
                )
            offset += len(piece)
            pending = ask(offset) if offset < size else None
            await asyncio.to_thread(write, piece)
    finally:
        if pending is not None:  # given up: the piece asked for is not wanted
            reading = pending[1]
            if not reading.done():
                reading.cancel()
            elif not reading.cancelled():
                reading.exception()  # (what it met, if anything, matters no more)
    return offset
