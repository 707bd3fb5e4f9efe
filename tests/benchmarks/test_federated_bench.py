"""benchmarks.federated: its round times and rows on hand-made events and figures (no
cluster)."""

from __future__ import annotations

import pytest

from benchmarks import federated as fl
from somatize.jobs import JobEventInfo


def event(seq: int, t: float, phase: str) -> JobEventInfo:
    return JobEventInfo(seq=seq, time=t, event="progress", data={"phase": phase})


def test_round_times_run_from_staged_to_each_round_event():
    events = [
        event(1, 10.0, "loading"),
        event(2, 11.0, "staged"),
        event(3, 11.5, "round"),
        JobEventInfo(seq=4, time=11.6, event="progress", data={"phase": "checkpoint"}),
        event(5, 12.25, "round"),
    ]
    assert fl.round_seconds(events) == [0.5, 0.75]


def test_rows_put_each_measurement_against_its_anchor():
    job = {"round_s": 2.0, "clients": 1000, "privacy": None}
    private = {"round_s": 0.3, "privacy": {"epsilon": 1.5, "delta": 1e-5}}
    results = {
        "sizes": {"big": 1000, "secagg": [10], "dp": 10},
        "big": job | {"anchor_s": 0.5},
        "plain_10": {"round_s": 0.1},
        "secagg_10": {"round_s": 0.4},
        "dp_fixed_10": private,
        "dp_adaptive_10": private | {"round_s": 0.2},
    }
    rows = fl.rows(results)
    assert [r.name for r in rows] == [
        "FedAvg round, 1,000 clients on 2 workers",
        "FedAvg round with SecAgg, 10 clients",
        "FedAvg round with DP (fixed clipping), 10 clients",
        "FedAvg round with DP (adaptive clipping), 10 clients",
    ]
    assert [r.ratio for r in rows] == pytest.approx([4.0, 4.0, 3.0, 2.0])
    assert rows[2].note == "ε 1.5 at δ 1e-05"
