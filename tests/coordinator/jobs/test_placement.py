"""The job manager's queue and placement, with no sockets and no processes: which workers a
job gets (tags, ids, datasets, slots, every matching one), in what order, why it waits, and
what it is refused."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from coordinator.jobs.submission import WAIT_HINT
from coordinator.workers.registry import WorkerState
from protocol.errors import ErrorCode, RequestRefused
from protocol.messages import ArrayShape, DatasetSummary
from protocol.rules.rows import needs_labels
from tests.coordinator.jobs.harness import FakeChannel, Harness, make_graph, run, submit
from tests.utils import UNIT, Center

# -- queueing and placement -------------------------------------------------------------------


def test_a_job_waits_queued_with_its_reason_until_its_workers_come(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            h.worker("b", "dp")
            msg = submit("data_parallel", workers=2, tag="dp")
            with pytest.raises(RequestRefused, match="1 of the registered workers can take it"):
                await h.manager.submit(msg)  # not queued for ever, unless it says it waits
            waits = msg.model_copy(update={"wait_for_workers": 60.0})
            job_id = await h.manager.submit(waits)
            await h.settle()
            record = await h.manager.record(job_id)
            assert record["state"] == "queued"
            assert record["summary"]["placement"] == "2 workers tagged 'dp'"
            events = await h.events_until(job_id, "queued")
            assert events[0].data == {
                "placement": "2 workers tagged 'dp'",
                "wait_for_workers": 60.0,
            }
            assert h.contexts == []

            h.worker("c", "dp")  # the second one tagged dp: now it can start
            result = await h.manager.result(job_id, wait=30 * UNIT)
            assert sorted(result["states"]) == ["c", "lin"]
            assert result["record"]["workers"] == ["b", "c"]
            assert [w.id for w in h.contexts[0].placed.workers] == ["b", "c"]
            assert h.contexts[0].closed

    run(main())


def test_a_job_that_cannot_start_does_not_hold_up_a_later_one_that_can(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            # No gpu worker yet: it would be refused, unless it waits for one.
            waiting = submit("local", tag="gpu").model_copy(update={"wait_for_workers": 60.0})
            first = await h.manager.submit(waiting)
            h.worker("g", "gpu")
            h.registry.get("g").state = WorkerState.BUSY  # taken elsewhere
            second = await h.manager.submit(submit("local", tag="cpu"))
            await h.manager.result(second, wait=30 * UNIT)
            assert (await h.manager.record(first))["state"] == "queued"
            assert (await h.manager.record(second))["workers"] == ["a"]

            h.registry.get("g").state = WorkerState.IDLE
            h.manager.kick()
            await h.manager.result(first, wait=30 * UNIT)
            assert (await h.manager.record(first))["workers"] == ["g"]

    run(main())


def test_jobs_are_placed_in_submission_order(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            first = await h.manager.submit(submit())
            second = await h.manager.submit(submit())
            h.worker("a")
            await h.settle()
            assert (await h.manager.record(first))["state"] == "running"
            assert (await h.manager.record(second))["state"] == "queued"
            assert h.registry.get("a").job_id == first
            h.gate.event.set()
            await h.manager.result(second, wait=30 * UNIT)
            assert (await h.manager.record(second))["workers"] == ["a"]
            # Freed after each job.
            assert h.registry.get("a").state is WorkerState.IDLE
            assert h.registry.get("a").job_id is None

    run(main())


def test_placement_by_worker_id_and_dataset(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", datasets={"mnist": 10})
            h.worker("b")
            by_id = await h.manager.submit(submit("local", worker="b"))
            await h.manager.result(by_id, wait=30 * UNIT)
            assert (await h.manager.record(by_id))["workers"] == ["b"]

            h.worker("c")
            msg = submit("local", graph=make_graph(Center().named("c")), dataset="mnist")
            on_data = await h.manager.submit(msg)
            record = await h.manager.record(on_data)
            assert record["summary"]["placement"] == "1 worker with dataset 'mnist'"
            await h.events_until(on_data, "placed")
            assert (await h.manager.record(on_data))["workers"] == ["a"]
            # A dataset no worker has is refused at submit, not queued forever.
            unknown = submit("local", graph=make_graph(Center().named("c")), dataset="imagenet")
            with pytest.raises(RequestRefused, match=r"no worker has dataset 'imagenet'") as no:
                await h.manager.submit(unknown)
            assert no.value.code == ErrorCode.NO_WORKERS
            assert "the workers have ['mnist']" in no.value.info.message

    run(main())


def test_slots_take_one_distinct_worker_each_in_slot_order(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("x", "s1")
            h.worker("y", "s0", "s1")
            msg = submit(
                "model_parallel",
                partitions=[{"node_ids": ["c"], "tag": "s0"}, {"node_ids": ["lin"], "tag": "s1"}],
            )
            job_id = await h.manager.submit(msg)
            await h.settle()
            # y is the only s0: it takes slot 0, and x the s1 slot although y also has s1.
            assert [w.id for w in h.contexts[0].placed.workers] == ["y", "x"]
            record = await h.manager.record(job_id)
            assert record["summary"]["placement"] == "2 workers: tag 's0', tag 's1'"

    run(main())


def test_all_matching_takes_every_idle_worker_that_qualifies(tmp_path):
    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            for name in ("a", "b", "c"):
                h.worker(name, "fl")
            h.worker("d", "other")
            busy = h.worker("e", "fl")
            busy.state = WorkerState.BUSY
            job_id = await h.manager.submit(submit("fedavg", rounds=1, tag="fl", min_workers=2))
            await h.settle()
            assert [w.id for w in h.contexts[0].placed.workers] == ["a", "b", "c"]
            record = await h.manager.record(job_id)
            assert record["summary"]["placement"] == "every idle worker (at least 2) tagged 'fl'"
            assert {w.id for w in h.registry if w.job_id == job_id} == {"a", "b", "c"}

    run(main())


def test_a_pinned_placement_no_known_worker_answers_is_refused(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            msg = submit(
                "model_parallel",
                partitions=[
                    {"node_ids": ["c"], "tag": "cpu"},
                    {"node_ids": ["lin"], "worker": "z"},
                ],
            )
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(msg)
            assert caught.value.info.code is ErrorCode.NO_WORKERS
            assert str(caught.value.info.message) == (
                "no worker answers to worker 'z': workers ['a'], tags ['cpu']" + WAIT_HINT
            )
            assert h.store.list(None, 10) == []

    run(main())


def test_bad_submissions_are_refused_before_they_are_stored(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            bad = [
                submit("nonsense"),
                submit("local", bogus=1),
                submit("data_parallel", graph=make_graph(Center().named("c")), workers=2),
            ]
            for msg in bad:
                with pytest.raises(RequestRefused) as caught:
                    await h.manager.submit(msg)
                assert caught.value.info.code is ErrorCode.BAD_REQUEST
            neither = submit().model_copy(update={"x": None, "y": None})
            with pytest.raises(RequestRefused, match="exactly one of the two"):
                await h.manager.submit(neither)
            assert h.store.list(None, 10) == []

    run(main())


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("local", {}),
        ("data_parallel", {"workers": 2}),
        ("fedavg", {"rounds": 1}),
        (
            "model_parallel",
            {
                "partitions": [
                    {"node_ids": ["c"], "tag": "cpu"},
                    {"node_ids": ["lin"], "tag": "cpu"},
                ]
            },
        ),
    ],
)
def test_data_graph_fit_would_refuse_is_refused_at_submit_for_every_strategy(
    tmp_path, strategy, options
):
    """Issue 18: x and y of different lengths (and labels missing for a TorchFilter) are
    refused when the job is submitted, in graph.fit's words, never stored nor run."""

    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "cpu")
            h.worker("b", "cpu")
            msg = submit(strategy, **options)
            short = msg.model_copy(update={"y": msg.y[:20]})
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(short)
            assert caught.value.info.code is ErrorCode.BAD_REQUEST
            assert caught.value.info.message == "x has 24 rows and y has 20: they must match"
            unlabelled = msg.model_copy(update={"y": None})
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(unlabelled)
            assert caught.value.info.message == needs_labels("lin")
            assert h.store.list(None, 10) == [] and h.contexts == []

    run(main())


def test_a_dataset_served_without_labels_is_refused_at_submit_for_a_torch_filter(tmp_path):
    """Issue 15: what the hellos say is checked at submit. Rows without y cannot train a
    TorchFilter; a plain graph still runs on them, and a loader's path is not judged."""
    x_only = DatasetSummary(rows=4, kind="npy", x=ArrayShape(shape=[4, 3], dtype="float32"))
    path = DatasetSummary(rows=None, kind="path")

    async def main():
        async with Harness(tmp_path) as h:
            caps = h.worker("probe").capabilities
            for worker_id, summary in (("a", x_only), ("b", x_only)):
                h.registry.attach(worker_id, [], caps, FakeChannel(), {"feats": summary})
            h.registry.attach("c", [], caps, FakeChannel(), {"pics": path})
            torch_job = submit("local", dataset="feats")  # Center >> a TorchFilter
            with pytest.raises(RequestRefused, match=r"dataset 'feats' has no labels \(y\)"):
                await h.manager.submit(torch_job)
            plain = submit("local", graph=make_graph(Center().named("c")), dataset="feats")
            assert await h.manager.submit(plain)  # accepted: a plain graph needs no labels
            assert await h.manager.submit(submit("local", dataset="pics"))  # not known: let in

    run(main())


def _three_stages():
    torch.manual_seed(0)
    return make_graph(
        sz.TorchFilter(torch.nn.Linear(3, 4), lr=0.1, batch_size=8).named("a"),
        sz.TorchFilter(torch.nn.Linear(4, 4), lr=0.1, batch_size=8).named("b"),
        sz.TorchFilter(torch.nn.Linear(4, 2), lr=0.1, batch_size=8).named("c"),
    )


def _pipeline_on(dataset):
    parts = [{"node_ids": [n], "tag": f"s{k}"} for k, n in enumerate("abc")]
    return submit("model_parallel", graph=_three_stages(), dataset=dataset, partitions=parts)


def test_a_pipeline_on_worker_data_needs_the_dataset_on_its_first_and_last_stages_only(tmp_path):
    """Issue 15: the first stage reads x, the last y; a middle stage reads nothing of it."""

    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a", "s0", datasets={"train": 40})
            h.worker("m", "s1")
            h.worker("z", "s2", datasets={"train": 40})
            job_id = await h.manager.submit(_pipeline_on("train"))
            await h.settle()
            assert [w.id for w in h.contexts[0].placed.workers] == ["a", "m", "z"]
            record = await h.manager.record(job_id)
            assert record["summary"]["placement"] == (
                "3 workers: tag 's0' serving dataset 'train', tag 's1', "
                "tag 's2' serving dataset 'train'"
            )

    run(main())


def test_a_pipeline_whose_last_stage_cannot_serve_the_dataset_is_refused_naming_who_does(
    tmp_path,
):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a", "s0", datasets={"train": 40})
            h.worker("m", "s1", datasets={"train": 40})
            h.worker("z", "s2")
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(_pipeline_on("train"))
            assert caught.value.info.code is ErrorCode.NO_WORKERS
            assert caught.value.info.message == (
                "no worker answers to tag 's2' serving dataset 'train': the workers serving "
                "dataset 'train' are ['a', 'm']" + WAIT_HINT
            )
            assert h.store.list(None, 10) == []

    run(main())


def test_a_pipeline_whose_first_and_last_stages_hold_other_row_counts_is_refused_at_submit(
    tmp_path,
):
    """Issue 15: x on the first stage's worker, y on the last's: their rows must agree."""

    async def main():
        async with Harness(tmp_path, gate_open=False) as h:
            h.worker("a", "s0", datasets={"train": 40})
            h.worker("m", "s1")
            h.worker("z", "s2", datasets={"train": 39})
            with pytest.raises(RequestRefused) as caught:
                await h.manager.submit(_pipeline_on("train"))
            assert caught.value.info.code is ErrorCode.BAD_REQUEST
            assert caught.value.info.message == (
                "dataset 'train': the first stage (tag 's0' serving dataset 'train') reads x and "
                "the last (tag 's2' serving dataset 'train') y, and their rows must agree; the "
                "workers that could take them hold a 40, z 39 rows"
            )
            assert h.store.list(None, 10) == []

    run(main())


# -- names no worker has, and waiting for workers (issue 18) ---------------------------------


def test_a_tag_or_worker_id_no_worker_has_is_refused_with_the_nearest_names(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("box-1", "dp")
            h.worker("box-2", "dp", "stage0")
            cases = [
                (
                    submit("data_parallel", workers=2, tag="dpp"),
                    "no worker answers to tag 'dpp' (did you mean 'dp'?): workers ['box-1', "
                    "'box-2'], tags ['dp', 'stage0']",
                ),
                (
                    submit("local", worker="box-3"),
                    "no worker answers to worker 'box-3' (did you mean 'box-1' or 'box-2'?): "
                    "workers ['box-1', 'box-2'], tags ['dp', 'stage0']",
                ),
                (
                    submit("fedavg", rounds=1, tag="gpu"),
                    "no worker answers to tag 'gpu': workers ['box-1', 'box-2'], tags ['dp', "
                    "'stage0']",
                ),
                (  # 'pd' for 'dp': the same letters, swapped
                    submit("data_parallel", workers=2, tag="pd"),
                    "no worker answers to tag 'pd' (did you mean 'dp'?): workers ['box-1', "
                    "'box-2'], tags ['dp', 'stage0']",
                ),
                (  # three asked for, two such workers registered: never queued for ever
                    submit("data_parallel", workers=3, tag="dp"),
                    "the job needs 3 workers tagged 'dp', and 2 of the registered workers can "
                    "take it: ['box-1', 'box-2']",
                ),
            ]
            for msg, message in cases:
                with pytest.raises(RequestRefused) as caught:
                    await h.manager.submit(msg)
                assert caught.value.info.code is ErrorCode.NO_WORKERS
                assert caught.value.info.message == message + WAIT_HINT
            assert h.store.list(None, 10) == []

    run(main())


def test_a_job_that_waits_for_workers_runs_when_they_come_or_fails_when_its_time_is_up(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("box-1", "dp")
            waits = submit("local", tag="gpu").model_copy(update={"wait_for_workers": 60.0})
            comes = await h.manager.submit(waits)
            queued = (await h.events_until(comes, "queued"))[-1]
            assert queued.data == {"placement": "1 worker tagged 'gpu'", "wait_for_workers": 60.0}
            h.worker("g", "gpu")
            await h.manager.result(comes, wait=30 * UNIT)
            assert (await h.manager.record(comes))["workers"] == ["g"]

            short = submit("local", tag="tpu").model_copy(update={"wait_for_workers": 0.2})
            never = await h.manager.submit(short)
            end = (await h.events_until(never, "failed"))[-1]
            assert end.data["code"] == "no_workers"
            assert end.data["message"] == (
                "waited 0.2 s for its workers (wait_for_workers): no worker answers to tag "
                "'tpu' (did you mean 'gpu'?): workers ['box-1', 'g'], tags ['dp', 'gpu']"
            )

            h.registry.get("g").state = WorkerState.BUSY  # its tag is there, but taken
            busy = submit("local", tag="gpu").model_copy(update={"wait_for_workers": 0.2})
            end = (await h.events_until(await h.manager.submit(busy), "failed"))[-1]
            assert end.data["message"] == (
                "waited 0.2 s for its workers (wait_for_workers): 1 worker tagged 'gpu' did "
                "not become free"
            )

    run(main())


def test_a_records_summary_stays_small_however_many_nodes_its_strategy_names():
    """Issue 53, a Low: a ModelParallel job's partitions name every node of its graph, and its
    record kept them all (1.07 MB a job, 21 MB of /api/status for 20 jobs)."""
    import json

    from coordinator.jobs.submission import SUMMARY_NODES, summary_of
    from coordinator.strategies.base import Placement
    from protocol.messages import StrategySpec

    ids = [f"node-{'x' * 200}-{k}" for k in range(4000)]
    spec = StrategySpec(name="model_parallel", options={"partitions": [{"node_ids": ids}]})
    msg = submit().model_copy(update={"strategy": spec})
    summary = summary_of(msg, Placement(workers=1), "client")
    said = summary["strategy"]["options"]["partitions"][0]["node_ids"]
    assert len(said) == SUMMARY_NODES + 1 and said[-1] == "... (4000 in all)"
    assert len(json.dumps(summary)) < 16_000
