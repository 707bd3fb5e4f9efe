"""The GPU check: every strategy on one device, against ``graph.fit`` on that device.

``python -m benchmarks.gpu [--device cuda] [--quick]`` trains a small graph (a centring filter,
then two TorchFilters: Linear 16-64 + ReLU, Linear 64-4; SGD with momentum, cross-entropy,
``shuffle=False``, fixed seeds) on random data:

1. ``graph.fit(device=D)``: the baseline, in this process;
2. ``sz.Local(device=D)`` on a :class:`somatize.cli.cluster.LocalCluster` whose 2 workers run
   ``somatize-worker --device D``;
3. ``sz.FedAvg(device=D)``, against the same FedAvg job on 2 workers with ``--device cpu``
   (FedAvg does not train what ``graph.fit`` trains; the device must not change it);
4. ``sz.DataParallel(2, device=D)`` with each collective (``torch``: gloo over CUDA tensors,
   since NCCL takes no two ranks on one GPU; ``coordinator``): both workers on the one device;
   and ``sz.DataParallel(2, sharding="full")`` (FSDP2) on the torch collective;
5. ``sz.ModelParallel`` with 2 partitions (one per worker, device D);
6. a DataParallel step of each collective (the time between the job's ``training`` events over
   the steps between them, after warm-up) against one step of a plain torch loop (the same
   modules, batch and optimizer) on D: a ratio, shown.

(2), (4) and (5) are compared with (1): the largest absolute difference of every state tensor,
at most :data:`TOLERANCE`. A table is printed (check, max |diff|, tolerance, ok, seconds); the
exit status is 1 when a check fails. Where ``--device`` is a CUDA device and CUDA is not
available, one line says so and nothing is checked (exit status 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import somatize as sz
from engine.devices import resolve_device
from somatize.cli.cluster import LocalCluster
from worker.confinement.sandbox import LEVELS

TOLERANCE = 1e-4
SEED = 0
FEATURES, HIDDEN, CLASSES = 16, 64, 4
BATCH = 32
WARMUP = 2
TIMEOUT = 300.0


@dataclass
class Check:
    name: str
    value: float | None  # max |diff|, or the ratio of a timing row
    tolerance: str
    ok: bool
    seconds: float
    note: str = ""


@dataclass
class Sizes:
    rows: int
    epochs: int
    rounds: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        return cls(rows=256, epochs=2, rounds=2) if quick else cls(rows=2048, epochs=3, rounds=3)


class Center(sz.Filter):
    """Subtract the column means (a plain filter: its state averages exactly over shards)."""

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        return {"mean": np.asarray(x, dtype=np.float32).mean(0)}

    def forward(self, x: Any, state: Any) -> Any:
        return np.asarray(x, dtype=np.float32) - state["mean"]


SETTINGS: dict[str, Any] = {"optimizer": "sgd", "lr": 0.05, "optimizer_options": {"momentum": 0.9}}


def modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(SEED)
    hidden = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU())
    return hidden, torch.nn.Linear(HIDDEN, CLASSES)


def make_graph(epochs: int) -> sz.Graph:
    """Center >> hidden >> head, seeded: the same initial weights every call."""
    hidden, head = modules()
    last: dict[str, Any] = {"batch_size": BATCH, "epochs": epochs, "shuffle": False, "seed": SEED}
    return (
        Center().named("center")
        >> sz.TorchFilter(hidden, **SETTINGS).named("hidden")
        >> sz.TorchFilter(head, loss="cross_entropy", **last, **SETTINGS).named("head")
    )


def make_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(rows, FEATURES, generator=g) * 2 + 1
    y = torch.randint(0, CLASSES, (rows,), generator=g)
    return x.numpy(), y.numpy()


def leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from leaves(value, f"{prefix}.{key}")
    else:
        yield prefix, state


def max_diff(a: sz.FittedGraph, b: sz.FittedGraph) -> float:
    """The largest absolute difference of any state tensor of ``a`` and ``b`` (inf when their
    states do not have the same keys or shapes)."""
    worst = 0.0
    for node_id in a.graph.node_ids:
        left, right = dict(leaves(a.states[node_id])), dict(leaves(b.states[node_id]))
        if sorted(left) != sorted(right):
            return float("inf")
        for key, value in left.items():
            u = torch.as_tensor(np.asarray(value)).double()
            v = torch.as_tensor(np.asarray(right[key])).double()
            if u.shape != v.shape:
                return float("inf")
            if u.numel():
                worst = max(worst, float((u - v).abs().max()))
    return worst


def submit(
    client: sz.Client, sizes: Sizes, x: np.ndarray, y: np.ndarray, strategy: sz.Strategy
) -> tuple[sz.FittedGraph, list[tuple[float, float]], float]:
    """Run one job; returns its fitted graph, the ``(time, steps done)`` of its ``training``
    events (one a step, or one a chunk of steps on the torch collective) and its wall time."""
    started = time.perf_counter()
    job = client.submit(make_graph(sizes.epochs), x, y, strategy=strategy)
    stamps, end = [], None
    for event in job.events(timeout=TIMEOUT):
        if event.event == "progress" and event.data.get("phase") == "training":
            stamps.append((event.time, float(event.data.get("step", len(stamps) + 1))))
        end = event
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the {strategy.name} job did not succeed: {end}")
    fitted = job.result(timeout=TIMEOUT)
    return fitted, stamps, time.perf_counter() - started


def compared(name: str, fitted: sz.FittedGraph, reference: sz.FittedGraph, took: float) -> Check:
    diff = max_diff(fitted, reference)
    return Check(name, diff, f"<= {TOLERANCE:g}", diff <= TOLERANCE, took)


def torch_step_ms(device: str, x: np.ndarray, y: np.ndarray, steps: int) -> float:
    """The median step of a plain torch loop (the graph's modules, batch and SGD) on ``device``,
    without the first :data:`WARMUP` steps."""
    hidden, head = modules()
    model = torch.nn.Sequential(hidden, head).to(device)
    options = SETTINGS["optimizer_options"]
    optimizer = torch.optim.SGD(model.parameters(), lr=SETTINGS["lr"], **options)
    xs = torch.as_tensor(x - x.mean(0)).to(device)
    ys = torch.as_tensor(y).to(device)
    durations = []
    for step in range(WARMUP + steps):
        lo = (step * BATCH) % max(1, len(xs) - BATCH + 1)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[lo : lo + BATCH]), ys[lo : lo + BATCH])
        loss.backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if step >= WARMUP:
            durations.append(time.perf_counter() - started)
    return statistics.median(durations) * 1e3


def step_check(
    name: str, device: str, x: np.ndarray, y: np.ndarray, stamps: list[tuple[float, float]]
) -> Check:
    """Our step (time over steps between the training events after warm-up) against a plain
    torch loop's on ``device``."""
    started = time.perf_counter()
    later = [(t, s) for t, s in stamps if s > WARMUP]
    if len(later) < 2 or later[-1][1] <= later[0][1]:
        return Check(f"{name} step / torch step", None, "shown", False, 0.0, "no steps")
    ours = (later[-1][0] - later[0][0]) / (later[-1][1] - later[0][1]) * 1e3
    steps = int(later[-1][1] - later[0][1])
    anchor = torch_step_ms(device, x, y, max(10, steps))
    note = f"{ours:.1f} ms vs {anchor:.2f} ms"
    took = time.perf_counter() - started
    return Check(f"{name} step / torch step", ours / anchor, "shown", True, took, note)


def cluster_checks(
    device: str,
    sizes: Sizes,
    x: np.ndarray,
    y: np.ndarray,
    reference: sz.FittedGraph,
    sandbox: str = "auto",
) -> list[Check]:
    """Checks (2)-(6) on a LocalCluster: 2 workers on ``device`` (and 2 on the cpu for the
    FedAvg reference, unless ``device`` is the cpu)."""
    checks = []
    beats = {"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0}
    with LocalCluster(**beats, job_threads=1, sandbox=sandbox) as c:
        try:
            c.start_coordinator()
            for i in (1, 2):
                c.start_worker(f"dev-{i}", threads=1, device=device)
            if device != "cpu":
                for i in (1, 2):
                    c.start_worker(f"cpu-{i}", threads=1, device="cpu")
            with sz.connect(c.url, timeout=60) as client:
                fitted, _, took = submit(client, sizes, x, y, sz.Local(device=device))
                checks.append(compared("Local vs graph.fit", fitted, reference, took))
                fed: dict[str, Any] = {"rounds": sizes.rounds, "local_epochs": 1, "workers": 2}
                ours, _, took = submit(client, sizes, x, y, sz.FedAvg(**fed, device=device))
                cpu, _, took_cpu = submit(client, sizes, x, y, sz.FedAvg(**fed, device="cpu"))
                checks.append(compared("FedAvg vs FedAvg on cpu", ours, cpu, took + took_cpu))
                timed = []
                for collective in ("torch", "coordinator"):
                    strategy: sz.Strategy = sz.DataParallel(2, device=device, collective=collective)
                    name = f"DataParallel(2, collective={collective!r})"
                    fitted, stamps, took = submit(client, sizes, x, y, strategy)
                    checks.append(compared(f"{name} vs graph.fit", fitted, reference, took))
                    timed.append((name, stamps))
                sharded = sz.DataParallel(2, device=device, collective="torch", sharding="full")
                fitted, _, took = submit(client, sizes, x, y, sharded)
                name = "DataParallel(2, sharding='full') vs graph.fit"
                checks.append(compared(name, fitted, reference, took))
                stages = [
                    sz.Partition(["center", "hidden"], worker="dev-1"),
                    sz.Partition(["head"], worker="dev-2"),
                ]
                strategy = sz.ModelParallel(stages, micro_batches=2, device=device)
                fitted, _, took = submit(client, sizes, x, y, strategy)
                checks.append(compared("ModelParallel(2) vs graph.fit", fitted, reference, took))
                checks += [step_check(name, device, x, y, stamps) for name, stamps in timed]
        except Exception:
            c.print_log_tails()
            raise
    return checks


def run(device: str, quick: bool = False, sandbox: str = "auto") -> list[Check]:
    """Every check on ``device`` (a resolved device), the workers' job code run in
    ``sandbox``."""
    sizes = Sizes.of(quick)
    x, y = make_data(sizes.rows)
    started = time.perf_counter()
    reference = make_graph(sizes.epochs).fit(x, y, device=device)
    baseline = Check("graph.fit (baseline)", 0.0, "-", True, time.perf_counter() - started)
    return [baseline, *cluster_checks(device, sizes, x, y, reference, sandbox)]


def print_table(checks: list[Check]) -> None:
    print(f"{'check':34} {'max |diff|':>12} {'tolerance':>10} {'ok':>4} {'seconds':>8}")
    for check in checks:
        if check.value is None:
            value = "-"
        elif check.tolerance == "shown":
            value = f"{check.value:.1f} x"
        else:
            value = f"{check.value:.2e}"
        ok = "ok" if check.ok else "FAIL"
        line = f"{check.name:34} {value:>12} {check.tolerance:>10} {ok:>4} {check.seconds:8.1f}"
        print(f"{line}  {check.note}".rstrip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny data, 2 epochs")
    parser.add_argument(
        "--sandbox",
        default="auto",
        choices=LEVELS,
        help="the workers' --sandbox (default auto: bubblewrap where it is installed)",
    )
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        if not str(args.device).strip().lower().startswith("cuda"):
            parser.error(str(exc))
        print(f"no CUDA device here: {exc}; nothing checked")
        return 0
    sizes = Sizes.of(args.quick)
    print(
        f"GPU check on {device}: {sizes.rows} rows, batch {BATCH}, {sizes.epochs} epochs, "
        f"FedAvg {sizes.rounds} rounds; state tensors within {TOLERANCE:g} of the reference"
    )
    checks = run(device, args.quick, args.sandbox)
    print_table(checks)
    failed = [check.name for check in checks if not check.ok]
    print(f"failed: {', '.join(failed)}" if failed else "every check ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
