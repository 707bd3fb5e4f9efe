"""How many idle workers one coordinator holds, and what each connection costs it.

``python -m benchmarks.fleet`` starts a real ``somatize-coordinator`` (heartbeat every 2 s,
timeout 10 s) and, from this one process on uvloop, connects N = 1,000 simulated agents to
``/worker``: each a real WebSocket connection that sends a real ``WorkerHello`` (``sim-<i>``,
tag ``sim``), reads the ``Welcome``, then sends a ``Heartbeat`` every interval (jittered ±10 %,
first one at a random point of the first interval) and reads and ignores anything else. They are
opened 50 at a time, so the handshake storm stays bounded. Measured:

- *register*: wall time from the first dial to the N-th ``Welcome``;
- *memory*: the coordinator's RSS (``VmRSS``) with only the benchmark's two client connections
  open, and after the N agents have been connected and idle for ~10 s, heartbeating → bytes per
  connection; plus the coordinator's CPU share over those 10 s (the cost of N heartbeats);
- *ping*: then, for 5 s while the agents go on heartbeating, ``Ping()`` round trips (client →
  coordinator) over a client ``Channel`` on the agents' own event loop, in bursts of 100 back to
  back every 0.25 s, p50/p99; next to the same bursts for 2 s against the coordinator before the
  agents came. (Bursts, not pings spread evenly: on this machine a request that wakes three idle
  processes costs ~3x a back-to-back one, which would swamp the figure.) The loaded figure
  includes this process sending the heartbeats of N agents on the same loop;
- *status*: ``client.status()`` (the SDK, in a thread) lists N workers ``idle`` right after
  registering and again at the end, none ``lost``, and no agent's connection was closed
  (asserted); plus the oldest ``last_heartbeat_age`` at the end.

The anchor for the memory is a bare ``websockets`` server on uvloop
(:data:`benchmarks.roundtrip.BARE_SERVER` in ``hold`` mode: it reads and drops messages) holding N
connections opened the same way, sending the same hello and heartbeat bytes, for the same time:
its RSS per connection is what the transport alone costs. Every process is stopped at the end,
also on Ctrl-C; the coordinator's log is kept in a temporary directory, scanned for errors,
warnings and lost workers, and its tail printed if the run fails.
"""

from __future__ import annotations

import asyncio
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from websockets.asyncio.client import ClientConnection, connect
from websockets.protocol import State

import somatize as sz
from benchmarks.roundtrip import (
    MAX_SIZE,
    Processes,
    client_channel,
    cpu_seconds,
    free_port,
    ping,
    rss_bytes,
    summary,
)
from protocol.channel import Channel, encode_small, parse
from protocol.messages import Capabilities, Heartbeat, Welcome, WorkerHello

AGENTS = 1_000
BATCH = 50
HEARTBEAT_INTERVAL = 2.0
HEARTBEAT_TIMEOUT = 10.0
HOLD_SECONDS = 10.0
PING_BURST = 100
PING_EVERY = 0.25
IDLE_PING_SECONDS = 2.0
LOADED_PING_SECONDS = 5.0
CAPABILITIES = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3.11", cloudpickle="3")


def raise_fd_limit() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _hello(i: int) -> bytes:
    return encode_small(WorkerHello(worker_id=f"sim-{i}", tags=["sim"], capabilities=CAPABILITIES))


def _heartbeat() -> bytes:
    return encode_small(Heartbeat(sent_at=time.time()))


class Fleet:
    """N simulated agents on this event loop: dial, hello, heartbeat, ignore everything else.

    Args:
        url: the ``/worker`` endpoint (or a bare server).
        welcome: expect a ``Welcome`` after the hello (the bare anchor sends nothing).
    """

    def __init__(self, url: str, welcome: bool) -> None:
        self.url = url
        self.welcome = welcome
        self.connections: list[ClientConnection] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, n: int, batch: int) -> float:
        """Connect ``n`` agents, ``batch`` handshakes at a time; seconds until all welcomed."""
        gate = asyncio.Semaphore(batch)
        start = time.perf_counter()
        await asyncio.gather(*(self._open_one(i, gate) for i in range(n)))
        return time.perf_counter() - start

    async def _open_one(self, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            # As the real agent dials: its keepalive pings on too (20 s), here never due.
            ws = await connect(
                self.url,
                compression=None,
                max_size=MAX_SIZE,
                open_timeout=30,
                ping_interval=20.0,
                ping_timeout=20.0,
            )
            self.connections.append(ws)
            await ws.send(_hello(i))
            if self.welcome:
                async with asyncio.timeout(30):
                    reply = parse(await ws.recv(decode=False))
                if not isinstance(reply, Welcome) or reply.worker_id != f"sim-{i}":
                    raise RuntimeError(
                        f"sim-{i}: the coordinator answered the hello with {reply!r}"
                    )
        task = asyncio.ensure_future(self._live(ws))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _live(self, ws: ClientConnection) -> None:
        async def drain() -> None:
            async for _ in ws:
                pass

        reader = asyncio.ensure_future(drain())
        try:
            await asyncio.wait({reader}, timeout=random.uniform(0, HEARTBEAT_INTERVAL))
            while not reader.done():
                await ws.send(_heartbeat())
                await asyncio.wait({reader}, timeout=HEARTBEAT_INTERVAL * random.uniform(0.9, 1.1))
        except Exception:  # the connection closed under a send: counted in dropped()
            pass
        finally:
            reader.cancel()

    def dropped(self) -> list[str]:
        """Why each connection that is no longer open closed (before :meth:`close`)."""
        return [
            f"{ws.close_code} {ws.close_reason}"
            for ws in self.connections
            if ws.state is not State.OPEN
        ]

    async def close(self, batch: int) -> None:
        for task in list(self._tasks):
            task.cancel()
        gate = asyncio.Semaphore(batch)

        async def close_one(ws: ClientConnection) -> None:
            async with gate:
                await ws.close()

        await asyncio.gather(*(close_one(ws) for ws in self.connections), return_exceptions=True)


async def _ping_bursts(channel: Channel, seconds: float) -> list[float]:
    """Round trips of ``Ping()``: :data:`PING_BURST` back to back every :data:`PING_EVERY` s."""
    times = []
    deadline = time.perf_counter() + seconds
    while (burst_start := time.perf_counter()) < deadline:
        for _ in range(PING_BURST):
            start = time.perf_counter()
            await ping(channel)
            times.append(time.perf_counter() - start)
        await asyncio.sleep(max(0.0, burst_start + PING_EVERY - time.perf_counter()))
    return times


def _census(client: sz.Client) -> dict[str, Any]:
    workers = [w for w in client.status()["workers"] if w["id"].startswith("sim-")]
    states: dict[str, int] = {}
    for w in workers:
        states[w["state"]] = states.get(w["state"], 0) + 1
    ages = [w["last_heartbeat_age"] for w in workers if w["state"] == "idle"]
    return {"states": states, "max_heartbeat_age": max(ages, default=0.0)}


def _check(census: dict[str, Any], n: int, when: str) -> None:
    if census["states"] != {"idle": n}:
        raise AssertionError(f"{when}: expected {n} idle simulated workers, got {census['states']}")


async def _coordinator_side(
    client: sz.Client, url: str, pid: int, n: int, batch: int, hold: float
) -> dict[str, Any]:
    async with client_channel(url) as channel:
        return await _measure_coordinator(client, channel, url, pid, n, batch, hold)


async def _measure_coordinator(
    client: sz.Client, channel: Channel, url: str, pid: int, n: int, batch: int, hold: float
) -> dict[str, Any]:
    idle_pings = await _ping_bursts(channel, IDLE_PING_SECONDS)
    await asyncio.sleep(1.0)
    rss_before = rss_bytes(pid)
    fleet = Fleet(f"{url}/worker", welcome=True)
    try:
        register_s = await fleet.open(n, batch)
        registered = await asyncio.to_thread(_census, client)
        _check(registered, n, "right after registering")
        cpu_start, wall_start = cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(hold)
        cpu_share = (cpu_seconds(pid) - cpu_start) / (time.perf_counter() - wall_start)
        rss_loaded = rss_bytes(pid)
        loaded_pings = await _ping_bursts(channel, LOADED_PING_SECONDS)
        held = await asyncio.to_thread(_census, client)
        dropped = fleet.dropped()
        _check(held, n, f"after {hold:.0f} s of heartbeats")
        if dropped:
            raise AssertionError(
                f"{len(dropped)} simulated agents were disconnected: {dropped[:5]}"
            )
    finally:
        await fleet.close(batch)
    return {
        "register_s": register_s,
        "rss_before": rss_before,
        "rss_loaded": rss_loaded,
        "bytes_per_connection": (rss_loaded - rss_before) / n,
        "cpu_share": cpu_share,
        "states": held["states"],
        "max_heartbeat_age": held["max_heartbeat_age"],
        "ping_idle": summary(idle_pings),
        "ping_loaded": summary(loaded_pings),
    }


async def _anchor_side(url: str, pid: int, n: int, batch: int, hold: float) -> dict[str, Any]:
    async with connect(url, compression=None, max_size=MAX_SIZE) as ws:  # warm its code paths
        await ws.send(_hello(-1))
    await asyncio.sleep(1.0)
    rss_before = rss_bytes(pid)
    fleet = Fleet(url, welcome=False)
    try:
        register_s = await fleet.open(n, batch)
        cpu_start, wall_start = cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(hold)
        cpu_share = (cpu_seconds(pid) - cpu_start) / (time.perf_counter() - wall_start)
        rss_loaded = rss_bytes(pid)
        dropped = fleet.dropped()
        if dropped:
            raise AssertionError(f"{len(dropped)} anchor connections closed: {dropped[:5]}")
    finally:
        await fleet.close(batch)
    return {
        "register_s": register_s,
        "rss_before": rss_before,
        "rss_loaded": rss_loaded,
        "bytes_per_connection": (rss_loaded - rss_before) / n,
        "cpu_share": cpu_share,
    }


def run(n: int = AGENTS, batch: int = BATCH, hold: float = HOLD_SECONDS) -> dict[str, Any]:
    """Hold ``n`` simulated idle agents on a real coordinator for ``hold`` s, then on the anchor.

    Returns:
        ``{"n", "batch", "hold_s", "fd_limit", "coordinator": {...}, "anchor": {...},
        "log_problems"}``. Both sides have ``register_s``, ``rss_before``, ``rss_loaded``,
        ``bytes_per_connection`` and ``cpu_share`` (CPU seconds per second during the hold); the
        coordinator also ``states`` (simulated workers by state), ``max_heartbeat_age`` and
        ``ping_idle``/``ping_loaded`` (:func:`benchmarks.roundtrip.summary`). ``log_problems``:
        the coordinator's log lines reporting an error, a warning or a lost worker.

    Raises:
        AssertionError: a simulated agent was not idle, was lost or was disconnected.
    """
    fd_limit = raise_fd_limit()
    if fd_limit < n + 100:
        raise RuntimeError(f"RLIMIT_NOFILE hard limit {fd_limit} is too low for {n} connections")
    results: dict[str, Any] = {"n": n, "batch": batch, "hold_s": hold, "fd_limit": fd_limit}
    with (
        tempfile.TemporaryDirectory(prefix="somatize-fleet-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        port = free_port()
        url = f"ws://127.0.0.1:{port}"
        heartbeat = ["--heartbeat-interval", str(HEARTBEAT_INTERVAL)]
        heartbeat += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        coordinator = procs.spawn_coordinator(port, Path(tmp) / "state", *heartbeat)
        with sz.connect(url, timeout=30) as client:
            client.ping()
            results["coordinator"] = uvloop.run(
                _coordinator_side(client, url, coordinator.pid, n, batch, hold)
            )
        if (code := coordinator.poll()) is not None:
            raise RuntimeError(f"the coordinator exited with {code} during the benchmark")
        procs.stop("coordinator")
        results["log_problems"] = procs.problems("coordinator")

        anchor_port = free_port()
        anchor = procs.spawn_bare("anchor", "hold", anchor_port)
        results["anchor"] = uvloop.run(
            _anchor_side(f"ws://127.0.0.1:{anchor_port}", anchor.pid, n, batch, hold)
        )
    return results


def main() -> None:
    results = run()
    ours, anchor = results["coordinator"], results["anchor"]
    n = results["n"]
    mib = 1 << 20
    print(
        f"fleet: {n} simulated idle agents on one coordinator (heartbeat {HEARTBEAT_INTERVAL:g} s, "
        f"timeout {HEARTBEAT_TIMEOUT:g} s), {results['batch']} handshakes at a time, "
        f"held {results['hold_s']:g} s"
    )
    header = f"{'register':>9} {'RSS before':>11} {'RSS with N':>11} {'per conn':>10} {'CPU':>6}"
    print(f"  {'':34} {header}")
    for label, r in (("coordinator", ours), ("anchor: bare websockets server", anchor)):
        print(
            f"  {label:34} {r['register_s']:7.2f} s {r['rss_before'] / mib:7.1f} MiB "
            f"{r['rss_loaded'] / mib:7.1f} MiB {r['bytes_per_connection'] / 1024:6.1f} KiB "
            f"{r['cpu_share'] * 100:5.1f}%"
        )
    print(
        f"  per connection: coordinator / anchor = "
        f"{ours['bytes_per_connection'] / anchor['bytes_per_connection']:.2f} x"
    )
    print(
        f"  status: {ours['states']}, none lost; oldest heartbeat "
        f"{ours['max_heartbeat_age']:.2f} s ago"
    )
    for label, key in (
        ("idle coordinator", "ping_idle"),
        (f"{n} agents heartbeating", "ping_loaded"),
    ):
        p = ours[key]
        print(
            f"  Ping(), {label:26} x{p['count']:<5} p50 {p['p50_us']:7.1f} µs   "
            f"p99 {p['p99_us']:7.1f} µs   mean {p['mean_us']:7.1f} µs"
        )
    for line in results["log_problems"]:
        print(f"  ! coordinator log: {line}")


if __name__ == "__main__":
    main()
