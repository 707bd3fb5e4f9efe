"""The anchors of :mod:`benchmarks.slow_links`: :mod:`benchmarks.slow_links.char_lm` trained by
plain torch over gloo, one process per rank, each the way its paper or torch's documentation
writes it.

``python -m benchmarks.slow_links.anchors --method ddp|powersgd|diloco --rank R --world W
--master HOST:PORT [--ifname IF] --rows ROWS --val-rows VR --batch B --epochs E --lr LR
--sync-every H --outer-lr 0.7 --outer-momentum 0.9 --powersgd-rank 4 --seed S --threads 1
[--d-model 256 --layers 4 --heads 4 --ff 1024] [--checkpoint FILE --checkpoint-every K]
[--resume] [--progress FILE] [--stop-loss LOSS] --out FILE``

* ``ddp``: ``DistributedDataParallel`` (CPU, gloo, its default buckets) and AdamW, one step per
  global batch.
* ``powersgd``: the same with torch's ``powerSGD_hook`` (Vogels et al. 2019) of rank
  ``--powersgd-rank``, with error feedback and warm start, the first 2 steps uncompressed
  (``start_powerSGD_iter=2``, the least torch accepts with error feedback) and the whole model
  in one DDP bucket (PowerSGD over gloo fails with DDP's default buckets,
  ``op.preamble.length <= op.nbytes``) — the settings ``sz.DataParallel(compression=
  "powersgd:R")`` uses.
* ``diloco``: DiLoCo (Douillard et al. 2023, Algorithm 1), no DDP: every rank takes inner AdamW
  steps on its own slice; after every ``H``-th step of the run and after each epoch's last
  step (the run validates there, as ``sz.DiLoCo`` then synchronises) the pseudo-gradients
  Δ = θ_global − θ_local are all-reduced (summed, in flat buckets of at most 25 MB, then
  divided by the world), set as the global weights' gradients, and an outer SGD step
  (Nesterov momentum) moves the global weights, which every rank copies into its model; the
  inner optimizer keeps its state across rounds.

Every rank builds the same data (:func:`benchmarks.slow_links.char_lm.train_and_validation` with
``--seed``) and the same model (:func:`benchmarks.slow_links.char_lm.model` with ``--seed``), and
walks the same global batches as the project (``protocol.rules.batching.global_batches(rows, W,
epochs, B, shuffle=True, seed=S)``: a global batch of ``B`` rows split by ``numpy.array_split`` into
``W`` slices, rank ``R`` training slice ``R``). Each rank's loss is its slice's mean cross-entropy
times ``len(slice) · W / len(batch)``, so DDP's mean of the gradients is the gradient of the global
batch's mean loss, uneven slices too — and DiLoCo with ``H = 1``, an outer SGD of lr 1 and no
momentum is DDP exactly when the inner optimizer is SGD (``--optimizer sgd``; with AdamW, averaging
the weights after one Adam step each is not Adam on the averaged gradient).

Rank 0 writes ``--out``, one JSON object a line, flushed as written: first the run's settings
(``method``, ``world``, ``params``, ``bytes_per_step`` for ``ddp``/``powersgd`` or
``bytes_per_sync`` for ``diloco`` — what one rank contributes to one step's or one sync's
all-reduces, float32 — and ``initial_val_loss``), then one line per epoch::

    {"epoch": e, "step": global steps done, "seconds": s, "eval_seconds": v_s,
     "val_loss": v, "train_loss": rank 0's last step's slice loss}

``seconds`` is the wall time from the start of training (every rank has its data, its model,
and DDP's wrapper or DiLoCo's global weights; a barrier, then the clock starts: the settings
line says when, ``started``, in Unix seconds) to the end of that epoch's last step (after its
synchronisation, for DiLoCo), the earlier epochs' evaluations included; ``eval_seconds`` is
that epoch's evaluation (the mean cross-entropy of every token of the validation windows, in
batches of 256 rows, no gradient), which only rank 0 runs while the others wait at a barrier
(the process group's ``--timeout``), so the ranks start the next epoch together. With
``--stop-loss`` the run ends at the first epoch whose validation loss is at most that (rank 0
decides, and a broadcast in place of the barrier tells the others).

**Checkpoints and restarts** (``ddp`` only: a torchrun job's way, :mod:`benchmarks.slow_links.churn`
restarts one). With ``--checkpoint-every K`` rank 0 saves to ``--checkpoint`` after every
``K``-th global step, inside the clock: the model's and AdamW's state, the steps done (the
position in the plan: the plan is the same on every run, so the next step's batch is known)
and torch's RNG state, with ``torch.save`` to a file beside it then renamed over it (a rank
killed mid-save leaves the last whole checkpoint). ``--resume`` loads it on every rank before
the group's clock starts (no initial evaluation then: ``initial_val_loss`` is ``null``) and
trains on from the step after it: the same batches in the same order as a run never stopped
(``resumed_from`` in the settings line says from where; with no checkpoint yet, from the
start). ``--progress`` has rank 0 append ``{"step": s, "time": t}`` after each step, for a
harness that must kill a rank at a given step.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from benchmarks.slow_links import char_lm
from protocol.rules.batching import global_batches, synchronises

__all__ = [
    "METHODS",
    "Config",
    "PseudoGradientSync",
    "load_checkpoint",
    "main",
    "parse",
    "save_checkpoint",
    "train",
]

METHODS = ("ddp", "powersgd", "diloco")
ONE_BUCKET_MB = 1 << 20
"""DDP's ``bucket_cap_mb`` that puts the whole model in one bucket (1 TiB), for PowerSGD."""
SYNC_BUCKET_BYTES = 25 * 1024 * 1024
"""The most bytes of pseudo-gradients in one DiLoCo all-reduce (DDP's default bucket)."""
POWERSGD_MIN_COMPRESSION_RATE = 2
"""torch's default: PowerSGD compresses a matrix when that makes it at least this much smaller."""
EVAL_BATCH = 256
FP32 = 4


@dataclass(frozen=True)
class Config:
    """One rank's run, as its command line gives it (module docstring)."""

    method: Literal["ddp", "powersgd", "diloco"]
    rank: int
    world: int
    master: str
    out: Path
    ifname: str | None = None
    rows: int = 4096
    val_rows: int = 1024
    batch: int = 64
    epochs: int = 1
    lr: float = 3e-3
    optimizer: Literal["adamw", "sgd"] = "adamw"
    sync_every: int = 16
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    powersgd_rank: int = 4
    seed: int = 0
    threads: int = 1
    timeout: float = 600.0
    d_model: int = char_lm.SIZE.d_model
    layers: int = char_lm.SIZE.layers
    heads: int = char_lm.SIZE.heads
    ff: int = char_lm.SIZE.ff
    checkpoint: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    progress: Path | None = None
    stop_loss: float | None = None

    @property
    def size(self) -> char_lm.Size:
        """The model's shape."""
        return char_lm.Size(d_model=self.d_model, layers=self.layers, heads=self.heads, ff=self.ff)

    @property
    def plan_key(self) -> dict[str, int]:
        """What fixes the plan and the model: a checkpoint resumes only a run of the same."""
        return {"rows": self.rows, "world": self.world, "batch": self.batch, "seed": self.seed}


def parse(argv: Sequence[str] | None = None) -> Config:
    """The :class:`Config` of a command line."""
    defaults = Config("ddp", 0, 1, "", Path())
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_links.anchors",
        description="One rank of a torch anchor of benchmarks.slow_links.",
    )
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's TCP store")
    p.add_argument("--out", type=Path, required=True, help="rank 0's JSON lines")
    p.add_argument("--ifname", default=None, help="GLOO_SOCKET_IFNAME")
    p.add_argument("--rows", type=int, default=defaults.rows)
    p.add_argument("--val-rows", type=int, default=defaults.val_rows)
    p.add_argument("--batch", type=int, default=defaults.batch, help="global batch rows")
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--lr", type=float, default=defaults.lr, help="(inner) optimizer's lr")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=defaults.optimizer)
    p.add_argument("--sync-every", type=int, default=defaults.sync_every)
    p.add_argument("--outer-lr", type=float, default=defaults.outer_lr)
    p.add_argument("--outer-momentum", type=float, default=defaults.outer_momentum)
    p.add_argument("--powersgd-rank", type=int, default=defaults.powersgd_rank)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument("--timeout", type=float, default=defaults.timeout, help="seconds")
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--heads", type=int, default=defaults.heads)
    p.add_argument("--ff", type=int, default=defaults.ff)
    p.add_argument("--checkpoint", type=Path, default=None, help="ddp: rank 0's checkpoint file")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="ddp: save after every K steps (0: never)"
    )
    p.add_argument("--resume", action="store_true", help="ddp: train on from --checkpoint")
    p.add_argument("--progress", type=Path, default=None, help="rank 0's steps, one a line")
    p.add_argument("--stop-loss", type=float, default=None, help="end once val loss <= this")
    args = p.parse_args(argv)
    keeps = args.checkpoint_every or args.resume
    if keeps and args.method != "ddp":
        p.error(f"--checkpoint-every and --resume are ddp's, not {args.method}'s")
    if keeps and args.checkpoint is None:
        p.error("--checkpoint-every and --resume need --checkpoint FILE")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every is a number of steps >= 0, not {args.checkpoint_every}")
    if args.stop_loss is not None and not math.isfinite(args.stop_loss):
        p.error(f"--stop-loss is a finite loss, not {args.stop_loss}")
    return Config(**vars(args))


class PseudoGradientSync:
    """DiLoCo's synchronisation (Douillard et al. 2023, Algorithm 1, lines 9–11) over the
    default process group: the global weights of ``params`` and their outer optimizer, the
    same on every rank, so neither travels."""

    def __init__(self, params: Sequence[torch.nn.Parameter], lr: float, momentum: float) -> None:
        self.params = list(params)
        self.global_params = [p.detach().clone() for p in self.params]
        # torch's SGD refuses Nesterov without momentum; with none the two steps are the same
        self.outer = torch.optim.SGD(
            self.global_params, lr=lr, momentum=momentum, nesterov=momentum > 0
        )

    @torch.no_grad()
    def __call__(self) -> None:
        """Average Δ = θ_global − θ_local over the ranks, take the outer step with it as the
        global weights' gradient, and start the next inner steps from the new global weights."""
        world = dist.get_world_size()
        for g, p in zip(self.global_params, self.params, strict=True):
            g.grad = g - p
        for bucket in _buckets([g.grad for g in self.global_params if g.grad is not None]):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)  # a sum
            flat /= world
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self.outer.step()
        for g, p in zip(self.global_params, self.params, strict=True):
            p.copy_(g)
            g.grad = None


def _buckets(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in order, in runs of at most :data:`SYNC_BUCKET_BYTES` (a larger one alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > SYNC_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def powersgd_bytes(params: Sequence[torch.Tensor], rank: int) -> int:
    """One rank's bytes in one PowerSGD step after its uncompressed start: as ``powerSGD_hook``
    decides, each gradient viewed as ``n × m`` (its first dimension by the rest) travels as
    ``(n + m) · min(n, m, rank)`` values when that is under half of ``n · m``, vectors and
    the rest whole."""
    total = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // n
        r = min(n, m, rank)
        compressed = (n + m) * r
        small = compressed * POWERSGD_MIN_COMPRESSION_RATE < n * m
        total += compressed if p.dim() > 1 and small else p.numel()
    return FP32 * total


def _settings(
    config: Config, model: torch.nn.Module, initial_val_loss: float | None
) -> dict[str, Any]:
    """The first line of ``--out``."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    line: dict[str, Any] = {"method": config.method, "world": config.world, "params": count}
    if config.method == "ddp":
        line["bytes_per_step"] = FP32 * count
    elif config.method == "powersgd":
        line["bytes_per_step"] = powersgd_bytes(params, config.powersgd_rank)
    else:
        line["bytes_per_sync"] = FP32 * count
    settings = asdict(config)
    own = ("method", "rank", "world", "master", "out", "ifname", "threads", "timeout")
    for key in (*own, "checkpoint", "progress"):
        settings.pop(key)
    return {**line, **settings, "initial_val_loss": initial_val_loss}


def _optimizer(config: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr)
    return torch.optim.AdamW(model.parameters(), lr=config.lr)


def save_checkpoint(
    path: Path,
    config: Config,
    steps: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """``model`` and ``optimizer`` after ``steps`` global steps of ``config``'s plan, and
    torch's RNG state, saved to ``path`` atomically (written beside it, then renamed)."""
    state = {
        "steps": steps,
        "plan": config.plan_key,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(
    path: Path, config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Set ``model``, ``optimizer`` and torch's RNG to the checkpoint at ``path``; the global
    steps it was taken after.

    Raises:
        ValueError: it is of another plan (rows, world, batch or seed).
    """
    state = torch.load(path, weights_only=True)
    if state["plan"] != config.plan_key:
        raise ValueError(f"{path} is of the plan {state['plan']}, not {config.plan_key}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["steps"])


def train(config: Config) -> None:
    """One rank's run (module docstring); rank 0 writes ``config.out``.

    Raises:
        RuntimeError: the process group broke or timed out (torch.distributed's own error).
    """
    torch.set_num_threads(config.threads)
    if config.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = config.ifname
    timeout = datetime.timedelta(seconds=config.timeout)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config.master}",
        rank=config.rank,
        world_size=config.world,
        timeout=timeout,
    )
    try:
        _train(config)
    finally:
        dist.destroy_process_group()


def _train(config: Config) -> None:
    rank, world = config.rank, config.world
    # --- the same data, model and plan on every rank
    x, y, val_x, val_y = char_lm.train_and_validation(config.rows, config.val_rows, config.seed)
    model = char_lm.model(config.seed, config.size)
    plan = list(global_batches(config.rows, world, config.epochs, config.batch, True, config.seed))
    # H over the run, and at each epoch's end: the run validates there (as sz.DiLoCo does)
    per_epoch = Counter(epoch for epoch, _, _ in plan)
    ends = list(itertools.accumulate(per_epoch[e] for e in sorted(per_epoch)))
    syncs = synchronises(len(plan), config.sync_every, ends)

    # --- the method: DDP's wrapper (which broadcasts rank 0's weights) or DiLoCo's global weights
    net: torch.nn.Module
    outer: PseudoGradientSync | None = None
    if config.method == "diloco":
        with torch.no_grad():
            for p in model.parameters():  # as DDP does: every rank starts from rank 0's
                dist.broadcast(p, 0)
        net = model
        outer = PseudoGradientSync(list(model.parameters()), config.outer_lr, config.outer_momentum)
    elif config.method == "powersgd":
        ddp = DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=config.seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        net = ddp
    else:
        net = DistributedDataParallel(model)
    optimizer = _optimizer(config, model)
    # --- a restart: every rank loads the same weights (in place: DDP holds these parameters),
    # AdamW's moments and the position in the plan
    done = 0
    if config.resume and config.checkpoint is not None and config.checkpoint.exists():
        done = load_checkpoint(config.checkpoint, config, model, optimizer)

    out = progress = None
    head: dict[str, Any] = {}
    if rank == 0:
        out = config.out.open("w")
        progress = config.progress.open("a") if config.progress is not None else None
        initial = None if config.resume else char_lm.evaluate(model, val_x, val_y, EVAL_BATCH)
        head = _settings(config, model, initial) | {"resumed_from": done}
    dist.barrier()

    # --- training: one global batch a step, this rank's slice of it
    start = time.perf_counter()
    if out is not None:
        _write(out, head | {"started": time.time()})
    try:
        loss = 0.0
        for g in range(done, len(plan)):
            epoch, _, slices = plan[g]
            local, batch = slices[rank], sum(len(s) for s in slices)
            net.train()
            optimizer.zero_grad(set_to_none=True)
            loss = _backward(net, x, y, local, world / batch)
            optimizer.step()
            if outer is not None and syncs[g]:
                outer()
            if rank == 0 and config.checkpoint_every and (g + 1) % config.checkpoint_every == 0:
                assert config.checkpoint is not None  # (parse() refuses one without the other)
                save_checkpoint(config.checkpoint, config, g + 1, model, optimizer)
            if progress is not None:
                _write(progress, {"step": g + 1, "time": time.time()})
            if g + 1 < len(plan) and plan[g + 1][0] == epoch:
                continue
            # --- the epoch's end: rank 0 evaluates, the others wait for it
            seconds = time.perf_counter() - start
            reached = False
            if out is not None:
                val_loss = char_lm.evaluate(model, val_x, val_y, EVAL_BATCH)
                line = {"epoch": epoch, "step": g + 1, "seconds": seconds}
                line["eval_seconds"] = time.perf_counter() - start - seconds
                _write(out, {**line, "val_loss": val_loss, "train_loss": loss})
                reached = config.stop_loss is not None and val_loss <= config.stop_loss
            if config.stop_loss is None:
                dist.barrier()
            elif _agreed(reached):
                break
    finally:
        for opened in (out, progress):
            if opened is not None:
                opened.close()


def _agreed(reached: bool) -> bool:
    """Rank 0's word (``reached``) on every rank: whether the run ends here."""
    flag = torch.tensor([1 if reached else 0])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _backward(
    net: torch.nn.Module,
    x: np.ndarray[Any, Any],
    y: np.ndarray[Any, Any],
    local: np.ndarray[Any, Any],
    per_row: float,
) -> float:
    """Forward and backward of rows ``local``, the loss scaled by ``len(local) · per_row``
    (``W / len(batch)``); their mean loss. A rank without rows still joins DDP's all-reduce,
    with zero gradients."""
    if not len(local):
        (net(torch.from_numpy(x[:1])).sum() * 0.0).backward()
        return 0.0
    loss = F.cross_entropy(net(torch.from_numpy(x[local])), torch.from_numpy(y[local]))
    (loss * (len(local) * per_row)).backward()
    return float(loss.detach())


def _write(out: Any, line: dict[str, Any]) -> None:
    out.write(json.dumps(line) + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (module docstring)."""
    train(parse(argv))


if __name__ == "__main__":
    main()
