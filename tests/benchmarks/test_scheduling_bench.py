"""benchmarks.scheduling's figures, on jobs whose runs are written by hand."""

from __future__ import annotations

import pytest

from benchmarks.scheduling import figures, trace


def _job(owner, created, runs, short=True, finished=None):
    """A job's record as the benchmark reads it; a run is (start, end, workers, preempted,
    preempting at)."""
    return {
        "owner": owner,
        "short": short,
        "created": created,
        "finished": finished if finished is not None else runs[-1][1],
        "state": "succeeded",
        "runs": runs,
    }


def test_shares_in_the_contended_window_waits_and_utilisation_by_hand():
    # Two workers, 0-10 s. alice waits 0-2 and 4-6 (preempted at 4); bob's second job waits
    # 0-4: both queue during 0-2 only (the contended window), when bob holds a worker and
    # alice none.
    jobs = [
        _job("alice", 0.0, [(2.0, 4.0, 1, True, 3.5), (6.0, 10.0, 1, False, None)]),
        _job("bob", 0.0, [(0.0, 10.0, 1, False, None)], short=False),
        _job("bob", 0.0, [(4.0, 6.0, 1, False, None)]),
    ]
    said = figures(jobs, workers=2, shares={"alice": 1.0, "bob": 1.0})
    assert said["contended_s"] == pytest.approx(2.0)  # 0-2: both queued
    assert said["clients"]["bob"]["share"] == pytest.approx(1.0)
    assert said["clients"]["alice"]["deviation"] == pytest.approx(-1.0)
    held = (2 + 4) + 2 + 10  # alice's two runs, bob's second job, bob's first
    assert said["utilisation"] == pytest.approx(held / (2 * 10))
    assert said["clients"]["alice"]["wait_p50"] == pytest.approx(2.0)  # to its first run
    assert said["preemptions"] == 1 and said["leave_max_s"] == pytest.approx(0.5)


def test_the_trace_is_the_same_for_a_seed():
    one, two = trace(54, 100.0, 50), trace(54, 100.0, 50)
    assert one == two and len(one) > 100
    assert {a.owner for a in one} == {"alice", "bob", "carol"}
