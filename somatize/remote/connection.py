"""The client's connection: its URL, its event loop thread, dialling and the hello handshake.

A :class:`~somatize.remote.client.Client` owns one :class:`LoopThread` (uvloop when it is installed)
that runs the connection's :class:`~protocol.asyncio.channel.Channel`; the synchronous methods hand
coroutines to it and wait for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
import urllib.parse
from collections.abc import Coroutine
from typing import Any, TypeVar

import websockets
from websockets.asyncio.client import ClientConnection

from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import send_hello
from protocol.asyncio.loop import loop_factory
from protocol.asyncio.websocket import client_tls, tls_hint, ws_options
from protocol.errors import ProtocolError, RemoteError, UnexpectedReply
from protocol.messages import ClientHello, Welcome
from somatize.errors import ClientError, ConnectionFailed

T = TypeVar("T")

MARGIN = 5.0
"""Extra seconds the calling thread waits beyond a coroutine's own timeout, so that the
coroutine's clearer error, not the thread's, reports a timeout."""

_KEEPALIVE = 20.0
"""Seconds between keepalive pings, and to wait for their answer: a silent coordinator is
declared lost within twice this."""


def client_url(url: str) -> str:
    """The ``/client`` WebSocket URL of a coordinator given as ``ws://HOST:PORT[/path]``."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a coordinator URL is a non-empty string, not {url!r}")
    url = url.strip()
    if "://" not in url:
        url = "ws://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(
            f"a coordinator URL starts with ws:// or wss://, not {parts.scheme}:// ({url!r})"
        )
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"bad port in the coordinator URL {url!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"no host in the coordinator URL {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/client"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _new_loop() -> asyncio.AbstractEventLoop:
    factory = loop_factory()
    return factory() if factory is not None else asyncio.new_event_loop()


class LoopThread:
    """An event loop running in a daemon thread, and a way to run coroutines on it."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self._main, name="somatize-client-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # What asyncio.run does on the way out: no task or generator left half-done.
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop and wait for it at most ``timeout`` seconds."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("the somatize client cannot be called from its own event loop")
        if not self._thread.is_alive():
            coro.close()
            raise ClientError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # (the built-in TimeoutError, since 3.11)
            if future.done():  # the coroutine's own timeout, or it ended just now
                return future.result()
            future.cancel()
            raise TimeoutError(f"{what}: no answer within {timeout:g} s") from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: stop the coroutine too
            raise

    def stop(self, timeout: float) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


def websocket_options(url: str, context: ssl.SSLContext | None, timeout: float) -> dict[str, Any]:
    """The options of the client's WebSocket (:func:`websockets.connect`): no compression, a
    bounded frame size, keepalive pings, and ``ssl=`` for ``wss://`` only."""
    return {
        **client_tls(url, context),
        **ws_options(
            open_timeout=timeout,
            ping_interval=_KEEPALIVE,
            ping_timeout=_KEEPALIVE,
            close_timeout=min(timeout, 5.0),
        ),
    }


async def dial(
    url: str,
    token: str | None,
    context: ssl.SSLContext | None,
    timeout: float,  # noqa: ASYNC109 - the handshake's own limit, passed to websockets
    ca_file: str | None = None,
) -> ClientConnection:
    """Open the WebSocket to the coordinator at ``url`` (``context`` trusting ``ca_file``,
    when one was given: a TLS failure's hint names it).

    Raises:
        ConnectionFailed: it cannot be reached, or refused the token.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return await websockets.connect(
            url, additional_headers=headers, **websocket_options(url, context, timeout)
        )
    except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
        hint = tls_hint(url, exc, ca_file, "--ca-file (sz.connect(url, ca_file=...))")
        raise ConnectionFailed(
            f"cannot reach the coordinator at {url}: {_describe(exc, timeout, bool(token))}"
            + (f"; {hint}" if hint else "")
        ) from exc


async def handshake(channel: Channel, url: str, timeout: float) -> Welcome:  # noqa: ASYNC109
    """Say hello on a new connection and return the coordinator's welcome; on any failure the
    connection is closed.

    Raises:
        ConnectionFailed: no answer within ``timeout``, a refusal, or an answer that is not a
            welcome.
    """
    try:
        return await send_hello(
            channel,
            ClientHello(name="somatize"),
            Welcome,
            timeout,
            peer=f"the coordinator at {url}",
            first=True,
        )
    except RemoteError as exc:
        await channel.close(1002, "handshake failed")
        raise ConnectionFailed(
            f"the coordinator at {url} refused the connection: [{exc.code}] {exc.info.message}",
            code=str(exc.code),
            detail=exc.info.detail,
        ) from exc
    except UnexpectedReply as exc:
        await channel.close(1002, "handshake failed")
        raise ConnectionFailed(f"{exc}, not 'welcome'") from exc
    except BaseException as exc:
        await channel.close(1002, "handshake failed")
        if isinstance(exc, TimeoutError):
            raise ConnectionFailed(
                f"the coordinator at {url} did not answer the hello within {timeout:g} s"
            ) from None
        if isinstance(exc, ProtocolError | websockets.exceptions.WebSocketException):
            raise ConnectionFailed(
                f"the coordinator at {url} refused the connection: {exc}"
            ) from exc
        raise


def _describe(exc: BaseException, timeout: float, sent_token: bool) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the coordinator running?)"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, websockets.exceptions.InvalidStatus):
        status = exc.response.status_code
        if status in (401, 403) and not sent_token:
            return (
                f"HTTP {status}: the coordinator wants a client token and none was given "
                "(connect(url, token=...), or set SOMATIZE_TOKEN)"
            )
        if status in (401, 403):
            return (
                f"HTTP {status}: the coordinator refused the token (is it the client token? "
                "the workers' token is not one)"
            )
        if status == 503:  # too many connections waiting for their hello: a retry may pass
            said = (exc.response.body or b"").decode(errors="replace").strip()[:200]
            return f"HTTP 503: the coordinator is busy: {said}"
        return f"HTTP {status} (is this a somatize coordinator?)"
    return str(exc) or type(exc).__name__
