"""The Flower side of ``benchmarks.federated``: the same FedAvg rounds in Flower's simulation
engine, run with the Python of Flower's own environment (``benchmarks/federated/flower_env.sh``).

``python -m benchmarks.federated.flower_sim SPEC.json`` (``benchmarks.federated.flower_anchor``
writes the spec and starts it; nothing of ``flwr`` or ``ray`` is ever imported in the project's
environment, nor anything of ours here but :mod:`benchmarks.federated.partition`) runs
``flwr.simulation.run_simulation`` with one virtual SuperNode a client (partition-id ``c`` = our
client ``c``, see :func:`~benchmarks.federated.partition.client_rows`), on Flower's Ray backend with
``init_args.num_cpus`` = the spec's CPUs and ``client_resources.num_cpus`` = 1 (Flower's advice for
small clients: as many ClientApps at a time as CPUs):

- the ServerApp runs Flower's message-API ``flwr.serverapp.strategy.FedAvg`` (1.42's name for
  the old ``fraction_fit`` is ``fraction_train``: 1.0, every client each round; no federated
  evaluation) from the spec's initial weights: first one round, a warm-up (Ray's actors start
  and import torch), then the spec's rounds again from the same initial weights — as our
  benchmark runs a one-round job before the measured one;
- each ClientApp trains ``Linear`` from the round's weights on its rows, as our
  ``TorchFilter`` does: ``torch.optim.SGD`` (lr from the spec), mse, batches of the spec's rows
  in order (8 rows a client: one step), and replies the weights with ``num-examples`` = its
  rows, so Flower's FedAvg takes the same row-weighted mean. A worker's ``.npz`` is read once in
  each Ray actor (cached), as our worker stages its dataset once a job.

A round's time is the strategy's own: from ``configure_train`` to the end of
``aggregate_train``. Written to the spec's ``out`` (JSON): Flower's and Ray's versions, the
start-up (``run_simulation`` called to the first round's ``configure_train``: Ray, its actors'
pool, the SuperNodes), the warm-up round, each measured round, the shut-down, the clients that
answered; the final weights to ``weights_out`` (``.npz``).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.federated.partition import client_rows


@dataclass(frozen=True)
class Spec:
    """What ``benchmarks.federated.flower_anchor`` asks for (the JSON file's keys)."""

    data: tuple[str, ...]  # each worker's .npz (x, y), in the order of the workers
    per_worker: int  # K: the clients of each worker
    rounds: int  # measured rounds, after one warm-up round
    lr: float
    batch: int  # rows of one SGD step
    initial: str  # .npz of the initial weights (a torch state_dict's keys)
    cpus: int  # Ray's CPUs; each ClientApp takes one
    out: str  # the JSON result
    weights_out: str  # the final weights (.npz)

    @classmethod
    def read(cls, path: Path) -> Spec:
        fields = json.loads(path.read_text())
        return cls(**{**fields, "data": tuple(fields["data"])})


@functools.cache
def worker_data(path: str) -> tuple[Any, Any]:
    """A worker's rows as torch tensors: read once in each Ray actor."""
    import torch

    with np.load(path) as f:
        return torch.as_tensor(f["x"]), torch.as_tensor(f["y"])


@functools.cache
def worker_rows(paths: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(len(worker_data(p)[0]) for p in paths)


def client_data(spec: Spec, client: int) -> tuple[Any, Any]:
    """Client ``client``'s rows: the same our virtual client ``client`` trains on."""
    worker, rows = client_rows(client, spec.per_worker, worker_rows(spec.data))
    x, y = worker_data(spec.data[worker])
    return x[rows], y[rows]


def local_training(spec: Spec, state: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """One client's epoch from ``state``: SGD over its rows in batches, mse."""
    import torch

    torch.set_num_threads(1)  # one CPU a ClientApp, as each of our workers' --threads 1
    out_features, in_features = state["weight"].shape
    model = torch.nn.Linear(in_features, out_features)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    for s in range(0, len(x), spec.batch):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s : s + spec.batch]), y[s : s + spec.batch])
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def client_app(spec: Spec) -> Any:
    """The ClientApp: :func:`local_training` on the client's partition."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        x, y = client_data(spec, int(context.node_config["partition-id"]))
        state = msg.content["arrays"].to_torch_state_dict()
        trained = local_training(spec, state, x, y)
        content = RecordDict(
            {"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": len(x)})}
        )
        return Message(content=content, reply_to=msg)

    return app


def timed_fedavg(clients: int) -> Any:
    """Flower's FedAvg over all ``clients`` each round, noting when each round starts and
    ends: ``strategy.rounds`` holds ``(start, end, replies)`` per round (``perf_counter``)."""
    from flwr.serverapp.strategy import FedAvg

    class TimedFedAvg(FedAvg):
        def __init__(self) -> None:
            super().__init__(
                fraction_train=1.0,
                fraction_evaluate=0.0,
                min_train_nodes=clients,
                min_available_nodes=clients,
            )
            self.rounds: list[tuple[float, float, int]] = []
            self._started = 0.0

        def configure_train(self, *args: Any, **kwargs: Any) -> Any:
            self._started = time.perf_counter()
            return super().configure_train(*args, **kwargs)

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            out = super().aggregate_train(server_round, replies)
            answered = sum(not r.has_error() for r in replies)
            self.rounds.append((self._started, time.perf_counter(), answered))
            return out

    return TimedFedAvg()


def server_app(spec: Spec, clients: int, outcome: dict[str, Any]) -> Any:
    """The ServerApp: a warm-up round, then the measured rounds, both from the initial
    weights; the strategy and the final weights land in ``outcome``."""
    import torch
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        with np.load(spec.initial) as f:
            initial = {k: torch.as_tensor(f[k]) for k in f.files}
        strategy = outcome["strategy"] = timed_fedavg(clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=1)
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=spec.rounds
        )
        outcome["final"] = {k: v.numpy() for k, v in result.arrays.to_torch_state_dict().items()}

    return app


def simulate(spec: Spec) -> dict[str, Any]:
    """Run the simulation; the figures (see the module docstring)."""
    import flwr
    import ray
    from flwr.simulation import run_simulation

    clients = len(spec.data) * spec.per_worker
    outcome: dict[str, Any] = {}
    backend = {
        "init_args": {"num_cpus": spec.cpus},
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    }
    called = time.perf_counter()
    run_simulation(
        server_app=server_app(spec, clients, outcome),
        client_app=client_app(spec),
        num_supernodes=clients,
        backend_config=backend,
    )
    returned = time.perf_counter()
    if "final" not in outcome:
        raise RuntimeError("Flower's ServerApp ended without final weights (see its log above)")
    rounds = outcome["strategy"].rounds
    np.savez(spec.weights_out, **outcome["final"])
    return {
        "flwr": flwr.__version__,
        "ray": ray.__version__,
        "clients": clients,
        "cpus": spec.cpus,
        "startup_s": rounds[0][0] - called,
        "warmup_round_s": rounds[0][1] - rounds[0][0],
        "rounds_s": [end - start for start, end, _ in rounds[1:]],
        "answered": [n for _, _, n in rounds[1:]],
        "shutdown_s": returned - rounds[-1][1],
        "wall_s": returned - called,
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m benchmarks.federated.flower_sim SPEC.json")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    spec = Spec.read(Path(args[0]))
    Path(spec.out).write_text(json.dumps(simulate(spec), indent=1))


if __name__ == "__main__":
    # Run under its importable name, so that Ray's actors find worker_data's cache by
    # reference instead of receiving a copy of this __main__ with every message.
    from benchmarks.federated.flower_sim import main as _main

    _main()
