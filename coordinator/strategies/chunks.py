"""Chunks of training steps: how a run on a torch group is told to train, and how fast.

DataParallel's torch collective and ModelParallel's torch transport tell their workers to train
a *chunk* of steps (global batches) at a time: one call per worker per chunk, one progress
event per chunk. Chunks grow (doubling, from one step) until one takes about
:data:`CHUNK_SECONDS` (:func:`next_chunk`), so fast steps do not cost a message each and the
progress stays live. The next chunk may be sent while one trains — each worker's daemon queues
it behind the one running, so no worker waits a round trip to the coordinator between them —
and a :class:`Chunk` is one sent: where it ends, its calls settling, when it was sent, whether
its replies carry a checkpoint's snapshot. :func:`cancelled` takes one back.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

__all__ = ["CHUNK_SECONDS", "MAX_CHUNK", "Chunk", "cancelled", "next_chunk"]

CHUNK_SECONDS = 2.0
"""About how long one chunk of steps (one call, one progress event) should take. Each chunk's
end is a round trip through the coordinator in which no replica trains: on links of 20 ms round
trip, chunks of half a second cost DataParallel with PowerSGD 1.24× and DiLoCo 1.16× their
plain-torch anchors' time, two-second chunks 1.10× and 1.05× (``python -m
benchmarks.slow_links``)."""

MAX_CHUNK = 4096
"""The most steps in one chunk, however fast they are."""


@dataclass
class Chunk:
    """A chunk of steps sent to every worker: where it ends, its settling, when it was sent."""

    stop: int
    calls: asyncio.Future[dict[int, Any]]
    sent: float  # the loop's clock
    snapshot: bool = False  # its replies carry a checkpoint's snapshot


async def cancelled(chunk: Chunk | None) -> None:
    """``chunk``'s calls cancelled, if it was sent and is not over."""
    if chunk is not None and not chunk.calls.done():
        chunk.calls.cancel()
        with contextlib.suppress(BaseException):
            await chunk.calls


def next_chunk(chunk: int, ran: int, elapsed: float) -> int:
    """The next chunk's steps: doubled while a chunk is well under :data:`CHUNK_SECONDS`,
    halved when it is well over."""
    if ran < chunk:
        return chunk
    if elapsed < CHUNK_SECONDS / 2:
        return min(MAX_CHUNK, chunk * 2)
    if elapsed > CHUNK_SECONDS * 2 and chunk > 1:
        return chunk // 2
    return chunk
