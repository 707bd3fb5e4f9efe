"""Elastic DataParallel in memory: replicas lost at every phase of a run (the in-memory
counterpart of a connection closing, :meth:`InMemoryContext.lose`), replaced by spare workers,
and the result still equal to the independent plain-torch loop. Live: test_data_parallel_live.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.context import InMemoryContext, WorkerCallError
from coordinator.strategies import DataParallel, StrategyFailed, StrategyOptionsError
from protocol.errors import ErrorCode
from protocol.options.strategies import DataParallelOptions
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    inputs,
    reference_training,
)
from worker.daemon.main import Daemon

STEPS = 3 * 7  # 3 epochs of ceil(203 / 32) steps


def run_losing(
    optimizer: str,
    losses: dict[tuple[str, int | None], list[int]],
    *,
    workers: int = 2,
    spares: int = 1,
    elastic: bool = True,
    timeout: float = 5.0,
):
    """Train ``graph_for(optimizer)`` elastically, losing replicas ``losses[(phase, step)]``
    right after the progress event of that phase (and step) was emitted: the next call on each
    fails with ``worker_lost``, after the other replicas' calls of the same round ran."""
    x, y = dataset()
    ctx = InMemoryContext(workers, Daemon, spares=spares)
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))
        if event == "progress":
            for i in losses.pop((data["phase"], data.get("step")), []):
                ctx.lose(i, "killed by the test")

    strategy = DataParallel(
        DataParallelOptions(workers=workers, elastic=elastic, elastic_timeout=timeout)
    )
    states = asyncio.run(strategy.run(ctx, inputs(graph_for(optimizer), x, y), emit))
    assert not losses, f"never reached: {losses}"
    return states, events, x, y


def assert_equals_reference(states, x, y, optimizer):
    for key, value in reference_training(x, y, optimizer).items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("optimizer", "phase", "step", "replica"),
    [
        ("sgd", "training", 5, 1),  # mid-training: the survivor applied step 5's mean
        ("adam", "training", 9, 0),  # the first replica goes: copy from the second
        ("adam", "training", STEPS, 1),  # the last mean is applied on its own: lost there
        ("sgd", "loading", None, 0),  # before anything was staged
        ("adam", "fitting", None, 1),  # while the plain prefix is fitted per shard
    ],
)
def test_a_replica_lost_at_any_phase_is_replaced_and_the_result_equals_the_reference(
    optimizer, phase, step, replica
):
    states, events, x, y = run_losing(optimizer, {(phase, step): [replica]})
    assert_equals_reference(states, x, y, optimizer)
    kinds = [kind for kind, _ in events]
    lost = next(data for kind, data in events if kind == "worker_lost")
    assert lost["worker"] == f"mem-{replica}" and lost["code"] == "worker_lost"
    replaced = next(data for kind, data in events if kind == "worker_replaced")
    assert (replaced["lost"], replaced["worker"], replaced["replica"]) == (
        f"mem-{replica}",
        "mem-2",
        replica,
    )
    # Every step was reported once, in order: the failed one was resumed, not skipped or redone.
    steps = [d["step"] for k, d in events if k == "progress" and d["phase"] == "training"]
    assert steps == list(range(1, STEPS + 1))
    if phase == "training" and step < STEPS:
        # Lost during step + 1, replaced and restored from a survivor, then step + 1 completes.
        assert lost["step"] == step + 1
        at = kinds.index("worker_lost")
        assert kinds[at : at + 3] == ["worker_lost", "worker_replaced", "worker_restored"]
        restored = events[at + 2][1]
        assert restored["from"] == f"mem-{1 - replica}" and restored["worker"] == "mem-2"
        assert events[at + 3] == ("progress", events[at + 3][1])
        assert events[at + 3][1]["step"] == step + 1


def test_two_losses_at_different_steps_each_get_a_replacement():
    states, events, x, y = run_losing(
        "adam", {("training", 3): [0], ("training", 11): [1]}, workers=2, spares=2
    )
    assert_equals_reference(states, x, y, "adam")
    replaced = [(d["lost"], d["worker"]) for k, d in events if k == "worker_replaced"]
    assert replaced == [("mem-0", "mem-2"), ("mem-1", "mem-3")]


def test_three_replicas_one_lost_equals_the_reference():
    states, _, x, y = run_losing("sgd", {("training", 7): [2]}, workers=3)
    assert_equals_reference(states, x, y, "sgd")


def test_no_replacement_within_the_timeout_fails_saying_it_waited():
    with pytest.raises(StrategyFailed) as failure:
        run_losing("sgd", {("training", 4): [1]}, spares=0, timeout=0.2)
    info = failure.value.info
    assert info.code is ErrorCode.NOT_ENOUGH_WORKERS
    assert "replica 1 lost its worker 'mem-1' at step 5" in info.message
    assert "waited 0.2s for a replacement (2 workers) and none came" in info.message
    assert info.detail["worker_id"] == "mem-1" and info.detail["step"] == 5


def test_every_replica_lost_at_once_fails_with_nothing_to_copy_from():
    with pytest.raises(StrategyFailed) as failure:
        run_losing("sgd", {("training", 4): [0, 1]}, spares=2)
    info = failure.value.info
    assert info.code is ErrorCode.WORKER_LOST
    assert "every replica was lost at step 5, leaving no survivor to copy" in info.message
    assert sorted(info.detail["lost"]) == ["mem-0", "mem-1"]


def test_every_replica_lost_while_loading_is_recovered_there_is_nothing_to_copy_yet():
    states, _, x, y = run_losing("sgd", {("loading", None): [0, 1]}, spares=2)
    assert_equals_reference(states, x, y, "sgd")


def test_without_elastic_a_lost_replica_fails_the_job_at_once_naming_it():
    with pytest.raises(WorkerCallError) as failure:
        run_losing("sgd", {("training", 4): [1]}, elastic=False)
    assert failure.value.code is ErrorCode.WORKER_LOST
    assert failure.value.worker_id == "mem-1"


def test_elastic_options_are_checked():
    parsed = DataParallel.from_options({"workers": 2, "elastic": True})
    assert parsed.options.elastic_timeout == 60.0
    with pytest.raises(StrategyOptionsError, match="elastic must be True or False, not 'yes'"):
        DataParallel.from_options({"workers": 2, "elastic": "yes"})
    for bad in (0, -1, float("inf"), True, "10"):
        with pytest.raises(StrategyOptionsError, match="elastic_timeout must be a positive"):
            DataParallel.from_options({"workers": 2, "elastic": True, "elastic_timeout": bad})


def test_a_step_that_loses_its_replica_every_time_fails_after_a_bounded_number_of_recoveries():
    """A replica that dies again as soon as it is restored (a filter that kills its worker on
    those rows, say) must not be replaced forever."""
    x, y = dataset()
    ctx = InMemoryContext(2, Daemon, spares=10)

    async def emit(event, data):
        if (event == "progress" and data.get("step") == 5) or event == "worker_restored":
            ctx.lose(1, "killed again")

    strategy = DataParallel(DataParallelOptions(workers=2, elastic=True, elastic_timeout=5))
    with pytest.raises(StrategyFailed) as failure:
        asyncio.run(strategy.run(ctx, inputs(graph_for("sgd"), x, y), emit))
    info = failure.value.info
    assert info.code is ErrorCode.WORKER_LOST
    assert info.message.startswith("step 6: replicas were lost 3 times over; the last: worker")
    assert "killed again" in info.message
    assert ctx.spares == 10 - 3
