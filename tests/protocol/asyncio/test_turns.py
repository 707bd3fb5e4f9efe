"""protocol.asyncio.turns: at most so many callers a turn of the loop, in order, none lost."""

from __future__ import annotations

import asyncio

import pytest

from protocol.asyncio.turns import TurnGate


def test_no_more_than_per_turn_go_through_between_two_turns_and_in_order():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = TurnGate(per_turn=10)
        turn = [0]
        entered: list[tuple[int, int]] = []  # (turn, caller)

        def tick() -> None:  # one run a turn: what the loop's look at its sockets stands for
            turn[0] += 1
            if len(entered) < 100:
                loop.call_soon(tick)

        async def caller(k: int) -> None:
            await gate.enter()  # never suspends by itself: only the gate makes it wait
            entered.append((turn[0], k))

        loop.call_soon(tick)
        await asyncio.gather(*(caller(k) for k in range(100)))
        assert [k for _, k in entered] == list(range(100))
        per_turn: dict[int, int] = {}
        for t, _ in entered:
            per_turn[t] = per_turn.get(t, 0) + 1
        assert max(per_turn.values()) == 10 and len(per_turn) >= 10

    asyncio.run(scenario())


def test_a_cancelled_waiter_takes_no_room_and_a_bad_bound_is_refused():
    async def scenario() -> None:
        gate = TurnGate(per_turn=1)
        first, cancelled, after = (asyncio.ensure_future(gate.enter()) for _ in range(3))
        await asyncio.sleep(0)  # one turn: its one caller through, the other two wait
        assert first.done() and not cancelled.done() and not after.done()
        cancelled.cancel()
        await asyncio.wait_for(after, 1)
        assert cancelled.cancelled()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="at least 1"):
        TurnGate(0)
