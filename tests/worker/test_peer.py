"""Pipeline tensors between two in-process agents: direct peer links and the coordinator relay.

Real sockets and real filter daemons: two :class:`~worker.agent.Agent` s serve ``/peer`` on
loopback and talk to one coordinator stand-in (:mod:`tests.worker.standin`'s, which also
records the ``deliver`` messages an agent sends it for relaying).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from protocol.asyncio.channel import Channel
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorInfo, RequestRefused
from protocol.messages import Ack, Call, Deliver, Links, PeerRoute, Result
from tests.utils import FORK_SERVER_LINGER, UNIT, Center, shared_fork_servers
from tests.worker.standin import (
    StandIn,
    drive,
    listening,
    no_process_left,
    open_job,
    presented,
)
from worker.agent import Agent, AgentConfig, Backoff
from worker.peer import CallOrder, Mailbox, MailboxDropped, OutOfOrder, PeerLinks

pytestmark = pytest.mark.integration
__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

A_TO_B = {"B": presented("A")}
"""What A presents to B (both hold the stand-in's link key)."""


class RelayStandIn(StandIn):
    """The stand-in, also taking the ``deliver`` messages agents send it to relay: each is
    acknowledged (the test relays it itself), or refused with ``refuse``."""

    def __init__(self, refuse: ErrorInfo | None = None) -> None:
        super().__init__()
        self.delivers: asyncio.Queue[Deliver] = asyncio.Queue()
        self.refuse_relay = refuse

    async def on_message(self, message: Any) -> Any:
        if isinstance(message, Deliver):
            self.delivers.put_nowait(message)
            if self.refuse_relay is not None:
                raise RequestRefused(self.refuse_relay)
            return Ack()
        return await super().on_message(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def two_agents(
    stand_in: StandIn, **options: Any
) -> AsyncIterator[tuple[Agent, Channel, Agent, Channel]]:
    """Agents A and B, each listening for peers on a loopback port of its own binding (with
    ``options`` of :class:`AgentConfig`), and their channels. (A port picked free and then
    bound by the agent could be taken meanwhile by a test in another process.)"""
    async with listening(stand_in) as url:
        agents, runs, channels = [], [], []
        try:
            for name in ("A", "B"):
                config = AgentConfig(
                    url,
                    worker_id=name,
                    threads=1,
                    spare=False,
                    peer_listen="127.0.0.1:0",  # the port it binds, announced: none raced for
                    fork_server_share=shared_fork_servers(),
                    fork_server_linger=FORK_SERVER_LINGER,
                    **options,
                )
                agent = Agent(config, backoff=Backoff(0.02 * UNIT, 0.2 * UNIT))
                agents.append(agent)
                runs.append(asyncio.ensure_future(agent.run()))
                channels.append(await stand_in.next_channel())  # one at a time: A's, then B's
            yield agents[0], channels[0], agents[1], channels[1]
        finally:
            for agent in agents:
                agent.stop()
            async with asyncio.timeout(20 * UNIT):
                await asyncio.wait(set(runs))
        for run in runs:
            run.result()
        assert all(agent.jobs == {} and len(agent.mailbox) == 0 for agent in agents)


async def request(channel: Channel, message: Any) -> Any:
    return await channel.request(message, timeout=40 * UNIT)


async def exchange(a: Channel, b: Channel, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Forward ``x`` through A's ``center`` into B's mailbox; B's ``center`` takes it."""
    state = {"mean": mean}
    sent = await request(
        a,
        Call(
            job_id="j",
            request={"cmd": "forward", "node_id": "center", "x": x, "state": state},
            output_to=PeerRoute(worker="B", key="k"),
        ),
    )
    assert isinstance(sent, Result) and sent.result["delivered"] > x.nbytes
    got = await request(
        b,
        Call(
            job_id="j",
            request={"cmd": "forward", "node_id": "center", "state": {"mean": -mean}},
            input_from="k",
        ),
    )
    assert isinstance(got, Result)
    result: torch.Tensor = got.result
    return result


def test_the_hello_announces_the_peer_address() -> None:
    stand_in = StandIn()

    async def main() -> None:
        async with two_agents(stand_in) as (a, _, b, _):
            assert a.peer_address is not None and a.peer_address.startswith("ws://127.0.0.1:")
            assert [h.peer_address for h in stand_in.hellos] == [a.peer_address, b.peer_address]

    drive(main)


def test_a_stage_output_goes_to_the_next_worker_over_a_direct_link() -> None:
    stand_in = RelayStandIn()
    x, mean = torch.randn(8, 4), torch.randn(4)

    async def main() -> None:
        async with two_agents(stand_in) as (_, a, b_agent, b):
            await open_job(a, "j", center=Center())
            await open_job(b, "j", center=Center())
            links = await request(
                a, Links(job_id="j", peers={"B": b_agent.peer_address}, credentials=A_TO_B)
            )
            assert links.result == {"direct": ["B"], "relay": []}
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "k"}))
            y = await exchange(a, b, x, mean)
            # x - mean on A, then - (-mean) on B: x again, bit for bit through both hops.
            torch.testing.assert_close(y, (x - mean) + mean, rtol=0, atol=0)
            assert stand_in.delivers.empty()  # nothing went through the coordinator

    drive(main)


def test_without_a_direct_link_the_coordinator_relays_the_output() -> None:
    stand_in = RelayStandIn()
    x, mean = torch.randn(8, 4), torch.randn(4)

    async def main() -> None:
        async with two_agents(stand_in) as (_, a, _, b):
            await open_job(a, "j", center=Center())
            await open_job(b, "j", center=Center())
            links = await request(
                a,
                Links(
                    job_id="j",
                    peers={"B": None, "C": "ws://127.0.0.1:1"},
                    credentials={"C": presented("A")},
                ),
            )
            assert links.result == {"direct": [], "relay": ["B", "C"]}
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "k"}))
            taking = asyncio.ensure_future(exchange(a, b, x, mean))
            async with asyncio.timeout(20 * UNIT):
                deliver = await stand_in.delivers.get()
            assert deliver.kind == "deliver" and deliver.to == "B" and deliver.key == "k"
            torch.testing.assert_close(decode(bytearray(deliver.payload)), x - mean)
            assert deliver.sender is None  # the coordinator sets it, from the connection
            relayed = await request(
                b, Deliver(job_id="j", to="B", key="k", payload=deliver.payload, sender="A")
            )
            assert isinstance(relayed, Ack)
            y = await taking
            torch.testing.assert_close(y, (x - mean) + mean, rtol=0, atol=0)

    drive(main)


def test_the_mailbox_takes_each_key_once_and_drop_fails_its_waiters() -> None:
    async def main() -> None:
        box = Mailbox()
        box.put("j", "early", b"1")
        assert await box.take("j", "early", 1) == b"1"
        with pytest.raises(TimeoutError):
            await box.take("j", "early", 0.05)
        late = asyncio.ensure_future(box.take("j", "late", 5))
        await asyncio.sleep(0)
        box.put("j", "late", encode_frame(None))
        assert decode(bytearray(await late)) is None
        waiting = asyncio.ensure_future(box.take("j", "never", 5))
        await asyncio.sleep(0)
        box.put("other", "x", b"")
        box.drop("j")
        with pytest.raises(MailboxDropped):
            await waiting
        assert len(box) == 1
        box.clear()
        assert len(box) == 0

    drive(main)


def test_an_unreachable_peer_is_false_not_an_error() -> None:
    async def main() -> None:
        links = PeerLinks(lambda: "A", open_timeout=1)
        assert not await links.connect("j", "secret", "B", f"ws://127.0.0.1:{free_port()}")
        assert not await links.send("B", Deliver(job_id="j", to="B", key="k", payload=b""))
        await links.close()

    drive(main)


def test_sequenced_calls_run_in_seq_order_whatever_order_they_arrive_in() -> None:
    async def main() -> None:
        order, ran = CallOrder(), []

        async def call(seq: int) -> None:
            async with order.turn(seq, f"cmd{seq}", 5):
                ran.append(("start", seq))
                await asyncio.sleep(0.01 * (3 - seq))  # the earlier ones are the slower ones
                ran.append(("end", seq))

        await asyncio.gather(*(call(seq) for seq in (3, 1, 2, 0)))
        assert ran == [(edge, seq) for seq in range(4) for edge in ("start", "end")]

    drive(main)


def test_after_a_sequenced_call_fails_the_later_ones_fail_at_once() -> None:
    async def main() -> None:
        order = CallOrder()
        async with order.turn(0, "stage_forward", 1):
            pass
        with pytest.raises(RuntimeError, match="daemon died"):
            async with order.turn(1, "stage_backward", 1):
                raise RuntimeError("daemon died")
        with pytest.raises(OutOfOrder, match=r"call 2\) not run: call 1 \(stage_backward\) failed"):
            async with order.turn(2, "stage_forward", 1):
                raise AssertionError("must not run")
        fresh = CallOrder()
        async with fresh.turn(0, "stage_forward", 1):
            pass
        with pytest.raises(OutOfOrder, match="already run"):
            async with fresh.turn(0, "a call numbered twice", 1):
                raise AssertionError("must not run")

    drive(main)


def test_a_sequenced_call_whose_turn_never_comes_times_out_naming_the_missing_call() -> None:
    async def main() -> None:
        order = CallOrder()
        with pytest.raises(OutOfOrder, match=r"waited 0\.05s for call 0"):
            async with order.turn(1, "stage_step", 0.05):
                raise AssertionError("must not run")

    drive(main)
