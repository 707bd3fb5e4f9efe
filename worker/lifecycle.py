"""The agent's lifecycle as one explicit state: a transition table, no I/O, no event loop.

::

    STARTING ──dial──► CONNECTING ──welcome──► REGISTERED ──drain──► DRAINING
                          ▲   │                                         │
                          │   └──────────drain / disconnected────┐      │ disconnected
                          │                                      ▼      ▼
                          └──────────────dial──────────────── BACKOFF ◄─┘

    any state ──finish──► STOPPED (run() returned)

A connection is dialed and greeted (``CONNECTING``), serves once welcomed (``REGISTERED``: the
only state that takes jobs), and is torn down (``DRAINING``: jobs refused, daemons closed,
in-flight replies sent) before the agent waits to dial again (``BACKOFF``).

:meth:`Lifecycle.stop` is not a state of its own: it can come in any state and changes where
the agent goes next — a registered connection starts draining at once, a welcome that arrives
after it drains instead of registering, and no dial follows.
"""

from __future__ import annotations

from enum import Enum

from worker.errors import InvalidTransition

__all__ = ["Lifecycle", "Phase"]


class Phase(Enum):
    """Where the agent is in its connect → serve → teardown → backoff loop."""

    STARTING = "starting"
    CONNECTING = "connecting"
    REGISTERED = "registered"
    DRAINING = "draining"
    BACKOFF = "backoff"
    STOPPED = "stopped"


_LIVE = (Phase.STARTING, Phase.CONNECTING, Phase.REGISTERED, Phase.DRAINING, Phase.BACKOFF)

_TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.STARTING, "dial"): Phase.CONNECTING,
    (Phase.BACKOFF, "dial"): Phase.CONNECTING,
    (Phase.CONNECTING, "welcome"): Phase.REGISTERED,
    (Phase.CONNECTING, "drain"): Phase.DRAINING,  # the hello failed: tear the socket down
    (Phase.REGISTERED, "drain"): Phase.DRAINING,
    (Phase.DRAINING, "drain"): Phase.DRAINING,  # stop() began it; the teardown confirms it
    (Phase.CONNECTING, "disconnected"): Phase.BACKOFF,  # the dial itself failed
    (Phase.DRAINING, "disconnected"): Phase.BACKOFF,
    **{(phase, "finish"): Phase.STOPPED for phase in _LIVE},
}
"""``(state, step) → next state``; a step missing here raises :class:`InvalidTransition`."""


class Lifecycle:
    """The agent's state and what follows from it: whether it is connected, takes jobs, stops.

    Every method is one step of the table above; none does I/O. The agent turns the changes
    into wake-ups (its ``connected`` event) itself.
    """

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._stopping = False

    def __repr__(self) -> str:
        return f"Lifecycle({self._phase.value}{', stopping' if self._stopping else ''})"

    @property
    def phase(self) -> Phase:
        """The current state."""
        return self._phase

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called: no connection follows the current one."""
        return self._stopping

    @property
    def accepting(self) -> bool:
        """Whether a job may open now: registered, and not stopping."""
        return self._phase is Phase.REGISTERED

    @property
    def connected(self) -> bool:
        """Whether a welcomed connection serves (from the welcome until its teardown)."""
        return self._phase is Phase.REGISTERED

    def _step(self, step: str) -> Phase:
        following = _TRANSITIONS.get((self._phase, step))
        if following is None:
            raise InvalidTransition(f"no {step!r} from {self._phase.value}")
        self._phase = following
        return following

    def dial(self) -> None:
        """A connection attempt begins."""
        self._step("dial")

    def welcome(self) -> None:
        """The coordinator welcomed this worker: serve (or drain at once, when stopping)."""
        self._step("welcome")
        if self._stopping:
            self._phase = Phase.DRAINING

    def drain(self) -> None:
        """The connection's teardown begins (lost, shut down by the coordinator, or stopped)."""
        self._step("drain")

    def disconnected(self) -> None:
        """The connection (or the attempt at one) is over; the next waits for its backoff."""
        self._step("disconnected")

    def finish(self) -> None:
        """:meth:`~worker.agent.Agent.run` returned."""
        self._step("finish")

    def stop(self) -> None:
        """Stop for good: a registered connection drains now; no connection follows."""
        self._stopping = True
        if self._phase is Phase.REGISTERED:
            self._phase = Phase.DRAINING
