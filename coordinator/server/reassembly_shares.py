"""Who may hold how much of the coordinator's memory in chunked messages still arriving.

Every chunk's bytes are charged as they arrive (:class:`protocol.chunking.Budget`) to the
budget of the connection's side and sender:

* workers' connections share ``max_reassembly_bytes``, cut in two pools: three quarters for
  the replies to the coordinator's own calls (a running job's gradients, states, a kept file's
  pieces), a quarter for what workers send unasked (relayed tensors, and anything a hostile
  worker makes up). Each worker, by id over its connections (by connection until its hello
  names it), holds at most a share of each — half the replies' pool (at least
  ``max_message_bytes`` where the pool allows), a quarter of the other — so a few worker ids
  sending unasked cannot make an honest worker's reply ``busy`` and fail its job (two new ids
  holding 32 MB each once did), and no client can;
* clients' connections share another pool, and each client holds at most its share
  (``max_client_reassembly_bytes``, by default a third; the pool is at least three shares):
  two clients together cannot fill it for a third. A client named by its token counts over
  all its connections, one without a name of its own (no tokens, or the single token) per
  connection. Clients' messages land on disk (:mod:`protocol.asyncio.landing`), not in memory.

A sender over its share, or a pool that is full, gets ``busy`` for the message that went over
(retry later); what it had received of it is freed. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.server.clients import EVERYONE, ClientIdentity
from protocol.chunking import Budget

__all__ = ["ReassemblyShares", "WorkerBudgets"]

REPLIES = 3 / 4
"""The part of the workers' pool kept for the replies the coordinator awaits."""
CLIENTS_SHARING = 3
"""Clients whose shares the clients' pool holds at once, at least: two cannot starve a third."""


@dataclass(frozen=True)
class WorkerBudgets:
    """What one worker's connections charge: its share of the unasked pool, and of the
    replies' (``replies``: what answers the coordinator's own calls)."""

    unasked: Budget
    replies: Budget


class ReassemblyShares:
    """The coordinator's reassembly budgets (module docstring).

    Args:
        pool: the bytes workers' connections may hold together, and as many clients'.
        client_share: the bytes one client may hold.
        max_message_bytes: the largest message: a worker's share of the replies' pool is at
            least that where the pool allows (one whole reply in progress).
    """

    def __init__(self, pool: int, client_share: int, max_message_bytes: int | None = None) -> None:
        largest = max_message_bytes or 1
        replies = max(1, int(pool * REPLIES))
        self.worker_replies = Budget(replies, "all workers' replies")
        self.worker_unasked = Budget(max(1, pool - replies), "all workers' unasked messages")
        self.reply_share = min(replies, max(replies // 2, largest))
        self.unasked_share = max(1, self.worker_unasked.limit // 4)
        self.client_share = client_share
        self.clients = Budget(max(pool, CLIENTS_SHARING * client_share), "all clients' connections")
        self._named: dict[str, Budget] = {}
        self._workers: dict[str, WorkerBudgets] = {}

    def of_connection(self) -> WorkerBudgets:
        """What a worker's connection charges before its hello names it: shares of its own."""
        return self._shares("this connection")

    def of_worker(self, worker_id: str) -> WorkerBudgets:
        """What worker ``worker_id``'s connections charge, all of them together."""
        shares = self._workers.get(worker_id)
        if shares is None:
            shares = self._workers[worker_id] = self._shares(f"worker {worker_id!r}")
        return shares

    def _shares(self, who: str) -> WorkerBudgets:
        return WorkerBudgets(
            Budget(self.unasked_share, f"{who}'s unasked messages", self.worker_unasked),
            Budget(self.reply_share, f"{who}'s replies", self.worker_replies),
        )

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
