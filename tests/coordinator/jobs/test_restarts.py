"""``max_restarts`` in the job manager: which faults restart a job, that a restart goes to the
head of the queue on the workers there are, and how one ends when none come or it is cancelled
while it waits. (Resuming from the checkpoint, live: tests/integration/faults/test_restarts.py.)"""

from __future__ import annotations

import asyncio

import torch

import somatize as sz
from coordinator.errors import WorkerCallError
from coordinator.jobs.restarts import RESTARTABLE, no_workers_for_restart, should_restart
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from coordinator.workers.registry import WorkerState
from protocol.errors import ErrorCode, ErrorInfo
from protocol.options.strategies import DataParallelOptions
from tests.coordinator.jobs.harness import (
    Boom,
    GatedContext,
    Harness,
    RecruitingContext,
    graph_epochs,
    make_graph,
    run,
    submit,
)
from tests.utils import UNIT


class Disconnecting(RecruitingContext):
    """Loses replica 1's worker at its third gradient step as its connection closing would:
    the registry no longer has it either, so a restart waits for another."""

    def lose(self, worker_idx, reason="its connection closed"):
        record = self.placed.workers[worker_idx]
        record.state = WorkerState.LOST
        record.channel = None
        super().lose(worker_idx, reason)


def test_only_the_clusters_faults_restart_and_only_while_restarts_are_left():
    strategy = DataParallel(DataParallelOptions(workers=2, max_restarts=2))
    lost = ErrorInfo(code=ErrorCode.WORKER_LOST, message="worker 'b' lost")
    assert should_restart(lost, strategy, 0) and should_restart(lost, strategy, 1)
    assert not should_restart(lost, strategy, 2)
    for code in (ErrorCode.FILTER_ERROR, ErrorCode.RESOURCE_LIMIT, ErrorCode.BAD_REQUEST):
        assert code not in RESTARTABLE
        assert not should_restart(ErrorInfo(code=code, message="the job's own"), strategy, 0)
    assert not should_restart(
        lost, DataParallel(DataParallelOptions(workers=2)), 0
    )  # max_restarts=0: the default
    why = no_workers_for_restart(
        lost, DataParallel(DataParallelOptions(workers=2, max_restarts=2, restart_timeout=5.0)), 1
    )
    assert why.code is ErrorCode.WORKER_LOST
    assert why.message == (
        "worker 'b' lost (restart 1 of 2 found no workers within restart_timeout=5s)"
    )


def test_a_lost_worker_restarts_the_job_until_its_restarts_are_spent(tmp_path):
    """Each run loses replica 1 at its third step: the first loss restarts the job on the
    workers there are (queued again at the head), the second fails it with worker_lost."""

    async def main():
        async with Harness(tmp_path, context=RecruitingContext) as h:
            h.worker("a", "dp")
            h.worker("b", "dp")
            options = {"workers": 2, "tag": "dp", "max_restarts": 1}
            job_id = await h.manager.submit(
                submit("data_parallel", graph=graph_epochs(3), **options)
            )
            waiting = await h.manager.submit(submit("local", tag="dp"))
            events = await h.events(job_id)
            kinds = [e.kind for e in events]
            assert kinds.count("placed") == 2 and kinds.count("restarting") == 1
            assert kinds[-1] == "failed"
            restarting = next(e.data for e in events if e.kind == "restarting")
            assert (restarting["attempt"], restarting["code"]) == (1, "worker_lost")
            failed = events[-1].data
            assert failed["code"] == "worker_lost" and "'b'" in failed["message"]
            # The restart went ahead of the job queued meanwhile: it only ran after.
            assert len(h.contexts) >= 2 and h.contexts[1].placed.job_id == job_id
            result = await h.manager.result(waiting, wait=30 * UNIT)
            assert result["record"]["state"] == "succeeded"

    run(main())


def test_a_filter_that_raises_is_not_restarted(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.worker("a")
            h.worker("b")
            linear = sz.TorchFilter(torch.nn.Linear(3, 2), batch_size=8).named("lin")
            graph = make_graph(Boom().named("boom"), linear)  # Boom is fitted per shard
            job_id = await h.manager.submit(
                submit("data_parallel", graph=graph, workers=2, max_restarts=3)
            )
            kinds = await h.kinds(job_id)
            assert "restarting" not in kinds and kinds[-1] == "failed"
            assert (await h.manager.record(job_id))["error"]["code"] == "filter_error"

    run(main())


def test_a_restart_that_no_worker_takes_in_time_fails_and_one_cancelled_while_it_waits_ends(
    tmp_path,
):
    async def main():
        async with Harness(tmp_path, context=Disconnecting) as h:
            h.worker("a", "dp")
            h.worker("b", "dp")
            options = {"workers": 2, "tag": "dp", "max_restarts": 1, "restart_timeout": 0.2}
            job_id = await h.manager.submit(
                submit("data_parallel", graph=graph_epochs(3), **options)
            )
            kinds = await h.kinds(job_id)
            assert kinds[-2:] == ["restarting", "failed"]
            record = await h.manager.record(job_id)
            assert record["state"] == "failed"
            assert (
                "restart 1 of 1 found no workers within restart_timeout=0.2s"
                in (record["error"]["message"])
            )
            assert h.registry.get("a").state is WorkerState.IDLE  # the survivor is freed

            h.worker("b", "dp")  # back, for the next job to lose again
            options["restart_timeout"] = 60.0
            cancelled = await h.manager.submit(
                submit("data_parallel", graph=graph_epochs(3), **options)
            )
            await h.events_until(cancelled, "restarting")
            await h.until(lambda: h.store.get(cancelled).state == "queued")
            await h.manager.cancel(cancelled)
            kinds = await h.kinds(cancelled)
            assert kinds[-1] == "cancelled" and kinds.count("failed") == 0
            await asyncio.sleep(0.1)
            assert h.store.get(cancelled).state == "cancelled"

    run(main())


class CrashesTheFirstFit(GatedContext):
    """The first job's daemon dies in its training call; every later one trains."""

    crashed = 0

    async def call(self, worker_idx, request, **kwargs):
        if request.cmd == "batched_fit" and not CrashesTheFirstFit.crashed:
            CrashesTheFirstFit.crashed += 1
            info = ErrorInfo(code=ErrorCode.DAEMON_CRASHED, message="the daemon died")
            raise WorkerCallError(self.workers[worker_idx].id, info)
        return await super().call(worker_idx, request, **kwargs)


def test_a_local_job_restarts_from_the_start_after_its_daemon_crashed(tmp_path):
    async def main():
        async with Harness(tmp_path, context=CrashesTheFirstFit) as h:
            h.worker("a")
            job_id = await h.manager.submit(submit("local", max_restarts=1))
            events = await h.events(job_id)
            kinds = [e.kind for e in events]
            assert kinds.count("placed") == 2 and kinds[-1] == "succeeded"
            restarting = next(e.data for e in events if e.kind == "restarting")
            assert (restarting["attempt"], restarting["code"]) == (1, "daemon_crashed")
            assert "resumed" not in kinds  # no checkpoint: it trained from the start again

    asyncio.run(main())
