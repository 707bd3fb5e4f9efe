"""The demo: scikit-learn's digits, a standardising filter, then an MLP — in-process and on a
local cluster, side by side.

``somatize demo`` trains the graph with ``graph.fit`` (the in-process baseline), then starts an
embedded coordinator and N workers as real processes on 127.0.0.1, trains the same graph there
with DataParallel, FedAvg and a 2-stage ModelParallel, each with a live progress bar, and prints
the held-out accuracy of each beside the baseline's: distribution must not change the answer.
The held-out images are each job's validation data: the accuracy printed is the last row of its
history (the model evaluated at the end of its last epoch, or round), not computed here.
It ends with the commands that run the same thing on separate machines. Ctrl-C stops every
process it started.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from somatize.filters import TorchFilter
from somatize.graph import Filter, Graph
from somatize.options.strategies import Strategy


class Standardize(Filter):
    """Zero mean, unit variance per column (columns that never vary are left at zero).

    Its state is two means (of the values and of their squares), the standard deviation
    worked out in ``forward``: distributed, each replica fits it on its own rows and the states
    are averaged by rows, which gives the whole data's means exactly — a standard deviation
    averaged would not be the whole data's.
    """

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        x = np.asarray(x, dtype=np.float64)
        return {"mean": x.mean(0), "mean_square": (x * x).mean(0)}

    def forward(self, x: Any, state: Any) -> Any:
        std = np.sqrt(np.maximum(state["mean_square"] - state["mean"] ** 2, 0.0))
        scale = np.where(std > 1e-9, std, 1.0)
        return ((np.asarray(x, dtype=np.float64) - state["mean"]) / scale).astype(np.float32)


@dataclass
class Digits:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """scikit-learn's 8x8 digits (1,797 images shipped with the package), split at random."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return Digits(x[train], y[train], x[test], y[test])


def digits_graph(epochs: int = 10, seed: int = 0) -> Graph:
    """Standardize >> hidden (Linear 64-128, ReLU) >> head (Linear 128-10): SGD with momentum,
    cross-entropy, accuracy on the validation data. Two TorchFilters so that the graph can also
    be split in two pipeline stages; in-process they train as one autograd graph."""
    torch.manual_seed(seed)
    hidden = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU())
    head = torch.nn.Linear(128, 10)
    settings: dict[str, Any] = {
        "optimizer": "sgd",
        "lr": 0.05,
        "optimizer_options": {"momentum": 0.9},
    }
    return (
        Standardize().named("standardize")
        >> TorchFilter(hidden, **settings).named("hidden")
        >> TorchFilter(
            head,
            loss="cross_entropy",
            batch_size=64,
            epochs=epochs,
            shuffle=True,
            seed=seed,
            metrics=("accuracy",),
            **settings,
        ).named("head")
    )


def strategies(workers: int) -> list[tuple[str, Strategy]]:
    """What the demo runs on the cluster, with how it is shown."""
    from somatize.options.strategies import DataParallel, FedAvg, ModelParallel, Partition

    stages = [
        Partition(["standardize", "hidden"], worker="worker-1"),
        Partition(["head"], worker=f"worker-{min(2, workers)}"),
    ]
    return [
        (f"DataParallel, {workers} workers", DataParallel(workers=workers)),
        (
            f"FedAvg, {workers} workers, 10 rounds",
            FedAvg(rounds=10, local_epochs=1, workers=workers),
        ),
        ("ModelParallel, 2 stages, M=4", ModelParallel(stages, micro_batches=4)),
    ]


def run(workers: int = 2, epochs: int = 10) -> dict[str, float]:
    """The demo: the in-process baseline, then each strategy on an embedded cluster.

    Returns:
        Held-out accuracy by how the graph was trained.
    """
    from rich.console import Console

    from somatize.cli.cluster import LocalCluster
    from somatize.cli.following import follow
    from somatize.remote.client import connect

    if workers < 2:
        raise ValueError("the demo needs at least 2 workers")
    console = Console(highlight=False)
    data = load_digits()
    console.print(f"digits: {len(data.x_train)} training images, {len(data.x_test)} held out")
    started = time.perf_counter()
    accuracies = {IN_PROCESS: run_local(epochs, quiet=True, data=data)}
    timings = {IN_PROCESS: time.perf_counter() - started}
    console.print(
        f"in-process graph.fit: held-out accuracy {accuracies[IN_PROCESS]:.1%} in "
        f"{timings[IN_PROCESS]:.1f} s"
    )

    threads = max(1, (os.cpu_count() or 1) // workers)
    with LocalCluster(job_threads=threads) as cluster:
        console.print(f"starting a coordinator on {cluster.url} and {workers} workers ...")
        cluster.start_coordinator()
        for i in range(workers):
            cluster.start_worker(f"worker-{i + 1}", threads=threads, peer_link=True)
        with connect(cluster.url) as client:
            levels = {w["capabilities"].get("sandbox") or "?" for w in client.status()["workers"]}
            console.print(f"job code's sandbox on the workers: {', '.join(sorted(levels))}")
            for label, strategy in strategies(workers):
                console.print(f"[bold]{label}[/bold]")
                started = time.perf_counter()
                job = client.submit(
                    digits_graph(epochs=epochs),
                    data.x_train,
                    data.y_train,
                    strategy=strategy,
                    validation=(data.x_test, data.y_test),
                )
                follow(job, console)
                fitted = job.result(timeout=600)
                timings[label] = time.perf_counter() - started
                accuracies[label] = fitted.history[-1]["accuracy"]
    console.print()
    console.print(f"{'trained':<40}{'validation accuracy':>20}{'time':>8}")
    for label, acc in accuracies.items():
        console.print(f"{label:<40}{acc:>20.1%}{timings[label]:>6.1f} s")
    console.print(
        "DataParallel and ModelParallel train exactly what graph.fit trains; "
        "FedAvg averages local trainings. A model this small trains fastest in-process: "
        "distributed, every step waits on the network and on other processes, which pays "
        "off only when a step's compute (or the data, or the model) outgrows one machine.",
        soft_wrap=True,
    )
    console.print()
    for line in ELSEWHERE:
        console.print(line, soft_wrap=True, markup=False)
    return accuracies


IN_PROCESS = "in-process (graph.fit)"

EXAMPLE_JOB = "examples/digits_job.py"
"""The demo's job as a file to submit (DataParallel over two workers tagged ``dp``)."""

ELSEWHERE = (
    f"The same on separate machines: {EXAMPLE_JOB} trains on 2 workers tagged dp, so start the "
    "worker line on two machines (each with its own --id):",
    "  somatize-coordinator --listen 0.0.0.0:8765 --state-dir /var/lib/somatize "
    "--worker-token-file worker.token --client-token-file client.token",
    "  somatize-worker --connect ws://COORDINATOR:8765 --id box-1 --tag dp --token-file "
    "worker.token --peer-listen 0.0.0.0:9000 --peer-advertise THIS-HOST:9000",
    f"  SOMATIZE_TOKEN=$(cat client.token) somatize submit {EXAMPLE_JOB} "
    "--coordinator ws://COORDINATOR:8765",
)
"""What the demo ends with: the commands that run its job on machines of one's own."""


def run_local(epochs: int = 10, *, quiet: bool = False, data: Digits | None = None) -> float:
    """Train in-process, print the result (unless ``quiet``), return held-out accuracy."""
    data = data if data is not None else load_digits()
    graph = digits_graph(epochs=epochs)
    started = time.perf_counter()
    fitted = graph.fit(data.x_train, data.y_train, validation=(data.x_test, data.y_test))
    took = time.perf_counter() - started
    acc = float(fitted.history[-1]["accuracy"])
    if quiet:
        return acc
    print(f"graph: {graph}")
    print(f"data:  digits, {len(data.x_train)} training rows, {len(data.x_test)} held out")
    losses = ", ".join(f"{v:.3f}" for v in fitted.epoch_losses[:: max(1, epochs // 5)])
    print(
        f"in-process: {epochs} epochs in {took:.1f} s, loss {losses} ... "
        f"{fitted.epoch_losses[-1]:.3f}"
    )
    print(f"held-out accuracy: {acc:.1%}")
    return acc
