"""benchmarks.pipeline's arithmetic and its torch.distributed.pipelining anchor (a tiny run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.allreduce import mlp
from benchmarks.anchors import pipelining
from benchmarks.pipeline import MLP_SIZES, chunk_steps, falls, rows
from benchmarks.roundtrip import Processes


def test_chunked_events_give_each_batch_its_share_of_the_interval_after_warm_up() -> None:
    # events at global batches 1, 3, 7, 11 (chunks 1, 2, 4, 4); warm-up 3: from batch 3 on
    events = [(0.0, 1, 1, [2.3]), (1.0, 3, 2, [2.3] * 2), (3.0, 7, 4, [2.2] * 4)]
    events.append((7.0, 11, 4, [2.1] * 4))
    per_batch, span = chunk_steps(events, warmup=3)
    assert per_batch == [0.5] * 4 + [1.0] * 4
    assert span == pytest.approx(6.0 / 8)


def test_too_few_events_past_the_warm_up_give_no_figure() -> None:
    per_batch, span = chunk_steps([(0.0, 1, 1, [2.3]), (1.0, 3, 2, [2.3, 2.3])], warmup=3)
    assert per_batch == []
    assert math.isnan(span)


def test_a_loss_falls_when_its_last_values_are_below_its_first() -> None:
    assert falls([2.3, 2.3, 2.2, 2.1, 2.0, 1.9])
    assert not falls([2.0, 2.1, 2.2, 2.3])
    assert not falls([2.3])


def test_the_anchor_builds_and_splits_the_model_as_ours() -> None:
    ours, theirs = mlp(MLP_SIZES), pipelining.build(MLP_SIZES, 0)
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    head, tail = pipelining.split(theirs)
    assert [type(m) for m in head] == [torch.nn.Linear, torch.nn.ReLU]
    assert head[0].out_features == tail[0].in_features == MLP_SIZES[1]


def test_the_data_are_reproducible_and_labelled_by_their_first_features() -> None:
    x, y = pipelining.data((16, 8, 10), 4, 3, seed=0)
    x2, y2 = pipelining.data((16, 8, 10), 4, 3, seed=0)
    assert x.shape == (12, 16) and y.shape == (12,)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(y, x[:, :10].argmax(dim=1))


def test_rows_hold_ours_on_torch_to_the_anchor() -> None:
    step = {"p50_ms": 110.0, "min_ms": 100.0, "max_ms": 120.0, "n": 10}
    anchor = {"p50_ms": 100.0, "min_ms": 90.0, "max_ms": 110.0, "n": 10}
    by_m = {m: {"ours": step, "anchor": anchor, "bubble": 0.2} for m in (2, 4, 8)}
    micro = {"single": anchor, "by_m": {1: {"step": step, "bubble": 0.5}}, "speedup_8_vs_1": 1.5}
    act = {"mb_s": {"direct": 100.0, "relay": 50.0, "ws": 200.0}}
    results = {"torch": {"gpipe": by_m, "1f1b": by_m}, "micro": micro, "activation": act}
    out = rows(results)
    torch_rows = [r for r in out if "transport torch" in r.name]
    assert len(torch_rows) == 6
    assert all(r.target is not None and r.target.op == "<=" for r in torch_rows)
    assert all(r.ratio == pytest.approx(1.1) and r.met for r in torch_rows)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", pipelining.SCHEDULES)
def test_the_anchor_trains_in_two_processes(tmp_path: Path, schedule: str) -> None:
    sizes, steps = (12, 32, 16, 4), 6
    with Processes(tmp_path) as procs:
        result = pipelining.run_anchor(procs, sizes, 16, 4, schedule, steps, seed=0, lr=0.5)
        assert all(proc.poll() is not None for proc in procs.procs.values())
    assert len(result["times"]) == steps + 1
    assert result["times"] == sorted(result["times"])
    assert len(result["losses"]) == steps
    # the same SGD in one process: equal losses, step for step
    model = pipelining.build(sizes, 0)
    x, y = pipelining.data(sizes, 16, steps, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step, loss in enumerate(result["losses"]):
        opt.zero_grad()
        batch = slice(step * 16, (step + 1) * 16)
        expected = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), abs=1e-4)
