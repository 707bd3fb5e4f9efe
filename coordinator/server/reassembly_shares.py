"""Who may hold how much of the coordinator's memory in chunked messages still arriving.

Every chunk's bytes are charged as they arrive (:class:`protocol.chunking.Budget`) to the
budget of the connection's side and sender:

* workers' connections share one pool (``max_reassembly_bytes``): replies to the coordinator's
  calls, so no client can make a running job's replies wait or fail;
* clients' connections share another of the same size, and each client holds at most its share
  of it (``max_client_reassembly_bytes``, by default half): a client named by its token over all
  its connections, one without a name of its own (no tokens, or the single token) per
  connection. A client over its share, or a pool that is full, gets ``busy`` for the message
  that went over (retry later); what it had received of it is freed.

No I/O.
"""

from __future__ import annotations

from coordinator.server.clients import EVERYONE, ClientIdentity
from protocol.chunking import Budget

__all__ = ["ReassemblyShares"]


class ReassemblyShares:
    """The coordinator's reassembly budgets (module docstring).

    Args:
        pool: the bytes each side's connections may hold together.
        client_share: the bytes one client may hold (at most ``pool``).
    """

    def __init__(self, pool: int, client_share: int) -> None:
        self.workers = Budget(pool, "all workers' connections")
        self.clients = Budget(pool, "all clients' connections")
        self.client_share = min(client_share, pool)
        self._named: dict[str, Budget] = {}

    def of_worker(self) -> Budget:
        """What a worker's connection charges: the workers' pool."""
        return self.workers

    def of_client(self, identity: ClientIdentity) -> Budget:
        """What a client's connection charges: its client's share of the clients' pool (a
        share of its own for a connection whose client has no name of its own)."""
        if identity == EVERYONE:
            return Budget(self.client_share, "this connection", parent=self.clients)
        share = self._named.get(identity.name)
        if share is None:
            share = Budget(
                self.client_share, f"client {identity.name!r}'s connections", self.clients
            )
            self._named[identity.name] = share
        return share
