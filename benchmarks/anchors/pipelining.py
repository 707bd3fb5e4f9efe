"""The anchor of :mod:`benchmarks.pipeline`: ``torch.distributed.pipelining`` on gloo.

:func:`run_anchor` trains an MLP split in 2 stages as ``sz.ModelParallel`` splits it (stage 0
the first ``Linear`` + ``ReLU``, stage 1 the rest) in 2 spawned processes (1 thread each), one
stage each: a :class:`torch.distributed.TCPStore` on ``127.0.0.1`` (rank 0 hosts it),
``init_process_group("gloo")`` with ``GLOO_SOCKET_IFNAME=lo``, a
:class:`~torch.distributed.pipelining.PipelineStage` per process, and
:class:`~torch.distributed.pipelining.ScheduleGPipe` or
:class:`~torch.distributed.pipelining.Schedule1F1B` with ``M`` micro-batches and
``F.cross_entropy`` as its loss (gradients scaled by ``1 / M``, its default, so a step equals
one step on the whole global batch, as ours does). Each stage has its own SGD (lr as asked) and
steps it once per global batch, after ``schedule.step``. Rank 0 records the end time of every
global batch (after a barrier that both ranks pass before the first); rank 1 the loss of each
batch (its micro-batches' mean). Both write what they have to a JSON file of their own.

Same seed, same initial parameters (:func:`build`, as :func:`benchmarks.allreduce.mlp` builds
them), same rows and labels (:func:`data`, which :mod:`benchmarks.pipeline` uses for its jobs),
in the same order: the anchor's losses are ours, up to floating-point rounding.

The processes are :class:`benchmarks.roundtrip.Processes`' (own sessions, logs, all killed when
it closes); a process is run as ``python -m benchmarks.anchors.pipelining RANK JSON OUT``. This
module imports only torch and the standard library at its top, so a stage process starts fast.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from benchmarks.roundtrip import Processes

SCHEDULES = ("gpipe", "1f1b")
RUN_TIMEOUT = 180.0
"""Seconds both stage processes may take, from spawn to exit."""
STORE_TIMEOUT = 60.0


def build(sizes: tuple[int, ...] | list[int], seed: int) -> torch.nn.Sequential:
    """The MLP ``sizes`` (Linear, ReLU, ..., Linear), seeded: :func:`benchmarks.allreduce.mlp`."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def split(model: torch.nn.Sequential) -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    """Stage 0 (the first ``Linear`` + ``ReLU``) and stage 1 (the rest)."""
    layers = list(model)
    return torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:])


def data(
    sizes: tuple[int, ...] | list[int], batch: int, steps: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` global batches of ``batch`` random rows that a model can learn (so its loss
    falls within a few dozen SGD steps at lr 0.01): each row's label is which of its first
    ``classes`` features is the largest, those features scaled by 4 (a strong signal)."""
    g = torch.Generator().manual_seed(seed)
    classes = min(sizes[-1], sizes[0])
    x = torch.randn(batch * steps, sizes[0], generator=g)
    x[:, :classes] *= 4
    return x, x[:, :classes].argmax(dim=1)


def stage_main(rank: int, spec: dict[str, Any], out: str) -> None:
    """One stage's process (module docstring)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = 2
    part = split(build(spec["sizes"], spec["seed"]))[rank]
    x, y = data(spec["sizes"], spec["batch"], spec["steps"], spec["seed"])
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT)
    host, port = "127.0.0.1", spec["port"]
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[spec["schedule"]]
    schedule = kind(stage, n_microbatches=spec["micro"], loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=spec["lr"])
    batch = spec["batch"]
    times: list[float] = []
    losses: list[float] = []
    dist.barrier()
    times.append(time.perf_counter())
    for step in range(spec["steps"]):
        rows = slice(step * batch, (step + 1) * batch)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x[rows])
        else:
            micro: list[torch.Tensor] = []
            schedule.step(target=y[rows], losses=micro, return_outputs=False)
            losses.append(float(torch.stack([m.detach() for m in micro]).mean()))
        opt.step()
        times.append(time.perf_counter())
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"rank": rank, "times": times, "losses": losses}))


def run_anchor(
    procs: Processes,
    sizes: tuple[int, ...],
    batch: int,
    micro: int,
    schedule: str,
    steps: int,
    *,
    seed: int,
    lr: float,
) -> dict[str, Any]:
    """Train ``steps`` global batches with ``torch.distributed.pipelining`` in 2 processes.

    Returns:
        ``{"times", "losses", "wall_s"}``: rank 0's end time of every global batch (after a
        start time, so ``steps + 1`` of them), rank 1's loss of each batch, the wall time from
        spawning the processes to both exiting.
    """
    from benchmarks.roundtrip import free_port

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    port = free_port()
    spec = {"sizes": list(sizes), "batch": batch, "micro": micro, "schedule": schedule}
    spec |= {"steps": steps, "seed": seed, "lr": lr, "port": port}
    started = time.monotonic()
    names, outs = [], []
    for rank in range(2):
        name = f"pipelining-{schedule}-m{micro}-rank{rank}-{port}"
        out = procs.directory / f"{name}.json"
        argv = [sys.executable, "-m", "benchmarks.anchors.pipelining", str(rank)]
        procs.spawn(name, [*argv, json.dumps(spec), str(out)])
        names.append(name)
        outs.append(out)
    deadline = started + RUN_TIMEOUT
    from benchmarks.allreduce import wait_all  # not in the ranks: they import only torch

    try:
        wait_all(procs, names, deadline, RUN_TIMEOUT)
    finally:
        for name in names:  # the other rank, if one failed
            if name not in procs.stopped:
                procs.stop(name)
    wall = time.monotonic() - started
    first, last = (json.loads(out.read_text()) for out in outs)
    return {"times": first["times"], "losses": last["losses"], "wall_s": wall}


if __name__ == "__main__":
    stage_main(int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
