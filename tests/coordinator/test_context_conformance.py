"""One conformance suite for every StrategyContext: in-memory workers and live agents.

The transport variant runs a real coordinator on loopback and two real worker agents (each with
real filter-daemon subprocesses); the in-memory variant runs the daemon's command handling in
threads. Both must give the same answers, checked against independent references.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import (
    InMemoryContext,
    StrategyContext,
    Target,
    TargetError,
    WorkerCallError,
    WorkerIdentity,
)
from coordinator.server.app import Coordinator
from coordinator.server.config import CoordinatorConfig
from coordinator.workers.transport import TransportContext
from protocol.codec import decode
from protocol.daemon import GetStateRequest
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from tests.utils import FORK_SERVER_LINGER, UNIT, Center, shared_fork_servers
from worker.daemon.main import Daemon

WORKERS = [
    WorkerIdentity("alpha", frozenset({"stage0", "cpu"})),
    WorkerIdentity("beta", frozenset({"stage1", "cpu"})),
]


class Boom(sz.Filter):
    def fit(self, x, y=None):
        raise ValueError("boom in fit")


class Clock(sz.Filter):
    """Records when its fit ran, to see that two workers' calls overlap."""

    def fit(self, x, y=None):
        start = time.time()
        time.sleep(0.5)
        return {"start": start, "end": time.time()}


def _data(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return x, y


def _graph(seed: int = 0) -> sz.Graph:
    torch.manual_seed(seed)
    return Center().named("center") >> sz.TorchFilter(
        torch.nn.Linear(4, 2), lr=0.1, batch_size=8, epochs=2, shuffle=False
    ).named("lin")


def _filters(graph: sz.Graph) -> dict[str, bytes]:
    return {node_id: dump_filter(f) for node_id, f in graph.items()}


@contextlib.asynccontextmanager
async def _transport_context(tmp_path) -> AsyncIterator[StrategyContext]:
    from worker.agent import Agent, AgentConfig

    coordinator = Coordinator(
        CoordinatorConfig(
            "127.0.0.1", 0, tmp_path / "state", heartbeat_interval=0.5, heartbeat_timeout=5.0
        )
    )
    await coordinator.start()
    url = f"ws://127.0.0.1:{coordinator.port}"
    agents = [
        Agent(
            AgentConfig(
                url,
                worker_id=w.id,
                tags=sorted(w.tags),
                threads=1,
                fork_server_share=shared_fork_servers(),
                fork_server_linger=FORK_SERVER_LINGER,
            )
        )
        for w in WORKERS
    ]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    try:
        async with asyncio.timeout(30 * UNIT):
            await asyncio.gather(*(agent.connected.wait() for agent in agents))
        records = [coordinator.registry.get(w.id) for w in WORKERS]
        ctx = TransportContext("job-conformance", records, timeout=60 * UNIT)
        yield ctx
        await ctx.close()
    finally:
        for agent in agents:
            agent.stop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15 * UNIT):
                await asyncio.gather(*tasks, return_exceptions=True)
        await coordinator.stop(grace=1.0)


@contextlib.asynccontextmanager
async def _memory_context(tmp_path) -> AsyncIterator[StrategyContext]:
    yield InMemoryContext(WORKERS, Daemon, timeout=60 * UNIT)


@pytest.fixture(params=["memory", "transport"])
def make_context(request, tmp_path):
    factory = _memory_context if request.param == "memory" else _transport_context
    return lambda: factory(tmp_path)


def run(coro):
    return asyncio.run(coro)


def test_execute_on_worker_equals_graph_fit(make_context):
    x, y = _data()
    graph = _graph()
    expected = graph.fit(x, y).states

    async def main():
        async with make_context() as ctx:
            await ctx.load(1, _filters(graph))
            fit = await ctx.execute_on_worker(1, graph.node_ids, x, y)
            back = await ctx.read_back_state(1, graph.node_ids)
            return fit, back

    fit, back = run(main())
    assert fit["rows"] == 40 and len(fit["epoch_losses"]) == 2
    for states in (fit["states"], back):
        np.testing.assert_array_equal(
            np.asarray(states["center"]["mean"]), expected["center"]["mean"]
        )
        for k, v in expected["lin"].items():
            torch.testing.assert_close(torch.as_tensor(states["lin"][k]), v, rtol=0, atol=1e-6)


def test_set_state_is_what_later_reads_return(make_context):
    graph = _graph()
    new = {
        "lin": {"weight": torch.full((2, 4), 0.5), "bias": torch.tensor([1.0, -1.0])},
        "center": {"mean": np.ones(4, np.float32)},
    }

    async def main():
        async with make_context() as ctx:
            await ctx.load(0, _filters(graph))
            await ctx.set_state(0, new)
            return await ctx.get_state(0, ["lin", "center"])

    got = run(main())
    torch.testing.assert_close(got["lin"]["weight"], new["lin"]["weight"])
    torch.testing.assert_close(got["lin"]["bias"], new["lin"]["bias"])
    np.testing.assert_array_equal(got["center"]["mean"], new["center"]["mean"])


def test_files_a_call_keeps_stay_on_the_worker_and_are_read_a_piece_at_a_time(make_context):
    """``call_keeping``: the files in the result are left on the worker, the reply says their
    names and sizes, pieces of them read back as they were, and once dropped they are gone; a
    part of the result that is not files by name is refused, naming it, and the job goes on.
    A file that is not bytes is kept as its codec frame."""
    graph = _graph()
    files = {".metadata": b"where each shard lies", "__0_0.distcp": bytes(range(256)) * 40}

    async def main():
        async with make_context() as ctx:
            await ctx.load(1, _filters(graph))
            await ctx.set_state(1, {"center": files})
            said = await ctx.call_keeping(1, GetStateRequest(node_ids=["center"]), ["center"])
            kept = said["center"]
            pieces = [
                await ctx.read_kept(1, kept["kept"], "__0_0.distcp", at, 4096)
                for at in range(0, 10240, 4096)
            ]
            whole = await ctx.read_kept(1, kept["kept"], ".metadata", 0, 1 << 20)
            lin = await ctx.call_keeping(1, GetStateRequest(node_ids=["lin"]), ["lin"])
            framed = {
                name: await ctx.read_kept(1, lin["lin"]["kept"], name, 0, 1 << 20)
                for name in lin["lin"]["files"]
            }
            with pytest.raises(WorkerCallError, match="not files by plain name") as refused:
                await ctx.call_keeping(1, GetStateRequest(node_ids=["lin"]), ["lin", "weight"])
            await ctx.drop_kept(1, kept["kept"])
            with pytest.raises(WorkerCallError, match=r"__0_0\.distcp") as gone:
                await ctx.read_kept(1, kept["kept"], "__0_0.distcp", 0, 1)
            state = await ctx.get_state(1, ["lin"])  # the job goes on
            sizes = lin["lin"]["files"]
            return kept, pieces, whole, refused.value, gone.value, state, framed, sizes

    kept, pieces, whole, refused, gone, state, framed, lin_sizes = run(main())
    assert kept["files"] == {name: len(data) for name, data in files.items()}
    assert [len(p) for p in pieces] == [4096, 4096, 2048]
    assert b"".join(pieces) == files["__0_0.distcp"] and whole == files[".metadata"]
    assert refused.code is ErrorCode.BAD_REQUEST and "lin" in str(refused)
    assert gone.code is ErrorCode.BAD_REQUEST
    assert set(state["lin"]) == set(framed) == {"weight", "bias"}
    assert {name: len(data) for name, data in framed.items()} == lin_sizes
    for name, data in framed.items():  # each tensor its own frame
        expected = torch.as_tensor(state["lin"][name])
        torch.testing.assert_close(torch.as_tensor(decode(data)), expected)


def test_gradients_out_and_in_and_the_state_read_back_after_apply(make_context):
    x, y = _data(n=16)
    graph = _graph(seed=3)
    reference = copy.deepcopy(graph["lin"].module)

    async def main():
        async with make_context() as ctx:
            await ctx.load(0, _filters(graph))
            output, states = await ctx.execute_partition(0, ["center", "lin"], x, y)
            grads = await ctx.get_gradients(0, ["lin"])
            await ctx.apply_gradients(0, grads)
            return output, states, grads, await ctx.read_back_state(0, ["lin"])

    output, states, grads, after = run(main())
    xc = torch.as_tensor(x - x.mean(0))
    torch.nn.functional.mse_loss(reference(xc), torch.as_tensor(y)).backward()
    torch.testing.assert_close(grads["lin"]["weight"], reference.weight.grad, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(output), reference(xc), rtol=0, atol=1e-6)
        expected_w = reference.weight - 0.1 * reference.weight.grad
    torch.testing.assert_close(states["lin"]["weight"], reference.weight.detach())  # no step on fit
    torch.testing.assert_close(after["lin"]["weight"], expected_w, rtol=0, atol=1e-6)


def test_calls_to_different_workers_run_concurrently(make_context):
    async def main():
        async with make_context() as ctx:
            filters = {"clock": dump_filter(Clock().named("clock"))}
            await asyncio.gather(*(ctx.load(i, filters) for i in range(2)))
            results = await asyncio.gather(
                *(ctx.execute_on_worker(i, ["clock"], np.zeros((2, 1))) for i in range(2))
            )
            return [r["states"]["clock"] for r in results]

    a, b = run(main())
    assert a["start"] < b["end"] and b["start"] < a["end"], "the two fits did not overlap"


def test_a_filter_that_raises_is_a_worker_call_error_with_the_traceback(make_context):
    async def main():
        async with make_context() as ctx:
            await ctx.load(1, {"boom": dump_filter(Boom().named("boom"))})
            with pytest.raises(WorkerCallError) as err:
                await ctx.execute_on_worker(1, ["boom"], np.zeros((2, 1)))
            # The worker is still usable after its filter failed.
            await ctx.load(1, {"center": dump_filter(Center().named("center"))})
            fit = await ctx.execute_on_worker(1, ["center"], np.ones((2, 3)))
            return err.value, fit

    error, fit = run(main())
    assert error.worker_id == "beta"
    assert error.code is ErrorCode.FILTER_ERROR
    assert "boom in fit" in error.info.message or "boom in fit" in str(error.info.detail)
    assert "ValueError" in error.info.detail.get("traceback", "")
    np.testing.assert_array_equal(fit["states"]["center"]["mean"], np.ones(3))


def test_worker_for_resolves_ids_and_tags_and_names_what_exists(make_context):
    async def main():
        async with make_context() as ctx:
            assert ctx.num_workers() == 2
            assert ctx.worker_for(Target(id="beta")) == 1
            assert ctx.worker_for(Target(tag="stage0")) == 0
            assert ctx.worker_for(Target(tag="cpu")) == 0
            listing = r"workers \['alpha', 'beta'\], tags \['cpu', 'stage0', 'stage1'\]"
            with pytest.raises(TargetError, match=r"no worker answers to tag 'gpu': " + listing):
                ctx.worker_for(Target(tag="gpu"))
            with pytest.raises(TargetError, match="worker 'gamma'"):
                ctx.worker_for(Target(id="gamma"))

    run(main())
