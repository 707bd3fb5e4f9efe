"""The one training loop: a differentiable run trained for its epochs, in batches.

``graph.fit`` and a daemon's ``batched_fit`` both come here (through
:meth:`engine.fitting.Fitting.batched_fit`, which fits a chain's plain filters and hands each
run of differentiable filters to a :class:`TrainingLoop`). Per epoch: the batches of the epoch
(shuffled by the last filter's seed, or in order), each forward, loss and backward, an
optimizer step every ``accumulate`` batches (:mod:`engine.stepping`), then the epoch's row of
the history, scored on validation data when there is some.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.batches import Batches
from engine.data.read_ahead import read_ahead
from engine.nodes import Node, Nodes, run_training, trainable
from engine.optimizers import Optimizers
from engine.stepping import Horizon, backward, fast_forward
from protocol.rules.batching import batch_len, generator
from protocol.rules.row_means import RowMeans

__all__ = ["FitSettings", "TrainingLoop"]


@dataclass(frozen=True)
class FitSettings:
    """How :meth:`~engine.fitting.Fitting.batched_fit` trains a chain, beyond what its filters
    say themselves: what ``graph.fit`` passes, and what a daemon's ``batched_fit`` command
    carries (:class:`protocol.daemon.BatchedFitRequest`, the wire's form of these).

    Attributes:
        batch_size: rows per batch (default: the run's last filter's).
        epochs: overrides the filters' own (a federated round's local epochs).
        prox_mu: FedProx's proximal term (Li et al. 2020), ``mu / 2 * ||w - w_start||^2`` over
            the run's parameters added to every batch's loss, ``w_start`` the weights the call
            started from (the round's global model).
        reset_optimizer: drop the chain's kept optimizers first, so training starts from fresh
            ones (a federated client's optimizer lives for one round).
        schedule_before: the epochs of the run trained before this call (a federated run's
            rounds: a fresh scheduler starts where they left it).
        schedule_epochs: the epochs the learning-rate schedules span (``None``: this call's).
        validation: ``(x_val, y_val)``, evaluated at the end of every epoch of the chain's last
            differentiable run (:mod:`engine.evaluation`).
        lr: the learning rate of the optimizers (a federated round's client config).
        start_loss: the mean loss of the last differentiable run at the weights it starts
            from, over all its rows, before training (q-FedAvg's F_k(w_t)).
        clip_norm: the L2 norm the update of the chain's TorchFilters is scaled down to when
            longer (client-side clipping for differential privacy, McMahan et al. 2018).
        output: make the chain's output on its training rows (``FitResult.output``); without
            it the last run's is never made (``graph.fit`` keeps none).
    """

    batch_size: int | None = None
    epochs: int | None = None
    prox_mu: float = 0.0
    reset_optimizer: bool = False
    schedule_before: int = 0
    schedule_epochs: int | None = None
    validation: tuple[Any, Any] | None = None
    lr: float | None = None
    start_loss: bool = False
    clip_norm: float | None = None
    output: bool = True


class TrainingLoop:
    """The training loop of one differentiable run.

    With ``accumulate=k`` (the run's last filter's) an optimizer step is taken every k batches
    (and after an epoch's last), each batch's loss weighted by its share of the rows of those
    batches: the step is the one a batch k times larger takes. The learning-rate schedulers
    step with the optimizers over the epochs of this call, or over
    ``settings.schedule_epochs`` of which ``settings.schedule_before`` were trained before.

    Args:
        nodes: the loaded nodes; ``run`` is some of them.
        optimizers: the kept optimizers the run steps.
        run: the differentiable run, in graph order.
        settings: the call's settings (:class:`FitSettings`).
        scores: what to score the model with at each epoch's end (validation), if anything.
    """

    def __init__(
        self,
        nodes: Nodes,
        optimizers: Optimizers,
        run: list[Node],
        settings: FitSettings,
        scores: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self.run = run
        self.settings = settings
        self.scores = scores
        self.training = training = run_training(run)
        self.epochs: int = training.epochs if settings.epochs is None else settings.epochs
        self.every = training.accumulate  # batches per step
        self.max_steps = training.max_steps
        self.validate_every = training.validate_every
        self.steps = 0  # optimizer steps taken
        self.step_scores: list[dict[str, Any]] = []  # validate_every's rows
        self._number = 0  # the epoch under way

    def train(self, x: Any, y: Any) -> list[dict[str, Any]]:
        """Train on inputs ``x`` and labels ``y``; a history row per epoch: its number, mean
        loss, the learning rate its last step took and what ``scores`` gives then.

        Raises:
            EngineError: ``BAD_REQUEST`` without labels.
        """
        self.nodes.check_labels(self.run, y, "training")
        data = Batches.of(self.run, x, y, self.settings.batch_size)
        optimizers = self._start(data.steps_per_epoch(self.every))
        scaler = self.optimizers.scaler(self.run[-1])
        penalty = _Proximal.of(self.run, self.settings.prox_mu)
        # Seeded, and without touching the caller's global RNG: dropout and friends inside the
        # modules draw from the forked default generator.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.training.seed)
            order = generator(self.training.seed)
            history = []
            for number in range(1, self.epochs + 1):
                if self.max_steps is not None and self.steps >= self.max_steps:
                    break
                self._number = number
                epoch = data.epoch(order if self.training.shuffle else None)
                if self.max_steps is not None:  # the batches of the steps left, at most
                    epoch = epoch[: (self.max_steps - self.steps) * self.every]
                loss, lr, metrics = self._epoch(data, epoch, optimizers, scaler, penalty)
                row = {"epoch": number, "loss": loss, "lr": lr} | metrics
                history.append(row | self._scored())
        return history

    def _start(self, steps_per_epoch: int) -> list[torch.optim.Optimizer]:
        """The run's optimizers, made if they were not (their schedules spanning this run), at
        the learning rate asked for, fresh schedules brought to where the epochs trained before
        this call left them."""
        before, span = self.settings.schedule_before, self.settings.schedule_epochs
        fresh = any(node.optimizer is None for node in self.run)
        epochs = span if span is not None else before + self.epochs
        self.optimizers.set_horizon(Horizon(steps_per_epoch, epochs, self.max_steps))
        optimizers = [self.optimizers.optimizer(node) for node in self.run]
        if self.settings.lr is not None:
            self.optimizers.set_lr(self.run, optimizers, self.settings.lr)
        if fresh and before:
            for node in self.run:  # the schedule stands where the epochs before left it
                interval = getattr(node.filter, "scheduler_interval", "step")
                if node.scheduler is not None:
                    steps = before * (1 if interval == "epoch" else steps_per_epoch)
                    fast_forward(node.scheduler, steps)
        return optimizers

    def _epoch(
        self,
        data: Batches,
        epoch: list[Any],
        optimizers: list[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
        penalty: _Proximal | None,
    ) -> tuple[float, float, dict[str, float]]:
        """One epoch's batches, a step every :attr:`every` of them; its mean loss, the
        learning rate its last step took and the epoch's mean of each metric a step function
        returned."""
        every, last_batch = self.every, len(epoch) - 1
        sizes = [batch_len(index, data.rows) for index in epoch]
        step_rows = [sum(sizes[g : g + every]) for g in range(0, len(epoch), every)]
        total, lr = 0.0, float("nan")
        metrics = RowMeans()
        for j, (xb, yb) in enumerate(read_ahead(data.read, epoch, 1 if data.lazy else 0)):
            if j % every == 0:  # a step starts
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
            computed = self.nodes.batch_loss(
                self.run, self.nodes.on_device(xb), self.nodes.on_device(yb)
            )
            loss = computed.loss
            if penalty is not None:
                loss = penalty.added_to(loss)
            backward(loss * (sizes[j] / step_rows[j // every]) if every > 1 else loss, scaler)
            total += float(loss.detach()) * sizes[j]
            metrics.add(computed.metrics, sizes[j])
            if (j + 1) % every == 0 or j == last_batch:  # a step ends
                lr = self.optimizers.step_run(self.run, scaler, epoch_end=j == last_batch)
                self.steps += 1
                if self._validates_now(last=j == last_batch):
                    scored = {"epoch": self._number, "step": self.steps}
                    self.step_scores.append(scored | self._scored())
        trained = sum(sizes)
        return (total / trained if trained else float("nan")), lr, metrics.means()

    def _validates_now(self, last: bool) -> bool:
        """Whether the step just taken is one of ``validate_every``'s: every that many steps,
        with validation data, not at an epoch's end (its row has the scores)."""
        every = self.validate_every
        if not every or last or self.scores is None:
            return False
        return self.steps % every == 0

    def _scored(self) -> dict[str, Any]:
        """What :attr:`scores` gives now (its row count left out), or nothing."""
        if self.scores is None:
            return {}
        # Evaluating leaves the training's generator where it was: the dropout masks are the
        # same with validation data or without.
        with torch.random.fork_rng(devices=[]):
            scored = self.scores()
        return {k: v for k, v in scored.items() if k != "rows"}


@dataclass(frozen=True)
class _Proximal:
    """FedProx's proximal term over a run's parameters, anchored at their weights now."""

    mu: float
    params: list[torch.nn.Parameter]
    anchor: list[torch.Tensor]

    @classmethod
    def of(cls, run: list[Node], mu: float) -> _Proximal | None:
        if not mu:
            return None
        params = [p for node in run for p in trainable(node).values()]
        return cls(mu, params, [p.detach().clone() for p in params])

    def added_to(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss + mu / 2 * ||w - w_start||^2``."""
        gap = sum(((p - a) ** 2).sum() for p, a in zip(self.params, self.anchor, strict=True))
        return loss + self.mu / 2 * gap
