"""The pending-connection bookkeeping: per-address shares and the admitted-upgrade limit."""

from __future__ import annotations

import pytest

from coordinator.server.pending import Accepted, PendingConnections


class Conn:
    """A stand-in connection: hashable and weak-referenceable, as a real one is."""


def test_a_new_socket_displaces_its_addresss_oldest_one_without_a_token():
    pending = PendingConnections(max_admitted=2, max_per_address=2)
    a, b, c, d = Conn(), Conn(), Conn(), Conn()
    assert pending.accepted(a, "10.0.0.1", 0.0) == Accepted(counted=True)
    assert pending.accepted(b, "10.0.0.1", 0.0) == Accepted(counted=True)
    # The share is taken: the oldest idle socket makes room (whoever floods churns their own).
    assert pending.accepted(c, "10.0.0.1", 1.0) == Accepted(counted=True, displaced=a)
    assert pending.accepted(d, "10.0.0.2", 1.5) == Accepted(counted=True)  # another address
    assert (len(pending), pending.displaced, pending.accepted_at(a)) == (3, 1, None)
    pending.done(a)  # its connection_lost comes later: idempotent
    assert pending.from_address("10.0.0.1") == 2
    # A socket whose upgrade showed a token is never displaced: b made its way in.
    assert pending.admit(b)
    e = Conn()
    assert pending.accepted(e, "10.0.0.1", 2.0) == Accepted(counted=True, displaced=c)
    pending.done(b)  # its hello came
    pending.done(b)  # idempotent: the count does not go below what is there
    assert pending.from_address("10.0.0.1") == 1


def test_a_socket_is_closed_at_accept_only_when_its_addresss_sockets_all_showed_a_token():
    pending = PendingConnections(max_admitted=4, max_per_address=2)
    a, b, c = Conn(), Conn(), Conn()
    for conn in (a, b):
        assert pending.accepted(conn, "10.0.0.1", 0.0).counted
        assert pending.admit(conn)
    assert pending.accepted(c, "10.0.0.1", 0.0) == Accepted(counted=False)
    assert (pending.refused_at_accept, pending.displaced) == (1, 0)
    pending.done(c)  # never counted: nothing to give back
    assert pending.from_address("10.0.0.1") == 2
    pending.done(a)
    assert pending.accepted(c, "10.0.0.1", 2.0) == Accepted(counted=True)


def test_only_admitted_upgrades_that_are_still_pending_count_against_the_limit():
    pending = PendingConnections(max_admitted=1, max_per_address=8)
    a, b = Conn(), Conn()
    for conn in (a, b):
        assert pending.accepted(conn, None, 0.0).counted  # an unknown address is never capped
    assert pending.admit(a)
    assert not pending.admit(b)
    pending.done(a)  # its hello came: it no longer holds a place
    assert pending.admit(b)


def test_sockets_from_many_addresses_are_held_to_the_limit_in_all():
    """Issue 53, a Low: one holding many addresses stayed under each address's share with
    each, and took the coordinator past its open-files limit. In all there are at most
    ``max_sockets``: the oldest without a token makes room, whatever its address; a socket
    that showed a token is never displaced."""
    pending = PendingConnections(max_admitted=8, max_per_address=2, max_sockets=3)
    flood = [Conn() for _ in range(3)]
    for k, conn in enumerate(flood):
        assert pending.accepted(conn, f"127.0.0.{k + 2}", float(k)) == Accepted(counted=True)
    client = Conn()
    assert pending.accepted(client, "10.0.0.1", 5.0) == Accepted(True, displaced=flood[0])
    assert pending.admit(client) and len(pending) == 3
    more = Conn()
    assert pending.accepted(more, "127.0.0.9", 6.0) == Accepted(True, displaced=flood[1])
    for conn in (flood[2], more):
        pending.admit(conn)
    assert pending.accepted(Conn(), "127.0.0.10", 7.0) == Accepted(counted=False)
    assert (pending.displaced, pending.refused_at_accept, len(pending)) == (2, 1, 3)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        PendingConnections(max_admitted=1, max_per_address=0)
