"""What each client is owed of the workers: its share, its quota, its priority ceiling, and how
much it has used lately.

* :class:`ClientPolicy` — what an operator sets per client in the clients file
  (``share=``, ``max_workers=``, ``max_priority=``: :mod:`coordinator.server.clients`).
* :class:`UsageLedger` — each client's use of worker-time, decayed with a half-life as Slurm's
  fair-share decays it (``PriorityDecayHalfLife``): a client that held ten workers an hour ago
  counts less than one holding them now, and none of it is forgotten at once.

Worker-time is counted in *workers*: a job holding all of a worker counts 1 for every second it
holds it, one holding one of its four slots ¼. No I/O; the clock is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_HALF_LIFE", "DEFAULT_POLICY", "ClientPolicy", "UsageLedger"]

DEFAULT_HALF_LIFE = 3600.0
"""Seconds after which a client's past use of worker-time counts half (Slurm's default is a
week, for clusters whose jobs run days; a lab's jobs run minutes to hours)."""


@dataclass(frozen=True)
class ClientPolicy:
    """What one client is owed and allowed.

    Attributes:
        share: its weight in fair share (every client's is 1 unless the clients file says).
        max_workers: the most workers its jobs hold at once (``None``: no quota). A
            preemptible job may borrow past it while no other client's job waits: whoever
            comes takes the borrowed workers back by preempting it.
        max_priority: the highest ``priority`` its jobs may ask (``None``: no ceiling, an
            admin's default; a named client's is 0).
    """

    share: float = 1.0
    max_workers: int | None = None
    max_priority: int | None = 0

    def __post_init__(self) -> None:
        if not (self.share > 0 and math.isfinite(self.share)):
            raise ValueError(f"share must be a positive number, not {self.share}")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {self.max_workers}")


DEFAULT_POLICY = ClientPolicy()
"""A client the clients file says nothing more of."""


class UsageLedger:
    """Decayed worker-time per client (module docstring).

    :meth:`accrue` is called with what each client holds now; between two calls each client is
    charged what it held, decayed exactly: holding ``w`` workers for ever converges to
    ``w * half_life / ln 2`` worker-seconds, which :meth:`recent` gives back as ``w``.
    """

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE) -> None:
        if not half_life > 0:
            raise ValueError(f"the half-life must be positive, not {half_life}")
        self.half_life = half_life
        self._rate = math.log(2) / half_life
        self._used: dict[str, float] = {}
        self._at: float | None = None

    def accrue(self, held: Mapping[str, float], now: float) -> None:
        """Charge each client what it held (workers) since the last call, and decay the rest."""
        if self._at is None or now <= self._at:
            self._at = now if self._at is None else self._at
            return
        decay = math.exp(-self._rate * (now - self._at))
        gained = (1.0 - decay) / self._rate  # ∫ decay over the interval, per worker held
        for client in set(self._used) | set(held):
            used = self._used.get(client, 0.0) * decay + held.get(client, 0.0) * gained
            if used < 1e-9:
                self._used.pop(client, None)
            else:
                self._used[client] = used
        self._at = now

    def used(self, client: str) -> float:
        """Decayed worker-seconds of ``client`` as of the last :meth:`accrue`."""
        return self._used.get(client, 0.0)

    def recent(self, client: str) -> float:
        """The workers ``client`` has held on average lately (its decayed worker-seconds over
        what holding one worker for ever comes to)."""
        return self.used(client) * self._rate

    def clients(self) -> dict[str, float]:
        """Every client with use on record: its :meth:`recent` workers."""
        return {client: self.recent(client) for client in self._used}
