"""``benchmarks.sharded_memory``'s phases: each daemon's peak over its idle memory."""

from __future__ import annotations

from benchmarks.sharded_memory import COORDINATOR, COORDINATOR_OWN, _phases

MIB = 1 << 20


def test_a_daemon_still_starting_when_the_job_came_counts_from_the_others_idle():
    # Daemon 11 was a spare still importing torch (200 MiB) when idle was read; daemon 10 was up.
    idle = {10: 330 * MIB, 11: 200 * MIB, 12: 7 * MIB, COORDINATOR: 100 * MIB, COORDINATOR_OWN: 0}
    marks = {"sharded": 1.0, "trained": 2.0}
    samples = [
        (0.5, {10: 400 * MIB, 11: 420 * MIB, 12: 7 * MIB, COORDINATOR: 100 * MIB}),
        (1.5, {10: 900 * MIB, 11: 880 * MIB, 12: 7 * MIB, COORDINATOR: 100 * MIB}),
        (2.5, {10: 600 * MIB, 11: 610 * MIB, 12: 7 * MIB, COORDINATOR: 140 * MIB}),
    ]
    out = _phases(samples, idle, marks)
    assert out["idle"] == 330 * MIB
    assert out["loading"] == 90 * MIB  # 420 - 330, not 420 - 200
    assert out["training"] == 570 * MIB
    assert out["reading"] == 280 * MIB
    assert out["coordinator_reading"] == 40 * MIB
