"""Placement by device: the rule on its own (``Placement``, ``Target``, the registry's identity),
then the job manager over the in-memory harness: which workers a device job gets, what it waits
for, and a device no worker has refused at submit naming the devices there are."""

from __future__ import annotations

import pytest

from coordinator.context import InMemoryContext, Target, TargetError, WorkerIdentity
from coordinator.jobs.submission import WAIT_HINT
from coordinator.strategies import Placement
from coordinator.workers.registry import WorkerState
from protocol.errors import ErrorCode, RequestRefused
from tests.coordinator.jobs.harness import Harness, run, submit
from tests.utils import UNIT
from worker.daemon.main import Daemon

CPU = WorkerIdentity("c", frozenset({"t"}), {"mnist": 60})
GPU0 = WorkerIdentity("g0", frozenset({"t"}), {"mnist": 60}, device="cuda:0")
GPU1 = WorkerIdentity("g1", frozenset(), device="cuda:1")
MPS = WorkerIdentity("m", frozenset({"t"}), device="mps")

# -- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "accepted"),
    [
        (None, ["c", "g0", "g1", "m"]),
        ("cpu", ["c"]),
        ("cuda", ["g0", "g1"]),
        ("cuda:1", ["g1"]),
        ("mps", ["m"]),
    ],
)
def test_a_placement_accepts_only_workers_on_its_device(device, accepted):
    placement = Placement(workers=1, device=device)
    assert [w.id for w in (CPU, GPU0, GPU1, MPS) if placement.accepts(w)] == accepted


def test_the_device_is_combined_with_the_tag_id_and_dataset_rules():
    tagged = Placement(workers=1, tag="t", device="cuda")
    assert [w.id for w in (CPU, GPU0, GPU1, MPS) if tagged.accepts(w)] == ["g0"]
    by_id = Placement(workers=1, worker_id="g1", device="cuda")
    assert [w.id for w in (CPU, GPU0, GPU1, MPS) if by_id.accepts(w)] == ["g1"]
    assert not Placement(workers=1, worker_id="g1", device="cpu").accepts(GPU1)
    with_data = Placement(workers=1, dataset="mnist", device="cuda")
    assert [w.id for w in (CPU, GPU0, GPU1, MPS) if with_data.accepts(w)] == ["g0"]


def test_choose_skips_workers_on_another_device_keeping_registration_order():
    idle = [CPU, GPU0, MPS, GPU1]
    assert Placement(workers=2, device="cuda").choose(idle) == [1, 3]
    assert Placement(workers=3, device="cuda").choose(idle) is None
    assert Placement(workers=1, device="cuda", all_matching=True).choose(idle) == [1, 3]
    # A slot on a device takes a worker with the tag on that device, even after others.
    slots = (Target(tag="t", device="mps"), Target(tag="t"))
    assert Placement(workers=2, slots=slots).choose(idle) == [2, 0]
    assert Placement(workers=1, slots=(Target(tag="t", device="cuda:1"),)).choose(idle) is None


def test_a_placement_says_which_device_it_waits_for():
    assert Placement(workers=2, device="cuda").describe() == "2 workers on cuda"
    assert Placement(workers=1, tag="t", device="cpu").describe() == "1 worker tagged 't' on cpu"
    slots = Placement(workers=2, slots=(Target(tag="s0", device="cuda:0"), Target(id="w")))
    assert slots.describe() == "2 workers: tag 's0' on cuda:0, worker 'w'"
    assert slots.devices() == ["cuda:0"]
    assert Placement(workers=2).devices() == []


def test_the_registry_identity_carries_the_announced_device(tmp_path):
    h = Harness(tmp_path)
    try:
        assert h.worker("a").identity.device == "cpu"
        assert h.worker("b", device="cuda:3").identity == WorkerIdentity("b", device="cuda:3")
    finally:
        h.store.close()


def test_worker_for_answers_a_target_only_on_its_device():
    ctx = InMemoryContext([CPU, GPU0], Daemon)
    assert ctx.worker_for(Target(tag="t")) == 0
    assert ctx.worker_for(Target(tag="t", device="cuda")) == 1
    with pytest.raises(TargetError, match="no worker answers to tag 't' on mps"):
        ctx.worker_for(Target(tag="t", device="mps"))


# -- the job manager ---------------------------------------------------------------------------


def test_a_device_no_worker_has_is_refused_at_submit_naming_the_devices(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("w1")
            h.worker("w2", "gpu")
            for msg in [
                submit("data_parallel", workers=2, device="cuda"),
                submit("local", tag="gpu", device="cuda"),
                submit("fedavg", rounds=1, device="cuda"),
            ]:
                with pytest.raises(RequestRefused) as caught:
                    await h.manager.submit(msg)
                info = caught.value.info
                assert info.code is ErrorCode.NO_WORKERS
                assert info.message == (
                    "no worker has device 'cuda' (workers: w1 cpu, w2 cpu)" + WAIT_HINT
                )
                assert info.detail == {"device": "cuda", "devices": ["cpu"]}
            assert h.store.list(None, 10) == []

    run(main())


def test_a_pipeline_stage_device_no_worker_has_is_refused(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "s0")
            h.worker("g", "s1", device="cuda:0")
            on_cuda1 = submit(
                "model_parallel",
                partitions=[
                    {"node_ids": ["c"], "tag": "s0"},
                    {"node_ids": ["lin"], "tag": "s1", "device": "cuda:1"},
                ],
            )
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(on_cuda1)
            assert caught.value.info.code is ErrorCode.NO_WORKERS
            assert caught.value.info.message == (
                "no worker has device 'cuda:1' (workers: a cpu, g cuda:0)" + WAIT_HINT
            )
            # cuda exists, but not where the stage is pinned: s0 is only on a cpu worker.
            s0_on_cuda = submit(
                "model_parallel",
                partitions=[{"node_ids": ["c"], "tag": "s0"}, {"node_ids": ["lin"], "tag": "s1"}],
                device="cuda",
            )
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(s0_on_cuda)
            assert caught.value.info.message == (
                "no worker answers to tag 's0' on cuda (workers: a cpu, g cuda:0)" + WAIT_HINT
            )
            assert h.store.list(None, 10) == []

    run(main())


def test_a_device_job_before_any_worker_registered_is_refused(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(submit("local", device="cpu"))
            assert caught.value.info.message == (
                "no worker has device 'cpu' (workers: none)" + WAIT_HINT
            )

    run(main())


def test_a_device_job_waits_for_workers_on_its_device_and_says_so(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            h.worker("g0", device="cuda:0")
            msg = submit("data_parallel", workers=2, device="cuda")
            waits = msg.model_copy(update={"wait_for_workers": 60.0})  # one on cuda yet
            job_id = await h.manager.submit(waits)
            await h.settle()
            record = await h.manager.record(job_id)
            assert record["state"] == "queued"
            assert record["summary"]["placement"] == "2 workers on cuda"
            events = await h.events_until(job_id, "queued")
            assert events[0].data == {"placement": "2 workers on cuda", "wait_for_workers": 60.0}

            h.worker("b")  # a second idle worker, but on the cpu: still waiting
            await h.settle()
            assert (await h.manager.record(job_id))["state"] == "queued"
            assert h.contexts == []

            h.worker("g1", device="cuda:1")
            result = await h.manager.result(job_id, wait=30 * UNIT)
            assert sorted(result["states"]) == ["c", "lin"]
            assert result["record"]["workers"] == ["g0", "g1"]
            assert [w.identity.device for w in h.contexts[0].placed.workers] == ["cuda:0", "cuda:1"]
            placed = (await h.events_until(job_id, "placed"))[-1]
            assert placed.data == {
                "workers": ["g0", "g1"],
                "devices": ["cuda:0", "cuda:1"],
                "collective": "coordinator",
                "collective_reason": "the workers are in-process and share one process",
                "step_bytes": 4 * (3 * 2 + 2),  # Linear(3, 2): 8 fp32 gradients a step
            }

    run(main())


def test_a_cpu_job_is_placed_on_a_cpu_worker_past_idle_gpu_ones(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("g0", device="cuda:0")
            h.worker("m", device="mps")
            h.worker("a")
            job_id = await h.manager.submit(submit("local", device="cpu"))
            await h.manager.result(job_id, wait=30 * UNIT)
            assert (await h.manager.record(job_id))["workers"] == ["a"]
            every_gpu = await h.manager.submit(submit("fedavg", rounds=1, device="cuda"))
            await h.manager.result(every_gpu, wait=30 * UNIT)
            assert (await h.manager.record(every_gpu))["workers"] == ["g0"]

    run(main())


def test_a_lost_device_worker_is_replaced_only_by_one_on_the_same_device(tmp_path):
    """An elastic job's recruit follows the job's placement, device included."""

    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("g0", device="cuda:0")
            h.worker("g1", device="cuda:1")
            job_id = await h.manager.submit(
                submit("data_parallel", workers=2, device="cuda", elastic=True)
            )
            await h.until(lambda: bool(h.contexts))
            h.worker("a")  # idle, but on the cpu
            found = h.manager.recruit(job_id, 0.2 * UNIT)
            assert await found is None
            assert h.registry.get("a").state is WorkerState.IDLE
            h.worker("g2", device="cuda:2")
            replacement = await h.manager.recruit(job_id, 30 * UNIT)
            assert replacement is not None and replacement.id == "g2"
            assert replacement.job_id == job_id

    run(main())
