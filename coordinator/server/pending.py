"""Connections between their TCP accept and their hello, and the two limits on them.

A connection is *pending* from the accept until its hello is read (or it is refused, or it
closes). Two limits keep pending sockets from locking anyone out:

* **per address**: beyond ``max_per_address`` pending sockets from one IP address, a new one
  from it is closed at its accept, before a byte is read — whoever opens sockets by the
  hundred exhausts only their own address's share, and every other machine still connects;
* **admitted**: beyond ``max_admitted`` pending upgrades *whose token was checked*, a new
  upgrade is answered ``503`` (sockets without a valid upgrade are not counted there: whoever
  holds no token cannot fill it).

This module holds the bookkeeping only; :mod:`coordinator.server.app` feeds it accepts and
hellos, :mod:`coordinator.server.http` asks it whether an upgrade is admitted.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

MAX_PENDING_PER_ADDRESS = 32
"""Default number of pending sockets one IP address may hold (more are closed at accept)."""


class PendingConnections:
    """The pending connections, by accept time and address.

    Args:
        max_admitted: pending upgrades with a valid token beyond which :meth:`admit` says no.
        max_per_address: pending sockets from one address beyond which :meth:`accepted` says no.
    """

    def __init__(self, max_admitted: int, max_per_address: int = MAX_PENDING_PER_ADDRESS) -> None:
        if min(max_admitted, max_per_address) < 1:
            raise ValueError("pending-connection limits must be positive")
        self.max_admitted = max_admitted
        self.max_per_address = max_per_address
        self._accepted_at: dict[Hashable, float] = {}
        self._address: dict[Hashable, str | None] = {}
        self._per_address: collections.Counter[str] = collections.Counter()
        # Upgrades whose token was checked and whose hello has not come yet: what admit() counts
        # (a set of the pending ones, not a scan of every connection: O(1) an upgrade).
        self._admitted: set[Hashable] = set()
        self.refused_at_accept = 0
        """Sockets closed at their accept because their address held its share."""

    def __len__(self) -> int:
        return len(self._accepted_at)

    def accepted(self, connection: Hashable, address: str | None, now: float) -> bool:
        """Count a socket just accepted from ``address`` (``None``: unknown, never capped);
        ``False`` (not counted: close it) when that address already holds its share."""
        if address is not None:
            if self._per_address[address] >= self.max_per_address:
                self.refused_at_accept += 1
                return False
            self._per_address[address] += 1
        self._accepted_at[connection] = now
        self._address[connection] = address
        return True

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
            self._per_address[address] -= 1
            if self._per_address[address] <= 0:
                del self._per_address[address]

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
        return self._per_address.get(address, 0)
