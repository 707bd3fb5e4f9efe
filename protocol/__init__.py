"""Wire formats shared by every somatize process.

``protocol`` owns what crosses a process boundary and nothing else: the binary frame codec
(:mod:`protocol.codec`), the typed messages (:mod:`protocol.daemon` for the agent ↔ filter-daemon
link), the error codes (:mod:`protocol.errors`) and the protocol version. It never opens a socket,
never runs an event loop and never trains anything.
"""

PROTOCOL_VERSION = 1
