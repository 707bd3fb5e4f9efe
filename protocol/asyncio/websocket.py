"""The WebSocket settings every endpoint shares: options, TLS, close reasons, fragmenting.

The coordinator's server, the agent's coordinator link and peer server, the peer links it dials
and the client all use :func:`ws_options`, so that the frame size limit and compression are the
same on both ends of every link (larger frames travel as chunk messages of
:data:`~protocol.messages.CHUNK_BYTES`). Nothing here imports ``websockets``: these are the
keyword arguments its ``connect()`` and ``serve()`` take.
"""

from __future__ import annotations

import ssl
from typing import Any

from protocol.messages import CHUNK_BYTES

__all__ = [
    "WS_MAX_SIZE",
    "as_sent",
    "client_tls",
    "close_reason",
    "server_tls",
    "tls_hint",
    "ws_options",
]

WS_MAX_SIZE = 4 * CHUNK_BYTES
"""Largest single WebSocket message; anything bigger travels as chunks (a chunk plus its header
fits with room to spare)."""

OPEN_TIMEOUT = 10.0
PING_INTERVAL = 20.0
PING_TIMEOUT = 20.0
CLOSE_TIMEOUT = 10.0
"""The defaults of ``websockets`` itself, for an endpoint that does not choose."""

FRAGMENT_BYTES = 16 << 10
"""Messages over this size go out as one WebSocket fragment and an empty last one
(:func:`as_sent`)."""

CLOSE_REASON_BYTES = 123
"""Longest reason a close frame carries (RFC 6455 §5.5: 125 bytes of payload, 2 of them the
code)."""


def ws_options(
    *,
    open_timeout: float | None = OPEN_TIMEOUT,
    ping_interval: float | None = PING_INTERVAL,
    ping_timeout: float | None = PING_TIMEOUT,
    close_timeout: float | None = CLOSE_TIMEOUT,
) -> dict[str, Any]:
    """Keyword arguments for ``websockets``' ``connect()`` and ``serve()``.

    No compression (tensor bytes do not compress, and deflate costs a copy per message) and
    ``max_size`` :data:`WS_MAX_SIZE`; the timeouts are the endpoint's own (``None``: none).
    """
    return {
        "compression": None,
        "max_size": WS_MAX_SIZE,
        "open_timeout": open_timeout,
        "ping_interval": ping_interval,
        "ping_timeout": ping_timeout,
        "close_timeout": close_timeout,
    }


def client_tls(url: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """``ssl=`` for ``websockets``' ``connect()``: a custom context for ``wss://`` only (the
    system's trust store otherwise, and none for ``ws://``)."""
    return {"ssl": context} if context is not None and url.startswith("wss:") else {}


def tls_hint(url: str, exc: BaseException, ca_file: str | None, ca_option: str) -> str:
    """What a failed dial of ``url`` most likely says about TLS, as a sentence to add to its
    error (``""``: nothing): a certificate this side does not trust (``ca_option`` is how to
    give one), ``ws://`` to a coordinator that speaks TLS, ``wss://`` to one that does not."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    verify = next((e for e in chain if isinstance(e, ssl.SSLCertVerificationError)), None)
    if verify is not None:
        why = getattr(verify, "verify_message", "") or "it cannot be verified"
        if ca_file is None:
            return (
                f"the coordinator's certificate is not one this machine trusts ({why}): give "
                f"it, or its CA's, with {ca_option}?"
            )
        return (
            f"{ca_file} does not vouch for the coordinator's certificate ({why}): is it that "
            "certificate, or its CA's?"
        )
    if url.startswith("ws:") and any(isinstance(e, EOFError) for e in chain):
        return (
            "the coordinator closed the connection without an HTTP answer: does it serve TLS "
            "(--tls-cert)? then its URL is wss://"
        )
    if url.startswith("wss:") and any(
        isinstance(e, ssl.SSLError | ConnectionResetError) for e in chain
    ):
        return "the TLS handshake failed: does the coordinator serve TLS? without --tls-cert it is ws://"
    return ""


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """A server's TLS context from its certificate chain and private key (PEM files).

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: the files are not a certificate and its key.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def close_reason(reason: str) -> str:
    """``reason`` cut to what a WebSocket close frame carries (RFC 6455 §5.5: 123 bytes)."""
    return reason.encode()[:CLOSE_REASON_BYTES].decode(errors="ignore")


def as_sent(data: bytes, last: bool = True) -> bytes | tuple[bytes]:
    """What to hand ``websockets``' ``send`` for ``data``: itself, or (over
    :data:`FRAGMENT_BYTES`, when it is the ``last`` message of its kind) a one-item tuple, which
    goes out as one fragment and an empty last one.

    A ``websockets`` receiver's frame parser keeps the last frame it parsed until the next frame
    arrives, and an unfragmented message *is* that frame's bytes (its reader gets them without a
    copy). So every connection would keep its last large message alive until its peer sends
    again: after a FedAvg round, 10,000 agents' 100 KB states (1 GB) until their next
    heartbeats. Fragmented, the receiver joins the fragments into a new object (one copy, at
    memcpy speed) and keeps only the empty last frame. Of a chunked message only the last chunk
    need be sent so (``last``): the next chunk takes the place of each one before it.
    """
    return (data,) if last and len(data) > FRAGMENT_BYTES else data
