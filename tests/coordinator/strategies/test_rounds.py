"""The round loop: run() calls a round strategy's hooks in the paper's order, round after round,
from the round a run starts at (a resumed one skips the rounds it had done)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from coordinator.strategies.base import JobInputs, Placement
from coordinator.strategies.rounds import RoundStrategy
from protocol.options.base import RestartOptions


class _Options(RestartOptions):
    name = "counted"


@dataclass
class _Run:
    round: int
    calls: list[str] = field(default_factory=list)


class _Counted(RoundStrategy[_Run, int]):
    """Three rounds; every hook notes itself."""

    options_model = _Options

    def __init__(self, start_at: int = 0) -> None:
        super().__init__(_Options())
        self.start_at = start_at
        self.run_record = _Run(start_at)

    @property
    def rounds(self) -> int:
        return 3

    def placement(self) -> Placement:
        return Placement(workers=1)

    async def start(self, ctx: Any, job: JobInputs, emit: Any) -> _Run:
        self.run_record.calls.append("start")
        return self.run_record

    async def configure_round(self, run: _Run, t: int) -> int:
        run.calls.append(f"configure {t}")
        return t

    async def train_round(self, run: _Run, work: int) -> None:
        run.calls.append(f"train {work}")

    async def aggregate_round(self, run: _Run, work: int) -> None:
        run.calls.append(f"aggregate {work} (done {run.round})")

    async def evaluate_round(self, run: _Run, work: int) -> None:
        run.calls.append(f"evaluate {work} (done {run.round})")

    async def record_round(self, run: _Run, work: int) -> None:
        run.calls.append(f"record {work}")

    async def checkpoint_round(self, run: _Run, work: int) -> None:
        run.calls.append(f"checkpoint {work}")

    async def finish(self, run: _Run) -> None:
        run.calls.append("finish")

    async def final_states(self, run: _Run) -> dict[str, Any]:
        run.calls.append("final")
        return {"done": run.round}


def _job() -> JobInputs:
    return JobInputs(node_ids=[], filters={}, x=None, y=None)


def test_the_loop_calls_the_hooks_in_order_and_counts_the_round_after_aggregating():
    strategy = _Counted()
    assert asyncio.run(strategy.run(None, _job(), None)) == {"done": 3}  # type: ignore[arg-type]
    round_2 = [
        "configure 2",
        "train 2",
        "aggregate 2 (done 1)",
        "evaluate 2 (done 2)",
        "record 2",
        "checkpoint 2",
    ]
    calls = strategy.run_record.calls
    assert calls[0] == "start" and calls[-2:] == ["finish", "final"]
    assert calls[7:13] == round_2 and len(calls) == 1 + 3 * 6 + 2


def test_a_run_that_starts_at_a_checkpoint_trains_only_the_rounds_left():
    strategy = _Counted(start_at=2)
    asyncio.run(strategy.run(None, _job(), None))  # type: ignore[arg-type]
    calls = strategy.run_record.calls
    assert [c for c in calls if c.startswith("configure")] == ["configure 3"]
    assert strategy.name == "counted"
