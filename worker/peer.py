"""Worker-to-worker tensor exchange for pipeline stages: a mailbox and the outgoing peer links.

A pipeline stage's output goes straight to the worker running the next stage, as a ``Deliver``
(an encoded frame, opaque on the way) for a mailbox ``key`` of a job. It travels over a direct
peer link when the two workers can reach each other (:class:`PeerLinks`, a WebSocket to the
other agent's ``/peer`` endpoint), and is relayed by the coordinator otherwise; either way it
ends in the receiving agent's :class:`Mailbox`, where the ``call`` naming that key as its
``input_from`` waits for it.

A peer link is one ``websockets`` connection driven by a
:class:`~protocol.asyncio.channel.Channel`: the dialing side sends ``PeerHello`` first and waits for
the ``Ack``; every ``Deliver`` after it is a request answered by ``Ack`` (so "sent" means "in the
peer's mailbox").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Callable

from websockets.asyncio.client import connect

from protocol.asyncio.channel import DEFAULT_MAX_MESSAGE_BYTES, Channel
from protocol.asyncio.websocket import client_tls, ws_options
from protocol.errors import ProtocolError, RemoteError
from protocol.handshake import expect_reply
from protocol.messages import Ack, Deliver, PeerHello
from worker.errors import DeliveredTwice, MailboxDropped, MailboxFull, OutOfOrder

__all__ = [
    "MAILBOX_ENTRIES",
    "MAILBOX_JOB_ENTRIES",
    "CallOrder",
    "DeliveredTwice",
    "Mailbox",
    "MailboxDropped",
    "MailboxFull",
    "OutOfOrder",
    "PeerLinks",
]

log = logging.getLogger(__name__)


MAILBOX_ENTRIES = 4096
"""Deliveries a mailbox holds untaken, all jobs together; one more is refused rather than
held."""
MAILBOX_JOB_ENTRIES = 1024
"""Of those, what one job may hold (a pipeline holds a few per micro-batch): a job that fills
its share leaves the others theirs."""
MAILBOX_JOB_BYTES = 2 << 30
"""And the bytes one job's untaken deliveries may hold together (2 GiB, the default largest
message): 1,024 deliveries of a large message each would pin far more."""


class Mailbox:
    """Delivered payloads by ``(job_id, key)``; each is taken once, whichever comes first.

    No I/O: :meth:`put` is what a ``deliver`` (direct or relayed) does, :meth:`take` what a
    ``call`` with ``input_from`` waits on.
    """

    def __init__(
        self,
        max_entries: int = MAILBOX_ENTRIES,
        max_job_entries: int = MAILBOX_JOB_ENTRIES,
        max_job_bytes: int = MAILBOX_JOB_BYTES,
    ) -> None:
        self.max_entries = max_entries
        self.max_job_entries = max_job_entries
        self.max_job_bytes = max_job_bytes
        self._slots: dict[tuple[str, str], asyncio.Future[bytes]] = {}
        self._per_job: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()  # of each job's deliveries not taken yet

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, job_id: str, key: str) -> asyncio.Future[bytes]:
        slot = self._slots.get((job_id, key))
        if slot is None:
            slot = asyncio.get_running_loop().create_future()
            self._slots[(job_id, key)] = slot
            self._per_job[job_id] += 1
        return slot

    def _forget(self, job_id: str, key: str) -> asyncio.Future[bytes]:
        slot = self._slots.pop((job_id, key))
        self._per_job[job_id] -= 1
        if not self._per_job[job_id]:
            del self._per_job[job_id]
        if slot.done() and not slot.cancelled() and slot.exception() is None:
            self._bytes[job_id] -= len(slot.result())
            if not self._bytes[job_id]:
                del self._bytes[job_id]
        return slot

    def put(self, job_id: str, key: str, payload: bytes) -> None:
        """Deliver ``payload`` to ``key``.

        Raises:
            MailboxFull: ``key`` is new and ``max_entries`` are held already, or
                ``max_job_entries`` of ``job_id``; or the job's untaken deliveries with this
                one would hold more than ``max_job_bytes``.
            DeliveredTwice: ``key`` holds a delivery not yet taken (it is not replaced).
        """
        if self._bytes[job_id] + len(payload) > self.max_job_bytes:
            raise MailboxFull(
                f"the mailbox holds {self._bytes[job_id]} bytes of job {job_id!r} nobody took "
                f"(the limit is {self.max_job_bytes} a job): {key!r} of {len(payload)} bytes "
                "refused"
            )
        if (job_id, key) not in self._slots:
            held, of_job = len(self._slots), self._per_job[job_id]
            if held >= self.max_entries or of_job >= self.max_job_entries:
                raise MailboxFull(
                    f"the mailbox holds {of_job} deliveries of job {job_id!r} nobody took "
                    f"({held} in all; the limits are {self.max_job_entries} a job, "
                    f"{self.max_entries} in all): {key!r} refused"
                )
        slot = self._slot(job_id, key)
        if slot.done():
            raise DeliveredTwice(
                f"job {job_id!r}: {key!r} was delivered already and not yet taken: the second "
                "delivery is refused"
            )
        slot.set_result(payload)
        self._bytes[job_id] += len(payload)

    async def take(self, job_id: str, key: str, timeout: float | None) -> bytes:  # noqa: ASYNC109
        """The payload of ``key``, once delivered; it is then forgotten.

        Raises:
            TimeoutError: nothing within ``timeout`` seconds (the slot stays for a late put).
            MailboxDropped: :meth:`drop` of the job while waiting.
        """
        slot = self._slot(job_id, key)
        async with asyncio.timeout(timeout):
            # Shielded: a timed-out or cancelled waiter must not cancel the slot itself.
            payload = await asyncio.shield(slot)
        if self._slots.get((job_id, key)) is slot:
            self._forget(job_id, key)
        return payload

    def drop(self, job_id: str) -> None:
        """Forget ``job_id``'s entries; its waiters fail with :class:`MailboxDropped`."""
        for slot_key in [k for k in self._slots if k[0] == job_id]:
            self._fail(self._forget(*slot_key), f"job {job_id!r}: mailbox dropped")

    def clear(self) -> None:
        """Forget every job's entries (the agent's connection went)."""
        for slot in self._slots.values():
            self._fail(slot, "mailbox cleared")
        self._slots.clear()
        self._per_job.clear()
        self._bytes.clear()

    @staticmethod
    def _fail(slot: asyncio.Future[bytes], why: str) -> None:
        if not slot.done():
            slot.set_exception(MailboxDropped(why))
            slot.exception()  # read here: no "exception never retrieved" when nobody waits


class CallOrder:
    """Runs one job's sequenced calls (``Call.seq``) strictly in order: 0, 1, 2, ...

    A pipeline stage's schedule arrives all at once; each call waits here for its turn, so the
    daemon runs the stage's actions back to back in schedule order, whatever order the messages'
    handlers happen to run in. The turn passes on when the daemon has answered (the output may
    still be on its way to the next stage). After a failure every later call fails at once:
    running it on a daemon that missed a step would compute garbage.
    """

    def __init__(self) -> None:
        self._next = 0
        self._failed: str | None = None
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def turn(self, seq: int, what: str, timeout: float | None) -> AsyncIterator[None]:  # noqa: ASYNC109
        """Hold the turn of call ``seq`` (``what`` names it in errors) for the ``async with``
        body; wait at most ``timeout`` seconds for it.

        Raises:
            OutOfOrder: an earlier call failed, ``seq`` was already used, or the turn did not
                come within ``timeout``.
        """
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(lambda: self._next >= seq or bool(self._failed))
            except TimeoutError:
                raise OutOfOrder(
                    f"{what} (call {seq}) waited {timeout}s for call {self._next} to finish"
                ) from None
            if self._failed is not None:
                raise OutOfOrder(f"{what} (call {seq}) not run: {self._failed}")
            if self._next != seq:
                raise OutOfOrder(f"{what}: call {seq} was already run (next is {self._next})")
        done = False
        try:
            yield
            done = True
        finally:
            async with self._changed:
                if not done:
                    self._failed = f"call {seq} ({what}) failed"
                self._next = seq + 1
                self._changed.notify_all()


class PeerLinks:
    """This agent's outgoing links to other workers, one per job and worker.

    A link serves one job: its hello names the job and presents the job's peer secret, and
    the receiver takes only that job's deliveries on it.

    Args:
        own_id: this worker's id, for the ``PeerHello`` (read at each connect: the coordinator
            may assign it after construction).
        open_timeout: seconds for the TCP connect, the upgrade and the hello's ``Ack``.
        send_timeout: seconds a ``Deliver`` may take to be acknowledged.
        max_message_bytes: largest message accepted from a peer.
        tls: the TLS context to dial ``wss://`` peers with (trusting ``--ca-file``).
    """

    def __init__(
        self,
        own_id: Callable[[], str | None],
        open_timeout: float = 3.0,
        send_timeout: float = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._own_id = own_id
        self.open_timeout = open_timeout
        self.send_timeout = send_timeout
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self._links: dict[tuple[str, str], tuple[Channel, asyncio.Task[None]]] = {}

    def linked(self, job_id: str, worker_id: str) -> bool:
        """Whether a live link to ``worker_id`` for ``job_id`` exists."""
        link = self._links.get((job_id, worker_id))
        return link is not None and not link[0].closed.is_set()

    async def connect(self, job_id: str, secret: str, worker_id: str, address: str) -> bool:
        """Open (or keep) a link to ``worker_id`` at ``address`` (``ws://`` or ``wss://``
        ``HOST:PORT``) for ``job_id``, presenting ``secret``: this worker's credential to it
        (:mod:`protocol.security.peer_credentials`).

        Returns ``False``, never raises, when the peer cannot be reached or refuses the hello
        within ``open_timeout``.
        """
        if self.linked(job_id, worker_id):
            return True
        await self.drop(job_id, worker_id)
        url = address.rstrip("/") + "/peer"
        channel: Channel | None = None
        reader: asyncio.Task[None] | None = None
        hello = PeerHello(worker_id=self._own_id() or "", job_id=job_id, secret=secret)
        try:
            async with asyncio.timeout(self.open_timeout):
                ws = await connect(
                    url,
                    **client_tls(url, self.tls),
                    **ws_options(open_timeout=self.open_timeout, close_timeout=self.open_timeout),
                )
                channel = Channel(
                    ws, f"peer {worker_id}", None, max_message_bytes=self.max_message_bytes
                )
                reader = asyncio.ensure_future(channel.run())
                reply = await channel.request(hello, self.open_timeout)
            expect_reply(reply, Ack)
        except Exception as exc:  # unreachable, refused, not a peer: no link, never a raise
            log.info("no direct link to worker %s at %s: %s", worker_id, url, exc)
            if channel is not None:
                await channel.close(1000, "peer hello failed")
            if reader is not None:
                reader.cancel()
                await asyncio.wait({reader})
            return False
        assert reader is not None
        self._links[(job_id, worker_id)] = (channel, reader)
        log.info("job %s: direct link to worker %s at %s", job_id, worker_id, url)
        return True

    async def send(self, worker_id: str, message: Deliver) -> bool:
        """Send ``message`` over the link to ``worker_id`` for its job; ``False`` when there is
        no live link (the caller then relays through the coordinator).

        Raises:
            RemoteError: the peer refused it (a key it does not expect, one delivered twice):
                relaying it would be refused the same way.
        """
        if not self.linked(message.job_id, worker_id):
            return False
        channel = self._links[(message.job_id, worker_id)][0]
        try:
            reply = await channel.request(message, self.send_timeout)
        except RemoteError:
            raise
        except (ProtocolError, TimeoutError) as exc:
            log.warning("direct delivery to worker %s failed: %s", worker_id, exc)
            await self.drop(message.job_id, worker_id)
            return False
        return isinstance(reply, Ack)

    async def drop(self, job_id: str, worker_id: str) -> None:
        """Close the link to ``worker_id`` for ``job_id``, if any."""
        link = self._links.pop((job_id, worker_id), None)
        if link is None:
            return
        channel, reader = link
        await channel.close(1000, "link dropped")
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({reader})

    async def drop_job(self, job_id: str) -> None:
        """Close every link of ``job_id`` (the job closed here)."""
        for key in [k for k in self._links if k[0] == job_id]:
            await self.drop(*key)

    async def close(self) -> None:
        """Close every link."""
        for key in list(self._links):
            await self.drop(*key)
