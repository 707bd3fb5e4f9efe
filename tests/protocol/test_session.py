"""protocol.session: the connection's states as a transition table, with no event loop."""

from __future__ import annotations

import pytest

from protocol.errors import SessionError
from protocol.session import TRANSITIONS, Event, Session, State


def test_a_session_opens_then_closes_from_this_side():
    session = Session("worker w1")
    assert session.state is State.OPENING and session.sending
    assert session.handle(Event.READY) is State.OPEN and session.sending
    assert session.handle(Event.CLOSE) is State.CLOSING and not session.sending
    assert session.handle(Event.CLOSED) is State.CLOSED and not session.sending


def test_a_lost_transport_closes_the_session_from_any_state():
    for start in (State.OPENING, State.OPEN, State.CLOSING, State.CLOSED):
        session = Session()
        session.state = start
        assert session.handle(Event.LOST) is State.CLOSED


def test_a_session_may_close_during_its_handshake():
    session = Session()
    assert session.handle(Event.CLOSE) is State.CLOSING


def test_races_between_the_two_sides_are_allowed():
    session = Session()
    session.handle(Event.READY)
    session.handle(Event.CLOSE)
    assert session.handle(Event.LOST) is State.CLOSED  # the peer went while we closed
    assert session.handle(Event.CLOSE) is State.CLOSED  # a second close
    assert session.handle(Event.CLOSED) is State.CLOSED  # the first close's end
    assert session.handle(Event.READY) is State.CLOSED  # a reading loop started too late


@pytest.mark.parametrize("start", [State.OPENING, State.OPEN])
def test_a_close_that_was_never_started_cannot_end(start):
    session = Session("client c")
    session.state = start
    with pytest.raises(SessionError, match=f"client c: closed is not allowed when {start}"):
        session.handle(Event.CLOSED)
    assert session.state is start


def test_only_the_two_open_states_send_and_every_listed_transition_holds():
    for (state, event), target in TRANSITIONS.items():
        assert state in State and event in Event and target in State
        session = Session()
        session.state = state
        assert session.handle(event) is target
        assert session.sending == (target in (State.OPENING, State.OPEN))
