"""How fast the agent talks to its filter daemon, through the real supervisor and daemon.

``python -m benchmarks.daemon`` starts one daemon with
:class:`worker.supervision.supervisor.DaemonSupervisor` on a uvloop event loop and measures:

- *ping*: the round trip of a no-op command (``ping``), 2,000 times after a warm-up: p50, p99 and
  mean. This is the fixed cost every command pays (framing, two pipe hops, validation, dispatch).
- *gradients out*: ``get_gradients`` of a ``Linear(5000, 5000)`` (25,005,000 float32 parameters,
  100 MB) after a backward pass, best of 5, in MB/s; and *gradients in*: ``apply_gradients`` of the
  same 100 MB. The anchor is ``np.copyto`` of 100 MB in this process: a transfer through a pipe
  costs at least two copies (into the kernel, out of it), so half the anchor's rate is the ceiling.
- *loop stall*: the longest gap a 1 ms ticker task saw on the event loop while the 100 MB went
  out: the supervisor moves big frames in bounded slices, so this should stay in milliseconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np
import torch
import uvloop

from benchmarks.report import Row
from protocol.filters import dump_filter
from somatize import TorchFilter
from worker.supervision.supervisor import DaemonSupervisor

PINGS = 2_000
WARMUP = 200
FEATURES = 5_000  # Linear(5000, 5000): 25,005,000 parameters, 100.02 MB of float32 gradients
REPEATS = 5


async def _ping_times(daemon: DaemonSupervisor, count: int) -> list[float]:
    for _ in range(WARMUP):
        await daemon.request_dict({"cmd": "ping"})
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await daemon.request_dict({"cmd": "ping"})
        times.append(time.perf_counter() - start)
    return times


async def _timed_with_stall(coro: Any) -> tuple[Any, float, float]:
    """Run ``coro``; return its result, its wall time and the longest event-loop stall seen."""
    stall = 0.0
    done = False

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall = max(stall, now - last - 0.001)
            last = now

    tick = asyncio.ensure_future(ticker())
    start = time.perf_counter()
    try:
        result = await coro
    finally:
        elapsed = time.perf_counter() - start
        done = True
        await tick
    return result, elapsed, stall


async def _measure(pings: int, features: int, repeats: int) -> dict[str, Any]:
    async with DaemonSupervisor(threads=1, default_timeout=120.0) as daemon:
        times = await _ping_times(daemon, pings)
        times.sort()

        torch.manual_seed(0)
        module = torch.nn.Linear(features, features)
        filters = {"big": dump_filter(TorchFilter(module))}
        await daemon.request_dict({"cmd": "load", "filters": filters})
        x, y = torch.randn(4, features), torch.randn(4, features)
        await daemon.request_dict({"cmd": "fit", "node_id": "big", "x": x, "y": y})

        out_s, stall_s = float("inf"), 0.0
        grads: dict[str, Any] = {}
        for _ in range(repeats):
            reply, seconds, stall = await _timed_with_stall(
                daemon.request_dict({"cmd": "get_gradients"})
            )
            grads = reply["big"]
            out_s, stall_s = min(out_s, seconds), max(stall_s, stall)
        nbytes = sum(int(g.nbytes) for g in grads.values())

        in_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            await daemon.request_dict({"cmd": "apply_gradients", "gradients": {"big": grads}})
            in_s = min(in_s, time.perf_counter() - start)

    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    copy_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        copy_s = min(copy_s, time.perf_counter() - start)

    return {
        "ping": {
            "count": pings,
            "p50_us": times[len(times) // 2] * 1e6,
            "p99_us": times[int(len(times) * 0.99)] * 1e6,
            "mean_us": statistics.fmean(times) * 1e6,
        },
        "gradients": {
            "bytes": nbytes,
            "parameters": nbytes // 4,
            "out_s": out_s,
            "out_mb_per_s": nbytes / out_s / 1e6,
            "in_s": in_s,
            "in_mb_per_s": nbytes / in_s / 1e6,
            "max_loop_stall_ms": stall_s * 1e3,
        },
        "copy": {"seconds": copy_s, "mb_per_s": nbytes / copy_s / 1e6},
    }


def run(pings: int = PINGS, features: int = FEATURES, repeats: int = REPEATS) -> dict[str, Any]:
    """Measure ping round trips and 100 MB gradient transfers through a real daemon.

    Returns:
        ``{"ping": {"count", "p50_us", "p99_us", "mean_us"}, "gradients": {"bytes",
        "parameters", "out_s", "out_mb_per_s", "in_s", "in_mb_per_s", "max_loop_stall_ms"},
        "copy": {"seconds", "mb_per_s"}}``.
    """
    return uvloop.run(_measure(pings, features, repeats))


def rows(results: dict[str, Any]) -> list[Row]:
    """Gradients out of and into the daemon next to a memory copy of the same bytes."""
    grads, copy = results["gradients"], results["copy"]
    mb = grads["bytes"] / 1e6
    ping = results["ping"]
    return [
        Row(
            bench="daemon",
            name=f"get_gradients {mb:.0f} MB out of the daemon",
            ours=grads["out_mb_per_s"],
            unit="MB/s",
            anchor=copy["mb_per_s"],
            anchor_name="np.copyto",
            note=f"ping p50 {ping['p50_us']:.0f} µs",
        ),
        Row(
            bench="daemon",
            name=f"apply_gradients {mb:.0f} MB into the daemon",
            ours=grads["in_mb_per_s"],
            unit="MB/s",
            anchor=copy["mb_per_s"],
            anchor_name="np.copyto",
        ),
    ]


def main() -> None:
    results = run()
    ping, grads, copy = results["ping"], results["gradients"], results["copy"]
    mb = grads["bytes"] / 1e6
    print("filter daemon through DaemonSupervisor (uvloop, daemon --threads 1)")
    print(
        f"  ping round trip x{ping['count']}     p50 {ping['p50_us']:7.1f} µs   "
        f"p99 {ping['p99_us']:7.1f} µs   mean {ping['mean_us']:7.1f} µs"
    )
    print(
        f"  get_gradients {mb:.0f} MB out     {grads['out_s'] * 1e3:7.1f} ms   "
        f"{grads['out_mb_per_s']:7.0f} MB/s   (max loop stall {grads['max_loop_stall_ms']:.1f} ms)"
    )
    print(
        f"  apply_gradients {mb:.0f} MB in    {grads['in_s'] * 1e3:7.1f} ms   "
        f"{grads['in_mb_per_s']:7.0f} MB/s   (includes the optimizer step)"
    )
    print(
        f"  anchor np.copyto {mb:.0f} MB     {copy['seconds'] * 1e3:7.1f} ms   "
        f"{copy['mb_per_s']:7.0f} MB/s"
    )


if __name__ == "__main__":
    main()
