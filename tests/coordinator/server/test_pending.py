"""The pending-connection bookkeeping: per-address shares and the admitted-upgrade limit."""

from __future__ import annotations

import pytest

from coordinator.server.pending import PendingConnections


class Conn:
    """A stand-in connection: hashable and weak-referenceable, as a real one is."""


def test_an_address_gets_its_share_and_gets_it_back_as_its_sockets_finish():
    pending = PendingConnections(max_admitted=2, max_per_address=2)
    a, b, c, d = Conn(), Conn(), Conn(), Conn()
    assert pending.accepted(a, "10.0.0.1", 0.0)
    assert pending.accepted(b, "10.0.0.1", 0.0)
    assert not pending.accepted(c, "10.0.0.1", 0.0)  # its share is taken
    assert pending.accepted(d, "10.0.0.2", 1.5)  # another address is not affected
    assert (len(pending), pending.refused_at_accept, pending.accepted_at(d)) == (3, 1, 1.5)
    pending.done(a)
    pending.done(a)  # idempotent: the count does not go below what is there
    pending.done(c)  # never counted: nothing to give back
    assert pending.from_address("10.0.0.1") == 1
    assert pending.accepted(c, "10.0.0.1", 2.0)
    assert pending.accepted_at(a) is None


def test_only_admitted_upgrades_that_are_still_pending_count_against_the_limit():
    pending = PendingConnections(max_admitted=1, max_per_address=8)
    a, b = Conn(), Conn()
    for conn in (a, b):
        assert pending.accepted(conn, None, 0.0)  # an unknown address is never capped
    assert pending.admit(a)
    assert not pending.admit(b)
    pending.done(a)  # its hello came: it no longer holds a place
    assert pending.admit(b)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        PendingConnections(max_admitted=1, max_per_address=0)
