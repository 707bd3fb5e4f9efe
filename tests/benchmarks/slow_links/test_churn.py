"""benchmarks.slow_links.churn's arithmetic on hand-made curves and events, and the DDP
anchor's checkpoint: saved and loaded whole, and a run resumed from one trains on exactly as
one never stopped (real processes, one rank on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.slow_links import anchors, char_lm
from benchmarks.slow_links.bench import Curve
from benchmarks.slow_links.churn import (
    Plan,
    _steps_done,
    churn_steps,
    estimated_step,
    hidden_share,
    membership,
    restarted,
    steady_began,
    steady_curve,
    time_ratio,
)
from benchmarks.slow_links.links import LinkShape
from somatize.cli.cluster import free_port
from somatize.remote.jobs import JobEventInfo
from tests.utils import UNIT

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--ff", "64"]


def test_the_worker_is_lost_at_40_and_a_new_one_started_at_60_percent_of_s() -> None:
    assert churn_steps(206, 250) == (82, 124)
    assert churn_steps(None, 250) == (100, 150)  # never reached: all its steps
    assert churn_steps(1, 250) == (1, 2)  # always one after the other


def test_where_a_job_stands_is_its_last_mark_and_the_pace_since() -> None:
    assert estimated_step(None, began=100.0, pace=0.5, now=105.0) == 10.0
    assert estimated_step((25, 110.0), began=100.0, pace=0.5, now=112.0) == 29.0
    assert estimated_step((25, 110.0), began=100.0, pace=0.5, now=109.0) == 25.0  # (its clock)


def test_the_exchange_hidden_is_1_at_the_compute_and_0_at_diloco() -> None:
    assert hidden_share(stream=0.30, diloco=0.40, compute=0.30) == pytest.approx(1.0)
    assert hidden_share(stream=0.40, diloco=0.40, compute=0.30) == pytest.approx(0.0)
    assert hidden_share(stream=0.35, diloco=0.40, compute=0.30) == pytest.approx(0.5)
    assert hidden_share(stream=0.45, diloco=0.40, compute=0.30) == pytest.approx(-0.5)
    assert hidden_share(stream=0.35, diloco=0.30, compute=0.30) is None  # nothing to hide


def test_a_time_ratio_is_of_the_times_to_the_target() -> None:
    base = Curve("base", [(25, 10.0, 3.5), (50, 20.0, 3.0)], {})
    slower = Curve("slower", [(25, 15.0, 3.5), (50, 30.0, 3.0)], {})
    never = Curve("never", [(25, 15.0, 3.5), (50, 30.0, 3.2)], {})
    assert time_ratio(slower, base, 3.0) == pytest.approx(1.5)
    assert time_ratio(slower, base, 3.25) == pytest.approx(1.5)  # halfway, both
    assert time_ratio(never, base, 3.0) is None
    assert time_ratio(base, never, 3.0) is None


def test_ddp_with_restart_runs_on_from_the_kill_through_the_restart() -> None:
    """First life: started at t=1000, an epoch to step 25 in 50 s then 5 s of evaluation,
    killed at t=1085 after step 40 (30 s of training since the evaluation); second life: from
    the checkpoint of step 25, its clock started 12 s after the kill."""
    first = [
        {"started": 1000.0, "resumed_from": 0},
        {"epoch": 0, "step": 25, "seconds": 50.0, "eval_seconds": 5.0, "val_loss": 3.5},
    ]
    again = [
        {"started": 1097.0, "resumed_from": 25},
        {"epoch": 1, "step": 50, "seconds": 50.0, "eval_seconds": 5.0, "val_loss": 3.2},
        {"epoch": 2, "step": 75, "seconds": 105.0, "eval_seconds": 5.0, "val_loss": 3.0},
    ]
    curve = restarted("DDP with restart", first, again, killed_at=1085.0, killed_step=40)
    trained = 1085.0 - 1000.0 - 5.0  # the first life's training, to the kill
    assert curve.points == [
        (25, 50.0, 3.5),
        (50, trained + 12.0 + 50.0, 3.2),
        (75, trained + 12.0 + 100.0, 3.0),  # less the second life's first evaluation
    ]
    assert curve.said == {
        "killed_step": 40,
        "killed_at": trained,
        "restart_seconds": 12.0,
        "resumed_from": 25,
        "redone": 15,
    }


def test_membership_events_are_timed_from_the_training_start() -> None:
    events = [
        JobEventInfo(1, 10.0, "placed", {"workers": ["a", "b"]}),
        JobEventInfo(2, 30.0, "worker_lost", {"worker": "b", "step": 50, "replica": 1}),
        JobEventInfo(3, 31.0, "progress", {"phase": "training", "step": 50}),
        JobEventInfo(4, 31.5, "worker_dropped", {"worker": "b", "step": 50}),
        JobEventInfo(5, 60.0, "worker_joined", {"worker": "c", "lost": "b", "step": 100}),
    ]
    assert membership(events, began=20.0) == [
        {"event": "worker_lost", "seconds": 10.0, "step": 50, "worker": "b"},
        {"event": "worker_dropped", "seconds": 11.5, "step": 50, "worker": "b"},
        {"event": "worker_joined", "seconds": 40.0, "step": 100, "worker": "c"},
    ]


def _rounds(*chunks: tuple[float, float, str | None]) -> list[JobEventInfo]:
    """A job's events: placed at 0, then rounds of 25 steps, each (training seconds, then its
    evaluation's, and an event that came during it)."""
    events = [JobEventInfo(1, 0.0, "placed", {"workers": ["a"], "collective": "torch"})]
    at, step = 5.0, 0
    for seconds, evaluation, during in chunks:
        if during is not None:
            events.append(JobEventInfo(len(events) + 1, at + 1.0, during, {"step": step + 1}))
        at, step = at + seconds, step + 25
        events.append(
            JobEventInfo(len(events) + 1, at, "progress", {"phase": "training", "step": step})
        )
        at += evaluation
        epoch = {"phase": "epoch", "epoch": step // 25, "val_loss": 4.0 - step / 100}
        events.append(JobEventInfo(len(events) + 1, at, "progress", epoch))
    return events


def test_a_job_began_training_its_first_round_at_its_steady_pace_before_its_first_mark() -> None:
    """Rounds of 10 s (evaluations of 2 s after each left out), one slowed to 70 s by a lost
    worker: training began 10 s before the first mark, at 5 s, not at its average pace."""
    events = _rounds((10.0, 2.0, None), (70.0, 2.0, "worker_lost"), (10.0, 2.0, None))
    assert steady_began(events) == pytest.approx(5.0)
    curve = steady_curve("x", events)
    assert [round(t, 6) for _, t, _ in curve.points] == [10.0, 80.0, 90.0]
    assert curve.said["setup"] == pytest.approx(5.0)
    assert curve.said["collective"] == "torch" and "began" not in events[0].data  # a copy
    plain = _rounds(*((seconds, 2.0, None) for seconds in (10.0, 12.0, 11.0, 14.0)))
    assert steady_began(plain) == pytest.approx(5.0 + 10.0 - 12.0)  # the median round's
    assert steady_began(plain[:3]) is None  # one round: no pace


def test_the_steps_done_are_the_last_whole_line(tmp_path: Path) -> None:
    progress = tmp_path / "steps.jsonl"
    assert _steps_done(progress) == 0
    progress.write_text('{"step": 1, "time": 1.0}\n{"step": 2, "time": 2.0}\n{"ste')
    assert _steps_done(progress) == 2


def test_the_link_bound_workload_computes_less_per_byte() -> None:
    plain = Plan(LinkShape("100mbit", 0.01))
    bound = Plan(LinkShape("100mbit", 0.01), link_bound=True)
    assert bound.budget.per_replica < plain.budget.per_replica
    assert bound.budget.size.d_model > plain.budget.size.d_model
    assert (bound.section, plain.section) == ("slow_links_churn_link_bound", "slow_links_churn")
    quick = Plan(LinkShape("100mbit", 0.01), quick=True)
    assert quick.budget.epochs < plain.budget.epochs and quick.longer.epochs < plain.longer.epochs
    kill = round(0.4 * quick.budget.epochs * 25)
    assert quick.checkpoint_every <= kill  # the smoke's kill falls after a checkpoint


def test_a_checkpoint_restores_the_model_the_optimizer_and_the_rng(tmp_path: Path) -> None:
    given = ["--method", "ddp", "--rank", "0", "--world", "1", "--master", "x:1", "--out", "o"]
    saving = ["--checkpoint", str(tmp_path / "c.pt"), "--checkpoint-every", "5"]
    config = anchors.parse([*given, *saving, *TINY])
    assert config.checkpoint is not None
    model = char_lm.model(0, config.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, char_lm.VOCAB_SIZE, (2, char_lm.CONTEXT))
    char_lm.loss(model, x, x).backward()
    optimizer.step()
    anchors.save_checkpoint(config.checkpoint, config, 7, model, optimizer)
    draw = torch.rand(3)
    other = char_lm.model(1, config.size)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    steps = anchors.load_checkpoint(config.checkpoint, config, other, other_optimizer)
    assert steps == 7
    for mine, theirs in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    moments = other_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), draw)  # the RNG as it was when saved
    elsewhere = anchors.parse(
        ["--method", "ddp", "--rank", "0", "--world", "2", "--master", "x:1", "--out", "o"]
    )
    with pytest.raises(ValueError, match="plan"):
        anchors.load_checkpoint(config.checkpoint, elsewhere, other, other_optimizer)


def test_only_ddp_checkpoints_and_only_into_a_file() -> None:
    given = ["--rank", "0", "--world", "1", "--master", "x:1", "--out", "o"]
    with pytest.raises(SystemExit):
        anchors.parse(["--method", "diloco", *given, "--resume", "--checkpoint", "c"])
    with pytest.raises(SystemExit):
        anchors.parse(["--method", "ddp", *given, "--checkpoint-every", "5"])


def _ddp(tmp_path: Path, name: str, *more: str) -> list[dict[str, object]]:
    """One rank of the DDP anchor on loopback, 2 epochs of 4 steps on a tiny model: what rank
    0 wrote."""
    out = tmp_path / f"{name}.jsonl"
    argv = [sys.executable, "-m", "benchmarks.slow_links.anchors", "--method", "ddp"]
    argv += ["--rank", "0", "--world", "1", "--master", f"127.0.0.1:{free_port()}"]
    argv += ["--ifname", "lo", "--rows", "32", "--val-rows", "16", "--batch", "8"]
    argv += ["--epochs", "2", "--lr", "1e-2", "--out", str(out), *TINY, *more]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120 * UNIT)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_resumed_ddp_trains_on_exactly_as_one_never_stopped(tmp_path: Path) -> None:
    """Straight through, against: stopped after its first epoch (``--stop-loss`` any), its
    checkpoint taken there, then resumed."""
    checkpoint = ["--checkpoint", str(tmp_path / "c.pt"), "--checkpoint-every", "4"]
    straight = _ddp(tmp_path, "straight")
    stopped = _ddp(tmp_path, "stopped", *checkpoint, "--stop-loss", "1e9")
    resumed = _ddp(tmp_path, "resumed", *checkpoint, "--resume")
    assert [line["step"] for line in stopped[1:]] == [4]
    assert resumed[0]["resumed_from"] == 4 and resumed[0]["initial_val_loss"] is None
    assert [line["step"] for line in resumed[1:]] == [8]
    assert resumed[1]["val_loss"] == straight[2]["val_loss"]
    assert resumed[1]["train_loss"] == straight[2]["train_loss"]
