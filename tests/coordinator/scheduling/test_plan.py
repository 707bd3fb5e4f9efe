"""One pass of the scheduler: order by priority then fair share then age, quotas, reservations
with backfill, and the preemptions it asks for."""

from __future__ import annotations

import dataclasses
import math

import pytest

from coordinator.context import WorkerIdentity
from coordinator.scheduling.plan import Queued, Running, Seat, WaitReason, plan
from coordinator.scheduling.shares import ClientPolicy, UsageLedger
from coordinator.strategies.base import Placement


def seats(n: int, busy: int = 0, slots: int = 1) -> list[Seat]:
    return [Seat(WorkerIdentity(f"w{i}"), slots, 0 if i < busy else slots) for i in range(n)]


def job(jid: str, owner: str, workers: int = 1, order: int = 0, **kw: object) -> Queued:
    return Queued(jid, owner, Placement(workers), order=order, **kw)  # type: ignore[arg-type]


def equal(name: str) -> ClientPolicy:
    return ClientPolicy(max_priority=None)


def started(p: object) -> list[str]:
    return [jid for jid, _ in p.starts]  # type: ignore[attr-defined]


def test_two_clients_alternate_whatever_order_they_queued_in() -> None:
    queued = [job(f"a{i}", "alice", order=i) for i in range(8)]
    queued += [job(f"b{i}", "bob", order=8 + i) for i in range(8)]
    p = plan(queued, [], seats(2), equal, {}, 0.0)
    assert sorted(started(p)) == ["a0", "b0"]  # one each, though all of alice's came first
    # bob's next job waits behind alice's next, not behind all seven
    assert p.waits["a1"].position == 1 and p.waits["b1"].position == 2
    assert p.waits["b1"].reason is WaitReason.SHARE


def test_shares_weigh_the_order() -> None:
    policies = {"alice": ClientPolicy(share=3), "bob": ClientPolicy(share=1)}
    queued = [job(f"a{i}", "alice", order=i) for i in range(8)]
    queued += [job(f"b{i}", "bob", order=8 + i) for i in range(8)]
    p = plan(queued, [], seats(4), policies.__getitem__, {}, 0.0)
    assert sorted(started(p)) == ["a0", "a1", "a2", "b0"]


def test_recent_use_counts_against_a_client() -> None:
    queued = [job("a", "alice", order=0), job("b", "bob", order=1)]
    p = plan(queued, [], seats(1), equal, {"alice": 3.0}, 0.0)
    assert started(p) == ["b"]


def test_priority_goes_before_share_and_age() -> None:
    queued = [job("old", "alice", order=0), job("urgent", "alice", order=5, priority=2)]
    running = [Running("r", "bob", ("w0",))]
    p = plan(queued, running, seats(2, busy=1), equal, {}, 0.0)
    assert started(p) == ["urgent"]
    assert p.waits["old"].reason is WaitReason.PRIORITY


def test_a_job_that_cannot_start_does_not_hold_up_one_that_can() -> None:
    queued = [
        Queued("gpu", "alice", Placement(1, device="cuda"), order=0),
        job("cpu", "alice", order=1),
    ]
    p = plan(queued, [], seats(1), equal, {}, 0.0)
    assert started(p) == ["cpu"]
    assert p.waits["gpu"].reason is WaitReason.NO_WORKER


def test_a_quota_holds_a_client_unless_it_borrows_while_nobody_waits() -> None:
    policies = {"alice": ClientPolicy(max_workers=1), "bob": ClientPolicy()}
    alone = [job("a0", "alice", order=0), job("a1", "alice", order=1)]
    p = plan(alone, [], seats(3), policies.__getitem__, {}, 0.0)
    assert sorted(started(p)) == ["a0", "a1"]  # preemptible: borrows while nobody else waits
    fixed = [job("a0", "alice", order=0), job("a1", "alice", order=1, preemptible=False)]
    p = plan(fixed, [], seats(3), policies.__getitem__, {}, 0.0)
    assert started(p) == ["a0"] and p.waits["a1"].reason is WaitReason.QUOTA
    both = [*alone, job("b0", "bob", order=2, workers=3)]
    p = plan(both, [], seats(3), policies.__getitem__, {}, 0.0)
    assert "a1" in p.waits and p.waits["a1"].reason is WaitReason.QUOTA


def test_a_gang_reserves_free_workers_against_later_small_jobs() -> None:
    running = [Running("r0", "bob", ("w0",)), Running("r1", "bob", ("w1",))]
    queued = [job("gang", "carol", workers=3, order=0)]
    queued += [job(f"b{i}", "bob", order=1 + i) for i in range(4)]
    p = plan(queued, running, seats(4, busy=2), equal, {}, 0.0)
    assert started(p) == []  # w2 and w3 are free, but held for the gang
    assert p.reserved_for == "gang"
    assert p.waits["b0"].reason is WaitReason.RESERVATION
    # the next pass: one of bob's jobs ended; the gang takes three, bob's queue waits
    p = plan(queued, running[:1], seats(4, busy=1), equal, {}, 1.0, reserved_for="gang")
    assert started(p) == ["gang"]


def test_the_reservation_stays_with_its_job() -> None:
    # bob now holds nothing and would go first by share, but carol's gang holds the reservation
    queued = [job("gang", "carol", workers=2, order=0), job("b", "bob", order=1)]
    running = [Running("c", "carol", ("w0",))]
    p = plan(queued, running, seats(2, busy=1), equal, {}, 0.0, reserved_for="gang")
    assert started(p) == [] and p.reserved_for == "gang"


def test_backfill_takes_a_reserved_worker_only_if_it_ends_in_time() -> None:
    running = [Running("r", "bob", ("w0",), ends=100.0)]
    gang = job("gang", "carol", workers=3, order=0)
    short = job("short", "bob", order=1, time_limit=50.0)
    long = job("long", "bob", order=2, time_limit=500.0)
    p = plan([gang, short, long], running, seats(3, busy=1), equal, {}, 0.0)
    assert started(p) == ["short"]
    assert p.waits["long"].reason is WaitReason.RESERVATION
    assert p.waits["gang"].start == 100.0  # when r's time limit ends it


def test_priority_preempts_the_lowest_newest_job_that_makes_room() -> None:
    running = [
        Running("old", "bob", ("w0",), started=0.0, preemptible=True),
        Running("new", "bob", ("w1",), started=5.0, preemptible=True),
        Running("fixed", "bob", ("w2",), started=9.0, preemptible=False),
    ]
    queued = [job("urgent", "alice", priority=1)]
    p = plan(queued, running, seats(3, busy=3), equal, {}, 10.0)
    assert p.preempt == [("new", "urgent")]
    assert p.waits["urgent"].reason is WaitReason.PREEMPTING
    # the next pass: it is leaving; nothing more is preempted
    leaving = [running[0], Running("new", "bob", ("w1",), leaving=True), running[2]]
    p = plan(queued, leaving, seats(3, busy=3), equal, {}, 11.0, reserved_for="urgent")
    assert p.preempt == [] and p.waits["urgent"].reason is WaitReason.PREEMPTING


def test_equal_priority_preempts_only_for_share_after_waiting() -> None:
    running = [
        Running(f"b{i}", "bob", (f"w{i}",), preemptible=True, started=-100.0) for i in range(4)
    ]
    queued = [job("a", "alice", waited=10.0)]
    p = plan(queued, running, seats(4, busy=4), equal, {}, 10.0, share_wait=60.0)
    assert p.preempt == []
    queued = [job("a", "alice", waited=61.0)]
    p = plan(queued, running, seats(4, busy=4), equal, {}, 10.0, share_wait=60.0)
    assert len(p.preempt) == 1
    # nor a job that started within share_wait: it would come straight back
    lately = [dataclasses.replace(r, started=0.0) for r in running]
    p = plan(queued, lately, seats(4, busy=4), equal, {}, 10.0, share_wait=60.0)
    assert p.preempt == []
    # nor where, once swapped, bob would go first again (alice held much lately)
    p = plan(queued, running, seats(4, busy=4), equal, {"alice": 4.0}, 10.0, share_wait=60.0)
    assert p.preempt == []
    # bob at his share (2 of 4 with alice holding 2): no preemption
    running = [
        Running("b0", "bob", ("w0",), preemptible=True, started=-100.0),
        Running("b1", "bob", ("w1",), preemptible=True, started=-100.0),
        Running("a0", "alice", ("w2",)),
        Running("a1", "alice", ("w3",)),
    ]
    p = plan(queued, running, seats(4, busy=4), equal, {}, 10.0, share_wait=60.0)
    assert p.preempt == []


def test_slots_pack_small_jobs_onto_one_worker() -> None:
    queued = [job(f"j{i}", "alice", order=i) for i in range(5)]
    p = plan(queued, [], seats(1, slots=4), equal, {}, 0.0)
    assert started(p) == ["j0", "j1", "j2", "j3"]
    assert all(workers == ["w0"] for _, workers in p.starts)
    assert p.waits["j4"].reason is WaitReason.WORKERS_BUSY


def test_a_job_on_one_slot_of_four_counts_a_quarter_worker() -> None:
    policies = {"alice": ClientPolicy(max_workers=1), "bob": ClientPolicy()}
    running = [Running(f"a{i}", "alice", ("w0",)) for i in range(3)]
    queued = [job("a3", "alice"), job("b", "bob", order=1)]
    slots = [Seat(WorkerIdentity("w0"), 4, 1), Seat(WorkerIdentity("w1"), 4, 4)]
    p = plan(queued, running, slots, policies.__getitem__, {}, 0.0)
    assert sorted(started(p)) == ["a3", "b"]  # ¾ + ¼ is alice's one worker


def test_the_ledger_decays_as_the_integral_says() -> None:
    half = 100.0
    ledger = UsageLedger(half)
    ledger.accrue({"alice": 2.0}, 0.0)
    ledger.accrue({"alice": 2.0}, 50.0)
    rate = math.log(2) / half
    # ∫₀⁵⁰ 2·e^{-rate(50-t)} dt, by hand
    expected = 2.0 * (1 - math.exp(-rate * 50.0)) / rate
    assert ledger.used("alice") == pytest.approx(expected, rel=1e-12)
    ledger.accrue({}, 150.0)  # a half-life with nothing held halves it
    assert ledger.used("alice") == pytest.approx(expected / 2, rel=1e-12)
    for t in range(1, 200):  # held for ever, it converges to what it holds
        ledger.accrue({"bob": 3.0}, 150.0 + t * half)
    assert ledger.recent("bob") == pytest.approx(3.0, rel=1e-9)


def test_a_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="share"):
        ClientPolicy(share=0)
    with pytest.raises(ValueError, match="max_workers"):
        ClientPolicy(max_workers=0)


def test_a_clients_own_jobs_go_shortest_first_until_the_longer_has_waited_its_difference():
    queued = [
        job("long", "alice", order=0, time_limit=600.0),
        job("unsaid", "alice", order=1),
        job("short", "alice", order=2, time_limit=5.0),
    ]
    p = plan(queued, [], seats(1), equal, {}, 0.0)
    assert started(p) == ["short"] and p.waits["long"].position < p.waits["unsaid"].position
    waited = [dataclasses.replace(queued[0], waited=600.0), *queued[1:]]
    p = plan(waited, [], seats(1), equal, {}, 0.0)
    assert started(p) == ["long"]  # it waited as long as it lasts: its turn
