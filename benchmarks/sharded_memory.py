"""What a sharded replica holds: each daemon's peak resident memory for N = 1, 2 and 4 replicas,
next to the training state it should hold (the model's weights, gradients and Adam moments
over N).

``python -m benchmarks.sharded_memory [--width W --layers L] [--replicas 1 2 4] [--checkpoints]
[--daemon-malloc auto|tcmalloc|glibc]`` trains L W × W Linear layers as ``sz.DataParallel(N,
sharding="full", collective="torch")`` — by default two models of the same 1 GiB of training state
with Adam (:data:`MODELS`): 4 layers of 4096 (64 MiB units: a few large layers) and 16 of 2048 (16
MiB units, as a deeper model's) — for one epoch of 2 steps (64 rows, 32 a step; the result read
back; with ``--checkpoints`` checkpointed at its end, whose snapshot — each replica's shards of the
weights and moments, written by DCP and read into the chunk's reply — then falls in the training
phase) on a :class:`somatize.cli.cluster.LocalCluster` of 4 workers (``--threads 1``), sampling
every job daemon's resident memory (its process group's, as ``--max-job-memory`` counts it) every 20
ms. Per replica, and per phase as the job's events mark them — *loading* (the filters arriving,
until the replicas say what they hold), *training* (until the last step's progress) and *reading*
(the result, read from each replica's shards) — the peak over the daemon's resident memory when idle
(its Python and torch, read before the job). And the coordinator's rise while it reads and keeps
the result (its peak after the last step over its resident memory then): two 16 MiB pieces of one
replica's file at most, whatever the model (+88 MiB for N = 2 and +91 MiB for N = 1, against +131
and +258 MiB when each replica's pieces came in one reply); and its peak over the whole job, over
its memory before it: the submitted model, which it holds whole for the job's life, and with
``--checkpoints`` the checkpoints' files, which it reads from the workers a piece at a time.

The anchors: the arithmetic — the training state over N (weights, gradients, two moments) plus
the activations (rows × width × layers, fp32, forward and backward: a few MiB here), the
training phase's peak to be within 15 % of it; and torch's own ``fully_shard`` in N plain
processes on the same model and batches, with glibc's default malloc settings, as ``torchrun``
would run it (:mod:`benchmarks.anchors.fsdp_memory`: its peak while it trains), within 15 % of
which ours should be too. FSDP2's own all-gathered units (a layer, W² values, while it runs
forward or backward, its whole gradient before it is reduce-scattered, the next one's gathered
ahead) come on top of the arithmetic for both: some 100 MiB for 16 MiB units, 250 MiB for
64 MiB ones, whatever N — so the fewer and larger the units and the more the replicas, the
further from state / N. The loading phase is what a replica holds of the filters as they
arrive: its rows of each parameter (and, for a moment, a copy of them out of the message),
never the whole model.

glibc's heap: from it, FSDP2's freed units and gradients fragment it (blocks under the mmap
threshold: 32 MiB in the daemons of unsharded replicas, :mod:`protocol.asyncio.memory`): with
16 layers of 2048 a replica of four held 1589 MiB over idle for 256 MiB of state, and torch's
own ``fully_shard`` in plain processes does the same (1453 MiB). Under glibc's ``malloc`` a
sharded replica's daemon maps its blocks of 1 MiB and more instead
(:func:`protocol.asyncio.memory.map_tensor_blocks`): 331 MiB. Layers over 32 MiB (the 4096-wide
model's 64 MiB) were mapped and unmapped whole already. The workers' daemons run tcmalloc where
the machine has it (``--daemon-malloc``, :mod:`worker.daemon.allocator`), which reuses freed
blocks without faulting their pages in again, for a little more memory than mapped blocks: the
benchmark's ``--daemon-malloc`` is its workers'.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.anchors import fsdp_memory
from benchmarks.periodic import Periodic
from benchmarks.report import Row, Target
from worker.daemon.allocator import LEVELS as MALLOC_LEVELS

MODELS = ((4096, 4), (2048, 16))
"""``(width, layers)`` of the models measured by default: the same training state in a few
large units and in many smaller ones."""
WIDTH, LAYERS = MODELS[0]
ROWS = 64
BATCH = 32
REPLICAS = (1, 2, 4)
TARGET = 0.15
"""How far the training peak may be from the training state over N plus activations."""

_PAGE = os.sysconf("SC_PAGE_SIZE")


COORDINATOR = -1
"""The key of the coordinator's resident bytes among :func:`_groups`' process groups."""
COORDINATOR_OWN = -2
"""The key of the coordinator's own resident bytes (anonymous memory: its resident set but the
pages of files it maps, which the kernel may drop and read again)."""


def _groups(skip: set[int]) -> dict[int, int]:
    """Resident bytes by process group of every process that is not the agents', the
    coordinator's or in ``skip`` (this process's group); the coordinator's under
    :data:`COORDINATOR`."""
    out: dict[int, int] = defaultdict(int)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/statm") as f:
                _, resident, shared = (int(v) for v in f.read().split()[:3])
                rss = resident * _PAGE
        except (OSError, ValueError, IndexError):
            continue
        group = int(stat[stat.rindex(")") + 2 :].split()[2])
        if b"somatize-coordinator" in cmd:
            out[COORDINATOR] += rss
            out[COORDINATOR_OWN] += (resident - shared) * _PAGE
        elif group not in skip and b"somatize-worker" not in cmd:
            out[group] += rss
    return out


class _Sampler:
    """Every daemon group's resident bytes every ``period`` seconds, stamped, while a ``with``
    block runs."""

    def __init__(self, period: float = 0.02) -> None:
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._skip = {os.getpgid(0)}
        self._periodic = Periodic(self._sample, period, "daemon memory")

    def __enter__(self) -> _Sampler:
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._periodic.__exit__(*exc)

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), _groups(self._skip)))


def _model(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def run(
    replicas: Sequence[int] = REPLICAS,
    width: int = WIDTH,
    layers: int = LAYERS,
    checkpoints: bool = False,
    daemon_malloc: str = "auto",
) -> dict[str, Any]:
    """Each N's per-replica peaks by phase, over the idle daemon (module docstring); without
    ``checkpoints`` the job saves none (``checkpoint_every=0``): the training phase is the
    training alone, and the coordinator's rise at the end the result's. ``daemon_malloc``: the
    workers' ``--daemon-malloc``.

    Returns:
        ``{"width", "state_bytes", "activation_bytes", "by_n": {N: {"idle", "loading",
        "training", "reading"}}, "daemon_malloc", "seconds"}``: bytes; each phase's figure the
        largest over the replicas of their peak above their idle resident memory.
    """
    import somatize as sz
    from somatize.cli.cluster import LocalCluster

    began = time.monotonic()
    params = layers * (width * width + width) * 4
    activations = 2 * BATCH * width * (layers + 1) * 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, width)).astype(np.float32)
    y = rng.integers(0, width, size=ROWS)
    options: dict[str, Any] = {
        "loss": "cross_entropy",
        "optimizer": "adam",
        "lr": 1e-3,
        "batch_size": BATCH,
        "epochs": 1,
        "shuffle": False,
    }
    by_n: dict[int, dict[str, int]] = {}
    with LocalCluster(job_threads=1, heartbeat_interval=1.0, heartbeat_timeout=30.0) as c:
        c.start_coordinator()
        for k in range(max(replicas)):
            c.start_worker(f"w{k}", args=("--daemon-malloc", daemon_malloc))
        with sz.connect(c.url, timeout=300) as client:
            for n in replicas:
                time.sleep(1.0)  # the spare daemons settle
                idle = _groups({os.getpgid(0)})
                graph = sz.Graph([sz.TorchFilter(_model(width, layers), **options).named("net")])
                every = None if checkpoints else 0
                strategy = sz.DataParallel(
                    n, sharding="full", collective="torch", checkpoint_every=every
                )
                marks: dict[str, float] = {}
                with _Sampler() as sampler:
                    job = client.submit(graph, x, y, strategy=strategy)
                    for event in job.events(timeout=600):
                        data = event.data
                        if data.get("phase") == "sharded":
                            marks["sharded"] = time.monotonic()
                        elif data.get("phase") == "training" and data["step"] == data["steps"]:
                            marks["trained"] = time.monotonic()
                    job.result(timeout=60)
                by_n[n] = _phases(sampler.samples, idle, marks)
    for n in replicas:  # the anchor, alone on the machine
        by_n[n]["fully_shard"] = max(fsdp_memory.peaks(n, width, layers, ROWS, BATCH))
    return {
        "width": width,
        "layers": layers,
        "state_bytes": 4 * params,
        "activation_bytes": activations,
        "by_n": by_n,
        "checkpoints": checkpoints,
        "daemon_malloc": daemon_malloc,
        "seconds": time.monotonic() - began,
    }


def _phases(
    samples: list[tuple[float, dict[int, int]]], idle: dict[int, int], marks: dict[str, float]
) -> dict[str, int]:
    """The job's daemons' largest peak above idle in each phase, and their idle memory (each
    daemon's, or the job's other daemons' if more: one still starting when the job came, as a
    spare that replaced the previous job's daemon may be, counts from theirs); and
    the coordinator's rise while the result is read (``coordinator_reading``: its peak then
    over its resident memory as training ended), while the replicas train
    (``coordinator_training``: over its memory as they began; a checkpoint's files come then)
    and over the whole job (``coordinator_job``: its peak over its memory before the job)."""
    trained = marks.get("trained", float("inf"))
    before = [s.get(COORDINATOR, 0) for t, s in samples if t < trained]
    after = [s.get(COORDINATOR, 0) for t, s in samples if t >= trained]
    rise = max(after, default=0) - (before[-1] if before else 0)
    groups = {g for _, seen in samples for g in seen if g in idle and g >= 0}
    busy = {g for g in groups if max(s.get(g, 0) for _, s in samples) - idle[g] > 64 << 20}
    up = max((idle[g] for g in busy), default=0)  # the job's other daemons', if more
    base = {g: max(idle[g], up) for g in busy}
    peak = max((s.get(COORDINATOR, 0) for _, s in samples), default=0)
    own = max((s.get(COORDINATOR_OWN, 0) for _, s in samples), default=0)
    sharded = marks.get("sharded", 0.0)
    loaded = [s.get(COORDINATOR, 0) for t, s in samples if t < sharded]
    training = [s.get(COORDINATOR, 0) for t, s in samples if sharded <= t < trained]
    out = {
        "idle": max(base.values(), default=0),
        "coordinator_reading": max(rise, 0),
        "coordinator_training": max(max(training, default=0) - (loaded or [0])[-1], 0),
        "coordinator_job": max(peak - idle.get(COORDINATOR, peak), 0),
        "coordinator_job_own": max(own - idle.get(COORDINATOR_OWN, own), 0),
    }
    spans = {
        "loading": (0.0, marks.get("sharded", 0.0)),
        "training": (marks.get("sharded", 0.0), marks.get("trained", float("inf"))),
        "reading": (marks.get("trained", float("inf")), float("inf")),
    }
    for phase, (start, stop) in spans.items():
        peaks = [
            s.get(g, 0) - base[g] for t, s in samples if start <= t < stop for g in busy if g in s
        ]
        out[phase] = max(peaks, default=0)
    return out


def rows(results: dict[str, Any]) -> list[Row]:
    """Per N, the training peak per replica against the state over N plus activations, and
    against torch's own ``fully_shard``'s."""
    out = []
    state, activations = results["state_bytes"], results["activation_bytes"]
    model = f"{results['layers']} × Linear({results['width']})"
    for n, figures in sorted(results["by_n"].items()):
        expected = state / n + activations
        ours: dict[str, Any] = {
            "bench": "sharded_memory",
            "name": f"DataParallel({n}, sharding='full') peak per replica, training, {model}",
            "ours": figures["training"] / 2**20,
            "unit": "MiB",
        }
        arithmetic = f"within {TARGET:.0%} of state / N + activations"
        out.append(
            Row(
                **ours,
                anchor=expected / 2**20,
                anchor_name=f"training state / {n} + activations",
                target=Target("<=", 1 + TARGET, text=arithmetic),
                note=(
                    f"loading {figures['loading'] / 2**20:.0f} MiB, reading "
                    f"{figures['reading'] / 2**20:.0f} MiB, idle {figures['idle'] / 2**20:.0f} MiB"
                    + _coordinator_note(results, figures)
                ),
            )
        )
        out.append(
            Row(
                **ours,
                anchor=figures["fully_shard"] / 2**20,
                anchor_name=f"torch fully_shard, {n} plain processes",
                target=Target("<=", 1 + TARGET, text=f"within {TARGET:.0%} of fully_shard's"),
            )
        )
    return out


def _coordinator_note(results: dict[str, Any], figures: dict[str, int]) -> str:
    """The coordinator's rise while it keeps the result, and its peak over the job, resident
    and its own (the submitted model's pages are those of the file it is kept in, mapped; with
    checkpoints their files, read from the workers a piece at a time)."""
    return (
        f"; the coordinator +{figures['coordinator_training'] / 2**20:.0f} MiB while they "
        f"train, +{figures['coordinator_reading'] / 2**20:.0f} MiB keeping the result, "
        f"+{figures['coordinator_job'] / 2**20:.0f} MiB at its peak over the job "
        f"(+{figures['coordinator_job_own'] / 2**20:.0f} MiB of its own memory, the rest the "
        "pages of files it maps)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharded_memory", description=__doc__
    )
    parser.add_argument("--width", type=int, help="one model's width (with --layers)")
    parser.add_argument("--layers", type=int, help="one model's layers (with --width)")
    parser.add_argument("--replicas", type=int, nargs="+", default=list(REPLICAS))
    parser.add_argument(
        "--checkpoints",
        action="store_true",
        help="checkpoint at the end (its snapshot then counts in the training phase)",
    )
    parser.add_argument(
        "--daemon-malloc",
        choices=MALLOC_LEVELS,
        default="auto",
        help="the workers' --daemon-malloc (default: theirs, tcmalloc where installed)",
    )
    args = parser.parse_args(argv)
    if (args.width is None) != (args.layers is None):
        parser.error("--width and --layers go together")
    models = MODELS if args.width is None else ((args.width, args.layers),)
    for width, layers in models:
        results = run(args.replicas, width, layers, args.checkpoints, args.daemon_malloc)
        _print(results)


def _print(results: dict[str, Any]) -> None:
    state = results["state_bytes"]
    print(
        f"{results['layers']} × Linear({results['width']}, {results['width']}), Adam: training "
        f"state {state / 2**20:.0f} MiB, activations "
        f"{results['activation_bytes'] / 2**20:.1f} MiB; the workers' --daemon-malloc "
        f"{results['daemon_malloc']}"
    )
    print(
        "  N   state/N   loading  training   reading  fully_shard   (per replica, over idle; MiB)"
    )
    for n, f in sorted(results["by_n"].items()):
        print(
            f"  {n}  {state / n / 2**20:8.0f}  {f['loading'] / 2**20:8.0f}  "
            f"{f['training'] / 2**20:8.0f}  {f['reading'] / 2**20:8.0f}  "
            f"{f['fully_shard'] / 2**20:11.0f}   idle {f['idle'] / 2**20:.0f}"
            + _coordinator_note(results, f)
        )
    print(f"took {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
