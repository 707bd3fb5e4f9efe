"""The agent's ``/peer`` endpoint: where other workers deliver pipeline tensors directly.

The incoming side of :class:`~worker.peer.PeerLinks`: a peer sends ``PeerHello`` first — the
job it delivers for and that job's peer secret, refused (``unauthorized``, then closed) unless
the job is open here with that secret — then ``Deliver`` requests of that job only, each
answered by ``Ack`` once it is in this agent's mailbox. The hello's worker id becomes each
delivery's ``sender``, whatever the delivery says. The limits are those of the coordinator's
link: ``open_timeout`` for the upgrade and again for the hello, ``max_message_bytes`` and
``max_inflight``; beyond that, all its links together hold at most ``max_message_bytes`` of
chunked messages in progress (one :class:`~protocol.chunking.Budget`), a chunked message that
stalls for :data:`~protocol.chunking.DEFAULT_STALL_SECONDS` is dropped, and at most
:data:`MAX_PEER_LINKS` links are open at once (one more is closed with 1013, before its hello).
With a certificate (``--peer-tls-cert``/``--peer-tls-key``) it serves ``wss://``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import receive_hello
from protocol.asyncio.websocket import server_tls
from protocol.chunking import Budget
from protocol.errors import ErrorCode, ProtocolError, RequestRefused, UnexpectedHello
from protocol.messages import Ack, Deliver, Error, PeerHello
from worker.config import AgentConfig, split_host_port
from worker.link import agent_ws_options, channel_over

__all__ = ["MAX_PEER_LINKS", "PeerServer"]

log = logging.getLogger(__name__)

MAX_PEER_LINKS = 64
"""Peer links open at once on one worker, authenticated or not (a pipeline stage has two)."""


class PeerServer:
    """Serves ``/peer`` on ``config.peer_listen`` while started.

    Args:
        config: the agent's settings (``peer_listen``, ``peer_advertise``, limits, timeouts,
            the peer certificate).
        admit: checks a hello; raises :class:`~protocol.errors.RequestRefused` to refuse it.
        put: what a delivery does (the agent's mailbox); raises
            :class:`~protocol.errors.RequestRefused` to refuse it.
    """

    def __init__(
        self,
        config: AgentConfig,
        admit: Callable[[PeerHello], None],
        put: Callable[[Deliver], Ack],
    ) -> None:
        self._config = config
        self._admit = admit
        self._put = put
        self._budget = Budget(config.max_message_bytes)
        self._open_links = 0
        self._server: Server | None = None
        self.address: str | None = None
        """``ws://HOST:PORT`` as announced in the hello while listening, else ``None``."""

    async def start(self) -> None:
        """Listen on ``peer_listen``; :attr:`address` is then what peers dial."""
        config = self._config
        assert config.peer_listen is not None
        host, port = split_host_port(config.peer_listen)
        tls = None
        if config.peer_tls_cert is not None and config.peer_tls_key is not None:
            tls = server_tls(config.peer_tls_cert, config.peer_tls_key)
        self._server = await serve(
            self._connection, host or None, port, ssl=tls, **agent_ws_options(config)
        )
        bound = next(iter(self._server.sockets)).getsockname()[1]
        shown = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        shown = f"[{shown}]" if ":" in shown else shown
        scheme = "ws" if tls is None else "wss"
        self.address = f"{scheme}://{shown}:{bound}"
        if config.peer_advertise is not None:
            self.address = f"{scheme}://{config.peer_advertise}"
        log.info("serving peer links on %s (announced as %s)", config.peer_listen, self.address)

    async def stop(self) -> None:
        """Stop listening (within ``close_timeout``)."""
        server, self._server = self._server, None
        self.address = None
        if server is not None:
            server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.close_timeout):
                    await server.wait_closed()

    async def _connection(self, ws: ServerConnection) -> None:
        """One incoming peer link: ``PeerHello`` (answered by ``Ack``), then ``Deliver``s."""
        if ws.request is None or ws.request.path != "/peer":
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._config.close_timeout):
                    await ws.close(1008, "not found: peer links are at /peer")
            return
        if self._open_links >= MAX_PEER_LINKS:
            log.warning("peer link from %s refused: %d are open", ws.remote_address, MAX_PEER_LINKS)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._config.close_timeout):
                    await ws.close(1013, f"{MAX_PEER_LINKS} peer links are open: try again later")
            return
        self._open_links += 1
        channel = channel_over(ws, "peer (incoming)", self._refuse, self._config, self._budget)
        try:
            await self._serve(channel)
        except (ConnectionClosed, ProtocolError, TimeoutError) as exc:  # gone, or not reading
            log.info("peer link closed: %s", exc)
        finally:
            self._open_links -= 1
            await channel.close(1000, "peer link over")

    async def _serve(self, channel: Channel) -> None:
        config = self._config
        deadline = asyncio.get_running_loop().time() + config.open_timeout
        try:
            hello = await receive_hello(
                channel,
                PeerHello,
                "a peer link starts with peer_hello, not {kind!r}",
                deadline=deadline,
            )
        except UnexpectedHello as exc:
            async with asyncio.timeout(config.close_timeout):
                await channel.send(
                    Error(id=channel.next_id(), reply_to=exc.reply_to, error=exc.info)
                )
            await channel.close(1008, "expected a peer_hello")
            return
        except (TimeoutError, ProtocolError) as exc:
            log.info("peer link refused: %s", exc)
            await channel.close(1008, f"expected a peer_hello: {exc}")
            return
        try:
            self._admit(hello)
        except RequestRefused as exc:
            log.warning("peer link refused: %s", exc.info.message)
            async with asyncio.timeout(config.close_timeout):
                await channel.send(Error(id=channel.next_id(), reply_to=hello.id, error=exc.info))
            await channel.close(1008, "peer link refused")
            return
        channel.handler = lambda message: self._deliver(hello, message)
        async with asyncio.timeout(config.close_timeout):
            await channel.reply(hello, Ack())
        log.info("peer link from worker %s for job %s", hello.worker_id, hello.job_id)
        await channel.run()

    async def _refuse(self, message: Any) -> Ack:
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST, f"a peer link starts with peer_hello, not {message.kind!r}"
        )

    async def _deliver(self, hello: PeerHello, message: Any) -> Ack:
        """A delivery on the link ``hello`` opened: of its job only, sent by its worker."""
        if not isinstance(message, Deliver):
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"a peer link carries deliver messages, not {message.kind!r}",
            )
        if message.job_id != hello.job_id:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"this peer link serves job {hello.job_id!r}: a delivery for job "
                f"{message.job_id!r} is refused",
            )
        return self._put(message.model_copy(update={"sender": hello.worker_id}))
