"""benchmarks.federated: its round times and rows on hand-made events and figures (no
cluster, no Flower)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.federated import bench as fl
from benchmarks.federated import flower_anchor
from somatize.remote.jobs import JobEventInfo


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
        "FedAvg round, 1,000 clients, vs Flower simulation",
        "FedAvg round with SecAgg, 10 clients",
        "FedAvg round with DP (fixed clipping), 10 clients",
        "FedAvg round with DP (adaptive clipping), 10 clients",
    ]
    assert [r.ratio for r in rows] == pytest.approx([4.0, None, 4.0, 3.0, 2.0])
    assert rows[3].note == "ε 1.5 at δ 1e-05"


def test_without_flower_the_row_says_how_to_get_it():
    results = {"sizes": {"big": 1000}, "big": {"round_s": 2.0}, "flower": None}
    (row,) = fl.flower_rows(results)
    assert row.anchor is None
    assert "make flower-env" in row.note and "--flower-python" in row.note
    assert not fl.flower_disagrees(results)


def flower_figures(max_diff: float) -> dict:
    return {
        "flwr": "1.42.0",
        "ray": "2.55.1",
        "cpus": 2,
        "round_s": 8.0,
        "answered": [1000, 1000],
        "startup_s": 1.5,
        "warmup_round_s": 12.0,
        "max_diff": max_diff,
    }


def test_flower_rows_put_our_round_against_flowers_and_check_the_weights():
    results = {"sizes": {"big": 1000}, "big": {"round_s": 2.0}, "flower": flower_figures(3e-7)}
    timing, weights = fl.flower_rows(results)
    assert timing.ratio == pytest.approx(0.25)
    assert timing.anchor_name == "Flower 1.42.0 simulation (Ray 2.55.1, 2 CPUs)"
    assert weights.ours == 3e-7 and weights.met
    assert not fl.flower_disagrees(results)


@pytest.mark.parametrize("max_diff", [1e-3, float("nan")])
def test_other_weights_than_flowers_fail_the_row(max_diff):
    results = {"sizes": {"big": 10}, "big": {"round_s": 2.0}, "flower": flower_figures(max_diff)}
    assert fl.flower_rows(results)[1].met is False
    assert fl.flower_disagrees(results)


def test_largest_difference_of_weights():
    ours = {"weight": np.array([[1.0, 2.0]], np.float32), "bias": np.array([0.5], np.float32)}
    theirs = {"weight": np.array([[1.0, 2.25]]), "bias": np.array([0.0])}
    assert flower_anchor.largest_difference(ours, theirs) == 0.5
    with pytest.raises(flower_anchor.FlowerFailed, match="keys differ"):
        flower_anchor.largest_difference(ours, {"weight": theirs["weight"]})


def test_flowers_python_is_the_option_then_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(flower_anchor.PYTHON_ENV, raising=False)
    assert flower_anchor.flower_python(None) is None
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv(flower_anchor.PYTHON_ENV, str(python))
    assert flower_anchor.flower_python(None) == python
    with pytest.raises(flower_anchor.FlowerFailed, match="not an executable file"):
        flower_anchor.flower_python(tmp_path / "missing")
