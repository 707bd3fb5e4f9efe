"""Sharded DataParallel (FSDP2) next to torchrun-style FSDP2 on the same model and data.

``python -m benchmarks.sharded [--steps S] [--rounds R]`` trains
:mod:`benchmarks.data_parallel`'s 5.8M-parameter MLP (784-2048-2048-10, SGD lr 0.01,
cross-entropy, 256 rows per replica, ``shuffle=False``) on N = 2 workers:

- *ours*: ``sz.DataParallel(2, collective="torch", sharding="full", checkpoint_every=0)`` on a
  :class:`somatize.cli.cluster.LocalCluster` (a real coordinator and two ``somatize-worker
  --threads 1``): each replica's daemon shards the model with ``fully_shard`` (each Linear a
  unit, then the whole) and trains its chunks of steps itself;
- *anchor*: the same model in 2 processes of 1 thread over gloo, each Linear and then the whole
  ``fully_shard``-ed, the same batches and optimizer: what a torchrun FSDP2 script does;
- *context*: the same job unsharded (``DistributedDataParallel`` on the replicas); and the
  anchor again with the ``malloc`` a sharded replica's daemon runs with here
  (:func:`daemon_malloc`: tcmalloc preloaded where installed, :mod:`worker.daemon.allocator`;
  else glibc's with blocks of 1 MiB and more mapped, :mod:`protocol.asyncio.memory`): the step's
  difference between the two anchors is the allocator's, the rest ours.

Per step as :mod:`benchmarks.data_parallel` measures it (the span of the progress marks after
the warm-up over the steps in it; the anchor's rank 0 step ends), the median over the rounds.
The target: ours at most 1.1× the anchor. The end of our run (the replicas gathering the whole
model for the coordinator to read) is outside the span, as the anchor has none.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.allreduce import cluster, mlp, run_torch
from benchmarks.data_parallel import EPOCH_STEPS, LR, PER_REPLICA, epochs_for, per_step, run_job
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes
from protocol.asyncio.memory import TENSOR_MMAP_THRESHOLD
from worker.daemon.allocator import choose as choose_allocator

STEPS = 24
"""Measured global steps (after the warm-up), at least; rounded up to whole epochs."""
ROUNDS = 2
WORKERS = 2
TARGET = 1.1


def daemon_malloc() -> dict[str, str]:
    """The ``malloc`` a sharded replica's daemon runs with here, as the anchor's environment
    (blocking: it may run ``ldconfig``)."""
    allocator = choose_allocator("auto")
    return allocator.environment() or {"MALLOC_MMAP_THRESHOLD_": str(TENSOR_MMAP_THRESHOLD)}


def run(steps: int = STEPS, rounds: int = ROUNDS) -> dict[str, Any]:
    """Ours sharded, the FSDP2 anchor and ours unsharded, ``rounds`` times interleaved.

    Returns:
        ``{"steps", "rounds", "sharded_s", "fsdp_s", "fsdp_daemon_malloc_s", "unsharded_s",
        "ratio", "all", "seconds"}``: the median seconds per step of each
        (``fsdp_daemon_malloc_s``: the anchor with :func:`daemon_malloc`), ours sharded over the
        anchor, and every round's figures (``all``).
    """
    began = time.monotonic()
    model = mlp()
    epochs = epochs_for(steps)
    total = epochs * EPOCH_STEPS
    found: dict[str, list[float]] = {
        "sharded": [],
        "fsdp": [],
        "fsdp_daemon_malloc": [],
        "unsharded": [],
    }
    malloc = daemon_malloc()
    names = tuple(f"w{i}" for i in range(WORKERS))
    with (
        cluster(names) as c,
        tempfile.TemporaryDirectory(prefix="somatize-sharded-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for _ in range(rounds):
            ours = run_job(c, model, WORKERS, "torch", epochs, sharding="full")
            found["sharded"].append(ours["step_s"])
            args = {"lr": LR, "steps": total, "threads": 1, "batch": PER_REPLICA, "fsdp": True}
            times = run_torch(procs, "train", args, WORKERS)
            found["fsdp"].append(per_step(list(enumerate(times))))
            times = run_torch(procs, "train", args, WORKERS, malloc)
            found["fsdp_daemon_malloc"].append(per_step(list(enumerate(times))))
            found["unsharded"].append(run_job(c, model, WORKERS, "torch", epochs)["step_s"])
    median = {k: statistics.median(v) for k, v in found.items()}
    return {
        "steps": total,
        "rounds": rounds,
        "sharded_s": median["sharded"],
        "fsdp_s": median["fsdp"],
        "fsdp_daemon_malloc_s": median["fsdp_daemon_malloc"],
        "unsharded_s": median["unsharded"],
        "ratio": median["sharded"] / median["fsdp"],
        "all": found,
        "seconds": time.monotonic() - began,
    }


def rows(results: dict[str, Any]) -> list[Row]:
    """Our sharded step next to the FSDP2 anchor's (target ≤ 1.1×)."""
    return [
        Row(
            bench="sharded",
            name=f"DataParallel({WORKERS}, sharding='full') step, 5.8M-param MLP",
            ours=results["sharded_s"] * 1e3,
            unit="ms",
            anchor=results["fsdp_s"] * 1e3,
            anchor_name="fully_shard over gloo (torchrun-style)",
            target=Target("<=", TARGET, text=f"≤ {TARGET} × FSDP2"),
            note=(
                f"unsharded (DDP) {results['unsharded_s'] * 1e3:.0f} ms; fully_shard with a "
                f"sharded replica's malloc {results['fsdp_daemon_malloc_s'] * 1e3:.0f} ms"
            ),
        )
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    results = run(args.steps, args.rounds)
    print(
        f"per step over {results['rounds']} rounds (median), {results['steps']} steps a run:\n"
        f"  ours, sharding='full'   {results['sharded_s'] * 1e3:8.1f} ms\n"
        f"  FSDP2 over gloo         {results['fsdp_s'] * 1e3:8.1f} ms   "
        f"ratio {results['ratio']:.2f} (target ≤ {TARGET})\n"
        f"  FSDP2, daemon's malloc  {results['fsdp_daemon_malloc_s'] * 1e3:8.1f} ms   "
        f"ratio {results['sharded_s'] / results['fsdp_daemon_malloc_s']:.2f}\n"
        f"  ours, unsharded (DDP)   {results['unsharded_s'] * 1e3:8.1f} ms\n"
        f"took {results['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
