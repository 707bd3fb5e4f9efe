"""What :mod:`benchmarks.fleet` measures with: the heartbeat probe and the bare anchor server
(scripts run as their own processes), a sampler of a process's memory and CPU, and the probe's
latencies."""

from __future__ import annotations

import math
import resource
import statistics
import time
from pathlib import Path

from benchmarks.periodic import Periodic
from benchmarks.roundtrip import cpu_seconds, rss_bytes

PROBE = """
import asyncio, sys, time
import uvloop
from websockets.asyncio.client import connect
from protocol.parsing import encode_small, parse
from protocol.messages import Capabilities, Heartbeat, WorkerHello

URL, OUT, EVERY = sys.argv[1], sys.argv[2], float(sys.argv[3])
CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3.11", cloudpickle="3")

async def main():
    async with connect(URL, compression=None, max_size=4 << 20) as ws:
        hello = WorkerHello(worker_id="probe", tags=["probe"], capabilities=CAPS)
        await ws.send(encode_small(hello))
        parse(await ws.recv())
        with open(OUT, "a") as out:
            while True:
                sent = time.time()
                await ws.send(encode_small(Heartbeat(sent_at=sent)))
                latency = await asyncio.wait_for(await ws.ping(), 60)
                out.write(f"{sent} {latency}\\n")
                out.flush()
                await asyncio.sleep(EVERY)

uvloop.run(main())
"""
"""The heartbeat probe: ``python -c PROBE URL OUT EVERY`` registers as worker ``probe`` and
appends ``<time sent> <pong latency s>`` to ``OUT`` every ``EVERY`` s until killed."""

FANOUT = """
import asyncio, sys, time
import uvloop
from websockets.asyncio.server import serve

PORT, NBYTES = int(sys.argv[1]), int(sys.argv[2])
PAYLOAD = bytes(NBYTES)
agents = {}

async def handler(ws):
    first = await ws.recv()
    if first == b"control":
        async for _ in ws:  # one round per message
            start = time.perf_counter()
            async def one(ws, replies):
                await ws.send(PAYLOAD)
                await replies.get()
            await asyncio.gather(*(one(w, q) for w, q in list(agents.items())))
            await ws.send(str(time.perf_counter() - start).encode())
        return
    replies = agents[ws] = asyncio.Queue()
    try:
        async for message in ws:  # heartbeats are dropped, replies handed to the round
            if len(message) == NBYTES:
                replies.put_nowait(message)
    finally:
        del agents[ws]

async def main():
    async with serve(handler, "127.0.0.1", PORT, compression=None, max_size=None):
        await asyncio.Future()

uvloop.run(main())
"""
"""The anchor: ``python -c FANOUT PORT NBYTES``, a bare ``websockets`` server on uvloop that holds
agents' connections (dropping what they send) and, for each message of a connection whose first
message is ``control``, sends ``NBYTES`` to every agent, waits for ``NBYTES`` back from each and
answers with the seconds it took. It imports nothing of ours (nor torch)."""


def raise_fd_limit() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def peak_rss_bytes(pid: int) -> int:
    """The peak resident set size of process ``pid`` so far (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


class RssSampler:
    """Samples a process's RSS and CPU time, and this process's CPU time, every ``every`` s in
    a thread: the peak RSS and the CPU seconds spent in any time window."""

    def __init__(self, pid: int, every: float = 0.01) -> None:
        self.pid = pid
        self.every = every
        self.samples: list[tuple[float, int, float, float]] = []
        self._periodic = Periodic(self._sample, every, "rss sampler")

    def __enter__(self) -> RssSampler:
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._periodic.__exit__(*exc)

    def _sample(self) -> bool:
        try:
            sample = (time.time(), rss_bytes(self.pid), cpu_seconds(self.pid))
        except (OSError, RuntimeError):  # the process is gone
            return False
        self.samples.append((*sample, time.process_time()))
        return True

    def peak(self, start: float, stop: float) -> int:
        return max((s[1] for s in self.samples if start <= s[0] <= stop), default=0)

    def cpu(self, start: float, stop: float) -> tuple[float, float]:
        """CPU seconds of the process and of this one between ``start`` and ``stop``."""
        inside = [s for s in self.samples if start <= s[0] <= stop]
        if len(inside) < 2:
            return math.nan, math.nan
        return inside[-1][2] - inside[0][2], inside[-1][3] - inside[0][3]


def probe_samples(path: Path, start: float, stop: float) -> list[float]:
    """The probe's pong latencies (s) of the pings sent between ``start`` and ``stop``."""
    samples = []
    for line in path.read_text().splitlines():
        sent, latency = (float(v) for v in line.split())
        if start <= sent <= stop:
            samples.append(latency)
    return samples


def latency(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"count": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    return {
        "count": len(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }
