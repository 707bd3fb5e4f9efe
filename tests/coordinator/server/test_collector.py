"""coordinator.server.collector: what is alive is frozen out of the collector's walks, and a cycle
that became garbage meanwhile is taken by the next full collection, on its timetable."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from coordinator.server.collector import Chore, GcTimetable, do, tend


def test_a_full_collection_is_due_every_collect_every_seconds_and_a_freeze_otherwise():
    timetable = GcTimetable(collect_every=10.0, now=100.0)
    assert [timetable.due(t) for t in (101.0, 109.9, 110.0, 111.0, 119.9, 120.5)] == [
        Chore.FREEZE,
        Chore.FREEZE,
        Chore.COLLECT,
        Chore.FREEZE,
        Chore.FREEZE,
        Chore.COLLECT,
    ]
    with pytest.raises(ValueError, match="positive"):
        GcTimetable(collect_every=0, now=0.0)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """Two objects that refer to each other, unreachable once this returns; a weak reference
    to one of them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_frozen_cycle_survives_collections_until_the_next_full_one_takes_it():
    try:
        garbage = cycle()
        do(Chore.FREEZE)  # garbage, but frozen: no collection walks it
        gc.collect()
        assert garbage() is not None
        do(Chore.COLLECT)
        assert garbage() is None
        assert gc.get_freeze_count() > 0  # what is alive is frozen again after the collection
    finally:
        gc.unfreeze()


def test_tend_freezes_each_interval_and_collects_on_schedule():
    async def main() -> None:
        clock = [0.0]
        task = asyncio.ensure_future(tend(0.01, 5.0, clock=lambda: clock[0]))
        try:
            gc.unfreeze()
            count = gc.get_freeze_count()
            garbage = cycle()  # frozen with the rest at tend's next interval
            while gc.get_freeze_count() <= count:  # noqa: ASYNC110 - no event announces it
                await asyncio.sleep(0.01)
            gc.collect()
            assert garbage() is not None
            clock[0] = 6.0  # the full collection is due: it unfreezes and takes the cycle
            while garbage() is not None:  # noqa: ASYNC110 - no event announces it
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            gc.unfreeze()

    asyncio.run(asyncio.wait_for(main(), 10))
