"""1,000 workers on one coordinator: what they cost idle, and one FedAvg round over all of them.

``python -m benchmarks.fleet`` starts a real ``somatize-coordinator`` (heartbeat every 2 s,
timeout 10 s) and, from this one process on uvloop, connects N = 1,000 simulated agents to
``/worker``: each a real WebSocket connection with a :class:`protocol.channel.Channel` on it,
that sends a real ``WorkerHello`` (``sim-<i>``, tag ``sim``, a dataset ``sim`` of 100-102 rows),
reads the ``Welcome``, sends a ``Heartbeat`` every interval (jittered ±10 %, the first at a
random point of the first interval) and answers the coordinator's job messages as an agent
would, without a daemon (:class:`SimAgent`): ``open_job``/``close_job`` with an ``ack``, and the
daemon commands FedAvg sends in ``call`` messages — ``stage``, ``get_state``, ``set_state``,
``batched_fit`` — with results of the daemon's shape, over a 1 MB float32 state (torch tensors,
as a daemon's ``state_dict``). They are opened 50 at a time. Measured:

- *register*: wall time from the first dial to the N-th ``Welcome``;
- *idle memory*: the coordinator's RSS (``VmRSS``) before the agents and after they have been
  connected and heartbeating for :data:`HOLD_SECONDS` → bytes per connection; its CPU share
  over that time; ``Ping()`` round trips (client → coordinator) in bursts of 100 every 0.25 s,
  idle and with the N agents;
- *the FedAvg round*: ``client.submit(TorchFilter(Linear(512, 512)), WorkerData("sim"),
  strategy=FedAvg(rounds=1, tag="sim"))`` through the SDK: the coordinator opens the job on
  every agent (the 1 MB pickled filter to each) and stages their data (*setup*, submit →
  ``staged`` event), then the *round* (``staged`` → ``round`` event): w_0 read from one agent,
  1 MB sent to each of the N (``set_state``), each answers ``batched_fit`` with its row count,
  the coordinator pulls each one's 1 MB trained state (``get_state``) and averages them weighted
  by rows as they arrive. The final model (read back from one
  agent) is checked against the weighted mean computed here. Also: the coordinator's peak
  memory (``VmHWM``, the whole run) and the latency of the heartbeat path while the round runs:
  a probe worker in a process of its own (tag ``probe``, so not in the job) sends a
  ``Heartbeat`` and a WebSocket ping every :data:`PROBE_EVERY` s and times the pong: how long
  the coordinator takes to read a worker's frame. No agent may be lost or disconnected;
- *anchors*: a bare ``websockets`` server on uvloop (:data:`FANOUT`) holds N connections opened
  the same way, sending the same hello and heartbeat bytes, for the same time: its RSS per
  connection is what the transport alone costs; then it sends 1 MB to each of the N and waits
  for 1 MB back from each (the bytes of the round, no codec, no strategy): the round's anchor.

Every process is stopped at the end, also on Ctrl-C; the coordinator's log is kept in a
temporary directory, scanned for errors, warnings and lost workers, and its tail printed if the
run fails.
"""

from __future__ import annotations

import asyncio
import math
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import uvloop
from websockets.asyncio.client import ClientConnection, connect
from websockets.protocol import State

import somatize as sz
from benchmarks.report import Row, Target
from benchmarks.roundtrip import (
    MAX_SIZE,
    Processes,
    client_channel,
    cpu_seconds,
    free_port,
    ping,
    port_open,
    rss_bytes,
    summary,
)
from protocol.asyncio.channel import Channel
from protocol.errors import ErrorCode, ErrorInfo, RemoteError
from protocol.messages import Ack, Capabilities, Heartbeat, Result, Welcome, WorkerHello
from protocol.parsing import encode_small, parse

AGENTS = 1_000
BATCH = 50
HEARTBEAT_INTERVAL = 2.0
HEARTBEAT_TIMEOUT = 10.0
HOLD_SECONDS = 6.0
PING_BURST = 100
PING_EVERY = 0.25
IDLE_PING_SECONDS = 2.0
LOADED_PING_SECONDS = 3.0
STATE_BYTES = 1 << 20
"""The model's weight matrix (``Linear(512, 512)``: 1 MiB, plus 2 KiB of bias)."""
NODE = "model"
DATASET = "sim"
VARIANTS = 4
"""Sim ``i`` trains its state to all ``(i % VARIANTS) + 1``: the mean is known in advance."""
PROBE_EVERY = 0.02
JOB_TIMEOUT = 300.0
CAPABILITIES = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3.11", cloudpickle="3")

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                sample = (time.time(), rss_bytes(self.pid), cpu_seconds(self.pid))
                self.samples.append((*sample, time.process_time()))
            except (OSError, RuntimeError):  # the process is gone
                return

    def peak(self, start: float, stop: float) -> int:
        return max((s[1] for s in self.samples if start <= s[0] <= stop), default=0)

    def cpu(self, start: float, stop: float) -> tuple[float, float]:
        """CPU seconds of the process and of this one between ``start`` and ``stop``."""
        inside = [s for s in self.samples if start <= s[0] <= stop]
        if len(inside) < 2:
            return math.nan, math.nan
        return inside[-1][2] - inside[0][2], inside[-1][3] - inside[0][3]


def side(state_bytes: int) -> int:
    """The width of the square ``Linear`` whose weight is ``state_bytes`` of float32."""
    return max(1, math.isqrt(state_bytes // 4))


def state_nbytes(state_bytes: int) -> int:
    """The bytes of the tensors of the model state (weight and bias)."""
    width = side(state_bytes)
    return 4 * (width * width + width)


def rows_of(i: int) -> int:
    return 100 + i % 3


def trained(width: int, variant: int) -> dict[str, torch.Tensor]:
    """Variant ``variant``'s trained state: every number ``variant + 1``."""
    value = float(variant + 1)
    return {"weight": torch.full((width, width), value), "bias": torch.full((width,), value)}


def expected_mean(n: int) -> float:
    """The rows-weighted mean of the N sims' trained states (each a constant)."""
    weights = [rows_of(i) for i in range(n)]
    return sum(w * (i % VARIANTS + 1) for i, w in enumerate(weights)) / sum(weights)


class SimAgent:
    """The job side of one simulated agent: answers as an agent with a daemon would, in memory.

    Args:
        i: its number (``sim-<i>``).
        states: the trained states by variant, shared by every sim (encoding does not copy them).
        initial: what ``get_state`` answers before any ``set_state``.
    """

    def __init__(self, i: int, states: list[dict[str, torch.Tensor]], initial: Any) -> None:
        self.i = i
        self.rows = rows_of(i)
        self.trained = states[i % VARIANTS]
        self.state: Any = initial

    async def handle(self, message: Any) -> Any:
        if message.kind in ("open_job", "close_job"):
            return Ack()
        if message.kind == "call":
            return Result(result=self.call(message.request))
        raise RemoteError(
            ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"sim takes no {message.kind!r}")
        )

    def call(self, request: dict[str, Any]) -> Any:
        cmd = request.get("cmd")
        if cmd == "stage":
            return {"rows": self.rows}
        if cmd == "get_state":
            return {node: self.state for node in request["node_ids"]}
        if cmd == "set_state":
            self.state = request["states"][NODE]
            return None
        if cmd == "batched_fit":
            self.state = self.trained
            return {
                "rows": self.rows,
                "states": {NODE: self.trained} if request.get("return_states", True) else {},
                "loss": 1.0 / (1 + self.i % VARIANTS),
                "epoch_losses": [1.0],
                "output": None,
            }
        raise RemoteError(
            ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"sim runs no command {cmd!r}")
        )


class Fleet:
    """N simulated agents on this event loop: dial, hello, heartbeat, answer job messages.

    Args:
        url: the ``/worker`` endpoint (or a bare server).
        welcome: expect a ``Welcome`` after the hello (the bare anchor sends nothing).
        state_bytes: the size of the model state a sim trains.
        bare: answer every message of ``state_bytes`` with as many bytes (the anchor's round),
            instead of speaking the protocol.
    """

    def __init__(self, url: str, welcome: bool, state_bytes: int, bare: bool = False) -> None:
        self.url = url
        self.welcome = welcome
        self.bare = bare
        self.state_bytes = state_bytes
        width = side(state_bytes)
        self.states = [trained(width, k) for k in range(VARIANTS)]
        self.initial = {"weight": torch.zeros(width, width), "bias": torch.zeros(width)}
        self.payload = bytes(state_nbytes(state_bytes))
        self.connections: list[ClientConnection] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, n: int, batch: int) -> float:
        """Connect ``n`` agents, ``batch`` handshakes at a time; seconds until all welcomed."""
        gate = asyncio.Semaphore(batch)
        start = time.perf_counter()
        await asyncio.gather(*(self._open_one(i, gate) for i in range(n)))
        return time.perf_counter() - start

    def _hello(self, i: int) -> bytes:
        hello = WorkerHello(
            worker_id=f"sim-{i}",
            tags=["sim"],
            capabilities=CAPABILITIES,
            datasets={DATASET: rows_of(i)},
        )
        return encode_small(hello)

    async def _open_one(self, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            # As the real agent dials: its keepalive pings on too (20 s), here never due.
            ws = await connect(
                self.url,
                compression=None,
                max_size=None if self.bare else MAX_SIZE,
                open_timeout=30,
                ping_interval=20.0,
                ping_timeout=20.0,
            )
            self.connections.append(ws)
            await ws.send(self._hello(i))
            if self.welcome:
                async with asyncio.timeout(30):
                    reply = parse(await ws.recv(decode=False))
                if not isinstance(reply, Welcome) or reply.worker_id != f"sim-{i}":
                    raise RuntimeError(
                        f"sim-{i}: the coordinator answered the hello with {reply!r}"
                    )
        agent = SimAgent(i, self.states, self.initial)
        self._spawn(self._bare(ws) if self.bare else self._live(ws, agent))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _live(self, ws: ClientConnection, agent: SimAgent) -> None:
        channel = Channel(ws, f"sim-{agent.i}", agent.handle)
        reader = asyncio.ensure_future(channel.run())
        await self._heartbeat(reader, lambda: channel.send(Heartbeat(sent_at=time.time())))

    async def _bare(self, ws: ClientConnection) -> None:
        async def answer() -> None:
            async for message in ws:
                if len(message) == len(self.payload):
                    await ws.send(self.payload)

        reader = asyncio.ensure_future(answer())
        heartbeat = encode_small(Heartbeat(sent_at=time.time()))
        await self._heartbeat(reader, lambda: ws.send(heartbeat))

    async def _heartbeat(
        self, reader: asyncio.Future[None], send: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await asyncio.wait({reader}, timeout=random.uniform(0, HEARTBEAT_INTERVAL))
            while not reader.done():
                await send()
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


def _fedavg_job(client: sz.Client, state_bytes: int) -> dict[str, Any]:
    """Submit the one-round FedAvg job and follow it to its end (in a thread: the SDK blocks)."""
    width = side(state_bytes)
    torch.manual_seed(0)
    graph = sz.Graph([sz.TorchFilter(torch.nn.Linear(width, width)).named(NODE)])
    strategy = sz.FedAvg(rounds=1, tag="sim")
    submitted = time.time()
    job = client.submit(graph, sz.WorkerData(DATASET), strategy=strategy)
    stamps: dict[str, float] = {}
    end = None
    for event in job.events(timeout=JOB_TIMEOUT):
        phase = event.data.get("phase") if event.event == "progress" else event.event
        stamps.setdefault(str(phase), event.time)
        end = event
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the FedAvg job did not succeed: {end}")
    states = job.states(timeout=JOB_TIMEOUT)
    return {"submitted": submitted, "stamps": stamps, "states": states}


def _probe_samples(path: Path, start: float, stop: float) -> list[float]:
    """The probe's pong latencies (s) of the pings sent between ``start`` and ``stop``."""
    samples = []
    for line in path.read_text().splitlines():
        sent, latency = (float(v) for v in line.split())
        if start <= sent <= stop:
            samples.append(latency)
    return samples


def _latency(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"count": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    return {
        "count": len(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def _coordinator_side(
    procs: Processes,
    client: sz.Client,
    url: str,
    pid: int,
    n: int,
    batch: int,
    hold: float,
    state_bytes: int,
) -> dict[str, Any]:
    async with client_channel(url) as channel:
        idle_pings = await _ping_bursts(channel, IDLE_PING_SECONDS)
        await asyncio.sleep(1.0)
        rss_before = rss_bytes(pid)
        fleet = Fleet(f"{url}/worker", welcome=True, state_bytes=state_bytes)
        try:
            register_s = await fleet.open(n, batch)
            registered = await asyncio.to_thread(_census, client)
            _check(registered, n, "right after registering")
            probe_out = procs.directory / "probe.txt"
            probe = [sys.executable, "-c", PROBE, f"{url}/worker", str(probe_out)]
            procs.spawn("probe", [*probe, str(PROBE_EVERY)])
            cpu_start, wall_start = cpu_seconds(pid), time.perf_counter()
            hold_start = time.time()
            await asyncio.sleep(hold)
            cpu_share = (cpu_seconds(pid) - cpu_start) / (time.perf_counter() - wall_start)
            rss_loaded = rss_bytes(pid)
            loaded_pings = await _ping_bursts(channel, LOADED_PING_SECONDS)
            held = await asyncio.to_thread(_census, client)
            _check(held, n, f"after {hold:.0f} s of heartbeats")
            hold_stop = time.time()
            with RssSampler(pid) as sampler:
                job = await asyncio.to_thread(_fedavg_job, client, state_bytes)
            after = await asyncio.to_thread(_census, client)
            _check(after, n, "after the FedAvg round")
            dropped = fleet.dropped()
            if dropped:
                raise AssertionError(
                    f"{len(dropped)} simulated agents were disconnected: {dropped[:5]}"
                )
            procs.stop("probe")
        finally:
            await fleet.close(batch)
    stamps = job["stamps"]
    model = job["states"][NODE]
    expected = expected_mean(n)
    for name, tensor in model.items():
        if not torch.allclose(tensor, torch.full_like(tensor, expected), rtol=1e-6, atol=0):
            raise AssertionError(
                f"the averaged {name} is not the rows-weighted mean {expected!r}: "
                f"{tensor.flatten()[:3].tolist()} ..."
            )
    return {
        "register_s": register_s,
        "rss_before": rss_before,
        "rss_loaded": rss_loaded,
        "bytes_per_connection": (rss_loaded - rss_before) / n,
        "cpu_share": cpu_share,
        "states": held["states"],
        "max_heartbeat_age": after["max_heartbeat_age"],
        "ping_idle": summary(idle_pings),
        "ping_loaded": summary(loaded_pings),
        "fedavg": {
            "state_bytes": sum(t.numel() * 4 for t in model.values()),
            "setup_s": stamps["staged"] - job["submitted"],
            "round_s": stamps["round"] - stamps["staged"],
            "read_back_s": stamps["succeeded"] - stamps["round"],
            "job_s": stamps["succeeded"] - job["submitted"],
            "mean": expected,
            "peak_rss": peak_rss_bytes(pid),
            "peak_rss_setup": sampler.peak(job["submitted"], stamps["staged"]),
            "peak_rss_round": sampler.peak(stamps["staged"], stamps["round"]),
            "cpu_round": dict(
                zip(
                    ("coordinator", "sims"),
                    sampler.cpu(stamps["staged"], stamps["round"]),
                    strict=True,
                )
            ),
            "heartbeat_idle": _latency(_probe_samples(probe_out, hold_start, hold_stop)),
            "heartbeat_round": _latency(
                _probe_samples(probe_out, stamps["staged"], stamps["round"])
            ),
        },
    }


async def _anchor_side(
    url: str, pid: int, n: int, batch: int, hold: float, state_bytes: int
) -> dict[str, Any]:
    async with connect(url, compression=None, max_size=None) as ws:  # warm its code paths
        await ws.send(encode_small(Heartbeat(sent_at=time.time())))
    await asyncio.sleep(1.0)
    rss_before = rss_bytes(pid)
    fleet = Fleet(url, welcome=False, state_bytes=state_bytes, bare=True)
    try:
        register_s = await fleet.open(n, batch)
        cpu_start, wall_start = cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(hold)
        cpu_share = (cpu_seconds(pid) - cpu_start) / (time.perf_counter() - wall_start)
        rss_loaded = rss_bytes(pid)
        async with connect(url, compression=None, max_size=None) as control:
            await control.send(b"control")
            start = time.perf_counter()
            await control.send(b"round")
            async with asyncio.timeout(JOB_TIMEOUT):
                server_s = float(await control.recv())
            round_s = time.perf_counter() - start
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
        "round_s": round_s,
        "round_server_s": server_s,
        "peak_rss": peak_rss_bytes(pid),
    }


def run(
    n: int = AGENTS,
    batch: int = BATCH,
    hold: float = HOLD_SECONDS,
    state_bytes: int = STATE_BYTES,
) -> dict[str, Any]:
    """Hold ``n`` simulated agents on a real coordinator for ``hold`` s, run one FedAvg round
    over them with a state of ``state_bytes``, then do the same on the bare anchor.

    Returns:
        ``{"n", "batch", "hold_s", "fd_limit", "coordinator": {...}, "anchor": {...},
        "log_problems"}``. Both sides have ``register_s``, ``rss_before``, ``rss_loaded``,
        ``bytes_per_connection``, ``cpu_share`` (CPU seconds per second during the hold);
        the coordinator also ``states`` (simulated workers by state), ``max_heartbeat_age``
        (after the round), ``ping_idle``/``ping_loaded`` (:func:`benchmarks.roundtrip.summary`)
        and ``fedavg``: ``setup_s``, ``round_s``, ``read_back_s``, ``job_s``, ``state_bytes``,
        ``mean`` (checked), ``peak_rss`` and the probe's ``heartbeat_idle`` and
        ``heartbeat_round`` (``count``, ``p50_ms``, ``p99_ms``, ``max_ms``); the anchor its
        ``round_s`` (``round_server_s`` as its server timed it) and ``peak_rss``.
        ``log_problems``: the coordinator's log lines reporting an error, a warning or a lost
        worker.

    Raises:
        AssertionError: a simulated agent was not idle, was lost or was disconnected, or the
            averaged model is not the weighted mean.
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
        with sz.connect(url, timeout=60) as client:
            client.ping()
            results["coordinator"] = uvloop.run(
                _coordinator_side(procs, client, url, coordinator.pid, n, batch, hold, state_bytes)
            )
        if (code := coordinator.poll()) is not None:
            raise RuntimeError(f"the coordinator exited with {code} during the benchmark")
        procs.stop("coordinator")
        results["log_problems"] = procs.problems("coordinator")

        anchor_port = free_port()
        fanout = [sys.executable, "-c", FANOUT, str(anchor_port), str(state_nbytes(state_bytes))]
        anchor = procs.spawn("anchor", fanout)
        procs.wait_for(lambda: port_open(anchor_port), 30, "the anchor to listen")
        results["anchor"] = uvloop.run(
            _anchor_side(f"ws://127.0.0.1:{anchor_port}", anchor.pid, n, batch, hold, state_bytes)
        )
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: the FedAvg round (time, peak memory, heartbeat latency) and the idle
    cost of the fleet, each next to the bare ``websockets`` anchor where there is one."""
    n = results["n"]
    ours, anchor = results["coordinator"], results["anchor"]
    fed = ours["fedavg"]
    mb = fed["state_bytes"] / 2**20
    mib = 2**20
    hb_idle, hb_round = fed["heartbeat_idle"], fed["heartbeat_round"]
    return [
        Row(
            bench="fleet",
            name=f"FedAvg round over {n:,} workers, {mb:.1f} MB state each",
            ours=fed["round_s"],
            unit="s",
            anchor=anchor["round_s"],
            anchor_name=f"bare ws: {mb:.1f} MB out to and back from each",
            target=Target("<", 10.0, on="ours", text="< 10 s"),
            note=f"job setup {fed['setup_s']:.1f} s, whole job {fed['job_s']:.1f} s",
        ),
        Row(
            bench="fleet",
            name="coordinator peak memory (VmHWM, whole run)",
            ours=fed["peak_rss"] / mib,
            unit="MiB",
            anchor=anchor["peak_rss"] / mib,
            anchor_name="bare ws server's peak",
            target=Target("<", 1024.0, on="ours", text="< 1 GB"),
            note=f"idle before the fleet {ours['rss_before'] / mib:.0f} MiB",
        ),
        Row(
            bench="fleet",
            name="heartbeat path latency p99 during the round",
            ours=hb_round["p99_ms"],
            unit="ms",
            anchor=hb_idle["p99_ms"],
            anchor_name=f"same, {n:,} idle workers",
            note=f"p50 {hb_round['p50_ms']:.1f} ms, max {hb_round['max_ms']:.0f} ms, "
            f"x{hb_round['count']}",
        ),
        Row(
            bench="fleet",
            name=f"register {n:,} workers",
            ours=ours["register_s"],
            unit="s",
            anchor=anchor["register_s"],
            anchor_name="bare ws server",
        ),
        Row(
            bench="fleet",
            name="memory per idle connection",
            ours=ours["bytes_per_connection"] / 1024,
            unit="KiB",
            anchor=anchor["bytes_per_connection"] / 1024,
            anchor_name="bare ws server",
            note=f"CPU {ours['cpu_share'] * 100:.0f} % vs {anchor['cpu_share'] * 100:.0f} % idle",
        ),
    ]


def main() -> None:
    results = run()
    ours, anchor = results["coordinator"], results["anchor"]
    fed = ours["fedavg"]
    n = results["n"]
    mib = 1 << 20
    print(
        f"fleet: {n} simulated agents on one coordinator (heartbeat {HEARTBEAT_INTERVAL:g} s, "
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
    for label, key in (
        ("idle coordinator", "ping_idle"),
        (f"{n} agents heartbeating", "ping_loaded"),
    ):
        p = ours[key]
        print(
            f"  Ping(), {label:26} x{p['count']:<5} p50 {p['p50_us']:7.1f} µs   "
            f"p99 {p['p99_us']:7.1f} µs   mean {p['mean_us']:7.1f} µs"
        )
    print(
        f"  FedAvg, {fed['state_bytes'] / mib:.2f} MiB state: setup {fed['setup_s']:.2f} s, "
        f"round {fed['round_s']:.2f} s (anchor {anchor['round_s']:.2f} s), read back "
        f"{fed['read_back_s']:.2f} s, whole job {fed['job_s']:.2f} s; "
        f"mean {fed['mean']:.4f} checked"
    )
    print(
        f"  peak RSS: coordinator {fed['peak_rss'] / mib:.0f} MiB (sampled every 10 ms: setup "
        f"{fed['peak_rss_setup'] / mib:.0f} MiB, round {fed['peak_rss_round'] / mib:.0f} MiB), "
        f"anchor {anchor['peak_rss'] / mib:.0f} MiB"
    )
    cpu = fed["cpu_round"]
    print(
        f"  CPU seconds in the round: coordinator {cpu['coordinator']:.2f} s, "
        f"the {n} sims (this process) {cpu['sims']:.2f} s"
    )
    for label, key in (("idle", "heartbeat_idle"), ("during the round", "heartbeat_round")):
        h = fed[key]
        print(
            f"  heartbeat path, {label:17} x{h['count']:<4} p50 {h['p50_ms']:6.1f} ms   "
            f"p99 {h['p99_ms']:6.1f} ms   max {h['max_ms']:6.1f} ms"
        )
    print(
        f"  status after the round: none lost; oldest heartbeat {ours['max_heartbeat_age']:.2f} s"
    )
    for line in results["log_problems"]:
        print(f"  ! coordinator log: {line}")


if __name__ == "__main__":
    main()
