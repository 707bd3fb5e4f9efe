"""Learning-rate schedules, clipping and accumulation: how a differentiable run takes a step.

A ``TorchFilter`` may keep a learning-rate scheduler beside its optimizer
(``scheduler=``, ``scheduler_interval="step" | "epoch"``): a callable ``(optimizer) ->
LRScheduler``, or one of :data:`SCHEDULES` by name. A named one spans the *horizon* of the run
(:class:`Horizon`: optimizer steps per epoch and epochs), which whoever runs the loop knows:
``graph.fit`` and a daemon's ``batched_fit`` count it themselves, a data-parallel replica or a
pipeline stage is told it (its plan, or the ``schedule`` command).

A step of a run (:meth:`engine.optimizers.Optimizers.step_run`) is, in order: the fp16
scaler's unscale, the clipping of the run's gradient to ``clip_grad_norm`` (the norm of all the
run's parameters' gradients together, as ``torch.nn.utils.clip_grad_norm_`` computes it, or a
coefficient computed elsewhere from a larger whole: a pipeline's stages), every optimizer's
step, then every scheduler's (a step-wise one after each step, an epoch-wise one after an
epoch's last).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler

__all__ = [
    "INTERVALS",
    "SCHEDULES",
    "Horizon",
    "backward",
    "check_schedule",
    "current_lr",
    "fast_forward",
    "made_scheduler",
    "named_scheduler",
    "squared_norm",
]

INTERVALS = ("step", "epoch")
"""When a scheduler steps: after every optimizer step, or after an epoch's last."""

SCHEDULES: dict[str, frozenset[str]] = {
    "cosine": frozenset({"t_max", "eta_min"}),
    "linear_warmup": frozenset({"warmup", "start_factor"}),
}
"""The schedules a TorchFilter may name, with the arguments each takes (``scheduler_options``):

* ``"cosine"``: ``torch.optim.lr_scheduler.CosineAnnealingLR`` from the optimizer's ``lr`` down
  to ``eta_min`` (default 0) over ``t_max`` intervals (default: the whole run);
* ``"linear_warmup"``: ``LinearLR`` from ``start_factor`` (default 0.1) times the ``lr`` up to
  the ``lr`` over ``warmup`` intervals (default: a tenth of the run, at least one), then constant.
"""


@dataclass(frozen=True)
class Horizon:
    """What a run's schedules span: optimizer steps per epoch, and epochs; the run stops after
    ``max_steps`` steps when it is given and comes first."""

    steps_per_epoch: int
    epochs: int
    max_steps: int | None = None

    def total(self, interval: str) -> int:
        """How many times a scheduler stepping every ``interval`` steps in the whole run."""
        steps = self.steps_per_epoch * self.epochs
        if self.max_steps is not None:
            steps = min(steps, self.max_steps)
        if interval != "epoch":
            return steps
        return -(-steps // self.steps_per_epoch) if self.steps_per_epoch else self.epochs

    def ends_epoch(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) is the last of its epoch, or the last of
        a run that ``max_steps`` stops mid-epoch."""
        if self.max_steps is not None and step == self.max_steps:
            return True
        return self.steps_per_epoch > 0 and step % self.steps_per_epoch == 0


def check_schedule(
    scheduler: Any, interval: str, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``scheduler``, ``interval`` and ``options`` as a TorchFilter takes them; the options.

    Raises:
        ValueError: an unknown name, interval or argument, or options for a callable.
    """
    if interval not in INTERVALS:
        raise ValueError(f"scheduler_interval must be one of {list(INTERVALS)}, not {interval!r}")
    options = dict(options or {})
    if scheduler is None or callable(scheduler):
        if options:
            raise ValueError("scheduler_options are the arguments of a named scheduler")
        return options
    if not isinstance(scheduler, str) or scheduler not in SCHEDULES:
        raise ValueError(
            f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULES)}, "
            "or a callable (optimizer) -> LRScheduler"
        )
    unknown = sorted(set(options) - SCHEDULES[scheduler])
    if unknown:
        raise ValueError(
            f"scheduler {scheduler!r} takes {sorted(SCHEDULES[scheduler])}, not {unknown}"
        )
    return options


def named_scheduler(
    name: str, optimizer: torch.optim.Optimizer, total: int, options: Mapping[str, Any]
) -> LRScheduler:
    """The scheduler ``name`` over ``optimizer`` for a run of ``total`` intervals (module
    docstring of :data:`SCHEDULES`)."""
    if name == "cosine":
        t_max = int(options.get("t_max") or max(total, 1))
        return CosineAnnealingLR(optimizer, T_max=t_max, eta_min=float(options.get("eta_min", 0)))
    warmup = int(options.get("warmup") or max(1, total // 10))
    start = float(options.get("start_factor", 0.1))
    return LinearLR(optimizer, start_factor=start, end_factor=1.0, total_iters=warmup)


def made_scheduler(
    make: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer
) -> LRScheduler:
    """What a user's ``(optimizer) -> LRScheduler`` made, checked.

    Raises:
        TypeError: it is not a learning-rate scheduler.
    """
    made = make(optimizer)
    if not isinstance(made, LRScheduler) and not (
        hasattr(made, "step") and hasattr(made, "state_dict")
    ):
        raise TypeError(
            f"the scheduler callable returned {type(made).__name__}, not a "
            "torch.optim.lr_scheduler.LRScheduler"
        )
    return made  # type: ignore[no-any-return]


def fast_forward(scheduler: LRScheduler, steps: int) -> None:
    """Step ``scheduler`` ``steps`` times without training: a federated client's fresh
    scheduler brought to where the run's schedule stands after the rounds before."""
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()": on purpose here.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate ``optimizer``'s first parameter group steps with now."""
    return float(optimizer.param_groups[0]["lr"])


def squared_norm(params: Sequence[torch.nn.Parameter]) -> float:
    """The sum of the squared 2-norms of the gradients of ``params`` (those that have one):
    one part of a gradient norm taken over more parameters than one process holds."""
    norms = [torch.linalg.vector_norm(p.grad.detach(), 2) for p in params if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms).double(), 2) ** 2)


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Backward of ``loss``, through ``scaler`` for fp16 (the loss scaled; the step that
    follows unscales, skips a step whose gradients overflowed and updates the scale)."""
    torch.autograd.backward(loss if scaler is None else scaler.scale(loss))
