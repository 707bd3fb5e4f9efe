"""FedAvg at many clients, against Flower's simulation engine; what secure aggregation and
differential privacy cost a round.

``python -m benchmarks.federated [--clients N] [--rounds R] [--quick] [--json PATH]
[--flower-python PATH]`` starts one :class:`somatize.cli.cluster.LocalCluster`: a real coordinator
and :data:`WORKERS` = 2 ``somatize-worker --threads 1 --spare-daemon off``, each serving a
dataset ``fl`` of its own (an ``.npz`` of ``K ×`` :data:`ROWS` rows, :data:`DIM` features, a
linear target). Every job trains the small model ``Linear(DIM, 2)`` (mse, SGD lr :data:`LR`,
batch :data:`ROWS`: one step per client and epoch) with ``sz.FedAvg(rounds=R,
clients_per_worker=K)``, K = N / 2: each worker trains its K virtual clients in turn, client
``i·K + j`` on the ``j``-th contiguous part of worker ``i``'s rows
(:func:`benchmarks.federated.partition.client_rows`). The time of a round is the
coordinator's, from its events: the ``staged`` event to the first ``round`` event, then
``round`` to ``round``; the median over the R rounds, each cluster's first job (one round) a
warm-up. Measured:

- *a round of N clients* (default 1,000) — against two anchors:

  - the same N local trainings (a fresh ``torch.optim.SGD`` from w_t each, the same batches)
    and their row-weighted mean in a plain loop in this process: the floor of the work, with
    no process, wire or coordinator;
  - Flower's simulation engine (``flwr[simulation]`` 1.42, Ray) on the same clients, data
    files, initial weights and training, in the same run (:mod:`benchmarks.federated.flower_sim`:
    its FedAvg over all N clients, one ClientApp per CPU; the median of its R rounds after a warm-up
    round; Ray's start-up reported apart). It runs in Flower's own virtualenv, never this one (Ray
    would move the pins of ``rich`` and ``pycryptodome``): make it with ``make flower-env``
    (``benchmarks/federated/flower_env.sh``), then pass ``--flower-python .flower-venv/bin/python``
    or set ``SOMATIZE_FLOWER_PYTHON``. Without it the row says how, and is not measured. With it,
    the final weights of both must agree within :data:`benchmarks.federated.flower_anchor.TOLERANCE`
    (the same data, initial weights and steps; only the order and precision of the sums differ): the
    row shows the largest difference and fails (MISSED, exit status 1) past it.

- *secure aggregation* — ``secure_aggregation=sz.SecAgg()`` (k = 16 neighbours) against the
  same job without, at 10 and 100 clients: the overhead per round (keys, sealed shares, masks,
  unmasking).
- *differential privacy* — ``privacy=sz.FixedClipping(1.0, 1.0)`` and
  ``sz.AdaptiveClipping(1.0, count_stddev=...)`` against the same job without, at 100 clients.

``--quick`` (a smoke run): 100 clients for the big round, 10 for the others, one round each.
Every process is stopped at the end; on a failure the logs' tails are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import somatize as sz
from benchmarks.federated import flower_anchor
from benchmarks.federated.partition import client_rows
from benchmarks.report import Row, Target
from somatize.cli.cluster import LocalCluster

WORKERS = 2
DIM = 20
ROWS = 8
LR = 0.05
SEED = 0


def datasets(directory: Path, clients: int) -> dict[str, Path]:
    """Each worker's ``fl`` dataset: ``clients / WORKERS × ROWS`` rows of a linear target."""
    rng = np.random.default_rng(SEED)
    w = rng.normal(size=(DIM, 2))
    paths = {}
    for i in range(WORKERS):
        x = rng.normal(size=(clients // WORKERS * ROWS, DIM)).astype(np.float32)
        y = (x @ w + 0.1 * rng.normal(size=(len(x), 2))).astype(np.float32)
        paths[f"w{i}"] = directory / f"w{i}.npz"
        np.savez(paths[f"w{i}"], x=x, y=y)
    return paths


def net() -> sz.TorchFilter:
    torch.manual_seed(SEED)
    return sz.TorchFilter(
        torch.nn.Linear(DIM, 2),
        loss="mse",
        optimizer="sgd",
        lr=LR,
        batch_size=ROWS,
        epochs=1,
        shuffle=False,
    )


def graph() -> sz.Graph:
    return sz.Graph([net().named("lin")])


@contextlib.contextmanager
def cluster(directory: Path, clients: int) -> Iterator[LocalCluster]:
    """The coordinator and its :data:`WORKERS` workers, each serving its ``fl`` dataset."""
    paths = datasets(directory, clients)
    with LocalCluster(heartbeat_interval=1.0, heartbeat_timeout=60.0, job_threads=1) as c:
        try:
            c.start_coordinator()
            for worker_id, path in paths.items():
                c.start_worker(
                    worker_id, threads=1, data={"fl": path}, args=("--spare-daemon", "off")
                )
            run_job(c, clients, 1)  # warm-up, not measured: first imports, first allocations
            yield c
        except Exception:
            c.print_log_tails()
            raise


def round_seconds(events: Sequence[sz.JobEventInfo]) -> list[float]:
    """Each round's time, from the coordinator's events: ``staged`` to the first ``round``,
    then ``round`` to ``round``."""
    marks = [
        e.time
        for e in events
        if e.event == "progress" and e.data.get("phase") in ("staged", "round")
    ]
    return [b - a for a, b in itertools.pairwise(marks)]


def run_job(c: LocalCluster, clients: int, rounds: int, **options: Any) -> dict[str, Any]:
    """One FedAvg job over the cluster's workers, ``clients / WORKERS`` clients each."""
    strategy = sz.FedAvg(
        rounds=rounds, min_workers=WORKERS, clients_per_worker=clients // WORKERS, **options
    )
    with c.client() as client:
        job = client.submit(graph(), sz.WorkerData("fl"), strategy=strategy)
        started = time.perf_counter()
        fitted = job.result(timeout=1800)
        wall = time.perf_counter() - started
        events = list(job.events(timeout=60))
    seconds = round_seconds(events)
    last = [e.data for e in events if e.data.get("phase") == "round"][-1]
    return {
        "round_s": statistics.median(seconds),
        "rounds_s": seconds,
        "wall_s": wall,
        "clients": len(last["workers"]),
        "privacy": last.get("privacy"),
        "weights": {k: np.asarray(v) for k, v in fitted.states["lin"].items()},
    }


def anchor_round(directory: Path, clients: int) -> float:
    """The same round in a plain loop here: each client's SGD from w_t on its rows, then the
    row-weighted mean; seconds."""
    data = []
    for i in range(WORKERS):
        with np.load(directory / f"w{i}.npz") as f:
            data.append((torch.as_tensor(f["x"]), torch.as_tensor(f["y"])))
    parts = []
    for client in range(clients):
        worker, part = client_rows(client, clients // WORKERS, [len(x) for x, _ in data])
        parts.append((data[worker][0][part], data[worker][1][part]))
    start = {k: v.clone() for k, v in net().module.state_dict().items()}
    model = torch.nn.Linear(DIM, 2)
    torch.set_num_threads(1)  # as each worker's daemon (--threads 1)
    warm = torch.optim.SGD(model.parameters(), lr=LR)  # autograd's first call, not timed
    torch.nn.functional.mse_loss(model(parts[0][0]), parts[0][1]).backward()
    warm.step()
    started = time.perf_counter()
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in start.items()}
    for xk, yk in parts:
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(0, len(xk), ROWS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xk[s : s + ROWS]), yk[s : s + ROWS]).backward()
            opt.step()
        for k, v in model.state_dict().items():
            total[k] += len(xk) * v.double()
    rows = sum(len(xk) for xk, _ in parts)
    mean = {k: (v / rows).float() for k, v in total.items()}
    seconds = time.perf_counter() - started
    assert set(mean) == set(start)
    return seconds


def flower_round(
    python: Path, directory: Path, clients: int, rounds: int, ours: dict[str, Any]
) -> dict[str, Any]:
    """Flower's simulation of the big round on its data files (``w*.npz`` in ``directory``),
    from the same initial weights; its figures, and ``max_diff``: the largest difference of
    its final weights from ``ours`` (the big job's)."""
    initial = {k: v.numpy() for k, v in net().module.state_dict().items()}
    figures, final = flower_anchor.run_flower(
        python,
        directory / "flower",
        [directory / f"w{i}.npz" for i in range(WORKERS)],
        clients // WORKERS,
        rounds,
        initial,
        lr=LR,
        batch=ROWS,
        cpus=WORKERS,
    )
    figures["max_diff"] = flower_anchor.largest_difference(ours, final)
    return figures


def run(
    clients: int = 1000,
    rounds: int = 3,
    quick: bool = False,
    flower_python: str | Path | None = None,
) -> dict[str, Any]:
    """Every measurement (see the module docstring). ``flower_python``: Flower's virtualenv's
    Python (default: ``$SOMATIZE_FLOWER_PYTHON``; neither: Flower's row is not measured)."""
    flower = flower_anchor.flower_python(flower_python)
    small = 10 if quick else 100
    sizes = {"big": 100 if quick else clients, "secagg": (10,) if quick else (10, 100)}
    rounds = 1 if quick else rounds
    results: dict[str, Any] = {"rounds": rounds, "quick": quick}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="somatize-fl-") as tmp:
        # The big round: its own cluster, datasets of its size.
        big = Path(tmp) / "big"
        big.mkdir()
        with cluster(big, sizes["big"]) as c:
            results["big"] = run_job(c, sizes["big"], rounds)
        results["big"]["anchor_s"] = anchor_round(big, sizes["big"])
        ours = results["big"].pop("weights")
        results["flower"] = None
        if flower is not None:
            results["flower"] = flower_round(flower, big, sizes["big"], rounds, ours)
        # Secure aggregation and privacy against the same job without.
        for n in sorted({*sizes["secagg"], small}):
            where = Path(tmp) / f"n{n}"
            where.mkdir()
            with cluster(where, n) as c:
                plain = run_job(c, n, rounds)
                results[f"plain_{n}"] = plain
                if n in sizes["secagg"]:
                    results[f"secagg_{n}"] = run_job(c, n, rounds, secure_aggregation=sz.SecAgg())
                if n == small:
                    results[f"dp_fixed_{n}"] = run_job(
                        c, n, rounds, privacy=sz.FixedClipping(clip_norm=1.0, noise_multiplier=1.0)
                    )
                    adaptive = sz.AdaptiveClipping(noise_multiplier=1.0, count_stddev=n / 2)
                    results[f"dp_adaptive_{n}"] = run_job(c, n, rounds, privacy=adaptive)
    results["sizes"] = {"big": sizes["big"], "secagg": list(sizes["secagg"]), "dp": small}
    results["wall_s"] = time.perf_counter() - started
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """A round of many clients against the plain loop; secure aggregation and privacy against
    the same round without."""
    bench, sizes = "federated", results["sizes"]
    big = results["big"]
    out = [
        Row(
            bench,
            f"FedAvg round, {sizes['big']:,} clients on {WORKERS} workers",
            big["round_s"],
            "s",
            big["anchor_s"],
            "the same trainings and mean in one loop",
            note=f"{big['clients']:,} clients answered",
        ),
        *flower_rows(results),
    ]
    for n in sizes["secagg"]:
        out.append(
            Row(
                bench,
                f"FedAvg round with SecAgg, {n} clients",
                results[f"secagg_{n}"]["round_s"],
                "s",
                results[f"plain_{n}"]["round_s"],
                "the same round without",
            )
        )
    n = sizes["dp"]
    for kind in ("fixed", "adaptive"):
        job = results[f"dp_{kind}_{n}"]
        out.append(
            Row(
                bench,
                f"FedAvg round with DP ({kind} clipping), {n} clients",
                job["round_s"],
                "s",
                results[f"plain_{n}"]["round_s"],
                "the same round without",
                note=f"ε {job['privacy']['epsilon']:.3g} at δ {job['privacy']['delta']:g}",
            )
        )
    return out


def flower_rows(results: dict[str, Any]) -> list[Row]:
    """The big round against Flower's simulation of it, and whether both trained the same
    weights; without Flower's figures, one row that says how to get them."""
    big, flower = results["big"], results.get("flower")
    name = f"FedAvg round, {results['sizes']['big']:,} clients, vs Flower simulation"
    ours = functools.partial(Row, "federated", name, big["round_s"], "s")
    if flower is None:
        return [ours(None, "Flower simulation", note=flower_anchor.HOW_TO)]
    tolerance = flower_anchor.TOLERANCE
    return [
        ours(
            flower["round_s"],
            f"Flower {flower['flwr']} simulation (Ray {flower['ray']}, {flower['cpus']} CPUs)",
            note=(
                f"{min(flower['answered']):,} clients answered; Flower's start-up "
                f"{flower['startup_s']:.1f} s, warm-up round {flower['warmup_round_s']:.1f} s"
            ),
        ),
        Row(
            "federated",
            "final weights, ours vs Flower's: max |Δ|",
            flower["max_diff"],
            "",
            target=Target("<=", tolerance, on="ours", text=f"≤ {tolerance:g}"),
            note="same data, initial weights and steps",
        ),
    ]


def flower_disagrees(results: dict[str, Any]) -> bool:
    """Whether Flower's simulation trained other weights than ours (past the tolerance)."""
    flower = results.get("flower")
    return flower is not None and not flower["max_diff"] <= flower_anchor.TOLERANCE


def report(results: dict[str, Any]) -> None:
    print(
        f"FedAvg on {WORKERS} workers, Linear({DIM}, 2), {ROWS} rows a client, one step a "
        f"client; medians of {results['rounds']} round(s); the run took {results['wall_s']:.0f} s"
    )
    for row in rows(results):
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        anchor = row.anchor_name + (f": {row.anchor:.3f} s" if row.anchor is not None else "")
        if row.target is not None:
            anchor = f"{row.target.describe()}: {'met' if row.met else 'MISSED'}"
        ours = f"{row.ours:9.3f} s" if row.unit == "s" else f"{row.ours:11.2g}"
        print(f"  {row.name:56} {ours}   {anchor}  {ratio}  {row.note}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.federated", description=__doc__)
    parser.add_argument("--clients", type=int, default=1000, help="the big round's clients")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each job")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--flower-python",
        type=Path,
        help=f"the Python of Flower's virtualenv (make flower-env), for the Flower row "
        f"(default: ${flower_anchor.PYTHON_ENV})",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    results = run(
        clients=args.clients, rounds=args.rounds, quick=args.quick, flower_python=args.flower_python
    )
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if flower_disagrees(results):
        diff = results["flower"]["max_diff"]
        raise SystemExit(
            f"Flower's simulation trained other weights: max |Δ| {diff:.3g} > "
            f"{flower_anchor.TOLERANCE:g} (see the row above)"
        )
