"""worker.link's watch on the coordinator's link: a ping unanswered for the heartbeat timeout
gives the link up, unless the link is still taking what the agent sends (a large reply going
out, which the ping and its pong wait behind)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.utils import UNIT
from worker.errors import LinkDead
from worker.link import _watch_link


class _Unanswered:
    """A connection whose pings are never answered (their pongs wait behind what is queued)."""

    def __init__(self) -> None:
        self.pings = 0

    async def ping(self) -> asyncio.Future[float]:
        self.pings += 1
        return asyncio.get_running_loop().create_future()


class _Sending:
    """What the watch reads of the channel: when its transport last took a chunk."""

    def __init__(self) -> None:
        self.chunk_sent_at = time.monotonic()


def test_the_link_lives_while_chunks_go_out_and_is_given_up_once_they_stop():
    timeout = 0.3 * UNIT

    async def main() -> tuple[float, float, int]:
        ws, channel = _Unanswered(), _Sending()
        began = time.monotonic()
        watch = asyncio.ensure_future(_watch_link(ws, channel, 0.05, timeout, "ws://c"))
        for _ in range(12):  # a reply going out a chunk at a time, for 4 timeouts
            await asyncio.sleep(timeout / 3)
            assert not watch.done(), "given up while the link was taking the reply"
            channel.chunk_sent_at = time.monotonic()
        stopped = time.monotonic()  # nothing more goes out
        with pytest.raises(LinkDead, match=r"answered no ping for .* \(timeout"):
            await asyncio.wait_for(watch, 10 * timeout)
        return stopped - began, time.monotonic() - stopped, ws.pings

    streamed, after, pings = asyncio.run(main())
    assert streamed >= 4 * timeout and pings > 10
    assert timeout <= after < timeout + 1.0 * UNIT
