"""DataParallel's checkpoints in process (the coordinator's collective): saved where the policy
says, and a run resumed from any of them ends as the undisturbed run and a plain torch loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from coordinator.context import InMemoryContext
from coordinator.errors import StrategyFailed
from coordinator.storage.checkpoints import CheckpointPolicy, CheckpointStore, JobCheckpoints
from coordinator.strategies.data_parallel.checkpoints import ReplicaCheckpoints, Shards
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from coordinator.strategies.kept_on_worker import KeptLimit
from protocol.errors import ErrorCode
from protocol.options.strategies import DataParallelOptions
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    inputs,
    reference_training,
)
from worker.daemon.main import Daemon


def _run(strategy, job, store=None, resume=None):
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))

    if store is not None:
        saves = JobCheckpoints("job", store, strategy.keep_checkpoints, emit, resume)
        job = dataclasses.replace(job, checkpoints=saves)
    states = asyncio.run(strategy.run(InMemoryContext(2, Daemon), job, emit))
    return states, events


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_run_resumed_from_a_checkpoint_ends_as_the_undisturbed_run(tmp_path, optimizer):
    x, y = dataset()
    job = inputs(graph_for(optimizer, shuffle=True), x, y)
    store = CheckpointStore(tmp_path)
    strategy = DataParallel(
        DataParallelOptions(
            workers=2, collective="coordinator", checkpoint_every=5, keep_checkpoints=10
        )
    )
    straight, events = _run(strategy, job, store)
    saved = [data for event, data in events if event == "checkpoint"]
    assert [c["step"] for c in saved] == [5, 10, 15, 20, 21]  # 21 steps: the end too
    assert [c["epoch"] for c in saved] == [1, 2, 3, 3, 3]  # 7 steps an epoch
    expected = reference_training(x, y, optimizer, shuffle=True)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(straight["mlp"][key]), value, atol=1e-5, rtol=0)

    chosen = [store.read("job", seq) for seq, _ in store.positions("job")[1:3]]
    for checkpoint in chosen:  # from step 10, then from step 15
        seq, position = checkpoint.seq, checkpoint.position
        again = CheckpointStore(tmp_path / f"from-{seq}")
        resumed, events = _run(
            DataParallel(DataParallelOptions(workers=2, collective="coordinator")),
            job,
            again,
            checkpoint,
        )
        assert ("resumed", position | {"checkpoint": seq}) in events
        steps = [d["step"] for e, d in events if e == "progress" and "step" in d]
        assert steps[0] == position["step"] + 1 and steps[-1] == 21
        assert not any(d.get("phase") == "fitting" for e, d in events)  # states came back
        for key, value in straight["mlp"].items():
            torch.testing.assert_close(resumed["mlp"][key], value, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            torch.as_tensor(resumed["center"]["mean"]), torch.as_tensor(straight["center"]["mean"])
        )


def test_the_default_saves_at_each_epochs_end_and_zero_saves_nothing(tmp_path):
    x, y = dataset()
    job = inputs(graph_for("sgd"), x, y)
    _, events = _run(
        DataParallel(DataParallelOptions(workers=2, collective="coordinator")),
        job,
        CheckpointStore(tmp_path),
    )
    assert [d["step"] for e, d in events if e == "checkpoint"] == [7, 14, 21]
    off = DataParallel(DataParallelOptions(workers=2, collective="coordinator", checkpoint_every=0))
    _, events = _run(off, job, CheckpointStore(tmp_path / "off"))
    assert not [e for e, _ in events if e.startswith("checkpoint")]


def _kept(*files, size=1):
    return [
        {"kept": f"k{i}", "files": {name: size for name in names}} for i, names in enumerate(files)
    ]


MODEL = {"mlp": [[16, 6], [16], [3, 16], [3]]}
"""A model's trainable parameters' shapes (working_model's): 163 values in 4 tensors."""


def _shards(ctx, said, limit=None):
    limit = limit or KeptLimit.of(MODEL, len(said))
    return asyncio.run(Shards.of(ctx, said, {}, {}, limit))


def test_a_sharded_checkpoint_is_refused_by_a_run_that_is_not_sharded(tmp_path):
    """The replicas of a run not sharded would each have to load the whole model: the run
    fails saying how to resume it, rather than load it whole."""
    x, y = dataset()
    store = CheckpointStore(tmp_path)
    said = _shards(None, _kept([".metadata", "__0_0.distcp"], ["__1_0.distcp"]))
    assert said.sizes() == {".metadata": 1, "__0_0.distcp": 1, "__1_0.distcp": 1}
    payload = said.payload()
    assert payload["shards"]["by_replica"] == [[".metadata", "__0_0.distcp"], ["__1_0.distcp"]]
    writer = store.shards_writer("job")
    for name in said.sizes():
        file = writer.open(name)
        file.write(b"x")
        writer.close(file)
    saved = store.write("job", {"step": 7, "epoch": 1}, payload, keep=2, shards=writer)
    strategy = DataParallel(DataParallelOptions(workers=2, collective="coordinator"))
    with pytest.raises(StrategyFailed, match="resume it with sharding='full'") as failed:
        _run(strategy, inputs(graph_for("sgd", epochs=2), x, y), store, saved)
    assert failed.value.info.code is ErrorCode.STATE_MISMATCH


@pytest.mark.parametrize(
    ("kept", "said"),
    [
        (_kept([".metadata"], [".metadata"]), r"saved a file \.metadata"),
        ([{"kept": "k0", "files": {".metadata": 1}}, {"files": {}}], "not kept on its worker"),
    ],
)
def test_replicas_files_that_do_not_add_up_are_refused(kept, said):
    with pytest.raises(StrategyFailed, match=said) as failed:
        _shards(None, kept)
    assert failed.value.info.code is ErrorCode.STATE_MISMATCH


def test_shards_a_checkpoint_does_not_save_are_dropped_where_they_were_kept():
    """A snapshot whose checkpoint is no longer due (one due by time, after another was
    saved) is not written: its files are dropped from every replica's worker, not left there
    for the job's life."""
    dropped: list[tuple[int, str]] = []

    class Workers:
        async def drop_kept(self, i, kept):
            dropped.append((i, kept))

    shards = _shards(Workers(), _kept([".metadata", "__0_0.distcp"], ["__1_0.distcp"]))
    never = CheckpointPolicy(0, 10, lambda: 0.0)  # checkpoint_every=0: never due
    saves = ReplicaCheckpoints(checkpoints=None, policy=never, run=None, epochs=1)
    asyncio.run(saves.save(5, 10, shards))
    assert sorted(dropped) == [(0, "k0"), (1, "k1")]


def test_kept_files_beyond_what_a_checkpoint_of_the_model_can_be_are_refused_unread():
    """Issue 53, Medium 4: a hostile replica once kept 20,000 files, 860 MB, for a checkpoint
    of a 2.5 KB model, all read into the store. Files beyond the model's bound (their count,
    or their bytes: its values in float64 four times over, with headers) fail the checkpoint
    resource_limit before a byte is read, and every worker drops them."""
    dropped: list[tuple[int, str]] = []

    class Workers:
        async def drop_kept(self, i, kept):
            dropped.append((i, kept))

    limit = KeptLimit.of(MODEL, 2)
    assert limit.files == 9
    assert limit.nbytes == 4 * 8 * 163 + (64 << 10) * (4 * 4 + 9)
    many = _kept([".metadata", *(f"__0_{k}.distcp" for k in range(20_000))], ["__1_0.distcp"])
    large = _kept([".metadata", "__0_0.distcp"], ["__1_0.distcp"], size=860 << 20)
    for said, says in (
        (many, "20002 files of 20002 bytes"),
        (large, "3 files of 2705326080 bytes"),
    ):
        dropped.clear()
        with pytest.raises(StrategyFailed, match=f"kept {says} for a checkpoint") as failed:
            _shards(Workers(), said, limit)
        assert failed.value.info.code is ErrorCode.RESOURCE_LIMIT
        assert "none of it was read" in str(failed.value)
        assert sorted(dropped) == [(0, "k0"), (1, "k1")]
    fits = _kept([".metadata", "__0_0.distcp"], ["__1_0.distcp"], size=4 << 10)
    assert _shards(Workers(), fits, limit).sizes()["__1_0.distcp"] == 4 << 10
