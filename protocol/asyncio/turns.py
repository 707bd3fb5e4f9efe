"""At most so many heavy steps per turn of the event loop, whatever awaits suspend or not.

A coordinator that sends a model to ten thousand workers starts ten thousand sends at once. A
send that finds its socket's buffer free does not suspend, so the loop runs them all — seconds of
encoding and copying — in one turn, and no heartbeat is read meanwhile: a worker looks lost, a
probe times out. A :class:`TurnGate` lets ``per_turn`` of them through a turn and parks the
rest; each later turn (after the loop has polled its sockets) lets the next ``per_turn`` go.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["TurnGate"]


class TurnGate:
    """Admits at most ``per_turn`` callers of :meth:`enter` per turn of the running loop.

    A turn ends when the loop has run the callbacks that were ready when it began: those it
    parks resume after the loop's next look at its sockets. Order is kept: first come, first in.
    """

    def __init__(self, per_turn: int) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self._used = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._scheduled = False

    async def enter(self) -> None:
        """Return at once while this turn has room and nobody waits; else in a later turn."""
        loop = asyncio.get_running_loop()
        if not self._scheduled:  # the count starts again when this turn is over
            loop.call_soon(self._next_turn)
            self._scheduled = True
        if self._used < self.per_turn and not self._waiting:
            self._used += 1
            return
        waiter = loop.create_future()
        self._waiting.append(waiter)
        await waiter

    def _next_turn(self) -> None:
        self._scheduled = False
        self._used = 0
        while self._waiting and self._used < self.per_turn:
            waiter = self._waiting.popleft()
            if not waiter.done():  # a cancelled one takes no room
                waiter.set_result(None)
                self._used += 1
        if self._waiting or self._used:
            asyncio.get_running_loop().call_soon(self._next_turn)
            self._scheduled = True
