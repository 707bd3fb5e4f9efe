"""FedAvg at many clients, and what secure aggregation and differential privacy cost a round.

``python -m benchmarks.federated [--clients N] [--rounds R] [--quick] [--json PATH]`` starts one
:class:`somatize.cluster.LocalCluster`: a real coordinator and :data:`WORKERS` = 2
``somatize-worker --threads 1 --spare-daemon off``, each serving a dataset ``fl`` of its own
(an ``.npz`` of ``K ×`` :data:`ROWS` rows, :data:`DIM` features, a linear target). Every job
trains the small model ``Linear(DIM, 2)`` (mse, SGD lr :data:`LR`, batch :data:`ROWS`: one step
per client and epoch) with ``sz.FedAvg(rounds=R, clients_per_worker=K)``, K = N / 2: each
worker trains its K virtual clients in turn. The time of a round is the coordinator's, from
its events: the ``staged`` event to the first ``round`` event, then ``round`` to ``round``;
the median over the R rounds, each cluster's first job (one round) a warm-up. Measured:

- *a round of N clients* (default 1,000) — against the anchor, the same N local trainings
  (a fresh ``torch.optim.SGD`` from w_t each, the same batches) and their row-weighted mean
  in a plain loop in this process: the floor of the work, with no process, wire or
  coordinator. Flower's simulation engine (``flwr[simulation]``) is not the anchor here: it
  installs ``ray`` and would move this environment's pins of ``rich`` and ``pycryptodome``;
  the lead can run it in an environment of its own on the same data.
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
from benchmarks.report import Row
from somatize.cluster import LocalCluster

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
        job.result(timeout=1800)
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
    }


def anchor_round(directory: Path, clients: int) -> float:
    """The same round in a plain loop here: each client's SGD from w_t on its rows, then the
    row-weighted mean; seconds."""
    parts = []
    for i in range(WORKERS):
        with np.load(directory / f"w{i}.npz") as f:
            x, y = torch.as_tensor(f["x"]), torch.as_tensor(f["y"])
        for rows in np.array_split(np.arange(len(x)), clients // WORKERS):
            parts.append((x[rows], y[rows]))
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


def run(clients: int = 1000, rounds: int = 3, quick: bool = False) -> dict[str, Any]:
    """Every measurement (see the module docstring)."""
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
        )
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


def report(results: dict[str, Any]) -> None:
    print(
        f"FedAvg on {WORKERS} workers, Linear({DIM}, 2), {ROWS} rows a client, one step a "
        f"client; medians of {results['rounds']} round(s); the run took {results['wall_s']:.0f} s"
    )
    for row in rows(results):
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        anchor = f"{row.anchor_name}: {row.anchor or 0:.3f} s"
        print(f"  {row.name:52} {row.ours:9.3f} s   {anchor}  {ratio}  {row.note}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.federated", description=__doc__)
    parser.add_argument("--clients", type=int, default=1000, help="the big round's clients")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each job")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    results = run(clients=args.clients, rounds=args.rounds, quick=args.quick)
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
