"""Connections between their TCP accept and their hello, and the two limits on them.

A connection is *pending* from the accept until its hello is read (or it is refused, or it
closes). Two limits keep pending sockets from locking anyone out:

* **per address**: one IP address holds at most ``max_per_address`` pending sockets. A new
  one beyond that takes the place of the address's oldest socket whose upgrade showed no valid
  token yet (that one is closed): whoever opens sockets by the hundred churns only through
  their own address's idle sockets, every other machine still connects, and so does a client
  with a token behind the same address (a NAT, a shared host) — its upgrade, read at once,
  makes its socket one that is never displaced. Only when every pending socket of the address
  has shown a valid token is the new one closed at its accept, before a byte is read;
* **admitted**: beyond ``max_admitted`` pending upgrades *whose token was checked*, a new
  upgrade is answered ``503`` (sockets without a valid upgrade are not counted there: whoever
  holds no token cannot fill it);
* **in all**: the machine holds at most ``max_sockets`` pending sockets, whatever their
  addresses (one who holds many addresses — a subnet, loopback's 127.0.0.0/8 — is under each
  address's share with every one of them, and once took the coordinator past its open-files
  limit, failing a job "Too many open files"). A new one beyond that takes the place of the
  oldest pending socket of any address that has shown no valid token; when every one has, it
  is closed at its accept.

This module holds the bookkeeping only; :mod:`coordinator.server.app` feeds it accepts and
hellos, :mod:`coordinator.server.http` asks it whether an upgrade is admitted.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass

MAX_PENDING_PER_ADDRESS = 32
"""Default number of pending sockets one IP address may hold (more are closed at accept)."""
MAX_PENDING_SOCKETS = 256
"""Default number of pending sockets in all (never more than a quarter of the open-files
limit: :func:`coordinator.server.config`)."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """What :meth:`PendingConnections.accepted` decided for a socket just accepted."""

    counted: bool
    """The socket is pending (``False``: close it now)."""
    displaced: Hashable | None = None
    """The address's older socket, without a valid token, whose place it took: close that one."""


class PendingConnections:
    """The pending connections, by accept time and address.

    Args:
        max_admitted: pending upgrades with a valid token beyond which :meth:`admit` says no.
        max_per_address: pending sockets from one address beyond which :meth:`accepted` says no.
        max_sockets: pending sockets in all beyond which :meth:`accepted` displaces or says no.
    """

    def __init__(
        self,
        max_admitted: int,
        max_per_address: int = MAX_PENDING_PER_ADDRESS,
        max_sockets: int = MAX_PENDING_SOCKETS,
    ) -> None:
        if min(max_admitted, max_per_address, max_sockets) < 1:
            raise ValueError("pending-connection limits must be positive")
        self.max_admitted = max_admitted
        self.max_per_address = max_per_address
        self.max_sockets = max_sockets
        self._accepted_at: dict[Hashable, float] = {}
        self._address: dict[Hashable, str | None] = {}
        # Each address's pending sockets, oldest first (a dict keeps their accept order).
        self._by_address: collections.defaultdict[str, dict[Hashable, None]] = (
            collections.defaultdict(dict)
        )
        # Upgrades whose token was checked and whose hello has not come yet: what admit() counts
        # (a set of the pending ones, not a scan of every connection: O(1) an upgrade).
        self._admitted: set[Hashable] = set()
        self.refused_at_accept = 0
        """Sockets closed at their accept because their address held its share, all of it
        sockets that had shown a valid token."""
        self.displaced = 0
        """Sockets without a valid token closed to make room for a newer one of their address."""

    def __len__(self) -> int:
        return len(self._accepted_at)

    def accepted(self, connection: Hashable, address: str | None, now: float) -> Accepted:
        """Count a socket just accepted from ``address`` (``None``: unknown, not held to a
        share). When the address holds its share — or all addresses together the most there may
        be — the new socket takes the place of the oldest one (the address's, or any) that has
        not shown a valid token (returned as ``displaced``: close it); when every one of them
        has, the new socket is not counted (close it)."""
        displaced = None
        if address is not None:
            mine = self._by_address[address]
            if len(mine) >= self.max_per_address:
                displaced = next((c for c in mine if c not in self._admitted), None)
                if displaced is None:
                    self.refused_at_accept += 1
                    return Accepted(counted=False)
                self.done(displaced)
                self.displaced += 1
        if displaced is None and len(self._accepted_at) >= self.max_sockets:
            displaced = next((c for c in self._accepted_at if c not in self._admitted), None)
            if displaced is None:
                self.refused_at_accept += 1
                return Accepted(counted=False)
            self.done(displaced)
            self.displaced += 1
        if address is not None:
            self._by_address[address][connection] = None
        self._accepted_at[connection] = now
        self._address[connection] = address
        return Accepted(counted=True, displaced=displaced)

    def accepted_at(self, connection: Hashable) -> float | None:
        """When a pending connection was accepted (``None``: it is not pending)."""
        return self._accepted_at.get(connection)

    def done(self, connection: Hashable) -> None:
        """The connection is no longer pending (hello read, refused or closed); idempotent."""
        self._admitted.discard(connection)
        if self._accepted_at.pop(connection, None) is None:
            return
        address = self._address.pop(connection, None)
        if address is not None:
            mine = self._by_address[address]
            mine.pop(connection, None)
            if not mine:
                del self._by_address[address]

    def admit(self, connection: Hashable) -> bool:
        """Count an upgrade whose token was checked among those waiting for their hello;
        ``False`` (not counted) beyond ``max_admitted`` of them."""
        if len(self._admitted) >= self.max_admitted:
            return False
        if connection in self._accepted_at:  # still pending (not closed before its upgrade)
            self._admitted.add(connection)
        return True

    def from_address(self, address: str) -> int:
        """Pending sockets from ``address`` now."""
        return len(self._by_address.get(address, ()))
