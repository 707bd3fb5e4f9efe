"""Wire formats shared by every somatize process.

``protocol`` owns what crosses a process boundary and nothing else: the binary frame codec
(:mod:`protocol.codec`, :mod:`protocol.arrays`), the typed messages (:mod:`protocol.messages`,
:mod:`protocol.daemon` for the agent ↔ filter-daemon link), the error codes and exceptions
(:mod:`protocol.errors`) and the protocol version. Its core is sans-I/O: chunking
(:mod:`protocol.chunking`), parsing (:mod:`protocol.parsing`), what a connection receives
(:mod:`protocol.inbox`), its session states (:mod:`protocol.session`) and the hello
(:mod:`protocol.handshake`) are plain objects, messages in and messages out. Only its binding,
:mod:`protocol.asyncio`, runs an event loop and touches a connection. It never trains anything.
"""

PROTOCOL_VERSION = 1
