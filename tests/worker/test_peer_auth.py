"""Who may deliver what to a worker: the peer secret, the expected keys, a failed relay.

The attacks of issue 14 (rows 1 and 2) against two real in-process agents on loopback with real
filter daemons: a forged ``peer_hello`` (no secret, a wrong one, a job that is not open here), a
link used for another job, keys the schedule does not expect, a second delivery to a key, a
relay the coordinator could not make — each refused with a typed error, and the job's real
exchange still works after them.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import websockets

from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_HEAD, CHUNK_MAGIC
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorCode, ErrorInfo, RemoteError
from protocol.messages import CHUNK_BYTES, Ack, Call, Deliver, Links, PeerHello, PeerRoute, Result
from tests.utils import UNIT, Center, self_signed
from tests.worker.standin import drive, no_process_left, open_job, presented
from tests.worker.test_peer import RelayStandIn, exchange, request, two_agents
from worker import peer_server
from worker.peer import DeliveredTwice, Mailbox, MailboxFull

pytestmark = pytest.mark.integration
__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

A_TO_B = {"B": presented("A")}
"""What A presents to B (both hold the stand-in's link key)."""


async def dial(address: str, hello: PeerHello) -> tuple[Channel, asyncio.Task[None], object]:
    """A raw peer link to ``address`` and the answer to ``hello`` (an Ack or the RemoteError)."""
    ws = await websockets.connect(f"{address}/peer", compression=None, max_size=1 << 24)
    channel = Channel(ws, "forger")
    reader = asyncio.ensure_future(channel.run())
    try:
        answer: object = await channel.request(hello, 10 * UNIT)
    except RemoteError as exc:
        answer = exc
    return channel, reader, answer


def test_a_peer_hello_without_the_jobs_secret_is_refused_and_the_link_closed() -> None:
    stand_in = RelayStandIn()

    async def main() -> None:
        async with two_agents(stand_in) as (_, a, b_agent, b):
            await open_job(b, "j", center=Center())
            await open_job(b, "secret-job", center=Center())
            assert b_agent.peer_address is not None
            forged = [
                PeerHello(worker_id="A", job_id="j", secret=""),
                PeerHello(worker_id="A", job_id="j", secret=presented("A")[:-1] + "x"),
                PeerHello(worker_id="A", job_id="no-such-job", secret=presented("A")),
                # A stage of the job speaking for another with its own credential: refused.
                PeerHello(worker_id="C", job_id="j", secret=presented("A")),
            ]
            for hello in forged:
                channel, reader, answer = await dial(b_agent.peer_address, hello)
                assert isinstance(answer, RemoteError), answer
                assert answer.code == ErrorCode.UNAUTHORIZED
                assert f"no open job {hello.job_id!r} here for which it holds" in str(answer)
                assert "secret-job" not in str(answer)  # no other job is named
                async with asyncio.timeout(10 * UNIT):
                    await reader  # the agent closed the link
                assert channel.closed.is_set()
            # The job's own peers still link and exchange.
            await open_job(a, "j", center=Center())
            links = await request(
                a, Links(job_id="j", peers={"B": b_agent.peer_address}, credentials=A_TO_B)
            )
            assert links.result == {"direct": ["B"], "relay": []}
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "k"}))
            x, mean = torch.randn(8, 4), torch.randn(4)
            y = await exchange(a, b, x, mean)
            torch.testing.assert_close(y, x, rtol=0, atol=1e-6)

    drive(main)


def test_an_authenticated_link_takes_only_its_job_the_expected_keys_and_each_key_once() -> None:
    stand_in = RelayStandIn()

    async def main() -> None:
        async with two_agents(stand_in) as (_, _, b_agent, b):
            await open_job(b, "j", center=Center())
            await open_job(b, "other", center=Center())
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "act/"}))
            assert b_agent.peer_address is not None
            hello = PeerHello(worker_id="A", job_id="j", secret=presented("A"))
            channel, reader, answer = await dial(b_agent.peer_address, hello)
            assert isinstance(answer, Ack)
            try:
                good = encode_frame(torch.ones(3))

                async def refused(message: Deliver) -> RemoteError:
                    with pytest.raises(RemoteError) as info:
                        await channel.request(message, 10 * UNIT)
                    return info.value

                stray = Deliver(job_id="other", to="B", key="act/0/0", payload=good)
                other_job = await refused(stray)
                assert other_job.code == ErrorCode.BAD_REQUEST
                assert "serves job 'j'" in str(other_job)
                # grad/ keys come from the next stage, not from A; nor does an unknown prefix.
                for key in ("grad/0/0", "junk", ""):
                    wrong = await refused(Deliver(job_id="j", to="B", key=key, payload=good))
                    assert wrong.code == ErrorCode.BAD_REQUEST and "takes no" in str(wrong)
                # A delivery claiming another sender is still A's: the hello says who it is.
                claimed = Deliver(job_id="j", to="B", key="grad/0/0", payload=good, sender="C")
                assert (await refused(claimed)).code == ErrorCode.BAD_REQUEST
                # A delivery for another worker id.
                elsewhere = await refused(Deliver(job_id="j", to="Z", key="act/0/0", payload=good))
                assert elsewhere.code == ErrorCode.BAD_REQUEST
                # The expected key: taken once; a second delivery neither lands nor replaces it.
                first = Deliver(job_id="j", to="B", key="act/0/0", payload=good)
                assert isinstance(await channel.request(first, 10 * UNIT), Ack)
                forged = first.model_copy(update={"payload": encode_frame(torch.full((3,), 1e30))})
                twice = await refused(forged)
                assert twice.code == ErrorCode.BAD_REQUEST and "delivered already" in str(twice)
                assert len(b_agent.mailbox) == 1
                got = await request(
                    b,
                    Call(
                        job_id="j",
                        request={"cmd": "forward", "node_id": "center", "state": {"mean": 0.0}},
                        input_from="act/0/0",
                    ),
                )
                assert isinstance(got, Result)
                torch.testing.assert_close(got.result, torch.ones(3), rtol=0, atol=0)
            finally:
                await channel.close()
                reader.cancel()
            await asyncio.sleep(0)

    drive(main)


def test_a_relay_the_coordinator_could_not_make_fails_the_call_at_once() -> None:
    refusal = ErrorInfo(code=ErrorCode.WORKER_LOST, message="worker 'B' is not connected")
    stand_in = RelayStandIn(refuse=refusal)

    async def main() -> None:
        async with two_agents(stand_in) as (_, a, _, _):
            await open_job(a, "j", center=Center())
            await request(a, Links(job_id="j", peers={"B": None}, expects={}))
            started = time.monotonic()
            with pytest.raises(RemoteError) as info:
                await request(
                    a,
                    Call(
                        job_id="j",
                        request={
                            "cmd": "forward",
                            "node_id": "center",
                            "x": torch.ones(2),
                            "state": {"mean": 0.0},
                        },
                        output_to=PeerRoute(worker="B", key="act/0/0"),
                    ),
                )
            assert time.monotonic() - started < 10 * UNIT  # not the relay's 75 s
            assert info.value.code == ErrorCode.WORKER_LOST
            assert "refused 'act/0/0' by B: worker 'B' is not connected" in str(info.value)
            deliver = stand_in.delivers.get_nowait()
            torch.testing.assert_close(decode(bytearray(deliver.payload)), torch.ones(2))

    drive(main)


def test_with_a_certificate_peer_links_are_wss_and_a_plain_dialer_gets_nothing(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    stand_in = RelayStandIn()
    tls = {"peer_tls_cert": str(cert), "peer_tls_key": str(key), "ca_file": str(cert)}

    async def main() -> None:
        async with two_agents(stand_in, **tls) as (a_agent, a, b_agent, b):
            assert b_agent.peer_address is not None
            assert b_agent.peer_address.startswith("wss://127.0.0.1:")
            assert [h.peer_address for h in stand_in.hellos] == [
                a_agent.peer_address,
                b_agent.peer_address,
            ]
            # In clear, the TLS endpoint does not even upgrade.
            plain = "ws://" + b_agent.peer_address.removeprefix("wss://")
            with pytest.raises((OSError, websockets.InvalidHandshake, TimeoutError)):
                await dial(plain, PeerHello(worker_id="A", job_id="j", secret=presented("A")))
            await open_job(a, "j", center=Center())
            await open_job(b, "j", center=Center())
            links = await request(
                a, Links(job_id="j", peers={"B": b_agent.peer_address}, credentials=A_TO_B)
            )
            assert links.result == {"direct": ["B"], "relay": []}
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "k"}))
            x, mean = torch.randn(8, 4), torch.randn(4)
            y = await exchange(a, b, x, mean)
            torch.testing.assert_close(y, x, rtol=0, atol=1e-6)
            assert stand_in.delivers.empty()  # over the wss:// link, not the relay

    drive(main)


def test_one_job_cannot_fill_the_mailbox_for_the_others() -> None:
    async def main() -> None:
        box = Mailbox(max_entries=8, max_job_entries=3)
        for i in range(3):
            box.put("greedy", f"act/{i}/0", b"x")
        with pytest.raises(MailboxFull, match="3 deliveries of job 'greedy'"):
            box.put("greedy", "act/3/0", b"x")
        for i in range(3):
            box.put("fair", f"act/{i}/0", b"y")
        assert await box.take("greedy", "act/0/0", 1) == b"x"
        box.put("greedy", "act/3/0", b"x")  # its share freed by the take
        with pytest.raises(DeliveredTwice):
            box.put("fair", "act/0/0", b"z")
        assert await box.take("fair", "act/0/0", 1) == b"y"
        box.drop("greedy")
        assert len(box) == 2
        # Bytes too: a job's untaken deliveries hold at most max_job_bytes together.
        heavy = Mailbox(max_job_bytes=10)
        heavy.put("big", "act/0/0", b"123456")
        with pytest.raises(MailboxFull, match="holds 6 bytes of job 'big'"):
            heavy.put("big", "act/1/0", b"123456")
        heavy.put("small", "act/0/0", b"123456")  # another job's share is its own
        assert await heavy.take("big", "act/0/0", 1) == b"123456"
        heavy.put("big", "act/1/0", b"123456")  # room again once taken

    drive(main)


def test_peer_links_share_one_reassembly_budget_and_a_stalled_message_is_dropped() -> None:
    stand_in = RelayStandIn()
    stall = 1.0 * UNIT
    limits = {"max_message_bytes": 6 * CHUNK_BYTES, "stall_timeout": stall}

    async def main() -> None:
        async with two_agents(stand_in, **limits) as (_, _, b_agent, b):
            await open_job(b, "j", center=Center())
            await request(b, Links(job_id="j", peers={"A": None}, expects={"A": "act/"}))
            assert b_agent.peer_address is not None
            hello = PeerHello(worker_id="A", job_id="j", secret=presented("A"))
            links = [await dial(b_agent.peer_address, hello) for _ in range(2)]
            (first, _, _), (second, _, _) = links
            # 4 MiB announced on one link, 3 MiB of it sent (what counts), then nothing more.
            for k in range(3):
                head = CHUNK_HEAD.pack(CHUNK_MAGIC, 9, k * CHUNK_BYTES, 4 * CHUNK_BYTES)
                await first.transport.send(head + bytes(CHUNK_BYTES))
            stalled_at = time.monotonic()
            big = Deliver(job_id="j", to="B", key="act/0/0", payload=bytes(4 * CHUNK_BYTES))
            with pytest.raises(RemoteError, match="on all connections") as full:
                await second.request(big, 10 * UNIT)  # 3 + 4 MiB received > the 6 MiB budget
            assert full.value.code == ErrorCode.BUSY
            async with asyncio.timeout(stall + 10 * UNIT):
                while True:
                    try:
                        assert isinstance(await second.request(big, 10 * UNIT), Ack)
                        break
                    except RemoteError as exc:
                        assert exc.code == ErrorCode.BUSY
                    await asyncio.sleep(0.05)
            assert time.monotonic() - stalled_at >= stall * 0.9
            assert len(b_agent.mailbox) == 1
            for channel, reader, _ in links:
                await channel.close()
                reader.cancel()

    drive(main)


def test_peer_links_beyond_the_cap_are_closed_before_their_hello(monkeypatch) -> None:
    monkeypatch.setattr(peer_server, "MAX_PEER_LINKS", 2)
    stand_in = RelayStandIn()

    async def main() -> None:
        async with two_agents(stand_in) as (_, _, b_agent, _):
            assert b_agent.peer_address is not None
            url = f"{b_agent.peer_address}/peer"
            held = [await websockets.connect(url) for _ in range(2)]
            extra = await websockets.connect(url)
            async with asyncio.timeout(10 * UNIT):
                await extra.wait_closed()
            assert extra.close_code == 1013 and "2 peer links are open" in extra.close_reason
            await held[0].close()
            async with asyncio.timeout(10 * UNIT):  # a link closed: room for one again
                while True:
                    again = await websockets.connect(url)
                    await asyncio.sleep(0.05)
                    if again.close_code is None:
                        break
            for ws in (*held, again):
                await ws.close()

    drive(main)
