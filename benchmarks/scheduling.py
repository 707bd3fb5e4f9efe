"""A mixed day on 50 workers: the fair-share scheduler against first come, first placed.

``python -m benchmarks.scheduling [--day S] [--seed N] [--workers N] [--json FILE] [--write]``
replays one trace — a working day of three clients compressed into :data:`DAY` seconds of
arrivals — twice on a real ``somatize-coordinator``: once with ``--scheduler fifo`` (the
anchor: the jobs in the order they came, each that fits the free workers starting) and once
with ``--scheduler fair`` (the default: priority, then fair share, gangs reserving workers,
backfill, preemption: ``coordinator/scheduling/``). Everything but the scheduler is the same in
both runs. ``--json`` keeps every job's runs; ``--write`` puts the figures in their section of
``docs/benchmarks.md``.

*The clients* (:data:`CLIENTS`, a ``--client-tokens-file`` line each): alice ``share=2``, bob
and carol ``share=1`` (so their fair parts of the fleet are 50 %, 25 % and 25 %), carol
``max_priority=1``; and ``ops``, an admin that submits nothing and reads the records. Their
demand is skewed against their weights, as a lab's is: alice asks for 40 % of the day's
worker-time, bob — a sweep — 35 %, carol 25 %, so first come, first placed gives each about
what it asks for, not its share.

*The trace* (:func:`trace`, a fixed seed): each client's jobs arrive as a Poisson process whose
rate follows the day's load (:data:`LOAD`: demand 1.6 times what the fleet can serve for the
first three quarters of the day, so that every client has jobs queued for most of it, then
half of it: the evening); about half of each client's jobs are *short* (1-4 s of training, one
round, 1 worker or 2), the others *long* (20-50 s, in rounds of about :data:`ROUND_SECONDS`,
on the client's usual gang: alice 2-4 workers, bob 1-2, carol 1-4); 15 % of carol's are of
priority 1. Every job is a ``FedAvg`` over ``WorkerData`` on exactly its number of workers
(``workers=k``), one round per 5 s or so, so that it checkpoints every round and can be
preempted and resumed, and it declares a ``time_limit`` of twice its length plus 10 s (what
backfill needs). The day's length scales the arrivals only; jobs keep their lengths.

*The stand-in agents* (:class:`TimedFleet`): :data:`WORKERS` simulated agents on this
process's event loop, each a real WebSocket connection presenting the worker token, saying
hello (``sim-<i>``, tag ``sim``, a dataset ``sim``) and heartbeating every 2 s, answering the
coordinator's job messages from memory as :class:`benchmarks.fleet.sim.SimAgent` does; the
one difference (:class:`TimedAgent`): a ``batched_fit`` takes ``epochs`` ×
:data:`EPOCH_SECONDS` of sleep (``local_epochs`` of the job carries its length), cut short by
the job's ``close_job`` (a preemption), as a daemon stopped mid-fit. The model is a
``Linear(4, 4)``: the coordinator's work per job is its real work, the workers' a timer.

*The replay*: one thread per client (an SDK client each) submits each job at its arrival
time; once every job has ended, the admin reads every job's record and events. A run of a job
lasts from its ``placed`` event to its ``preempted`` or final event, on the workers ``placed``
names.

*The figures*, from those records, for each scheduler:

- *utilisation*: worker-seconds held by jobs over :data:`WORKERS` × the span from the first
  arrival to the last end (the row), and over the times some job was queued (the note) and
  the contended window;
- *shares*: each client's part of the worker-seconds held during the *contended window* — the
  times when every client had a job queued — against its weight's part (alice 50 %, bob and
  carol 25 %): the relative deviation;
- *queue waits*: the time from submission to a job's first start, p50 and p95 per client, and
  p95 of the short jobs;
- what preemption cost (the runs it ended and their worker-seconds; the training the
  stand-ins lost), and the submissions' lag behind the trace.

Targets (issue 54): fair's utilisation ≥ FIFO's; every client within ±10 % of its share;
p95 wait of short jobs ≤ ¼ of FIFO's. The coordinator's log is kept in a temporary directory
and scanned for errors and lost workers; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvloop
from websockets.asyncio.client import connect

import somatize as sz
from benchmarks.fleet.sim import DATASET, NODE, Fleet, SimAgent, side
from benchmarks.report import Row, Target, load_average, machine, now, with_section
from benchmarks.roundtrip import MAX_SIZE, Processes, free_port
from protocol.errors import ErrorCode, ErrorInfo, RequestRefused
from protocol.messages import Welcome
from protocol.parsing import parse

WORKERS = 50
DAY = 100.0
"""Seconds of arrivals: the compressed day."""
SEED = 54
LOAD = ((0.75, 1.6), (1.0, 0.5))
"""The day's demand for worker-time over what the fleet serves: until each fraction of the day,
that multiple."""
EPOCH_SECONDS = 0.1
"""What one local epoch takes on a stand-in: a job's ``local_epochs`` carry its length."""
SHORT_SECONDS = (1.0, 4.0)
LONG_SECONDS = (20.0, 50.0)
ROUND_SECONDS = 5.0
"""A long job's rounds last about this long: it checkpoints at each round's end."""
SHORT_GANG = ((1, 0.8), (2, 0.2))
"""A short job's workers, and how likely each count is."""
STATE_BYTES = 64
"""The model's weight (``Linear(4, 4)``): the bytes are not what is measured."""

SHARE_WAIT = 15.0
"""``--share-wait``: seconds a job of a client under its share waits before it preempts (the
default, 120 s, is for jobs of hours; these last seconds). 5 s preempted more (10 runs, 18 s of
training lost) and cost utilisation (73 % against FIFO's 78 %) for a carol 3 points nearer her
part."""
PREEMPT_GRACE = 8.0
"""``--preempt-grace``: a long job's round ends within it, so a preempted job checkpoints."""
HEARTBEAT = 2.0
HEARTBEAT_TIMEOUT = 10.0
BATCH = 50
LEAD = 1.0
"""Seconds between the end of the set-up and the day's first instant."""
DRAIN_TIMEOUT = 600.0
"""Seconds the jobs may take to end after the last arrival."""

WORKER_TOKEN = "scheduling-worker-token-0"
ADMIN = "ops"


@dataclass(frozen=True)
class ClientSpec:
    """One client of the day.

    Attributes:
        name: its name in the clients file (the jobs' owner).
        share: its ``share=`` weight.
        demand: its part of the day's demand for worker-time.
        short: the part of its jobs that are short.
        gangs: the worker counts its long jobs draw from, equally likely.
        urgent: the part of its jobs submitted at priority 1 (its ``max_priority`` is 1 then).
    """

    name: str
    share: int
    demand: float
    short: float
    gangs: tuple[int, ...]
    urgent: float = 0.0

    @property
    def max_priority(self) -> int:
        return 1 if self.urgent else 0

    def worker_seconds(self) -> float:
        """What one of its jobs asks for on average, in worker-seconds."""
        short_workers = sum(k * p for k, p in SHORT_GANG)
        short = sum(SHORT_SECONDS) / 2 * short_workers
        long = sum(LONG_SECONDS) / 2 * sum(self.gangs) / len(self.gangs)
        return self.short * short + (1 - self.short) * long


CLIENTS = (
    ClientSpec("alice", share=2, demand=0.40, short=0.5, gangs=(2, 3, 4)),
    ClientSpec("bob", share=1, demand=0.35, short=0.6, gangs=(1, 2)),
    ClientSpec("carol", share=1, demand=0.25, short=0.5, gangs=(1, 2, 3, 4), urgent=0.15),
)


@dataclass(frozen=True)
class Arrival:
    """One job of the trace.

    Attributes:
        index: its place in arrival order.
        at: seconds after the day's start it is submitted.
        owner: the client that submits it.
        workers: how many workers it runs on (FedAvg ``workers=``).
        rounds: its rounds.
        epochs: the local epochs of each round (each :data:`EPOCH_SECONDS` on a stand-in).
        priority: 0, or 1 for an urgent one.
        short: whether it is one of the short jobs.
    """

    index: int
    at: float
    owner: str
    workers: int
    rounds: int
    epochs: int
    priority: int
    short: bool

    @property
    def seconds(self) -> float:
        """How long it trains on its workers (the stand-ins' sleep)."""
        return self.rounds * self.epochs * EPOCH_SECONDS

    @property
    def time_limit(self) -> float:
        return 2 * self.seconds + 10.0

    @property
    def name(self) -> str:
        return f"{self.owner}-{self.index:03d}"


# -- the trace (pure) ----------------------------------------------------------------------------


def trace(
    seed: int = SEED,
    day: float = DAY,
    workers: int = WORKERS,
    clients: Sequence[ClientSpec] = CLIENTS,
    load: Sequence[tuple[float, float]] = LOAD,
) -> list[Arrival]:
    """The day's jobs in arrival order: each client's a Poisson process whose rate follows
    ``load`` (module docstring), drawn from ``default_rng([seed, k])`` for client ``k``."""
    drawn: list[tuple[float, str, int, int, int, int, bool]] = []
    for k, client in enumerate(clients):
        rng = np.random.default_rng([seed, k])
        begin = 0.0
        for until, multiple in load:
            end = until * day
            rate = multiple * workers * client.demand / client.worker_seconds()
            t = begin + rng.exponential(1 / rate)
            while t < end:
                drawn.append((t, client.name, *_job(rng, client)))
                t += rng.exponential(1 / rate)
            begin = end
    drawn.sort()
    return [Arrival(i, *job) for i, job in enumerate(drawn)]


def _job(rng: np.random.Generator, client: ClientSpec) -> tuple[int, int, int, int, bool]:
    """One job's ``workers``, ``rounds``, ``epochs``, ``priority`` and ``short``."""
    short = bool(rng.random() < client.short)
    if short:
        counts, odds = zip(*SHORT_GANG, strict=True)
        workers = int(rng.choice(counts, p=odds))
        seconds = rng.uniform(*SHORT_SECONDS)
        rounds = 1
    else:
        workers = int(rng.choice(client.gangs))
        seconds = rng.uniform(*LONG_SECONDS)
        rounds = max(1, round(seconds / ROUND_SECONDS))
    epochs = max(1, round(seconds / rounds / EPOCH_SECONDS))
    priority = int(rng.random() < client.urgent)
    return workers, rounds, epochs, priority, short


# -- the figures (pure) --------------------------------------------------------------------------

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint, none empty."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where two unions (:func:`union`) overlap."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap(interval: Interval, window: Sequence[Interval]) -> float:
    """Seconds of ``interval`` inside ``window`` (a union)."""
    return sum(max(0.0, min(interval[1], e) - max(interval[0], s)) for s, e in window)


def length(window: Sequence[Interval]) -> float:
    return sum(e - s for s, e in window)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def queued_intervals(job: dict[str, Any]) -> list[Interval]:
    """When ``job`` waited: from its submission to its first run (to its end, if it never
    ran), and from each preemption to the run after it."""
    runs = job["runs"]
    ends = [job["created"], *(r[1] for r in runs[:-1])] if runs else [job["created"]]
    starts = [r[0] for r in runs] if runs else [job["finished"]]
    return list(zip(ends, starts, strict=True))


def held_in(jobs: Iterable[dict[str, Any]], window: Sequence[Interval]) -> float:
    """Worker-seconds ``jobs`` held inside ``window`` (a union)."""
    return float(sum(overlap((r[0], r[1]), window) * r[2] for j in jobs for r in j["runs"]))


def wait(job: dict[str, Any]) -> float:
    """Seconds from the job's submission to its first run."""
    start = job["runs"][0][0] if job["runs"] else job["finished"]
    return float(start - job["created"])


def figures(
    jobs: Sequence[dict[str, Any]], workers: int, shares: dict[str, float]
) -> dict[str, Any]:
    """What one replay measured, from its jobs (each ``owner``, ``short``, ``created``,
    ``finished``, ``state`` and ``runs``: :func:`job_runs`).

    Returns:
        ``utilisation``: the worker-seconds held over ``workers`` × the ``span_s`` from the
        first submission to the last end; ``utilisation_backlogged`` the same over the
        ``backlogged_s`` when some job was queued, and ``utilisation_contended`` over the
        ``contended_s`` when every client had one queued (the contended window). Per client
        (``clients``): its ``share`` of the worker-seconds held in the contended window, its
        ``fair`` part by weight and the relative ``deviation``; its jobs' queue waits
        (``wait_p50``, ``wait_p95``, ``short_wait_p95``), ``jobs``, ``worker_s`` and
        ``queued_s`` (when it had a job queued). ``short_wait_p50``/``short_wait_p95`` and
        ``long_wait_p95`` over every client's jobs; ``preemptions`` and the worker-seconds of
        the runs they ended (``preempted_worker_s``; their work is kept by the checkpoints),
        the seconds from ``preempting`` to the run's end (``leave_p50_s``, ``leave_max_s``),
        and ``preempted_when_done``: the runs ended after all their training (the job's next
        run, its last, took under a second: the final read-back) with the seconds each job
        then waited to be placed again (``when_done_waits_s``); ``states`` (jobs by final
        state).
    """
    owners = sorted(shares)
    first = min(j["created"] for j in jobs)
    last = max(j["finished"] for j in jobs)
    span = [(first, last)]
    by_owner = {c: [j for j in jobs if j["owner"] == c] for c in owners}
    queued = {c: union(i for j in by_owner[c] for i in queued_intervals(j)) for c in owners}
    backlogged = union(i for c in owners for i in queued[c])
    contended = queued[owners[0]]
    for c in owners[1:]:
        contended = intersection(contended, queued[c])
    in_window = {c: held_in(by_owner[c], contended) for c in owners}
    total_in_window = sum(in_window.values())
    weights = sum(shares.values())

    def utilisation(window: Sequence[Interval]) -> float:
        return held_in(jobs, window) / (workers * length(window)) if window else math.nan

    clients = {}
    for c, mine in by_owner.items():
        share = in_window[c] / total_in_window if total_in_window else math.nan
        fair = shares[c] / weights
        clients[c] = {
            "jobs": len(mine),
            "share": share,
            "fair": fair,
            "deviation": share / fair - 1,
            "worker_s": held_in(mine, span),
            "wait_p50": percentile([wait(j) for j in mine], 50),
            "wait_p95": percentile([wait(j) for j in mine], 95),
            "short_wait_p95": percentile([wait(j) for j in mine if j["short"]], 95),
            "queued_s": length(queued[c]),
        }
    short = [wait(j) for j in jobs if j["short"]]
    ended = [r for j in jobs for r in j["runs"] if r[3]]
    leave = [r[1] - r[4] for r in ended if r[4] is not None]
    when_done = [
        j["runs"][-1][0] - j["runs"][-2][1]
        for j in jobs
        if len(j["runs"]) > 1 and j["runs"][-2][3] and j["runs"][-1][1] - j["runs"][-1][0] < 1
    ]
    states: dict[str, int] = {}
    for j in jobs:
        states[j["state"]] = states.get(j["state"], 0) + 1
    return {
        "span_s": last - first,
        "backlogged_s": length(backlogged),
        "contended_s": length(contended),
        "utilisation": utilisation(span),
        "utilisation_backlogged": utilisation(backlogged),
        "utilisation_contended": utilisation(contended),
        "held_worker_s": held_in(jobs, span),
        "clients": clients,
        "short_wait_p50": percentile(short, 50),
        "short_wait_p95": percentile(short, 95),
        "long_wait_p95": percentile([wait(j) for j in jobs if not j["short"]], 95),
        "preemptions": len(ended),
        "preempted_worker_s": sum((r[1] - r[0]) * r[2] for r in ended),
        "leave_p50_s": percentile(leave, 50),
        "leave_max_s": max(leave, default=math.nan),
        "preempted_when_done": len(when_done),
        "when_done_waits_s": sorted(when_done),
        "states": states,
    }


def job_runs(events: Sequence[sz.JobEventInfo]) -> list[list[Any]]:
    """A job's runs from its events: ``[start, end, workers, preempted, asked]`` each, from
    each ``placed`` to the ``preempted`` or final event after it; ``asked``: when it was told
    to leave (``preempting``), if it was."""
    runs: list[list[Any]] = []
    open_run: list[Any] | None = None
    for event in events:
        if event.event == "placed":
            open_run = [event.time, None, len(event.data.get("workers", [])), False, None]
        elif open_run is not None and event.event == "preempting":
            open_run[4] = event.time
        elif open_run is not None and (event.event == "preempted" or event.terminal):
            open_run[1] = event.time
            open_run[3] = event.event == "preempted"
            runs.append(open_run)
            open_run = None
    return runs


# -- the stand-ins -------------------------------------------------------------------------------


@dataclass
class Work:
    """What the stand-ins trained: seconds of ``batched_fit`` completed, and cut short."""

    done_s: float = 0.0
    lost_s: float = 0.0
    cut: int = 0


class TimedAgent(SimAgent):
    """A stand-in whose training takes time: ``batched_fit`` sleeps ``epochs`` ×
    :data:`EPOCH_SECONDS` (never blocking the loop) before answering as a
    :class:`~benchmarks.fleet.sim.SimAgent` does; the job's ``close_job`` ends the sleep and
    the fit fails, as a daemon stopped mid-fit."""

    def __init__(
        self, i: int, states: list[dict[str, torch.Tensor]], initial: Any, work: Work
    ) -> None:
        super().__init__(i, states, initial)
        self.work = work
        self.closing: dict[str, asyncio.Event] = {}

    async def handle(self, message: Any) -> Any:
        if message.kind == "close_job":
            closing = self.closing.pop(message.job_id, None)
            if closing is not None:
                closing.set()
        elif message.kind == "call" and message.request.get("cmd") == "batched_fit":
            await self._train(message.job_id, int(message.request.get("epochs") or 1))
        return await super().handle(message)

    async def _train(self, job_id: str, epochs: int) -> None:
        closing = self.closing.setdefault(job_id, asyncio.Event())
        seconds = epochs * EPOCH_SECONDS
        start = time.monotonic()
        try:
            async with asyncio.timeout(seconds):
                await closing.wait()
        except TimeoutError:
            self.work.done_s += seconds
            return
        self.work.lost_s += time.monotonic() - start
        self.work.cut += 1
        info = ErrorInfo(code=ErrorCode.CANCELLED, message="the job was closed during its fit")
        raise RequestRefused(info)


class TimedFleet(Fleet):
    """:data:`WORKERS` stand-ins (:class:`TimedAgent`) that present the worker token."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, welcome=True, state_bytes=STATE_BYTES, heartbeat=HEARTBEAT)
        self.token = token
        self.work = Work()

    async def _open_one(self, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            ws = await connect(
                self.url,
                compression=None,
                max_size=MAX_SIZE,
                open_timeout=30,
                ping_interval=20.0,
                ping_timeout=20.0,
                additional_headers={"Authorization": f"Bearer {self.token}"},
            )
            self.connections.append(ws)
            await ws.send(self._hello(i))
            async with asyncio.timeout(30):
                reply = parse(await ws.recv(decode=False))
            if not isinstance(reply, Welcome) or reply.worker_id != f"sim-{i}":
                raise RuntimeError(f"sim-{i}: the coordinator answered the hello with {reply!r}")
        agent = TimedAgent(i, self.states, self.initial, self.work)
        self._spawn(self._live(ws, agent))


# -- the replay ----------------------------------------------------------------------------------


def _tokens(clients: Sequence[ClientSpec]) -> dict[str, str]:
    names = [c.name for c in clients] + [ADMIN]
    return {name: f"scheduling-{name}-token-0" for name in names}


def _secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def _clients_file(path: Path, clients: Sequence[ClientSpec], tokens: dict[str, str]) -> Path:
    lines = [
        f"{c.name} {tokens[c.name]} share={c.share} max_priority={c.max_priority}" for c in clients
    ]
    return _secret(path, "\n".join([*lines, f"{ADMIN} {tokens[ADMIN]} admin", ""]))


def _graph() -> sz.Graph:
    torch.manual_seed(0)
    width = side(STATE_BYTES)
    return sz.Graph([sz.TorchFilter(torch.nn.Linear(width, width)).named(NODE)])


def _submitter(
    url: str, token: str, arrivals: Sequence[Arrival], zero: float
) -> tuple[dict[int, str], list[float]]:
    """Submit one client's ``arrivals`` at their times after ``zero`` (wall clock); their job
    ids by index, and how late each submit returned."""
    graph = _graph()
    ids: dict[int, str] = {}
    lags: list[float] = []
    with sz.connect(url, token=token, timeout=60) as client:
        for a in arrivals:
            time.sleep(max(0.0, zero + a.at - time.time()))
            strategy = sz.FedAvg(
                rounds=a.rounds, local_epochs=a.epochs, workers=a.workers, tag="sim"
            )
            job = client.submit(
                graph,
                sz.WorkerData(DATASET),
                strategy=strategy,
                name=a.name,
                priority=a.priority,
                time_limit=a.time_limit,
            )
            ids[a.index] = job.id
            lags.append(time.time() - (zero + a.at))
    return ids, lags


def _warm_up(url: str, token: str) -> None:
    """One short job before the day, so that none of the day's pays for the coordinator's
    first import of torch (a long-running coordinator has done it long before)."""
    with sz.connect(url, token=token, timeout=60) as admin:
        strategy = sz.FedAvg(rounds=1, local_epochs=1, workers=1, tag="sim")
        job = admin.submit(_graph(), sz.WorkerData(DATASET), strategy=strategy, name="warm-up")
        end = job.wait(timeout=120)
        if end.event != "succeeded":
            raise RuntimeError(f"the warm-up job did not succeed: {end}")


def _day(url: str, tokens: dict[str, str], arrivals: Sequence[Arrival]) -> dict[str, Any]:
    """Replay ``arrivals`` (a thread per client), wait for every job to end, and read back each
    job's record and events (as the admin)."""
    _warm_up(url, tokens[ADMIN])
    owners = sorted({a.owner for a in arrivals})
    zero = time.time() + LEAD
    with ThreadPoolExecutor(len(owners)) as pool:
        futures = [
            pool.submit(_submitter, url, tokens[o], [a for a in arrivals if a.owner == o], zero)
            for o in owners
        ]
        submitted = [f.result() for f in futures]
    ids = {i: job_id for done, _ in submitted for i, job_id in done.items()}
    lags = [lag for _, late in submitted for lag in late]
    with sz.connect(url, token=tokens[ADMIN], timeout=60) as admin:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while admin.queue()["jobs"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still live {DRAIN_TIMEOUT:g} s after the last arrival")
            time.sleep(0.5)
        records = {r["id"]: r for r in admin.jobs(limit=len(arrivals) + 1)}
        jobs = []
        for a in arrivals:
            record = records[ids[a.index]]
            events = list(admin.job(record["id"]).events(timeout=30))
            jobs.append(
                {
                    "index": a.index,
                    "id": record["id"],
                    "owner": a.owner,
                    "short": a.short,
                    "priority": a.priority,
                    "workers": a.workers,
                    "seconds": a.seconds,
                    "created": record["created"],
                    "finished": record["finished"],
                    "state": record["state"],
                    "runs": job_runs(events),
                }
            )
    return {
        "jobs": jobs,
        "zero": zero,
        "submit_lag_max_s": max(lags),
        "submit_lag_p50_s": percentile(lags, 50),
    }


async def _with_fleet(
    url: str, tokens: dict[str, str], arrivals: Sequence[Arrival], workers: int
) -> dict[str, Any]:
    fleet = TimedFleet(f"{url}/worker", WORKER_TOKEN)
    try:
        register_s = await fleet.open(workers, BATCH)
        out = await asyncio.to_thread(_day, url, tokens, arrivals)
        dropped = fleet.dropped()
        if dropped:
            raise AssertionError(f"{len(dropped)} stand-in agents were disconnected: {dropped[:5]}")
    finally:
        await fleet.close(BATCH)
    return out | {"register_s": register_s, "work": asdict(fleet.work)}


def replay(
    scheduler: str,
    arrivals: Sequence[Arrival],
    workers: int = WORKERS,
    clients: Sequence[ClientSpec] = CLIENTS,
    day: float = DAY,
) -> dict[str, Any]:
    """One replay of ``arrivals`` on a fresh coordinator with ``--scheduler scheduler``: its
    jobs (:func:`_day`), the stand-ins' ``work``, the coordinator's ``log_problems`` and its
    :func:`figures`."""
    with (
        tempfile.TemporaryDirectory(prefix="somatize-scheduling-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        tokens = _tokens(clients)
        port = free_port()
        url = f"ws://127.0.0.1:{port}"
        settings = ["--scheduler", scheduler]
        settings += [
            "--client-tokens-file",
            str(_clients_file(Path(tmp) / "clients", clients, tokens)),
        ]
        settings += ["--worker-token-file", str(_secret(Path(tmp) / "worker-token", WORKER_TOKEN))]
        settings += ["--share-wait", str(SHARE_WAIT), "--preempt-grace", str(PREEMPT_GRACE)]
        # The day is compressed: what a client held a quarter of it ago counts half.
        settings += ["--usage-half-life", str(day / 4)]
        settings += ["--heartbeat-interval", str(HEARTBEAT)]
        settings += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        # Every stand-in dials from 127.0.0.1, BATCH handshakes at a time (benchmarks.fleet).
        settings += ["--max-pending-per-address", str(2 * BATCH)]
        coordinator = procs.spawn_coordinator(port, Path(tmp) / "state", *settings)
        started = time.monotonic()
        out = uvloop.run(_with_fleet(url, tokens, arrivals, workers))
        if (code := coordinator.poll()) is not None:
            raise RuntimeError(f"the coordinator exited with {code} during the replay")
        procs.stop("coordinator")
        out["log_problems"] = procs.problems("coordinator")
        out["seconds"] = time.monotonic() - started
    shares = {c.name: float(c.share) for c in clients}
    out["figures"] = figures(out["jobs"], workers, shares)
    return out


def run(
    day: float = DAY,
    seed: int = SEED,
    workers: int = WORKERS,
    schedulers: Sequence[str] = ("fifo", "fair"),
) -> dict[str, Any]:
    """Replay the day (:func:`trace`) once per scheduler, FIFO (the anchor) first.

    Returns:
        ``{"day_s", "seed", "workers", "clients", "trace": {...}, "fifo": {...}, "fair":
        {...}}``: each replay's ``figures`` (:func:`figures`), ``jobs`` (with their runs),
        ``work`` (the stand-ins' training seconds done and lost), ``submit_lag_*``,
        ``log_problems`` and ``seconds``; ``trace``: its jobs by client and kind, and the
        worker-seconds asked; ``load``: the 1-minute load average before and after.
    """
    arrivals = trace(seed, day, workers)
    results: dict[str, Any] = {
        "day_s": day,
        "seed": seed,
        "workers": workers,
        "clients": [asdict(c) for c in CLIENTS],
        "trace": _trace_summary(arrivals, workers, day),
        "settings": {
            "share_wait": SHARE_WAIT,
            "preempt_grace": PREEMPT_GRACE,
            "half_life": day / 4,
        },
    }
    load_start = load_average()
    for scheduler in schedulers:
        results[scheduler] = replay(scheduler, arrivals, workers, CLIENTS, day)
    results["load"] = [load_start[0], load_average()[0]]
    return results


def _trace_summary(arrivals: Sequence[Arrival], workers: int, day: float) -> dict[str, Any]:
    asked = sum(a.seconds * a.workers for a in arrivals)
    by_client = {}
    for c in CLIENTS:
        mine = [a for a in arrivals if a.owner == c.name]
        by_client[c.name] = {
            "jobs": len(mine),
            "short": sum(a.short for a in mine),
            "urgent": sum(a.priority > 0 for a in mine),
            "worker_s": sum(a.seconds * a.workers for a in mine),
        }
    return {
        "jobs": len(arrivals),
        "short": sum(a.short for a in arrivals),
        "worker_s": asked,
        "demand": asked / (workers * day),
        "clients": by_client,
    }


# -- rows and print-out --------------------------------------------------------------------------


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: utilisation, each client's share of the contended worker-time, and
    the short jobs' p95 wait, fair against FIFO on the same trace."""
    fair, fifo = results["fair"]["figures"], results["fifo"]["figures"]
    n = results["workers"]
    out = [
        Row(
            bench="scheduling",
            name=f"utilisation of {n} workers, a mixed day (first arrival to last end)",
            ours=fair["utilisation"] * 100,
            unit="%",
            anchor=fifo["utilisation"] * 100,
            anchor_name="--scheduler fifo, same trace",
            target=Target(">=", 1.0, text=">= FIFO's"),
            note=f"while jobs queued {fair['utilisation_backlogged'] * 100:.0f} % vs "
            f"{fifo['utilisation_backlogged'] * 100:.0f} %; last end {fair['span_s']:.0f} s vs "
            f"{fifo['span_s']:.0f} s after the first arrival; {fair['preemptions']} preemptions",
        )
    ]
    for name, mine in fair["clients"].items():
        theirs = fifo["clients"][name]
        out.append(
            Row(
                bench="scheduling",
                name=f"{name}'s worker-time while all queue, off its share "
                f"({mine['fair'] * 100:.0f} %)",
                ours=abs(mine["deviation"]) * 100,
                unit="%",
                anchor=abs(theirs["deviation"]) * 100,
                anchor_name="--scheduler fifo, same trace",
                target=Target("<=", 10.0, on="ours", text="within ±10 %"),
                note=f"held {mine['share'] * 100:.1f} % (fifo {theirs['share'] * 100:.1f} %)",
            )
        )
    out.append(
        Row(
            bench="scheduling",
            name="p95 queue wait of the short jobs",
            ours=fair["short_wait_p95"],
            unit="s",
            anchor=fifo["short_wait_p95"],
            anchor_name="--scheduler fifo, same trace",
            target=Target("<=", 0.25, text="<= 1/4 x FIFO's"),
            note=f"p50 {fair['short_wait_p50']:.1f} s (fifo {fifo['short_wait_p50']:.1f} s)",
        )
    )
    return out


def _waits(figures: dict[str, Any]) -> str:
    waits = figures["when_done_waits_s"]
    if not waits:
        return "0"
    return f"{len(waits)} ({', '.join(f'{w:.0f}' for w in waits)} s)"


def markdown(results: dict[str, Any]) -> str:
    """The replays' figures as markdown tables (the section of ``docs/benchmarks.md``)."""
    fair, fifo = results["fair"]["figures"], results["fifo"]["figures"]
    t, settings = results["trace"], results["settings"]
    weights = sum(c["share"] for c in results["clients"])
    clients = "; ".join(
        f"{c['name']} `share={c['share']}{' max_priority=1' if c['urgent'] else ''}`: fair part "
        f"{c['share'] / weights * 100:.0f} %, asks {c['demand'] * 100:.0f} % of the day's "
        "worker-time"
        for c in results["clients"]
    )
    urgent = sum(c["urgent"] for c in t["clients"].values())
    lines = [
        f"Clients: {clients}. {t['jobs']} jobs ({t['short']} short, "
        f"{urgent} of priority 1) over {results['day_s']:g} s of arrivals, asking "
        f"{t['worker_s']:,.0f} worker-seconds ({t['demand']:.2f} × what {results['workers']} "
        f"workers serve in that time), seed {results['seed']}; `--share-wait "
        f"{settings['share_wait']:g} --preempt-grace {settings['preempt_grace']:g} "
        f"--usage-half-life {settings['half_life']:g}`.",
        "",
        "| | fifo | fair | target |",
        "|---|---:|---:|---|",
        f"| utilisation, first arrival to last end | {fifo['utilisation'] * 100:.1f} % | "
        f"{fair['utilisation'] * 100:.1f} % | fair ≥ fifo |",
        f"| utilisation while some job is queued | "
        f"{fifo['utilisation_backlogged'] * 100:.1f} % | "
        f"{fair['utilisation_backlogged'] * 100:.1f} % | |",
        f"| utilisation in the contended window | {fifo['utilisation_contended'] * 100:.1f} % | "
        f"{fair['utilisation_contended'] * 100:.1f} % | |",
        f"| first arrival to last end | {fifo['span_s']:.0f} s | {fair['span_s']:.0f} s | |",
        f"| some job queued / every client queued (contended) | "
        f"{fifo['backlogged_s']:.0f} / {fifo['contended_s']:.0f} s | "
        f"{fair['backlogged_s']:.0f} / {fair['contended_s']:.0f} s | |",
    ]
    for name, mine in fair["clients"].items():
        theirs = fifo["clients"][name]
        lines.append(
            f"| {name}'s worker-time in the window (fair part {mine['fair'] * 100:.0f} %) | "
            f"{theirs['share'] * 100:.1f} % ({theirs['deviation'] * 100:+.0f} %) | "
            f"{mine['share'] * 100:.1f} % ({mine['deviation'] * 100:+.0f} %) | within ±10 % |"
        )
    for name, mine in fair["clients"].items():
        theirs = fifo["clients"][name]
        lines.append(
            f"| {name}'s queue wait p50 / p95 (short p95) | {theirs['wait_p50']:.1f} / "
            f"{theirs['wait_p95']:.1f} s ({theirs['short_wait_p95']:.1f} s) | "
            f"{mine['wait_p50']:.1f} / {mine['wait_p95']:.1f} s "
            f"({mine['short_wait_p95']:.1f} s) | |"
        )
    lines += [
        f"| short jobs' queue wait p50 / p95 | {fifo['short_wait_p50']:.1f} / "
        f"{fifo['short_wait_p95']:.1f} s | {fair['short_wait_p50']:.1f} / "
        f"{fair['short_wait_p95']:.1f} s | p95 ≤ ¼ × fifo |",
        f"| long jobs' queue wait p95 | {fifo['long_wait_p95']:.1f} s | "
        f"{fair['long_wait_p95']:.1f} s | |",
        f"| preemptions (training lost on the stand-ins) | {fifo['preemptions']} "
        f"({results['fifo']['work']['lost_s']:.1f} s) | {fair['preemptions']} "
        f"({results['fair']['work']['lost_s']:.1f} s) | |",
        f"| of which after all the job's training, then queued again for | "
        f"{_waits(fifo)} | {_waits(fair)} | |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduling", description=__doc__)
    parser.add_argument(
        "--day", type=float, default=DAY, help=f"seconds of arrivals (default {DAY:g})"
    )
    parser.add_argument("--seed", type=int, default=SEED, help=f"the trace's seed (default {SEED})")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"default {WORKERS}")
    parser.add_argument("--write", action="store_true", help="into docs/benchmarks.md, its section")
    parser.add_argument("--json", type=Path, help="write the full results (every job's runs) here")
    args = parser.parse_args(argv)
    began = time.time()
    results = run(day=args.day, seed=args.seed, workers=args.workers)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    print(text)
    for scheduler in ("fifo", "fair"):
        r = results[scheduler]
        w = r["work"]
        print(
            f"{scheduler}: replay {r['seconds']:.0f} s; stand-ins trained {w['done_s']:.0f} s, "
            f"{w['lost_s']:.1f} s cut short ({w['cut']} fits); submits up to "
            f"{r['submit_lag_max_s']:.2f} s late; states {r['figures']['states']}"
        )
        for line in r["log_problems"]:
            print(f"  ! coordinator log: {line}")
    for row in rows(results):
        verdict = "" if row.met is None else " met" if row.met else " MISSED"
        print(f"{row.name}: {row.ours:.1f} {row.unit} vs {row.anchor:.1f}{verdict}")
    print(
        f"({time.time() - began:.0f} s in all; load average {results['load'][0]:.2f} -> "
        f"{results['load'][1]:.2f})"
    )
    if args.write:
        command = "python -m benchmarks.scheduling" + "".join(
            f" --{k} {v:g}"
            for k, v in (("day", args.day), ("seed", args.seed), ("workers", args.workers))
            if v != {"day": DAY, "seed": SEED, "workers": WORKERS}[k]
        )
        m = machine()
        load = results["load"]
        body = (
            f"## Scheduling: a mixed day on {results['workers']} workers\n\n"
            f"Written by `{command} --write` ({now()}, {m['cpu']}, {m['cores']} cores, load "
            f"average {load[0]:.1f} → {load[1]:.1f}; {time.time() - began:.0f} s).\n\n{text}\n"
        )
        document = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
        document.write_text(with_section(document.read_text(), "scheduling", body))
        print(f"wrote its section of {document}")


if __name__ == "__main__":
    main()
