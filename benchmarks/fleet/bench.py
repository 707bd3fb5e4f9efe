"""1,000 workers on one coordinator: what they cost idle, and one FedAvg round over all of them.

``python -m benchmarks.fleet [--agents N] [--state-bytes B] [--heartbeat S]`` starts a real
``somatize-coordinator`` (heartbeat every 2 s, timeout 10 s) and, from this one process on
uvloop, connects N (default 1,000) simulated agents to
``/worker``: each a real WebSocket connection with a
:class:`protocol.asyncio.channel.Channel` on it, that sends a real ``WorkerHello`` (``sim-<i>``, tag
``sim``, a dataset ``sim`` of 100-102 rows), reads the ``Welcome``, sends a ``Heartbeat`` every
interval (jittered ±10 %, the first at a random point of the first interval) and answers the
coordinator's job messages as an agent would, without a daemon (:class:`SimAgent`):
``open_job``/``close_job`` with an ``ack``, and the daemon commands FedAvg sends in ``call``
messages — ``stage``, ``get_state``, ``set_state``, ``batched_fit`` — with results of the daemon's
shape, over a 1 MB float32 state (torch tensors, as a daemon's ``state_dict``). They are opened 50
at a time. Measured:

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

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import uvloop
from websockets.asyncio.client import connect

import somatize as sz
from benchmarks.fleet.measure import (
    FANOUT,
    PROBE,
    RssSampler,
    latency,
    peak_rss_bytes,
    probe_samples,
    raise_fd_limit,
)
from benchmarks.fleet.sim import (
    DATASET,
    HEARTBEAT_INTERVAL,
    NODE,
    Fleet,
    expected_mean,
    side,
    state_nbytes,
)
from benchmarks.report import Row, Target
from benchmarks.roundtrip import (
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
from protocol.messages import Heartbeat
from protocol.parsing import encode_small

AGENTS = 1_000
BATCH = 50
HEARTBEAT_TIMEOUT = 10.0
HOLD_SECONDS = 6.0
PING_BURST = 100
PING_EVERY = 0.25
IDLE_PING_SECONDS = 2.0
LOADED_PING_SECONDS = 3.0
STATE_BYTES = 1 << 20
"""The model's weight matrix (``Linear(512, 512)``: 1 MiB, plus 2 KiB of bias)."""
PROBE_EVERY = 0.02
JOB_TIMEOUT = 300.0


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


async def _coordinator_side(
    procs: Processes,
    client: sz.Client,
    url: str,
    pid: int,
    n: int,
    batch: int,
    *,
    hold: float,
    state_bytes: int,
    heartbeat: float = HEARTBEAT_INTERVAL,
) -> dict[str, Any]:
    async with client_channel(url) as channel:
        idle_pings = await _ping_bursts(channel, IDLE_PING_SECONDS)
        await asyncio.sleep(1.0)
        rss_before = rss_bytes(pid)
        fleet = Fleet(f"{url}/worker", welcome=True, state_bytes=state_bytes, heartbeat=heartbeat)
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
        "fedavg": _fedavg_figures(job, n, pid, sampler, probe_out, (hold_start, hold_stop)),
    }


def _check_mean(model: dict[str, torch.Tensor], expected: float) -> None:
    """Raise unless every number of the averaged ``model`` is the rows-weighted ``expected``."""
    for name, tensor in model.items():
        if not torch.allclose(tensor, torch.full_like(tensor, expected), rtol=1e-6, atol=0):
            raise AssertionError(
                f"the averaged {name} is not the rows-weighted mean {expected!r}: "
                f"{tensor.flatten()[:3].tolist()} ..."
            )


def _fedavg_figures(
    job: dict[str, Any],
    n: int,
    pid: int,
    sampler: RssSampler,
    probe_out: Path,
    hold: tuple[float, float],
) -> dict[str, Any]:
    """The FedAvg job's figures, its model checked first: the phases' times from its events,
    the coordinator's memory and CPU from ``sampler``, the probe's latencies while the fleet was
    held idle (``hold``: its start and stop, wall times) and during the round."""
    stamps = job["stamps"]
    model = job["states"][NODE]
    expected = expected_mean(n)
    _check_mean(model, expected)
    return {
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
        "heartbeat_idle": latency(probe_samples(probe_out, *hold)),
        "heartbeat_round": latency(probe_samples(probe_out, stamps["staged"], stamps["round"])),
    }


async def _anchor_side(
    url: str,
    pid: int,
    n: int,
    batch: int,
    hold: float,
    *,
    state_bytes: int,
    heartbeat: float = HEARTBEAT_INTERVAL,
) -> dict[str, Any]:
    async with connect(url, compression=None, max_size=None) as ws:  # warm its code paths
        await ws.send(encode_small(Heartbeat(sent_at=time.time())))
    await asyncio.sleep(1.0)
    rss_before = rss_bytes(pid)
    fleet = Fleet(url, welcome=False, state_bytes=state_bytes, bare=True, heartbeat=heartbeat)
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
    heartbeat: float = HEARTBEAT_INTERVAL,
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
    results["heartbeat_s"] = heartbeat
    with (
        tempfile.TemporaryDirectory(prefix="somatize-fleet-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        port = free_port()
        url = f"ws://127.0.0.1:{port}"
        beats = ["--heartbeat-interval", str(heartbeat)]
        beats += ["--heartbeat-timeout", str(heartbeat * HEARTBEAT_TIMEOUT / HEARTBEAT_INTERVAL)]
        # Every simulated agent dials from 127.0.0.1, ``batch`` handshakes at a time: one
        # address holding that many pending sockets is this fleet, not an attack.
        pending = ["--max-pending-per-address", str(2 * batch)]
        coordinator = procs.spawn_coordinator(port, Path(tmp) / "state", *beats, *pending)
        with sz.connect(url, timeout=60) as client:
            client.ping()
            results["coordinator"] = uvloop.run(
                _coordinator_side(
                    procs,
                    client,
                    url,
                    coordinator.pid,
                    n,
                    batch,
                    hold=hold,
                    state_bytes=state_bytes,
                    heartbeat=heartbeat,
                )
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
            _anchor_side(
                f"ws://127.0.0.1:{anchor_port}",
                anchor.pid,
                n,
                batch,
                hold,
                state_bytes=state_bytes,
                heartbeat=heartbeat,
            )
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__)
    parser.add_argument("--agents", type=int, default=AGENTS, help=f"default {AGENTS:,}")
    parser.add_argument(
        "--state-bytes", type=int, default=STATE_BYTES, help=f"default {STATE_BYTES:,}"
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=HEARTBEAT_INTERVAL,
        help=f"the agents' heartbeat interval, s (default {HEARTBEAT_INTERVAL:g}; the timeout is "
        f"{HEARTBEAT_TIMEOUT / HEARTBEAT_INTERVAL:g} times it)",
    )
    args = parser.parse_args(argv)
    results = run(n=args.agents, state_bytes=args.state_bytes, heartbeat=args.heartbeat)
    ours, anchor = results["coordinator"], results["anchor"]
    fed = ours["fedavg"]
    n = results["n"]
    mib = 1 << 20
    print(
        f"fleet: {n} simulated agents on one coordinator (heartbeat {results['heartbeat_s']:g} "
        f"s, timeout {results['heartbeat_s'] * HEARTBEAT_TIMEOUT / HEARTBEAT_INTERVAL:g} s), "
        f"{results['batch']} handshakes at a time, "
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
