"""What the sandbox of job code costs a job: its start and its steps, sandboxed and not.

``python -m benchmarks.sandbox`` starts a coordinator and one ``somatize-worker --sandbox
LEVEL`` for each level of :data:`LEVELS` (``bwrap`` needs Debian's bubblewrap; the anchor is
``none``, the same worker without a sandbox), and times, median of :data:`REPEATS`:

- *start, spare warm*: submit → result of a one-step job, the worker's spare daemons up (a
  ``ping`` first waits for them): what a job waits for its daemon when jobs are spaced;
- *start, back to back*: the same job submitted as soon as the previous one ended, the spare
  that one took being replaced. Sandboxed daemons are spawned (a fork server would share its
  memory with every job), unsandboxed ones forked in milliseconds: a sandboxed agent keeps two
  spares (:data:`worker.supervision.pool.SANDBOXED_SPARES`), started nice on a root agent, so the
  job finds the other up and shares the cores with the replacement's start;
- *steps*: the time of :data:`STEPS` steps of a 32→256→4 MLP (a job of that many steps less
  the one-step job's time, the spare warm for both): what the sandbox costs a step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

import somatize as sz
from benchmarks.report import Row
from somatize.cli.cluster import LocalCluster

LEVELS = ("bwrap", "none")
REPEATS = 3
STEPS = 128
BATCH = 32


def _graph(steps: int) -> tuple[sz.Graph, np.ndarray, np.ndarray]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    trainer = sz.TorchFilter(net, loss="cross_entropy", batch_size=BATCH, epochs=1, lr=1e-2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 32)).astype(np.float32)
    y = rng.integers(0, 4, size=steps * BATCH)
    return sz.Graph([trainer.named("net")]), x, y


def _timed(client: sz.Client, steps: int) -> float:
    graph, x, y = _graph(steps)
    started = time.perf_counter()
    client.submit(graph, x, y, strategy=sz.Local(worker="w0")).result(timeout=600)
    return time.perf_counter() - started


def _level(level: str, repeats: int, steps: int) -> dict[str, float]:
    with LocalCluster(job_threads=1, sandbox=level, spares=None) as c:  # the worker's default
        c.start_coordinator()
        c.start_worker("w0", threads=1)
        with sz.connect(c.url, timeout=60) as client:
            client.ping("w0")
            _timed(client, 1)  # the first job imports what the later ones find loaded
            warm, back_to_back, many = [], [], []
            for _ in range(repeats):
                client.ping("w0")  # its spare daemon is up
                warm.append(_timed(client, 1))
                back_to_back.append(_timed(client, 1))
                client.ping("w0")
                many.append(_timed(client, steps))
    start = statistics.median(warm)
    return {
        "start_warm_s": start,
        "start_back_to_back_s": statistics.median(back_to_back),
        "steps_s": max(statistics.median(many) - start, 0.0),
    }


def run(repeats: int = REPEATS, steps: int = STEPS) -> dict[str, Any]:
    """Each level of :data:`LEVELS` on its own cluster, in turn.

    Returns:
        ``{"steps": N, LEVEL: {"start_warm_s", "start_back_to_back_s", "steps_s"}}``.
    """
    results: dict[str, Any] = {"steps": steps}
    for level in LEVELS:
        results[level] = _level(level, repeats, steps)
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Each figure sandboxed (``bwrap``) next to the same worker without a sandbox."""
    ours, anchor = results["bwrap"], results["none"]
    named = {
        "start_warm_s": "job start (submit → result, 1 step), spare daemon warm",
        "start_back_to_back_s": "job start (1 step), back to back: its daemon starting",
        "steps_s": f"{results['steps']} steps of a 32→256→4 MLP",
    }
    return [
        Row(
            bench="sandbox",
            name=f"--sandbox bwrap: {name}",
            ours=ours[key],
            unit="s",
            anchor=anchor[key],
            anchor_name="--sandbox none",
        )
        for key, name in named.items()
    ]


def main() -> None:
    results = run()
    print(f"{'':56} {'bwrap':>8} {'none':>8}")
    for row in rows(results):
        print(f"{row.name.removeprefix('--sandbox bwrap: '):56} {row.ours:8.3f} {row.anchor:8.3f}")


if __name__ == "__main__":
    main()
