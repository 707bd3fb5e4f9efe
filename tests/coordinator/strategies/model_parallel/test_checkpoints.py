"""ModelParallel's checkpoints and stage failover on in-memory stages: saved where the policy
says, a run resumed from one ends as the undisturbed run and the unsplit model in a plain torch
loop, and a lost stage moves to a spare without changing the result."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from coordinator.context import InMemoryContext, WorkerIdentity
from coordinator.storage.checkpoints import CheckpointStore, JobCheckpoints
from coordinator.strategies import JobInputs, ModelParallel, StrategyFailed
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from protocol.options.strategies import ModelParallelOptions, PartitionOptions
from somatize.remote.client import graph_info
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    graph,
    reference,
)
from worker.daemon.main import Daemon

SPLIT = [("center",), ("a", "b"), ("c",)]
"""A plain filter's stage in front of two that train: the resumed run must apply it again."""


class LosesAStage(InMemoryContext):
    """Stage 1's first worker goes at its ``lose_at``-th forward of a micro-batch."""

    lose_at = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0

    async def call(self, worker_idx, request, **kwargs):
        if request.cmd == "stage_forward" and self.workers[worker_idx].id == "w1":
            self.forwards += 1
            if self.forwards == self.lose_at:
                self.lose(worker_idx, "killed by the test")
        return await super().call(worker_idx, request, **kwargs)


def run(strategy, job, store=None, resume=None, spares=0, lose_at=0):
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))

    if store is not None:
        saves = JobCheckpoints("job", store, strategy.keep_checkpoints, emit, resume)
        job = dataclasses.replace(job, checkpoints=saves)
    workers = [WorkerIdentity(f"w{i}", frozenset({f"stage{i}"})) for i in range(len(SPLIT))]
    workers += [WorkerIdentity(f"spare{k}") for k in range(spares)]
    ctx = LosesAStage(workers, Daemon)
    ctx.lose_at = lose_at
    strategy.validate(job)
    states = asyncio.run(strategy.run(ctx, job, emit))
    return states, events


def pipeline(optimizer: str = "adam", **options) -> ModelParallel:
    parts = [PartitionOptions(node_ids=nodes, tag=f"stage{i}") for i, nodes in enumerate(SPLIT)]
    return ModelParallel(ModelParallelOptions(partitions=parts, micro_batches=2, **options))


def inputs(optimizer: str = "adam", epochs: int = 3):
    x, y = dataset()
    g = graph(optimizer, epochs=epochs)
    return JobInputs(g.node_ids, {n: dump_filter(f) for n, f in g.items()}, x, y, graph_info(g))


def assert_states(states, expected, atol=1e-5):
    for node in "abc":
        for key, value in expected[node].items():
            torch.testing.assert_close(
                torch.as_tensor(states[node][key]), torch.as_tensor(value), rtol=0, atol=atol
            )


def test_a_pipeline_resumed_from_a_checkpoint_ends_as_the_undisturbed_run(tmp_path):
    job = inputs("adam")
    store = CheckpointStore(tmp_path)
    straight, events = run(pipeline(checkpoint_every=5, keep_checkpoints=10), job, store)
    saved = [data for event, data in events if event == "checkpoint"]
    assert [c["step"] for c in saved] == [5, 10, 12]  # 60 rows in batches of 16: 4 an epoch
    assert [c["epoch"] for c in saved] == [2, 3, 3]
    x, y = dataset()
    assert_states(straight, reference(x, y, "adam", epochs=3))
    for seq, position in store.positions("job")[:2]:  # after batch 5, 10 (12 is the end)
        checkpoint = store.read("job", seq)
        again = CheckpointStore(tmp_path / f"from-{seq}")
        resumed, events = run(pipeline(), job, again, checkpoint)
        assert ("resumed", position | {"checkpoint": seq}) in events
        steps = [d["step"] for e, d in events if e == "progress" and "step" in d]
        assert steps[0] == position["step"] + 1 and steps[-1] == 12
        assert_states(resumed, {n: straight[n] for n in "abc"}, atol=1e-6)
        np.testing.assert_array_equal(resumed["center"]["mean"], straight["center"]["mean"])


def test_the_default_saves_at_each_epochs_end_and_zero_saves_nothing(tmp_path):
    job = inputs("sgd", epochs=2)
    _, events = run(pipeline(), job, CheckpointStore(tmp_path))
    assert [d["step"] for e, d in events if e == "checkpoint"] == [4, 8]  # and the end
    _, events = run(pipeline(checkpoint_every=0), job, CheckpointStore(tmp_path / "off"))
    assert not [e for e, _ in events if e.startswith("checkpoint")]


@pytest.mark.parametrize("every", [3, 0])
def test_a_lost_stage_fails_over_to_a_spare_and_the_result_is_the_undisturbed_runs(tmp_path, every):
    """Lost in its 15th micro-batch forward (batch 8: 2 a batch), stage 1 moves to the spare;
    every stage goes back to the checkpoint after batch 6 (``every=3``) or, keeping none, to
    the start — and the result is the plain torch loop's."""
    job = inputs("adam")
    states, events = run(
        pipeline(checkpoint_every=every), job, CheckpointStore(tmp_path), spares=1, lose_at=15
    )
    x, y = dataset()
    assert_states(states, reference(x, y, "adam", epochs=3))
    kinds = [e for e, _ in events]
    lost = next(d for e, d in events if e == "worker_lost")
    assert lost["stage"] == 1 and lost["worker"] == "w1" and lost["code"] == "worker_lost"
    replaced = next(d for e, d in events if e == "worker_replaced")
    assert replaced == {"stage": 1, "lost": "w1", "worker": "spare0"}
    after = kinds.index("worker_replaced")
    if every:
        assert ("resumed", {"step": 6, "epoch": 2}) in events[after:]
        steps = [d["step"] for e, d in events[after:] if e == "progress" and "step" in d]
        assert steps[0] == 7 and steps[-1] == 12
    else:
        assert "resumed" not in kinds
        steps = [d["step"] for e, d in events[after:] if e == "progress" and "step" in d]
        assert steps[0] == 1 and steps[-1] == 12


def test_with_no_spare_left_a_lost_stage_fails_the_job_naming_it(tmp_path):
    with pytest.raises(StrategyFailed) as failed:
        run(pipeline(), inputs("sgd"), CheckpointStore(tmp_path), spares=0, lose_at=3)
    assert failed.value.info.code is ErrorCode.WORKER_LOST
    assert failed.value.info.detail["stage"] == 1
    assert "on worker 'w1'" in failed.value.info.message
    assert failed.value.info.message.endswith("; no spare is left")
