"""The cyclic garbage collector of a coordinator that holds thousands of connections.

CPython (3.11) collects its oldest generation once the objects that survived into it since the
last full collection outnumber a quarter of those already there, and a full collection walks
every tracked object with the GIL held. A coordinator with 10,000 agents holds a few million
long-lived objects (connections, channels, their tasks), and a FedAvg round makes hundreds of
thousands more that live for seconds: full collections then come every few seconds and each
takes 0.7-1 s, during which no socket is read. Measured with ``python -m benchmarks.fleet
--agents 10000 --state-bytes 100000 --heartbeat 10``: the heartbeat path's worst latency was
1 s with the fleet idle and 1.5 s during a round.

So :func:`tend` freezes what is alive every :data:`FREEZE_EVERY` seconds (``gc.freeze``: every
tracked object moves to the permanent generation, which no collection walks; it costs nothing
but a list splice), and every :data:`COLLECT_EVERY` seconds unfreezes it and runs one full
collection, which takes the reference cycles that became garbage meanwhile: the only long
pause left, at a known rate. Objects freed by reference counting (nearly all) are freed as
ever, frozen or not; only garbage in reference cycles waits, at most :data:`COLLECT_EVERY`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from enum import Enum

__all__ = ["COLLECT_EVERY", "FREEZE_EVERY", "Chore", "GcTimetable", "tend"]

log = logging.getLogger(__name__)

FREEZE_EVERY = 1.0
"""Seconds between two freezes of what is alive."""
COLLECT_EVERY = 600.0
"""Seconds between two full collections (each unfreezes everything first)."""


class Chore(Enum):
    """What the garbage collector is made to do at one tick."""

    FREEZE = "freeze"
    COLLECT = "collect"


class GcTimetable:
    """The garbage collector's timetable: which chore is due at ``now``, a full collection
    every ``collect_every`` seconds, a freeze at every other call (the caller calls every
    ``freeze_every`` seconds)."""

    def __init__(self, collect_every: float, now: float) -> None:
        if collect_every <= 0:
            raise ValueError("collect_every must be positive")
        self.collect_every = collect_every
        self._next_collect = now + collect_every

    def due(self, now: float) -> Chore:
        if now >= self._next_collect:
            self._next_collect = now + self.collect_every
            return Chore.COLLECT
        return Chore.FREEZE


def do(chore: Chore) -> None:
    """Carry ``chore`` out on this thread (the loop's: a collection holds the GIL anyway)."""
    if chore is Chore.COLLECT:
        gc.unfreeze()
        started = time.perf_counter()
        found = gc.collect()
        log.debug("full collection: %d unreachable, %.3f s", found, time.perf_counter() - started)
    gc.freeze()


async def tend(
    freeze_every: float = FREEZE_EVERY,
    collect_every: float = COLLECT_EVERY,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Freeze and collect on :class:`GcTimetable`, until cancelled."""
    timetable = GcTimetable(collect_every, clock())
    while True:
        await asyncio.sleep(freeze_every)
        do(timetable.due(clock()))
