"""The round trip of a no-op request through a real cluster, next to bare ``websockets`` anchors.

``python -m benchmarks.roundtrip`` starts a real ``somatize-coordinator`` and one real
``somatize-worker`` (``--id bench --threads 1``) as subprocesses on 127.0.0.1 and times 5,000
round trips of each path below, ours and the anchors', in 5 interleaved rounds of 1,000 (each
after a warm-up of 200), so that a slow spell of the machine hits every path alike:

- *a. through every hop*: ``Ping(worker_id="bench")``: client → coordinator → worker agent → its
  filter daemon (pipes) → and back;
- *b. coordinator only*: ``Ping()``: client → coordinator → client;

each measured two ways: *SDK*, the synchronous ``client.ping()`` of :mod:`somatize.remote.client`
(what a user sees, including the hand-off to and from the SDK's event-loop thread), and *wire*, an
asyncio program on uvloop driving a :class:`protocol.asyncio.channel.Channel` over its own
``websockets`` connection (``await channel.request(Ping(...))``).

The anchors are timed in the same run, interleaved with ours, by the same kind of client (uvloop,
``websockets``), against bare ``websockets`` processes on uvloop: no codec, no pydantic, no daemon
pipes. *echo* is one
WebSocket hop to a server that sends each 64-byte binary message back (anchor of b); *chain* is
client → relay → relay → echo, each relay a process forwarding bytes both ways: 3 WebSocket hops
through 4 processes, like client → coordinator → agent → daemon (whose last hop is a pipe in
ours). The ratio ours/anchor is what our stack adds on top of the transport.

Figures are p50, p99 and mean in µs. Everything runs on loopback; with 2 cores, the 4 processes
of a chain share them, which is part of what is measured. Every process started here is killed at
the end (also on Ctrl-C); the coordinator's and worker's logs go to a temporary directory and
their tails are printed if the run fails. :mod:`benchmarks.fleet` reuses the process helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import uvloop
from websockets.asyncio.client import connect

import somatize as sz
from benchmarks.report import Row, Target
from protocol.asyncio.channel import Channel
from protocol.messages import ClientHello, Ping, Result, Welcome
from protocol.parsing import encode_small

ROUND_TRIPS = 5_000
WARMUP = 200
ROUNDS = 5
WORKER_ID = "bench"
ANCHOR_BYTES = 64
REQUEST_TIMEOUT = 60.0  # the first probe waits for the worker's spare daemon to import torch
MAX_SIZE = 4 << 20
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]

BARE_SERVER = """
import asyncio, sys
import uvloop
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

MODE, PORT = sys.argv[1], int(sys.argv[2])
KW = dict(compression=None, max_size=4 << 20, ping_interval=10.0, ping_timeout=20.0)

async def echo(ws):
    async for message in ws:
        await ws.send(message)

async def hold(ws):
    async for _ in ws:
        pass

async def relay(ws):
    async with connect(sys.argv[3], **KW) as upstream:
        async def pump(source, target):
            async for message in source:
                await target.send(message)
        tasks = [asyncio.ensure_future(pump(a, b)) for a, b in ((ws, upstream), (upstream, ws))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()

async def main():
    async with serve({"echo": echo, "hold": hold, "relay": relay}[MODE], "127.0.0.1", PORT, **KW):
        await asyncio.Future()

uvloop.run(main())
"""
"""A bare ``websockets`` server on uvloop, run as ``python -c BARE_SERVER MODE PORT [UPSTREAM]``:
``echo`` sends every message back, ``hold`` reads and drops them, ``relay`` forwards both ways to
``UPSTREAM``. It imports nothing of ours (nor torch), so its memory and latency are the
transport's."""

_PROBLEMS = re.compile(r"\b(ERROR|CRITICAL|WARNING|Traceback)\b| lost\b")


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(times: list[float]) -> dict[str, float]:
    """``count``, ``p50_us``, ``p99_us``, ``mean_us`` of durations in seconds."""
    ordered = sorted(times)
    return {
        "count": len(ordered),
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


class Processes:
    """Subprocesses in sessions of their own, each logging to a file; all killed on exit.

    On an exception (but Ctrl-C) the tail of every log is printed to stderr first.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            for name in self.procs:
                print(f"--- tail of {name}'s log ---\n{self.tail(name)}", file=sys.stderr)
        self.close()

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    def spawn(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``argv`` started in its own session, its output to its log; ``env``: variables set
        for it over this process's environment."""
        with open(self.log(name), "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )
        self.procs[name] = proc
        return proc

    def spawn_bare(self, name: str, mode: str, port: int, *args: str) -> subprocess.Popen[bytes]:
        """A :data:`BARE_SERVER` in ``mode`` on ``port``, once it accepts connections."""
        proc = self.spawn(name, [sys.executable, "-c", BARE_SERVER, mode, str(port), *args])
        self.wait_for(lambda: port_open(port), 30, f"{name} to listen on port {port}")
        return proc

    def spawn_coordinator(
        self, port: int, state_dir: Path, *extra: str, name: str = "coordinator"
    ) -> subprocess.Popen[bytes]:
        """``somatize-coordinator`` on ``127.0.0.1:port``, once ``/healthz`` answers."""
        argv = [str(BIN / "somatize-coordinator"), "--listen", f"127.0.0.1:{port}"]
        argv += ["--state-dir", str(state_dir), "--job-threads", "1", *extra]
        proc = self.spawn(name, argv)
        self.wait_for(lambda: healthy(port), 60, "the coordinator's /healthz")
        return proc

    def wait_for(self, condition: Callable[[], Any], seconds: float, what: str) -> Any:
        """Poll ``condition`` until truthy; fail early if one of our processes died."""
        deadline = time.monotonic() + seconds
        while True:
            value = condition()
            if value:
                return value
            for name, proc in self.procs.items():
                if name not in self.stopped and proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {seconds:.0f} s waiting for {what}")
            time.sleep(0.05)

    def tail(self, name: str, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def problems(self, name: str, limit: int = 20) -> list[str]:
        """Lines of ``name``'s log that report an error, a warning or a lost worker."""
        with contextlib.suppress(OSError):
            text = self.log(name).read_text(errors="replace")
            return [line for line in text.splitlines() if _PROBLEMS.search(line)][:limit]
        return []

    def stop(self, name: str, timeout: float = 10.0) -> int:
        """SIGTERM ``name``'s whole session (an agent's daemons too), SIGKILL after ``timeout``."""
        proc = self.procs[name]
        self.stopped.add(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):  # a straggler of its session
                os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop every process, newest first (workers before their coordinator)."""
        for name in reversed(list(self.procs)):
            if self.procs[name].returncode is None:
                self.stop(name)


# -- measurements ------------------------------------------------------------------------------


def _sdk_times(client: sz.Client, worker_id: str | None, n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        client.ping(worker_id)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.ping(worker_id)
        times.append(time.perf_counter() - start)
    return times


async def _timed(call: Callable[[], Awaitable[Any]], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return times


@contextlib.asynccontextmanager
async def client_channel(url: str) -> AsyncIterator[Channel]:
    """A client :class:`Channel` to the coordinator at ``url``, past the hello, running."""
    async with connect(f"{url}/client", compression=None, max_size=MAX_SIZE) as ws:
        channel = Channel(ws, "benchmark")
        await channel.send(ClientHello(name="benchmark"))
        welcome = await channel.receive(first=True)
        if not isinstance(welcome, Welcome):
            raise RuntimeError(f"the coordinator answered the hello with {welcome!r}")
        reader = asyncio.ensure_future(channel.run())
        try:
            yield channel
        finally:
            await channel.close()
            await reader


async def ping(channel: Channel, worker_id: str | None = None) -> None:
    """One ``Ping`` request over ``channel``, answered by a ``Result``."""
    reply = await channel.request(Ping(worker_id=worker_id), REQUEST_TIMEOUT)
    if not isinstance(reply, Result):
        raise RuntimeError(f"ping answered with {reply!r}")


async def _async_round(
    url: str, echo_url: str, chain_url: str, n: int, warmup: int
) -> dict[str, list[float]]:
    """One round of the asyncio paths: both pings over a ``Channel`` of our own, both anchors."""
    async with client_channel(url) as channel:
        wire_worker = await _timed(lambda: ping(channel, WORKER_ID), n, warmup)
        wire_coordinator = await _timed(lambda: ping(channel), n, warmup)
    return {
        "wire_worker": wire_worker,
        "wire_coordinator": wire_coordinator,
        "echo_1hop": await _echo_times(echo_url, n, warmup),
        "chain_3hop": await _echo_times(chain_url, n, warmup),
    }


async def _echo_times(url: str, n: int, warmup: int) -> list[float]:
    """``n`` send/recv round trips of :data:`ANCHOR_BYTES` bytes through bare ``websockets``."""
    message = os.urandom(ANCHOR_BYTES)
    async with connect(url, compression=None, max_size=MAX_SIZE) as ws:

        async def echo() -> None:
            await ws.send(message)
            if await ws.recv() != message:
                raise RuntimeError("the echo came back different")

        return await _timed(echo, n, warmup)


def run(n: int = ROUND_TRIPS, warmup: int = WARMUP, rounds: int = ROUNDS) -> dict[str, Any]:
    """Time ``n`` no-op round trips per path, ours and the anchors', in ``rounds`` interleaved
    rounds (each path's share of a round after ``warmup`` untimed ones).

    Returns:
        ``{"n", "warmup", "rounds", "frame_bytes": {"ping_worker", "ping", "anchor"}, "sdk_worker",
        "wire_worker", "chain_3hop", "sdk_coordinator", "wire_coordinator", "echo_1hop",
        "ratios", "log_problems"}``: each path a :func:`summary` (``count``, ``p50_us``,
        ``p99_us``, ``mean_us``); ``ratios`` maps ``<path>_vs_<anchor>`` to ``{"p50", "mean"}``
        (a vs the 3-hop chain, b vs the 1-hop echo); ``log_problems`` the coordinator's and
        worker's log lines that report an error, a warning or a lost worker.
    """
    with (
        tempfile.TemporaryDirectory(prefix="somatize-roundtrip-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        port = free_port()
        url = f"ws://127.0.0.1:{port}"
        procs.spawn_coordinator(port, Path(tmp) / "state")
        worker = [str(BIN / "somatize-worker"), "--connect", url, "--id", WORKER_ID]
        procs.spawn("worker", [*worker, "--threads", "1"])
        echo_port, relay2_port, relay1_port = free_port(), free_port(), free_port()
        procs.spawn_bare("echo", "echo", echo_port)
        procs.spawn_bare("relay2", "relay", relay2_port, f"ws://127.0.0.1:{echo_port}")
        procs.spawn_bare("relay1", "relay", relay1_port, f"ws://127.0.0.1:{relay2_port}")

        results: dict[str, Any] = {"n": n, "warmup": warmup, "rounds": rounds}
        with sz.connect(url, timeout=REQUEST_TIMEOUT) as client:

            def worker_idle() -> bool:
                workers = client.status()["workers"]
                return any(w["id"] == WORKER_ID and w["state"] == "idle" for w in workers)

            procs.wait_for(worker_idle, 60, f"worker {WORKER_ID} to register")
            times: dict[str, list[float]] = defaultdict(list)
            echo_url, chain_url = (f"ws://127.0.0.1:{p}" for p in (echo_port, relay1_port))
            for count in (n // rounds + (r < n % rounds) for r in range(rounds)):
                times["sdk_worker"] += _sdk_times(client, WORKER_ID, count, warmup)
                times["sdk_coordinator"] += _sdk_times(client, None, count, warmup)
                measured = uvloop.run(_async_round(url, echo_url, chain_url, count, warmup))
                for key, values in measured.items():
                    times[key] += values
        for key, values in times.items():
            results[key] = summary(values)

        results["ratios"] = {
            f"{ours}_vs_{anchor}": {
                stat: results[ours][f"{stat}_us"] / results[anchor][f"{stat}_us"]
                for stat in ("p50", "mean")
            }
            for ours, anchor in (
                ("sdk_worker", "chain_3hop"),
                ("wire_worker", "chain_3hop"),
                ("sdk_coordinator", "echo_1hop"),
                ("wire_coordinator", "echo_1hop"),
            )
        }
        results["frame_bytes"] = {
            "ping_worker": len(encode_small(Ping(id=1, worker_id=WORKER_ID))),
            "ping": len(encode_small(Ping(id=1))),
            "anchor": ANCHOR_BYTES,
        }
        for name in ("coordinator", "worker"):
            if (code := procs.procs[name].poll()) is not None:
                raise RuntimeError(f"the {name} exited with {code} during the benchmark")
        procs.close()
        results["log_problems"] = {name: procs.problems(name) for name in ("coordinator", "worker")}
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: p50 and p99 of each path next to the bare chain or echo."""
    out = []
    paths = (
        ("wire_worker", "chain_3hop", "no-op client→coordinator→agent→daemon", "ws 3-hop chain"),
        ("sdk_worker", "chain_3hop", "same through the SDK client.ping", "ws 3-hop chain"),
        ("wire_coordinator", "echo_1hop", "no-op client→coordinator", "ws 1-hop echo"),
    )
    for key, anchor, name, anchor_name in paths:
        for stat in ("p50", "p99"):
            target = None
            if key == "wire_worker" and stat == "p50":
                target = Target("<=", 2.0, text="<= 2 x bare echo")
            out.append(
                Row(
                    bench="latency",
                    name=f"{name} {stat}",
                    ours=results[key][f"{stat}_us"],
                    unit="µs",
                    anchor=results[anchor][f"{stat}_us"],
                    anchor_name=f"{anchor_name} {stat}",
                    target=target,
                )
            )
    return out


def main() -> None:
    results = run()
    frames = results["frame_bytes"]
    print(
        f"no-op round trips on 127.0.0.1, x{results['n']} in {results['rounds']} rounds "
        f"(each after {results['warmup']} warm-up) "
        f"(coordinator + worker --threads 1; ping frames {frames['ping_worker']} B / "
        f"{frames['ping']} B, anchor {frames['anchor']} B)"
    )
    print(f"  {'':52} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8}   ours/anchor p50, mean")
    rows = (
        ("a. client→coord→agent→daemon, SDK client.ping", "sdk_worker", "chain_3hop"),
        ("a. client→coord→agent→daemon, wire Channel", "wire_worker", "chain_3hop"),
        ("   anchor: websockets client→relay→relay→echo", "chain_3hop", None),
        ("b. client→coordinator, SDK client.ping", "sdk_coordinator", "echo_1hop"),
        ("b. client→coordinator, wire Channel", "wire_coordinator", "echo_1hop"),
        ("   anchor: websockets client→echo", "echo_1hop", None),
    )
    for label, key, anchor in rows:
        r = results[key]
        line = f"  {label:52} {r['p50_us']:8.1f} {r['p99_us']:8.1f} {r['mean_us']:8.1f}"
        if anchor is not None:
            ratio = results["ratios"][f"{key}_vs_{anchor}"]
            line += f"   {ratio['p50']:5.2f} x, {ratio['mean']:5.2f} x"
        print(line)
    for name, lines in results["log_problems"].items():
        for line in lines:
            print(f"  ! {name} log: {line}")


if __name__ == "__main__":
    main()
