"""Your own model, three ways: ``examples/char_lm_job.py`` (a character-level transformer LM on
the standard library's sources, written as a user writes one) trained in one process, with
``sz.DataParallel(2)`` on two local workers, and with torch DDP as ``torchrun`` runs it.

``python -m benchmarks.own_model [--rows R] [--write]`` loads the job file as ``somatize submit``
does (:func:`somatize.job_files.load_job_file`, ``CHAR_LM_ROWS`` = R training windows, default
the file's 8,192; 1,024 validation windows) and trains it for its one epoch (batches of 64 rows,
AdamW at 3e-3, a cosine schedule over the run, gradients clipped to 1.0, the rows shuffled by
the filter's seed):

- *plain loop*: a plain torch loop written here, in this process with 2 threads (the machine);
- *ours*: a :class:`somatize.cluster.LocalCluster` (a real coordinator and 2 real workers,
  ``--threads 1`` each) runs the job file's graph with ``sz.DataParallel(2, collective="torch",
  checkpoint_every=0)`` and its validation data; the time is the client's, submit to result;
- *anchor*: ``DistributedDataParallel`` over gloo in 2 processes of 1 thread each, started as
  ``torchrun`` starts them (spawned, each importing torch and building the model), each
  training on its half of every global batch; the time is from the spawn to the last one's end.

Each reports its wall time and its validation loss at the end (every one evaluates the same
windows the same way; ours in its job's history): the three losses agree to float rounding (the
same batches, the same steps), and the target is ours ≤ 1.1 × the anchor's time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import somatize as sz
from benchmarks.report import Row, Target, machine, now, with_section
from somatize.cluster import LocalCluster
from somatize.job_files import JobFile, load_job_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "char_lm_job.py"
DOCUMENT = ROOT / "docs" / "benchmarks.md"
TARGET = 1.1
"""Ours must take at most this many times the DDP anchor's wall time."""


def load(rows: int | None) -> JobFile:
    """The job file, with ``rows`` training windows (default: its own)."""
    if rows is not None:
        os.environ["CHAR_LM_ROWS"] = str(rows)
    return load_job_file(str(EXAMPLE))


def settings(spec: JobFile) -> dict[str, Any]:
    """What the job file's TorchFilter trains with."""
    (net,) = (f for _, f in spec.graph.items())
    return {
        "lr": net.lr,
        "batch": net.batch_size,
        "epochs": net.epochs,
        "seed": net.seed,
        "clip": net.clip_grad_norm,
    }


def plan(rows: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The global batches: one seeded permutation an epoch, cut in order (the batching rule)."""
    order = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(rows, generator=order)
        out += [perm[s : s + batch] for s in range(0, rows, batch)]
    return out


@torch.no_grad()
def validation_loss(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch: int) -> float:
    """The mean token cross-entropy over the validation windows, ``batch`` rows at a time."""
    model.eval()
    total = 0.0
    for s in range(0, len(x), batch):
        logits = model(torch.from_numpy(x[s : s + batch]))
        target = torch.from_numpy(y[s : s + batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        total += float(loss) * len(target)
    return total / len(x)


def train_steps(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: list[torch.Tensor],
    config: dict[str, Any],
    part: tuple[int, int] = (0, 1),
) -> None:
    """AdamW, the cosine schedule over every step and clipping, on ``batches``; with ``part``
    ``(rank, world)`` each step takes that replica's slice of its batch (``np.array_split``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(batches))
    rank, world = part
    model.train()
    for rows in batches:
        mine = torch.from_numpy(np.array_split(rows.numpy(), world)[rank])
        logits = model(x[mine])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[mine].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"])
        opt.step()
        schedule.step()


def run_plain(spec: JobFile, config: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(2)
    started = time.perf_counter()
    model = _example()["make_model"]()
    x, y = torch.from_numpy(spec.x), torch.from_numpy(spec.y)
    batches = plan(len(x), config["batch"], config["epochs"], config["seed"])
    train_steps(model, x, y, batches, config)
    x_val, y_val = spec.validation
    loss = validation_loss(model, x_val, y_val, config["batch"])
    return {"wall_s": time.perf_counter() - started, "val_loss": loss}


def _example() -> dict[str, Any]:
    import runpy

    return runpy.run_path(str(EXAMPLE), run_name="benchmark")


def _ddp_rank(rank: int, port: int, rows: int, out: str) -> None:
    """One DDP process, as ``torchrun`` would start it."""
    os.environ["CHAR_LM_ROWS"] = str(rows)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = load_job_file(str(EXAMPLE))
    config = settings(spec)
    model = torch.nn.parallel.DistributedDataParallel(_example()["make_model"]())
    x, y = torch.from_numpy(spec.x), torch.from_numpy(spec.y)
    batches = plan(len(x), config["batch"], config["epochs"], config["seed"])
    train_steps(model, x, y, batches, config, (rank, 2))
    if rank == 0:
        x_val, y_val = spec.validation
        loss = validation_loss(model.module, x_val, y_val, config["batch"])
        Path(out).write_text(json.dumps({"val_loss": loss}))
    dist.destroy_process_group()


def run_ddp(rows: int, scratch: Path) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = scratch / "ddp.json"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started = time.perf_counter()
    mp.spawn(_ddp_rank, args=(port, rows, str(out)), nprocs=2, join=True)
    wall = time.perf_counter() - started
    return {"wall_s": wall, **json.loads(out.read_text())}


def run_ours(spec: JobFile) -> dict[str, float]:
    with LocalCluster(job_threads=1, heartbeat_interval=1.0, heartbeat_timeout=30.0) as c:
        c.start_coordinator()
        for worker in ("w1", "w2"):
            c.start_worker(worker, threads=1)
        with sz.connect(c.url, timeout=60) as client:
            started = time.perf_counter()
            strategy = sz.DataParallel(2, collective="torch", checkpoint_every=0)
            job = client.submit(spec.graph, spec.x, spec.y, strategy, spec.validation)
            fitted = job.result(timeout=3600)
            wall = time.perf_counter() - started
    return {"wall_s": wall, "val_loss": float(fitted.history[-1]["val_loss"])}


def run(rows: int | None = None) -> dict[str, Any]:
    """Each way once, in order: plain loop, ours, DDP."""
    import tempfile

    spec = load(rows)
    config = settings(spec)
    results: dict[str, Any] = {"rows": len(spec.x), "config": config}
    results["plain"] = run_plain(spec, config)
    results["ours"] = run_ours(spec)
    with tempfile.TemporaryDirectory() as scratch:
        results["ddp"] = run_ddp(len(spec.x), Path(scratch))
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    ours, ddp, plain = results["ours"], results["ddp"], results["plain"]
    n = results["rows"]
    return [
        Row(
            bench="own-model",
            name=f"char LM (examples/char_lm_job.py), {n} windows, DataParallel(2)",
            ours=ours["wall_s"],
            unit="s",
            anchor=ddp["wall_s"],
            anchor_name="torchrun-style DDP, 2 processes",
            target=Target("<=", TARGET, text=f"<= {TARGET:g} x DDP"),
            note=(
                f"val loss {ours['val_loss']:.4f} (DDP {ddp['val_loss']:.4f}, one process "
                f"{plain['val_loss']:.4f} in {plain['wall_s']:.0f} s)"
            ),
        )
    ]


def table(results: dict[str, Any]) -> str:
    """The three ways as a markdown table."""
    lines = ["| way | wall time | validation loss |", "|---|---:|---:|"]
    for key, what in (
        ("plain", "plain single-process loop (2 threads)"),
        ("ours", "ours, `sz.DataParallel(2)` on 2 workers (`--threads 1`)"),
        ("ddp", "torch DDP, 2 processes as torchrun starts them"),
    ):
        r = results[key]
        lines.append(f"| {what} | {r['wall_s']:.1f} s | {r['val_loss']:.5f} |")
    ratio = results["ours"]["wall_s"] / results["ddp"]["wall_s"]
    lines.append("")
    lines.append(f"Ours ÷ DDP: **{ratio:.3f}×** (target ≤ {TARGET:g}×).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, help="training windows (default: the job file's)")
    p.add_argument("--write", action="store_true", help="into docs/benchmarks.md, its section")
    args = p.parse_args(argv)
    started = time.time()
    results = run(args.rows)
    text = table(results)
    print(text)
    for row in rows(results):
        print(f"{row.name}: {row.ours:.1f} s vs {row.anchor:.1f} s, met: {row.met}")
    print(f"({time.time() - started:.0f} s in all)")
    if args.write:
        command = "python -m benchmarks.own_model" + (f" --rows {args.rows}" if args.rows else "")
        body = (
            f"Written by `{command} --write` ({now()}, {machine()['cpu']}, "
            f"{machine()['cores']} cores): `examples/char_lm_job.py`, {results['rows']} "
            "training windows of 128 bytes, one epoch.\n\n" + text + "\n"
        )
        DOCUMENT.write_text(with_section(DOCUMENT.read_text(), "own_model", body))
        print(f"wrote its section of {DOCUMENT}")


if __name__ == "__main__":
    main()
