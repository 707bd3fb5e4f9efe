"""Workers far apart, coming and going: DiLoCo checkpointed, DiLoCo through the loss of a worker
and the arrival of a new one, and Streaming DiLoCo, next to DDP and to a DDP that restarts from
its checkpoint, all in one run on the links of :mod:`benchmarks.slow_links`.

``python -m benchmarks.slow_links --churn [--workers 4] [--link-bound] [--quick] [--rate 100mbit]
[--delay 10ms] [--write]`` builds one network namespace per worker
(:mod:`benchmarks.slow_links.links`: each site's only link held to ``--rate`` by HTB and delayed
``--delay`` each way), needs root and fails, never skips, without it. On
:mod:`benchmarks.slow_links`'s workload and clocks (its
:class:`~benchmarks.slow_links.bench.Workload`, anchors and jobs; every clock without the
evaluations; a job of ours, whose first progress event comes after a whole round of steps, started
at the median pace of its rounds that no worker's loss or arrival slowed, :func:`steady_began`) it
runs, in this order:

1. ``DDP``, the anchor (:mod:`benchmarks.slow_links.anchors`), over the budget
   (:data:`~benchmarks.slow_links.bench.BUDGET_EPOCHS`): its last validation loss is the *target*.
2. ``DDP with restart``: the same DDP, rank 0 saving a checkpoint every ``K`` steps
   (:data:`CHECKPOINT_EVERY`: each epoch's end, where DDP validates; model, AdamW state, steps
   done and RNG, atomically, inside the clock). When it has done :data:`KILL_AT` of the budget's
   steps the last rank is SIGKILLed and then every other (as torchrun's agent tears the group
   down), and the ranks are started again at once with ``--resume``: process start, group
   formation, the checkpoint's load and the steps since it, done again, all count. Its clock
   runs on from the kill: the first life's training up to the kill, then the wall time until
   the new group's clock starts, then the new life's. It trains to the target (an epoch past
   the budget at most, so a loss a rounding above the target still reaches it) and stops there.
   **Assumed, in DDP's favour:** a replacement machine is there at once and nothing waits for a
   timeout to notice the loss (torchrun's rendezvous would), the checkpoint is on a disk every
   rank reads, and the restart costs only what this machine takes to start the ranks again.
3. ``ours: DiLoCo`` (``sz.DiLoCo(N, sync_every=H)``,
   :data:`~benchmarks.slow_links.bench.DILOCO_EPOCHS`): ``S``, its steps to the target (all its
   steps if it never gets there), and its time.
4. ``ours: DiLoCo checkpointed``: the same with ``checkpoint_every=H``, a checkpoint after every
   synchronisation. Figure: its time to the target ÷ DiLoCo's (target ≤
   :data:`CHECKPOINT_TARGET`).
5. ``ours: Streaming DiLoCo``: ``fragments=F``, ``overlap=τ`` (:data:`FRAGMENTS`,
   :data:`OVERLAP`; the model has no buffers, so τ > 0 is allowed). Figures: the peak bytes of a
   synchronisation (the ``placed`` event's ``sync_bytes``) ÷ DiLoCo's (target ≤ 1/F); its time to
   the target ÷ DiLoCo's (target ≤ :data:`STREAMING_TARGET`). Where the model is read (each
   epoch's validation, every H steps here) every fragment synchronises at once, blocking, on top
   of the fragments' own exchanges in the round: the validated runs cost Streaming DiLoCo that.
6. The exchange hidden behind compute, measured where only H's synchronisations happen (no
   validation, :data:`PACE_EPOCHS` epochs; the wall seconds per step from a job's first training
   event to its last, :func:`benchmarks.slow_links.bench.per_step`): ``p_d``, DiLoCo on the links;
   ``p_s``, Streaming DiLoCo on the links; ``p_c``, DiLoCo on loopback — the same workers,
   threads and placement, its synchronisations a copy in memory: the compute. The links' share
   of DiLoCo's time is ``(p_d − p_c) / p_d`` (is the run compute- or link-bound?); the share of
   the exchange streaming hides is ``1 − (p_s − p_c) / (p_d − p_c)`` (:func:`hidden_share`:
   1 when streaming costs no more than the compute, 0 when it costs what DiLoCo's exchange does,
   below 0 when more).
7. Churn, for ``ours: DiLoCo elastic (torch)`` and ``ours: DiLoCo elastic (coordinator)``
   (``elastic=True`` on either collective): when the job stands at :data:`KILL_AT` of ``S``
   steps the agent of the last replica's worker is SIGKILLed (its process group; its filter
   daemons see it gone and exit), and at :data:`JOIN_AT` of ``S`` a new worker (``join0``,
   ``join1``) is started in that worker's site, dialing the coordinator as the others do. Where
   a job stands between its progress events (a chunk of steps each, a round when elastic) is
   estimated from its last one at undisturbed DiLoCo's pace (:func:`estimated_step`). The job
   must succeed; reported: its time and steps to the target, when the kill and the start came,
   and the times of its ``worker_lost``, ``worker_dropped`` and ``worker_joined`` events.
   Figure: DiLoCo elastic (torch)'s time to the target ÷ DDP with restart's (target ≤
   :data:`RESTART_TARGET`).

``--link-bound`` trains a wider model (:data:`LINK_BOUND_SIZE`) on one window per replica a
step (:data:`LINK_BOUND_PER_REPLICA`): fewer numbers computed per byte exchanged, so that the
link, not 4 replicas sharing 2 cores, sets the pace (the links' share of step 6 says how far).
``--quick`` trains fewer epochs (:data:`QUICK_EPOCHS`) and checkpoints DDP every
:data:`QUICK_CHECKPOINT_EVERY` steps (so that its kill still falls after a checkpoint): a smoke
test, not a measurement.

Every process started here is stopped at the end, and the namespaces removed (also on Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import somatize as sz
from benchmarks.report import with_section
from benchmarks.slow_links import char_lm
from benchmarks.slow_links.bench import (
    BUDGET_EPOCHS,
    DILOCO_EPOCHS,
    DOCUMENT,
    EPOCH_STEPS,
    EVENT_TIMEOUT,
    SYNC_EVERY,
    Curve,
    Workload,
    _header,
    _training,
    _verdict,
    anchor,
    anchor_curve,
    anchor_lines,
    finish_anchor,
    our_cluster,
    our_curve,
    our_events,
    per_step,
    start_anchor,
    start_in_site,
    stop_ranks,
    table,
)
from benchmarks.slow_links.links import LinkShape, Sites
from protocol.rules.traffic import FP32
from somatize.cli.cluster import LocalCluster

__all__ = [
    "Churn",
    "EventWatch",
    "Plan",
    "churn_steps",
    "estimated_step",
    "hidden_share",
    "main",
    "membership",
    "restarted",
    "run",
    "steady_began",
    "steady_curve",
    "time_ratio",
]

T = TypeVar("T")

WORKERS = 4
KILL_AT = 0.4
"""The share of the steps (S for ours, the budget for DDP) after which a worker is lost."""
JOIN_AT = 0.6
"""The share of S after which a new worker is started (ours)."""
CHECKPOINT_EVERY = EPOCH_STEPS
"""DDP with restart's K: a checkpoint at each epoch's end, where it validates anyway (the kill
at 40 of 100 steps then loses 15)."""
FRAGMENTS = 4
OVERLAP = 1
PACE_EPOCHS = 4
"""The epochs of the runs without validation that measure the exchange hidden (H syncs each)."""
QUICK_EPOCHS = {"budget": 2, "diloco": 4, "pace": 2}
QUICK_CHECKPOINT_EVERY = 15
"""``--quick``'s K: its kill at 40 % of 50 steps falls after one checkpoint, as the full run's."""
LINK_BOUND_SIZE = char_lm.Size(d_model=384, ff=1536)
"""``--link-bound``'s model: 7.2 M parameters, 28.8 MB of float32."""
LINK_BOUND_PER_REPLICA = 1
CHECKPOINT_TARGET = 1.05
RESTART_TARGET = 0.35
STREAMING_TARGET = 1.0
POLL_SECONDS = 0.05
MEMBERSHIP = ("worker_lost", "worker_dropped", "worker_joined")
"""The events of an elastic job that say who left and who joined."""
DISTURBANCES = (*MEMBERSHIP, "worker_restored", "worker_replaced")
"""The events that say a job's chunk was slowed by churn."""


@dataclass(frozen=True)
class Plan:
    """What one ``--churn`` run trains, on how many sites of which links."""

    shape: LinkShape
    workers: int = WORKERS
    link_bound: bool = False
    quick: bool = False

    def workload(self, epochs: int) -> Workload:
        if self.link_bound:
            return Workload(
                self.workers, epochs, per_replica=LINK_BOUND_PER_REPLICA, size=LINK_BOUND_SIZE
            )
        return Workload(self.workers, epochs)

    @property
    def budget(self) -> Workload:
        """DDP's: its last loss is the target."""
        return self.workload(QUICK_EPOCHS["budget"] if self.quick else BUDGET_EPOCHS)

    @property
    def longer(self) -> Workload:
        """DiLoCo's: up to this many epochs to reach the target."""
        return self.workload(QUICK_EPOCHS["diloco"] if self.quick else DILOCO_EPOCHS)

    @property
    def pace(self) -> Workload:
        """The runs without validation (the exchange hidden)."""
        return self.workload(QUICK_EPOCHS["pace"] if self.quick else PACE_EPOCHS)

    @property
    def checkpoint_every(self) -> int:
        """DDP with restart's K."""
        return QUICK_CHECKPOINT_EVERY if self.quick else CHECKPOINT_EVERY

    @property
    def section(self) -> str:
        """Its section of docs/benchmarks.md."""
        return "slow_links_churn" + ("_link_bound" if self.link_bound else "")

    def describe(self) -> str:
        """The workload, in words."""
        work = self.budget
        model = char_lm.model(0, work.size)
        count = char_lm.parameter_count(model)
        said = (
            f"char LM of {count / 1e6:.1f} M parameters (d_model {work.size.d_model}, "
            f"{work.size.layers} layers, feed-forward {work.size.ff}), {work.per_replica} "
            f"window(s) per replica a step"
        )
        if self.link_bound:
            return f"link-bound workload: {said}"
        return f"default workload: {said}"


@dataclass(frozen=True)
class Churn:
    """When a job of ours loses a worker and a new one is started, and how to tell."""

    kill_step: int
    join_step: int
    joiner: str
    pace: float
    """Seconds a step between progress events (undisturbed DiLoCo's)."""
    setup: float
    """Seconds from submit to training (undisturbed DiLoCo's)."""


# -- the arithmetic (no I/O) ---------------------------------------------------------------------


def churn_steps(reached: int | None, total: int) -> tuple[int, int]:
    """The steps after which a worker is lost and a new one started: :data:`KILL_AT` and
    :data:`JOIN_AT` of ``S`` (``reached``: undisturbed DiLoCo's steps to the target; ``total``,
    all its steps, if it never got there)."""
    steps = reached if reached is not None else total
    kill = max(1, round(KILL_AT * steps))
    return kill, max(kill + 1, round(JOIN_AT * steps))


def estimated_step(mark: tuple[int, float] | None, began: float, pace: float, now: float) -> float:
    """Where a job stands at ``now``: the steps of its last progress event ``mark`` (steps,
    time), or 0 at ``began`` before any, and ``pace`` seconds a step since."""
    step, since = mark if mark is not None else (0, began)
    return step + max(0.0, now - since) / pace


def hidden_share(stream: float, diloco: float, compute: float) -> float | None:
    """The share of DiLoCo's exchange that streaming hides: ``1 − (stream − compute) /
    (diloco − compute)``, of seconds per step (module docstring, 6); ``None`` when DiLoCo's
    exchange costs nothing measurable here (``diloco <= compute``)."""
    exchange = diloco - compute
    if exchange <= 0:
        return None
    return 1.0 - (stream - compute) / exchange


def time_ratio(curve: Curve, base: Curve, target: float) -> float | None:
    """``curve``'s time to ``target`` over ``base``'s; ``None`` if either never reaches it."""
    mine, theirs = curve.reaches(target), base.reaches(target)
    if mine is None or theirs is None:
        return None
    return mine[1] / theirs[1]


def restarted(
    name: str,
    first: Sequence[dict[str, Any]],
    again: Sequence[dict[str, Any]],
    killed_at: float,
    killed_step: int,
) -> Curve:
    """DDP with restart's curve from its two lives' lines (:func:`~benchmarks.slow_links.bench.
    anchor_lines`): the first's points, then the second's after the first's training up to
    the kill (``killed_at``, Unix seconds; its evaluations left out) and the restart (from the
    kill to the new group's clock starting)."""
    before, after = anchor_curve(name, first), anchor_curve(name, again)
    evaluated = sum(line["eval_seconds"] for line in first[1:])
    trained = killed_at - first[0]["started"] - evaluated
    restart = again[0]["started"] - killed_at
    points = before.points + [(s, trained + restart + t, loss) for s, t, loss in after.points]
    resumed_from = int(again[0]["resumed_from"])
    said = {
        "killed_step": killed_step,
        "killed_at": trained,
        "restart_seconds": restart,
        "resumed_from": resumed_from,
        "redone": killed_step - resumed_from,
    }
    return Curve(name, points, said)


def steady_began(events: Sequence[sz.JobEventInfo]) -> float | None:
    """When a job of ours began training: its first training event less its steps at the
    median pace of its undisturbed chunks (each chunk's wall seconds per step, the evaluation
    after it left out; a chunk is disturbed when a :data:`DISTURBANCES` event came during it,
    and all count if every one was). A job slowed by churn would start too early at its
    average pace, the way :func:`~benchmarks.slow_links.bench.our_curve` takes it (its chunks are
    whole rounds here, 25 steps the first). ``None`` with fewer than two chunks."""
    marks: list[tuple[int, float, float, bool]] = []  # (steps, time, evaluated after, disturbed)
    for e in events:
        if _training(e):
            marks.append((e.data["step"], e.time, 0.0, False))
        elif marks and e.event == "progress" and e.data.get("phase") == "epoch":
            step, at, evaluated, disturbed = marks[-1]
            marks[-1] = (step, at, evaluated + e.time - at, disturbed)
        elif marks and e.event in DISTURBANCES:
            step, at, evaluated, _ = marks[-1]
            marks[-1] = (step, at, evaluated, True)  # (the chunk after this mark)
    chunks = [
        ((t1 - t0 - evaluated) / (s1 - s0), disturbed)
        for (s0, t0, evaluated, disturbed), (s1, t1, _, _) in pairwise(marks)
    ]
    if not chunks:
        return None
    steady = [pace for pace, disturbed in chunks if not disturbed]
    step, at, _, _ = marks[0]
    return at - step * statistics.median(steady or [pace for pace, _ in chunks])


def steady_curve(method: str, events: Sequence[sz.JobEventInfo]) -> Curve:
    """``events``' curve, its clock from :func:`steady_began`."""
    return our_curve(method, events, steady_began(events))


def membership(events: Sequence[sz.JobEventInfo], began: float) -> list[dict[str, Any]]:
    """A job's :data:`MEMBERSHIP` events: which, when (wall seconds since ``began``, the
    evaluations in), at which step, whose."""
    return [
        {
            "event": e.event,
            "seconds": e.time - began,
            "step": e.data.get("step"),
            "worker": e.data.get("worker"),
        }
        for e in events
        if e.event in MEMBERSHIP
    ]


# -- DDP with restart ----------------------------------------------------------------------------


def restart_ddp(
    sites: Sites, work: Workload, directory: Path, kill_step: int, every: int, target: float
) -> Curve:
    """DDP on ``work`` checkpointed every ``every`` steps, its last rank SIGKILLed after
    ``kill_step`` steps and every other after it, restarted from its checkpoint at once and
    trained until its validation loss reaches ``target`` (module docstring, 2)."""
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint, progress = directory / "ddp-restart.pt", directory / "ddp-restart-steps.jsonl"
    longest = dataclasses.replace(work, epochs=work.epochs + 1)  # a rounding above: one more
    keep = ["--checkpoint", str(checkpoint), "--checkpoint-every", str(every)]
    keep += ["--stop-loss", repr(target)]
    first = directory / f"ddp-restart-{work.workers}.jsonl"
    ranks = start_anchor(sites, "ddp", longest, first, [*keep, "--progress", str(progress)])
    try:
        killed_step = _wait_for_step(ranks, progress, kill_step)
        killed_at = time.time()
        ranks[-1].kill()  # the lost rank ...
    finally:
        stop_ranks(ranks)  # ... and the rest, as torchrun's agent tears the group down
    again = directory / f"ddp-resumed-{work.workers}.jsonl"
    finish_anchor(start_anchor(sites, "ddp", longest, again, [*keep, "--resume"]), again)
    lines = anchor_lines(first), anchor_lines(again)
    return restarted("DDP with restart", *lines, killed_at, killed_step)


def _wait_for_step(ranks: Sequence[Any], progress: Path, step: int) -> int:
    """The steps rank 0 says it has done (``progress``, a line each), once at least ``step``.

    Raises:
        RuntimeError: a rank ended first.
    """
    while (done := _steps_done(progress)) < step:
        ended = [r for r, proc in enumerate(ranks) if proc.poll() is not None]
        if ended:
            raise RuntimeError(f"DDP's rank(s) {ended} ended before step {step} (see the logs)")
        time.sleep(POLL_SECONDS)
    return done


def _steps_done(progress: Path) -> int:
    """The last whole line of ``progress``: its steps (0 before any)."""
    if not progress.exists():
        return 0
    whole = progress.read_text().split("\n")[:-1]  # after the last newline: a line being written
    return int(json.loads(whole[-1])["step"]) if whole else 0


# -- ours, with churn ----------------------------------------------------------------------------


class EventWatch:
    """A job's events as they come, read by a thread of its own (the client is thread-safe):
    what the job said so far, and whether it ended."""

    def __init__(self, job: sz.Job) -> None:
        self.events: list[sz.JobEventInfo] = []
        self.ended = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(job,), daemon=True)
        self._thread.start()

    def _read(self, job: sz.Job) -> None:
        try:
            for event in job.events():
                self.events.append(event)
        except BaseException as exc:  # the caller's to say (a job's failure: job.result())
            self.failure = exc
        finally:
            self.ended.set()

    @property
    def submitted(self) -> float | None:
        """When the job was queued (Unix seconds)."""
        return self.events[0].time if self.events else None

    @property
    def workers(self) -> list[str] | None:
        """The workers it was placed on, replica by replica."""
        return next((list(e.data["workers"]) for e in self.events if e.event == "placed"), None)

    @property
    def mark(self) -> tuple[int, float] | None:
        """Its last training progress: steps done, and when."""
        marks = [(e.data["step"], e.time) for e in self.events if _training(e)]
        return marks[-1] if marks else None

    def close(self, timeout: float = 1.0) -> None:
        """Wait a little for the reading thread (it ends with the job, or with the client's
        connection: a daemon thread, it never holds the process)."""
        self._thread.join(timeout)


def churned(
    c: LocalCluster,
    sites: Sites,
    name: str,
    strategy: Any,
    work: Workload,
    churn: Churn,
    *,
    homes: dict[str, int],
) -> Curve:
    """``strategy`` on ``work`` through ``c``, its last replica's worker SIGKILLed and a new
    worker started in its site as ``churn`` says (module docstring, 7); ``homes``, each
    worker's site, learns the new one's."""
    x, y, val_x, val_y = work.arrays()
    killed: dict[str, Any] | None = None
    started: dict[str, Any] | None = None
    with c.client(timeout=60) as client:
        job = client.submit(work.graph(), x, y, strategy=strategy, validation=(val_x, val_y))
        watch = EventWatch(job)
        try:
            while not watch.ended.wait(POLL_SECONDS):
                placed, submitted = watch.workers, watch.submitted
                if placed is None or submitted is None:
                    continue
                now = time.time()
                step = estimated_step(watch.mark, submitted + churn.setup, churn.pace, now)
                if killed is None and step >= churn.kill_step:
                    victim = placed[-1]
                    c.send_signal(c.workers[victim], signal.SIGKILL)
                    killed = {"worker": victim, "step": step, "time": now}
                elif killed is not None and started is None and step >= churn.join_step:
                    home = homes[killed["worker"]]
                    start_in_site(c, sites, churn.joiner, home)
                    homes[churn.joiner] = home
                    started = {"worker": churn.joiner, "step": step, "time": now}
                    started["connected"] = time.time() - now
            job.result(timeout=EVENT_TIMEOUT)
            events = list(job.events(timeout=60))
        finally:
            watch.close()
    if killed is None or started is None:
        raise RuntimeError(
            f"{name}: the job ended before its worker was killed and replaced"
        ) from watch.failure
    curve = steady_curve(name, events)
    began = curve.said["began"]
    said = {
        "killed": killed | {"seconds": killed["time"] - began},
        "started": started | {"seconds": started["time"] - began},
        "events": membership(events, began),
        "kill_step": churn.kill_step,
        "join_step": churn.join_step,
    }
    return Curve(name, curve.points, curve.said | {"churn": said})


# -- the run -------------------------------------------------------------------------------------


def run(plan: Plan, directory: Path) -> dict[str, Any]:
    """Every run of ``plan`` (module docstring): the curves, S, and the paces (each said as it
    ends: a later one may fail)."""
    directory.mkdir(parents=True, exist_ok=True)
    n, budget, longer = plan.workers, plan.budget, plan.longer
    curves = _Said[Curve](lambda c: f"{c.last[0]} steps, {c.last[1]:.1f} s, loss {c.last[2]:.4f}")
    paces = _Said[float](lambda seconds: f"{seconds:.3f} s a step")
    diloco = sz.DiLoCo(n, sync_every=SYNC_EVERY)
    streaming = sz.DiLoCo(n, sync_every=SYNC_EVERY, fragments=FRAGMENTS, overlap=OVERLAP)
    with Sites(n, plan.shape) as sites:
        curves["DDP"] = anchor(sites, "ddp", budget, directory)
        target = curves["DDP"].last[2]
        ddp_kill = max(1, round(KILL_AT * budget.epochs * EPOCH_STEPS))
        curves["DDP with restart"] = restart_ddp(
            sites, budget, directory / "restart", ddp_kill, plan.checkpoint_every, target
        )
        sites.ensure_running()
        with our_cluster(sites, n, directory / "ours") as c:
            name = "ours: DiLoCo"
            curves[name] = undisturbed = steady_curve(name, our_events(c, diloco, longer))
            reached = undisturbed.reaches(target)
            kill, join = churn_steps(reached[0] if reached else None, undisturbed.last[0])
            checkpointed = sz.DiLoCo(n, sync_every=SYNC_EVERY, checkpoint_every=SYNC_EVERY)
            name = "ours: DiLoCo checkpointed"
            curves[name] = steady_curve(name, our_events(c, checkpointed, longer))
            name = "ours: Streaming DiLoCo"
            curves[name] = steady_curve(name, our_events(c, streaming, longer))
            paces["DiLoCo"] = per_step(c, diloco, plan.pace)
            paces["Streaming DiLoCo"] = per_step(c, streaming, plan.pace)
            homes = {f"site{i}": i for i in range(n)}
            said = undisturbed.said
            for collective, joiner in (("torch", "join0"), ("coordinator", "join1")):
                elastic = sz.DiLoCo(n, sync_every=SYNC_EVERY, elastic=True, collective=collective)
                churn = Churn(kill, join, joiner, said["pace"], said["setup"])
                name = f"ours: DiLoCo elastic ({collective})"
                curves[name] = churned(c, sites, name, elastic, longer, churn, homes=homes)
        sites.ensure_running()
    with our_cluster(None, n, directory / "loopback") as c:
        paces["DiLoCo on loopback"] = per_step(c, diloco, plan.pace)
    return {
        "curves": dict(curves),
        "paces": dict(paces),
        "target": target,
        "S": reached[0] if reached else None,
    }


class _Said(dict[str, T]):
    """A dict that prints each value as it is set (``said``: the value in words)."""

    def __init__(self, said: Callable[[T], str]) -> None:
        super().__init__()
        self.said = said

    def __setitem__(self, name: str, value: T) -> None:
        super().__setitem__(name, value)
        print(f"{name}: {self.said(value)}", flush=True)


def report(plan: Plan, result: dict[str, Any]) -> str:
    """The table, the figures against their targets and what happened, in markdown."""
    curves: dict[str, Curve] = result["curves"]
    paces: dict[str, float] = result["paces"]
    target: float = result["target"]
    ddp, restart = curves["DDP"], curves["DDP with restart"]
    diloco = curves["ours: DiLoCo"]
    streaming = curves["ours: Streaming DiLoCo"]
    s = result["S"]
    lines = [
        f"### Churn and streaming: {plan.workers} workers, links held to {plan.shape.describe()}",
        "",
        f"The {plan.describe()}. DDP's validation loss after {ddp.last[0]} steps: "
        f"{target:.4f} (the target). S, DiLoCo's steps to it: "
        + (f"{s}." if s is not None else f"not reached (S taken as its {diloco.last[0]} steps)."),
        "",
        *table(curves, target, ddp.last[1]),
        "",
    ]

    checkpointed = time_ratio(curves["ours: DiLoCo checkpointed"], diloco, target)
    lines.append(
        _figure("DiLoCo checkpointed", checkpointed, CHECKPOINT_TARGET, "× DiLoCo's time to target")
    )
    for collective in ("torch", "coordinator"):
        name = f"ours: DiLoCo elastic ({collective})"
        lines.append(
            _figure(
                f"DiLoCo elastic ({collective})",
                time_ratio(curves[name], restart, target),
                RESTART_TARGET,
                "× DDP with restart's time to target",
            )
        )
        cost = time_ratio(curves[name], diloco, target)
        said = f"{cost:.3f}× undisturbed DiLoCo's" if cost is not None else "not reached"
        lines.append(f"  (the churn's cost: its time to target {said})")
    peak, whole = streaming.said["sync_bytes"], diloco.said["sync_bytes"]
    share = -(-whole // (FP32 * FRAGMENTS)) * FP32  # 1/F of the model's fp32 values, rounded up
    lines += [
        f"- Streaming DiLoCo (F={FRAGMENTS}, τ={OVERLAP}): a synchronisation's peak "
        f"{peak:,} bytes against DiLoCo's {whole:,}: **{peak / whole:.4f}×** (target ≤ "
        f"1/{FRAGMENTS}, to a whole value: {share:,} bytes: {_verdict(peak <= share)})",
        _figure(
            "Streaming DiLoCo",
            time_ratio(streaming, diloco, target),
            STREAMING_TARGET,
            "× DiLoCo's time to target (each epoch's validation reads the global model where "
            "it stands: no fragment synchronises for it)",
        ),
    ]
    p_d, p_s, p_c = paces["DiLoCo"], paces["Streaming DiLoCo"], paces["DiLoCo on loopback"]
    hidden = hidden_share(p_s, p_d, p_c)
    epochs = plan.pace.epochs
    lines += [
        "",
        f"**The exchange hidden behind compute** (no validation, so only H's synchronisations; "
        f"{epochs} epochs, wall seconds per step from a job's first training event to its last): "
        f"DiLoCo on the links p_d = {p_d:.3f}, Streaming DiLoCo on the links p_s = {p_s:.3f}, "
        f"DiLoCo on loopback (the compute) p_c = {p_c:.3f}.",
        "",
        f"- the links' share of DiLoCo's time, (p_d − p_c) / p_d: **{(p_d - p_c) / p_d:.3f}**",
        f"- Streaming DiLoCo per step: **{p_s / p_d:.3f}×** DiLoCo's",
        "- the share of the exchange streaming hides, 1 − (p_s − p_c) / (p_d − p_c): "
        + (f"**{hidden:.3f}**" if hidden is not None else "none to hide (p_d ≤ p_c)"),
        "",
        "**Churn.**",
        "",
    ]
    life = restart.said
    lines.append(
        f"- DDP with restart: rank {plan.workers - 1} SIGKILLed after step "
        f"{life['killed_step']} ({life['killed_at']:.1f} s into training), then every other "
        f"rank; {plan.workers} ranks started again at once from the checkpoint of step "
        f"{life['resumed_from']} (K = {plan.checkpoint_every}): training again "
        f"{life['restart_seconds']:.1f} s after the kill (processes, group, checkpoint load), "
        f"{life['redone']} steps (and the one in flight) done again. Assumed, in DDP's favour: "
        "a replacement machine at hand at once, no timeout waited out to notice the loss."
    )
    for collective in ("torch", "coordinator"):
        name = f"ours: DiLoCo elastic ({collective})"
        churn = curves[name].said["churn"]
        killed, started = churn["killed"], churn["started"]
        happened = ", ".join(
            f"{e['event']} {e['seconds']:.1f} s (step {e['step']}, {e['worker']})"
            for e in churn["events"]
        )
        lines.append(
            f"- DiLoCo elastic ({collective}), collective {curves[name].said['collective']}: "
            f"{killed['worker']}'s agent SIGKILLed at step ~{killed['step']:.0f} "
            f"({killed['seconds']:.1f} s into training; due at {churn['kill_step']}), "
            f"{started['worker']} started in its site at step ~{started['step']:.0f} "
            f"({started['seconds']:.1f} s; due at {churn['join_step']}; listed "
            f"{started['connected']:.1f} s later); events (wall seconds since training "
            f"began): {happened or 'none'}"
        )
    for name, curve in curves.items():
        if "wall" in curve.said:
            lines.append(
                f"- {name}: the job {curve.said['wall']:.1f} s from submit to end, of which "
                f"set-up {curve.said['setup']:.1f} s; collective {curve.said['collective']}"
            )
    return "\n".join(lines) + "\n"


def _figure(label: str, value: float | None, bound: float, what: str) -> str:
    """One figure's line: ``value`` ``what``, against ``bound``."""
    if value is None:
        return f"- {label}: the target not reached, no figure (target ≤ {bound:g}: MISSED)"
    met = _verdict(value <= bound)
    return f"- {label}: **{value:.3f}** {what} (target ≤ {bound:g}: {met})"


def _save(path: Path, result: dict[str, Any]) -> None:
    """The run's curves (points, and what each said), S and the paces, as JSON."""
    curves = {name: {"points": c.points, "said": c.said} for name, c in result["curves"].items()}
    saved = {k: v for k, v in result.items() if k != "curves"} | {"curves": curves}
    path.write_text(json.dumps(saved, indent=1, default=str))


def main(plan: Plan, given: Sequence[str], write: bool = False) -> None:
    """Run ``plan``, print its report and, with ``write``, put it in docs/benchmarks.md
    (``given``: the command line's arguments, for the report)."""
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="slow-links-churn-"))
    print(f"logs: {directory}", flush=True)
    result = run(plan, directory)
    _save(directory / "churn.json", result)
    seconds = time.monotonic() - started
    command = shlex.join(["python", "-m", "benchmarks.slow_links", *given])
    flags = "--churn --link-bound " if plan.link_bound else "--churn "
    title = "Workers far apart: churn and streaming"
    written = _header(command, seconds, title, "churn", flags) + report(plan, result)
    print(written)
    if write:
        DOCUMENT.write_text(with_section(DOCUMENT.read_text(), plan.section, written))
        print(f"wrote its section of {DOCUMENT}")
