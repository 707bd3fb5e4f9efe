"""The asyncio binding of :mod:`protocol`: the only part of it that does I/O.

The rest of :mod:`protocol` is plain: messages in, messages out, no event loop, no sockets
(chunking, parsing, the session states, the handshake's checks). This package drives it over a
connection (:mod:`protocol.asyncio.channel`, :mod:`protocol.asyncio.handshake`) and holds the
settings every process's I/O shares: WebSocket options and TLS
(:mod:`protocol.asyncio.websocket`), the event loop (:mod:`protocol.asyncio.loop`) and malloc's
thresholds (:mod:`protocol.asyncio.memory`).
"""
