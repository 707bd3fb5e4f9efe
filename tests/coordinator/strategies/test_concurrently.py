"""coordinator.strategies.base.concurrently: every call's result in order, at most
STARTS_PER_TURN starts per turn of the loop, the first failure cancelling the rest."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.strategies.base import STARTS_PER_TURN, concurrently


class Turns:
    """Counts the loop's turns: a callback that puts itself back each time it runs."""

    def __init__(self) -> None:
        self.count = 0
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._loop.call_soon(self._tick)


def test_every_result_comes_back_in_order_and_starts_are_spread_over_turns():
    n = 5 * STARTS_PER_TURN + 7

    async def main() -> None:
        turns = Turns()
        started: list[int] = []

        async def call(i: int) -> int:
            started.append(turns.count)  # the turn its first step runs in
            await asyncio.sleep(0.01)
            return i * i

        results = await concurrently(*(call(i) for i in range(n)))
        assert results == [i * i for i in range(n)]
        per_turn: dict[int, int] = {}
        for turn in started:
            per_turn[turn] = per_turn.get(turn, 0) + 1
        assert max(per_turn.values()) <= STARTS_PER_TURN
        assert len(per_turn) >= n // STARTS_PER_TURN

    asyncio.run(main())


def test_the_first_failure_cancels_the_started_calls_and_closes_the_others():
    n = 3 * STARTS_PER_TURN

    async def main() -> None:
        cancelled: list[int] = []
        ran: list[int] = []

        async def call(i: int) -> int:
            ran.append(i)
            if i == 1:
                raise ValueError("call 1 failed")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(i)
                raise
            return i

        calls = [call(i) for i in range(n)]
        with pytest.raises(ValueError, match="call 1 failed"):
            await concurrently(*calls)
        assert cancelled and 1 not in cancelled
        assert len(ran) < n  # it stopped starting calls once one had failed
        # Those it never started were closed (a coroutine never awaited would warn, an error
        # under this suite's warning filter): none is left suspended or unstarted.
        assert all(c.cr_frame is None for c in calls)

    asyncio.run(main())
