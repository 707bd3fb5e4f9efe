"""The states of one connection's session, as a transition table: no I/O.

::

    opening ──ready──► open ──close──► closing ──closed──► closed
       │                 │                                  ▲
       └──close──► closing                                  │
    opening, open, closing ──lost──────────────────────────┘

* **opening**: the handshake; the owner reads messages directly (a hello and its answer).
* **open**: the reading loop routes every message (replies to their requests, the rest to the
  handler).
* **closing**: this side gave up on the connection (it closes it, or disconnects a peer that
  does not read): nothing more is sent, waiting requests fail, the transport is being closed.
* **closed**: the transport is gone.

Only *opening* and *open* send (:attr:`Session.sending`). Repeated events are allowed where the
two sides can race (a close while the transport is lost, a reading loop started after a close);
any other pair is a bug of this side and raises :class:`~protocol.errors.SessionError`.
"""

from __future__ import annotations

from enum import StrEnum

from protocol.errors import SessionError

__all__ = ["TRANSITIONS", "Event", "Session", "State"]


class State(StrEnum):
    """Where a connection's session is."""

    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Event(StrEnum):
    """What happens to a session."""

    READY = "ready"  # the reading loop starts
    CLOSE = "close"  # this side closes the connection
    CLOSED = "closed"  # the close this side started is done
    LOST = "lost"  # the transport ended (the peer closed, or the link broke)


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.OPENING, Event.READY): State.OPEN,
    (State.OPENING, Event.CLOSE): State.CLOSING,
    (State.OPENING, Event.LOST): State.CLOSED,
    (State.OPEN, Event.READY): State.OPEN,
    (State.OPEN, Event.CLOSE): State.CLOSING,
    (State.OPEN, Event.LOST): State.CLOSED,
    (State.CLOSING, Event.READY): State.CLOSING,
    (State.CLOSING, Event.CLOSE): State.CLOSING,
    (State.CLOSING, Event.CLOSED): State.CLOSED,
    (State.CLOSING, Event.LOST): State.CLOSED,
    (State.CLOSED, Event.READY): State.CLOSED,
    (State.CLOSED, Event.CLOSE): State.CLOSED,
    (State.CLOSED, Event.CLOSED): State.CLOSED,
    (State.CLOSED, Event.LOST): State.CLOSED,
}
"""Every allowed (state, event) pair and the state it leads to."""


class Session:
    """One connection's state, advanced by :meth:`handle`.

    Args:
        name: the connection's name, for the error of a transition that is not allowed.
    """

    def __init__(self, name: str = "connection") -> None:
        self.name = name
        self.state = State.OPENING

    @property
    def sending(self) -> bool:
        """Whether messages may still be sent (and requests wait for replies)."""
        return self.state in (State.OPENING, State.OPEN)

    def handle(self, event: Event) -> State:
        """Apply ``event``; return the new state.

        Raises:
            SessionError: ``event`` is not allowed in the current state.
        """
        try:
            self.state = TRANSITIONS[self.state, event]
        except KeyError:
            raise SessionError(f"{self.name}: {event} is not allowed when {self.state}") from None
        return self.state
