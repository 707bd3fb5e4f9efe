"""An independent plain-torch training loop with a schedule, clipping and accumulation: what
``graph.fit`` and every strategy are checked against (written here, not in the package).

Batches are the documented rule's: ``batch_size`` rows at a time, in order or, with
``shuffle``, in the order of one ``torch.randperm`` per epoch drawn from a generator seeded with
``seed``. ``accumulate`` consecutive batches of an epoch make one optimizer step (an epoch's last
may make a shorter one), each batch's mean loss weighted by its share of their rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FILTER = {
    "loss": "cross_entropy",
    "optimizer": "sgd",
    "lr": 0.1,
    "optimizer_options": {"momentum": 0.9},
    "batch_size": 16,
    "epochs": 3,
    "shuffle": True,
    "seed": 7,
}
"""The TorchFilter settings of :func:`reference_fit`'s defaults."""


def classes(n: int = 203, d: int = 6, k: int = 3, seed: int = 1) -> tuple[Any, Any]:
    """A small classification problem: ``n`` rows of ``d`` features, ``k`` classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32) * 2 + 1
    y = (x @ rng.normal(size=(d, k))).argmax(1).astype(np.int64)
    return x, y


def mlp(d: int = 6, hidden: int = 16, out: int = 3, seed: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out)
    )


@dataclass
class Reference:
    """What the reference loop learned: the model, each optimizer step's learning rate and
    each epoch's mean training loss."""

    model: torch.nn.Module
    lrs: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


# graph.fit by hand: a keyword of its own for each of the TorchFilter's training settings.
def reference_fit(  # noqa: PLR0913
    module: torch.nn.Module,
    x: Any,
    y: Any,
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
    epochs: int = 3,
    batch_size: int = 16,
    accumulate: int = 1,
    clip: float | None = None,
    cosine: bool = False,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    interval: str = "step",
    shuffle: bool = True,
    seed: int = 7,
    at_epoch_end: Callable[[torch.nn.Module], None] | None = None,
) -> Reference:
    """SGD with momentum on cross-entropy; ``cosine``: ``CosineAnnealingLR`` over the whole run
    (steps or epochs, by ``interval``), or ``scheduler`` made over the optimizer; ``clip``:
    ``clip_grad_norm_`` of all parameters before each step. ``at_epoch_end`` sees the model
    after each epoch."""
    net = copy.deepcopy(module)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    n = len(xt)
    per_epoch = math.ceil(math.ceil(n / batch_size) / accumulate)
    span = epochs if interval == "epoch" else per_epoch * epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=span) if cosine else None
    if scheduler is not None:
        sched = scheduler(opt)
    order = torch.Generator().manual_seed(seed)
    out = Reference(net)
    for _ in range(epochs):
        rows = torch.randperm(n, generator=order) if shuffle else torch.arange(n)
        batches = [rows[s : s + batch_size] for s in range(0, n, batch_size)]
        total = 0.0
        for g in range(0, len(batches), accumulate):
            group = batches[g : g + accumulate]
            together = sum(len(b) for b in group)
            opt.zero_grad()
            for b in group:
                loss = torch.nn.functional.cross_entropy(net(xt[b]), yt[b])
                (loss * (len(b) / together)).backward()
                total += float(loss.detach()) * len(b)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            out.lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            if sched is not None and interval == "step":
                sched.step()
        if sched is not None and interval == "epoch":
            sched.step()
        out.epoch_losses.append(total / n)
        if at_epoch_end is not None:
            at_epoch_end(net)
    return out


def evaluation(x_val: Any, y_val: Any, into: list[dict[str, float]]) -> Callable[[Any], None]:
    """An ``at_epoch_end`` that evaluates the model on ``(x_val, y_val)`` in eval mode, its
    cross-entropy and accuracy appended to ``into``."""
    xt, yt = torch.as_tensor(x_val), torch.as_tensor(y_val)

    def evaluate(net: torch.nn.Module) -> None:
        net.eval()
        with torch.no_grad():
            out = net(xt)
            loss = float(torch.nn.functional.cross_entropy(out, yt))
            accuracy = float((out.argmax(1) == yt).float().mean())
        net.train()
        into.append({"val_loss": loss, "accuracy": accuracy})

    return evaluate
