"""The demo: scikit-learn's digits, a standardising filter, then an MLP — in-process and on a
local cluster, side by side.

``somatize demo`` trains the graph with ``graph.fit`` (the reference), then starts an embedded
coordinator and N workers as real processes on 127.0.0.1, trains the same graph there through the
coordinator, and prints the held-out accuracy of both: distribution must not change the answer.
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

from somatize.filters import Filter, TorchFilter
from somatize.graph import Graph


class Standardize(Filter):
    """Zero mean, unit variance per column (columns that never vary are left at zero)."""

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        x = np.asarray(x, dtype=np.float32)
        std = x.std(0)
        return {"mean": x.mean(0), "scale": np.where(std > 0, std, 1.0).astype(np.float32)}

    def forward(self, x: Any, state: Any) -> Any:
        return (np.asarray(x, dtype=np.float32) - state["mean"]) / state["scale"]


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


def digits_graph(epochs: int = 20, seed: int = 0) -> Graph:
    """Standardize >> MLP(64-128-10), SGD with momentum, cross-entropy."""
    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    net = TorchFilter(
        mlp,
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.05,
        batch_size=64,
        epochs=epochs,
        shuffle=True,
        seed=seed,
        optimizer_options={"momentum": 0.9},
    )
    return Standardize().named("standardize") >> net.named("mlp")


def accuracy(output: Any, y: np.ndarray) -> float:
    """Share of rows whose highest output is the label."""
    predicted = torch.as_tensor(output).argmax(1).numpy()
    return float((predicted == y).mean())


def run(workers: int = 2, epochs: int = 20) -> dict[str, float]:
    """The demo: in-process reference, then the same job on an embedded cluster.

    Returns:
        Held-out accuracy by how it was trained (``"in-process"``, ``"local"``).
    """
    from rich.console import Console

    from somatize.cli import follow
    from somatize.client import connect
    from somatize.cluster import LocalCluster
    from somatize.strategies import Local

    console = Console(highlight=False)
    data = load_digits()
    console.print(f"digits: {len(data.x_train)} training images, {len(data.x_test)} held out")
    accuracies = {"in-process": run_local(epochs, quiet=True, data=data)}
    console.print(f"in-process graph.fit: held-out accuracy {accuracies['in-process']:.1%}")

    threads = max(1, (os.cpu_count() or 1) // workers)
    with LocalCluster(job_threads=threads) as cluster:
        console.print(f"starting a coordinator on {cluster.url} and {workers} workers ...")
        cluster.start_coordinator()
        for i in range(workers):
            cluster.start_worker(f"worker-{i + 1}", threads=threads)
        graph = digits_graph(epochs=epochs)
        with connect(cluster.url) as client:
            job = client.submit(graph, data.x_train, data.y_train, strategy=Local())
            follow(job, console)
            fitted = job.result(timeout=600)
        accuracies["local"] = accuracy(fitted.forward(data.x_test), data.y_test)
    console.print()
    console.print(f"{'trained':<32}{'held-out accuracy':>18}")
    console.print(f"{'in-process (graph.fit)':<32}{accuracies['in-process']:>18.1%}")
    console.print(f"{'Local, on one worker':<32}{accuracies['local']:>18.1%}")
    console.print()
    console.print("The same on separate machines:")
    console.print("  somatize-coordinator --listen 0.0.0.0:8765 --state-dir /var/lib/somatize")
    console.print("  somatize-worker --connect ws://COORDINATOR:8765      # on each worker machine")
    console.print("  somatize submit job.py --coordinator ws://COORDINATOR:8765")
    return accuracies


def run_local(epochs: int = 20, *, quiet: bool = False, data: Digits | None = None) -> float:
    """Train in-process, print the result (unless ``quiet``), return held-out accuracy."""
    data = data if data is not None else load_digits()
    graph = digits_graph(epochs=epochs)
    started = time.perf_counter()
    fitted = graph.fit(data.x_train, data.y_train)
    took = time.perf_counter() - started
    acc = accuracy(fitted.forward(data.x_test), data.y_test)
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
