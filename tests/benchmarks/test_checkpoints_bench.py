"""benchmarks.checkpoints: its arithmetic and rows on hand-made figures (no cluster)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from benchmarks import checkpoints as ck


def _checkpoint(
    step: int, t: float, seconds: float = 0.1, nbytes: int = 23_300_000, seq: int = 1
) -> dict[str, Any]:
    return {"step": step, "epoch": 1, "seq": seq, "bytes": nbytes, "seconds": seconds, "time": t}


def _results(off_ms: float, default_ms: float) -> dict[str, Any]:
    def summary(stall_s: float) -> dict[str, float]:
        return {
            "per_job": 4.0,
            "in_span": 4.0,
            "bytes": 23.3e6,
            "seconds": 0.1,
            "seconds_new": 0.15,
            "seconds_reused": 0.05,
            "stall_s": stall_s,
            "snapshot_s": stall_s - 0.1,
            "stall_per_step_s": 4 * stall_s / 48,
        }

    step = {v: {"p50_ms": m} for v, m in (("off", off_ms), ("default", default_ms))}
    return {
        "epoch_steps": 10,
        "steps": 48,
        "step": step | {"every_step": {"p50_ms": 2 * off_ms}},
        "model_bytes": {"state": 23_298_088, "optimizer": 0},
        "checkpoints": {"default": summary(0.3), "every_step": summary(0.4)},
    }


def test_the_default_interval_meets_its_target_within_3_percent_of_the_anchor_step() -> None:
    rows = ck.rows(_results(500.0, 514.0))
    head = rows[0]
    assert head.bench == "checkpoints" and "default" in head.name
    assert head.ratio == pytest.approx(1.028)
    assert head.target is not None and head.target.bound == ck.TARGET == 1.03
    assert head.met is True
    assert ck.rows(_results(500.0, 520.0))[0].met is False
    assert all(r.target is None for r in rows[1:])
    by_name = {r.name: r for r in rows}
    stall = by_name["one checkpoint: training stalled (the snapshot of replica 0)"]
    assert stall.ours == pytest.approx(300.0) and stall.ratio == pytest.approx(0.6)
    assert by_name["one checkpoint's file"].ratio == pytest.approx(23.3e6 / 23_298_088)


def test_stalls_run_from_the_progress_mark_of_the_checkpoints_step_to_its_event() -> None:
    marks = [(1, 0.0), (2, 1.0), (4, 2.0), (5, 3.5), (6, 4.0)]
    got = ck.stalls(marks, [_checkpoint(4, 2.3, seconds=0.2), _checkpoint(3, 9.0)])
    assert got[0]["to_event_s"] == pytest.approx(0.3)
    assert got[0]["stall_s"] == got[0]["snapshot_s"] == pytest.approx(0.1)  # less the write
    assert math.isnan(got[1]["stall_s"])  # no mark at its step


def test_summarize_counts_the_checkpoints_inside_the_measured_span_only() -> None:
    marks = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0)]
    assert ck.measured_span(marks) == (2, 5)
    saved = ck.stalls(marks, [_checkpoint(1, 0.5), _checkpoint(3, 2.2), _checkpoint(4, 3.4)])
    job = {"span": ck.measured_span(marks), "checkpoints": saved}
    got = ck.summarize([job, job])
    assert got["per_job"] == 3 and got["in_span"] == 2
    # Each stall is its event less the write (0.1 s, in the background): 0.4, 0.1 and 0.3.
    assert got["stall_per_step_s"] == pytest.approx((0.1 + 0.3) / 3)
    assert got["stall_s"] == pytest.approx((0.4 + 0.1 + 0.3) / 3)
    assert math.isnan(ck.summarize([{"span": (2, 5), "checkpoints": []}])["bytes"])


def test_summarize_tells_a_jobs_first_keep_writes_new_files_from_those_after() -> None:
    marks = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0)]
    written = [
        _checkpoint(s, s - 0.5, seconds=0.3 if s <= ck.KEEP else 0.1, seq=s) for s in (1, 2, 3, 4)
    ]
    got = ck.summarize(
        [{"span": ck.measured_span(marks), "checkpoints": ck.stalls(marks, written)}]
    )
    assert ck.KEEP == 2
    assert got["seconds_new"] == pytest.approx(0.3) and got["seconds_reused"] == pytest.approx(0.1)
    assert got["seconds"] == pytest.approx(0.2)


def test_the_job_is_whole_epochs_of_10_steps_and_the_model_needs_no_optimizer_bytes() -> None:
    assert ck.epochs_for(40) == 5 and ck.epochs_for(3) == 2
    x, y = ck.data()
    assert x.shape == (256 * 2 * 10, 784) and y.shape == (5120,)
    small = torch.nn.Linear(3, 2)
    assert ck.model_bytes(small) == {"state": (3 * 2 + 2) * 4, "optimizer": 0}


def test_the_pipeline_variant_splits_the_mlp_after_its_first_layer_over_two_stages() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    )
    graph, strategy = ck.job_of(model, None, 5, "none", "model_parallel")
    assert graph.node_ids == ["s0", "s1"]
    assert [list(p.node_ids) for p in strategy.partitions] == [["s0"], ["s1"]]
    assert [p.worker for p in strategy.partitions] == ["w0", "w1"]
    assert strategy.transport == "torch" and strategy.checkpoint_every is None
    graph, strategy = ck.job_of(model, 0, 5, "full", "data_parallel")
    assert graph.node_ids == ["mlp"]
    assert strategy.sharding == "full" and strategy.checkpoint_every == 0
