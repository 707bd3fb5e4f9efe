"""Which queued jobs start now, on which workers, which running jobs make room, and why the
others wait: one pass over the queue, pure logic (no I/O; the clock is the caller's).

The order. Among the jobs that can start, the higher ``priority`` goes first; among equals, the
client furthest under its fair share (what it holds now and has held lately, over its share:
:mod:`coordinator.scheduling.shares`); among one client's jobs of one priority, the one expected
to end soonest — its ``time_limit`` (:data:`UNDECLARED` without one) less the time it has
waited, so that none waits for ever behind shorter ones — then the older. The order is taken
again after every job that starts — a client that was just given a worker is further from its
share for the next — so two clients with equal shares and full queues alternate, and one
client's long queue never holds another's job behind it.

Gangs. A job that cannot start for want of free workers does not hold up the jobs after it that
can — except the first of them (in the order above): the free workers it would take are
*reserved* for it, as EASY backfilling reserves them for the job at the head, so a job of four
workers starts once four are free rather than never while one-worker jobs keep arriving. A job
after it may still take a reserved worker when it declares a ``time_limit`` that ends before
the reservation is expected to be needed (*backfill*). The reservation stays with its job from
one pass to the next (``reserved_for``) until it starts.

Preemption. The reserved job may make room by preempting running jobs that allow it (they
resume from their checkpoints, and did not opt out): of a lower priority; or, once it has waited
``share_wait`` seconds, of a client over its fair share when its own client is under it (the
one preempted staying at its share at least, the order still putting the waiting client
first, and the job preempted having run ``share_wait`` itself: none comes straight back); or
that borrow past their client's ``max_workers``. The fewest are chosen, the lowest priority
and furthest over share first, then the newest; those already leaving count as room coming.

Quotas. A client's jobs hold at most its ``max_workers`` at once; a preemptible job may borrow
past it while no other client's job is queued.

``fifo=True`` is the coordinator's placement before all this (``--scheduler fifo``): the jobs in
the order they came, each that can start on the free workers starting, no reservation, no
preemption, no quota — what the benchmark compares against.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from coordinator.context import WorkerIdentity
from coordinator.scheduling.shares import ClientPolicy
from coordinator.strategies.base import Placement

__all__ = [
    "DEFAULT_SHARE_WAIT",
    "UNDECLARED",
    "Plan",
    "Queued",
    "Running",
    "Seat",
    "Wait",
    "WaitReason",
    "plan",
]

UNDECLARED = 3600.0
"""What a job that declares no ``time_limit`` counts as in its client's own order: an hour."""

DEFAULT_SHARE_WAIT = 120.0
"""Seconds a job of a client under its share waits before it may preempt a job of one over its
share (a job of higher priority preempts at once)."""

EPSILON = 1e-9


class WaitReason(StrEnum):
    """Why a queued job is not running yet."""

    PRIORITY = "priority"  # jobs of higher priority go first
    SHARE = "share"  # other clients, further under their share, go first
    WORKERS_BUSY = "workers_busy"  # the workers it matches are all taken
    RESERVATION = "reservation"  # free workers it matches are held for an earlier job
    PREEMPTING = "preempting"  # running jobs are leaving to make room for it
    QUOTA = "quota"  # its client holds its max_workers
    NO_WORKER = "no_worker"  # no connected worker matches it


@dataclass(frozen=True)
class Seat:
    """A connected worker as placement sees it: all its slots, and those no job holds."""

    identity: WorkerIdentity
    slots: int = 1
    free: int = 1


@dataclass(frozen=True)
class Queued:
    """A job waiting for workers.

    Attributes:
        order: its place in submission order (smaller: older).
        slots: the slots it takes of each of its workers.
        time_limit: seconds it may run (``None``: not declared; it cannot backfill).
        preemptible: whether it may be preempted once running (and it resumes).
        waited: seconds it has been queued.
    """

    id: str
    owner: str
    placement: Placement
    priority: int = 0
    order: int = 0
    slots: int = 1
    time_limit: float | None = None
    preemptible: bool = True
    waited: float = 0.0


@dataclass(frozen=True)
class Running:
    """A job holding workers.

    Attributes:
        started: when it started (the caller's clock).
        ends: when its time limit ends it, or for one ``leaving``, when it will have left
            (``None``: not known).
        preemptible: whether it may be preempted (it checkpoints and resumes, and did not opt
            out).
        leaving: it is being preempted already: its workers are coming free.
    """

    id: str
    owner: str
    workers: tuple[str, ...]
    priority: int = 0
    slots: int = 1
    started: float = 0.0
    ends: float | None = None
    preemptible: bool = False
    leaving: bool = False


@dataclass(frozen=True)
class Wait:
    """Where a queued job stands: ``position`` 1 is the next to start; ``start`` the time it is
    expected to (the caller's clock; ``None``: not known)."""

    position: int
    reason: WaitReason
    detail: str
    start: float | None = None


@dataclass
class Plan:
    """What one pass decided.

    Attributes:
        starts: each job that starts now, with the ids of its workers in placement order.
        preempt: each running job to preempt, with the queued job it makes room for.
        waits: every other queued job's place and reason.
        reserved_for: the job free workers are held for (passed to the next pass).
    """

    starts: list[tuple[str, list[str]]] = field(default_factory=list)
    preempt: list[tuple[str, str]] = field(default_factory=list)
    waits: dict[str, Wait] = field(default_factory=dict)
    reserved_for: str | None = None


@dataclass
class _Pass:
    """The state of one pass: what is free and held as jobs are placed."""

    seats: dict[str, Seat]
    free: dict[str, int]
    held: defaultdict[str, float]
    policies: Callable[[str], ClientPolicy]
    recent: Mapping[str, float]
    fair: dict[str, float]
    # what the jobs given a place in the queue would hold once they start: the order of the
    # rest is taken as if they had (a client with one job ahead is further from its share)
    ahead: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def weight(self, workers: Iterable[str], slots: int) -> float:
        """The workers ``slots`` of each of ``workers`` come to (a lost worker's: 1 each)."""
        return sum(slots / self.seats[w].slots if w in self.seats else 1.0 for w in workers)

    def key(self, client: str, change: float | None = None) -> float:
        """How far ``client`` is from its share: what it holds and held lately, per share;
        the queued jobs given a place before counted as held (:attr:`ahead`), unless
        ``change`` says what it would hold more instead."""
        more = self.ahead[client] if change is None else change
        held = self.held[client] + more + self.recent.get(client, 0.0)
        return held / self.policies(client).share

    def available(self, slots: int, leave_out: frozenset[str] = frozenset()) -> list[Seat]:
        return [
            seat
            for wid, seat in self.seats.items()
            if self.free[wid] >= slots and wid not in leave_out
        ]


def plan(
    queued: Sequence[Queued],
    running: Sequence[Running],
    seats: Sequence[Seat],
    policies: Callable[[str], ClientPolicy],
    recent: Mapping[str, float],
    now: float,
    *,
    reserved_for: str | None = None,
    share_wait: float = DEFAULT_SHARE_WAIT,
    fifo: bool = False,
) -> Plan:
    """One pass of the scheduler (module docstring).

    Args:
        queued: the jobs waiting, in any order.
        running: the jobs holding workers.
        seats: the connected workers, with the slots no job holds.
        policies: each client's share, quota and priority ceiling.
        recent: the workers each client has held lately (:meth:`UsageLedger.recent`).
        now: the time of the pass (the clock of ``started``, ``ends`` and the estimates).
        reserved_for: the job the previous pass reserved workers for.
        share_wait: seconds a job waits before it preempts for fair share.
        fifo: place in arrival order only (module docstring).
    """
    if fifo:
        return _first_come(queued, seats)
    state = _Pass(
        seats={s.identity.id: s for s in seats},
        free={s.identity.id: s.free for s in seats},
        held=defaultdict(float),
        policies=policies,
        recent=recent,
        fair={},
    )
    for held in running:
        state.held[held.owner] += state.weight(held.workers, held.slots)
    demanding = {q.owner for q in queued} | {r.owner for r in running}
    shares = sum(policies(c).share for c in demanding) or 1.0
    state.fair = {c: len(seats) * policies(c).share / shares for c in demanding}
    owners_queued: defaultdict[str, int] = defaultdict(int)
    for waiting in queued:
        owners_queued[waiting.owner] += 1

    queues: dict[str, deque[Queued]] = defaultdict(deque)
    sticky: Queued | None = None
    for waiting in sorted(queued, key=_own_order):
        if waiting.id == reserved_for:
            sticky = waiting
        else:
            queues[waiting.owner].append(waiting)

    out = Plan()
    reserved: frozenset[str] = frozenset()
    reservation: Queued | None = None
    reservation_start: float | None = None
    position = 0
    # the jobs taken before each (started or given a place), by priority and by client
    ahead_by_priority: defaultdict[int, int] = defaultdict(int)
    ahead_by_owner: defaultdict[tuple[int, str], int] = defaultdict(int)

    def pick() -> Queued | None:
        nonlocal sticky
        heads = [q[0] for q in queues.values() if q]
        if sticky is not None:
            heads.append(sticky)
        if not heads:
            return None
        best = min(heads, key=lambda j: (-j.priority, j is not sticky, state.key(j.owner), j.order))
        if best is sticky:
            sticky = None
        else:
            queues[best.owner].popleft()
        return best

    while (job := pick()) is not None:
        policy = policies(job.owner)
        others_queued = len(queued) - owners_queued[job.owner] > 0
        backfills = (
            job.time_limit is not None
            and reservation_start is not None
            and now + job.time_limit <= reservation_start
        )
        seats_now = state.available(job.slots, frozenset() if backfills else reserved)
        picks = job.placement.choose([s.identity for s in seats_now])
        chosen = None if picks is None else [seats_now[i].identity.id for i in picks]
        takes = job.placement.workers if chosen is None else state.weight(chosen, job.slots)
        over_quota = (
            policy.max_workers is not None
            and state.held[job.owner] + takes > policy.max_workers + EPSILON
            and not (job.preemptible and not others_queued)
        )
        ahead_priority = sum(n for p, n in ahead_by_priority.items() if p > job.priority)
        ahead_share = sum(
            n
            for (p, owner), n in ahead_by_owner.items()
            if p == job.priority and owner != job.owner
        )
        ahead_by_priority[job.priority] += 1
        ahead_by_owner[(job.priority, job.owner)] += 1
        if chosen is not None and not over_quota:
            for wid in chosen:
                state.free[wid] -= job.slots
            state.held[job.owner] += takes
            out.starts.append((job.id, chosen))
            continue

        position += 1
        state.ahead[job.owner] += takes
        start = _estimate(job, state, running)
        if over_quota:
            holds = state.held[job.owner]
            detail = (
                f"client {job.owner} holds {holds:g} of its {policy.max_workers} workers "
                f"(max_workers)"
            )
            out.waits[job.id] = Wait(position, WaitReason.QUOTA, detail, start)
            continue
        if job.placement.choose([s.identity for s in seats]) is None:
            detail = "no connected worker matches it"
            out.waits[job.id] = Wait(position, WaitReason.NO_WORKER, detail, None)
            continue
        if reservation is None:
            reservation = job
            reserved = _reserve(job, state)
            reservation_start = start
            out.reserved_for = job.id
            victims = _victims(job, state, running, share_wait, now)
            out.preempt.extend((victim, job.id) for victim in victims)
            if victims or any(r.leaving and _touches(job, r, state) for r in running):
                detail = "running jobs are leaving to make room for it"
                out.waits[job.id] = Wait(position, WaitReason.PREEMPTING, detail, start)
                continue
        elif job.placement.choose([s.identity for s in state.available(job.slots)]) is not None:
            detail = f"the free workers it matches are held for job {reservation.id}"
            if job.time_limit is None:
                detail += " (a time_limit short enough would let it run before)"
            out.waits[job.id] = Wait(position, WaitReason.RESERVATION, detail, start)
            continue
        if ahead_priority:
            reason, detail = WaitReason.PRIORITY, f"{ahead_priority} of higher priority first"
        elif ahead_share:
            reason = WaitReason.SHARE
            detail = f"{ahead_share} of clients further under their share first"
        else:
            reason, detail = WaitReason.WORKERS_BUSY, "the workers it matches are all taken"
        out.waits[job.id] = Wait(position, reason, detail, start)
    return out


def _own_order(job: Queued) -> tuple[int, float, int]:
    """Where ``job`` stands among its client's own (module docstring)."""
    expected = UNDECLARED if job.time_limit is None else job.time_limit
    return (-job.priority, expected - job.waited, job.order)


def _first_come(queued: Sequence[Queued], seats: Sequence[Seat]) -> Plan:
    """Each job in arrival order that fits the free workers starts (module docstring)."""
    free = {s.identity.id: s.free for s in seats}
    out = Plan()
    position = 0
    for job in sorted(queued, key=lambda j: j.order):
        room = [s for s in seats if free[s.identity.id] >= job.slots]
        picks = job.placement.choose([s.identity for s in room])
        if picks is None:
            position += 1
            detail = "the workers it matches are all taken (first come, first placed)"
            out.waits[job.id] = Wait(position, WaitReason.WORKERS_BUSY, detail)
            continue
        chosen = [room[i].identity.id for i in picks]
        for wid in chosen:
            free[wid] -= job.slots
        out.starts.append((job.id, chosen))
    return out


def _touches(job: Queued, other: Running, state: _Pass) -> bool:
    """Whether ``other`` holds a worker ``job`` could run on."""
    return any(
        w in state.seats and job.placement.accepts(state.seats[w].identity) for w in other.workers
    )


def _reserve(job: Queued, state: _Pass) -> frozenset[str]:
    """The free workers held for ``job``: as many of those it matches as it needs."""
    matching = [
        wid
        for wid, seat in state.seats.items()
        if state.free[wid] >= job.slots and job.placement.accepts(seat.identity)
    ]
    return frozenset(matching[: max(job.placement.workers, len(job.placement.slots))])


def _estimate(job: Queued, state: _Pass, running: Sequence[Running]) -> float | None:
    """When enough workers ``job`` matches are expected free: as the running jobs holding
    them end (``None`` while one it needs has no known end)."""
    free = sum(
        1
        for wid, seat in state.seats.items()
        if state.free[wid] >= job.slots and job.placement.accepts(seat.identity)
    )
    need = max(job.placement.workers, len(job.placement.slots)) - free
    if need <= 0:
        return None
    ends = sorted(
        r.ends if r.ends is not None else float("inf") for r in running if _touches(job, r, state)
    )
    if len(ends) < need or ends[need - 1] == float("inf"):
        return None
    return ends[need - 1]


def _victims(
    job: Queued, state: _Pass, running: Sequence[Running], share_wait: float, now: float
) -> list[str]:
    """The running jobs to preempt so that ``job`` can start (module docstring), or none when
    those it may preempt would not make room enough."""

    def borrowing(owner: str) -> bool:
        quota = state.policies(owner).max_workers
        return quota is not None and state.held[owner] > quota + EPSILON

    def may(r: Running) -> bool:
        if not r.preemptible or r.leaving or not _touches(job, r, state):
            return False
        if r.priority < job.priority:
            return True
        if r.priority > job.priority or r.owner == job.owner:
            return False
        if borrowing(r.owner):
            return True
        if job.waited < share_wait or now - r.started < share_wait:
            return False  # (nor a job that started lately: it would come straight back)
        need = job.placement.workers * 1.0
        freed = state.weight(r.workers, r.slots)
        mine = state.held[job.owner] < state.fair.get(job.owner, 0.0) - EPSILON
        theirs = state.held[r.owner] - freed >= state.fair.get(r.owner, 0.0) - EPSILON
        # and, once swapped, the order would still put the waiting client first
        after = state.key(job.owner, need) <= state.key(r.owner, -freed) + EPSILON
        return mine and theirs and after

    free = dict(state.free)
    for r in running:
        if r.leaving:
            for w in r.workers:
                if w in free:
                    free[w] += r.slots

    def fits() -> bool:
        seats = [state.seats[wid].identity for wid in state.seats if free[wid] >= job.slots]
        return job.placement.choose(seats) is not None

    if fits():
        return []  # room is coming already
    over = {owner: state.held[owner] / state.policies(owner).share for owner in state.held}
    candidates = sorted(
        (r for r in running if may(r)),
        key=lambda r: (r.priority, -over.get(r.owner, 0.0), -r.started),
    )
    chosen: list[str] = []
    for r in candidates:
        for w in r.workers:
            if w in free:
                free[w] += r.slots
        chosen.append(r.id)
        if fits():
            return chosen
    return []
