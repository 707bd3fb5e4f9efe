"""Fitting and forwarding a chain of filters: one node, one pass, or the whole training.

``fit``, ``composite_fit`` and ``gradient_pass`` of a differentiable filter run forward, loss
and backward but never step: whoever owns the round owns the step (see
:mod:`engine.gradients`). ``batched_fit`` trains a chain to completion, what ``graph.fit``
runs: its plain filters fitted in order, each run of differentiable filters trained by the one
training loop (:mod:`engine.training`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.batches import concat, num_rows, on_disk, part_of, whole
from engine.evaluation import Evaluation
from engine.nodes import Node, Nodes, run_training, segments
from engine.optimizers import Optimizers
from engine.stepping import backward
from engine.training import FitSettings, TrainingLoop
from engine.transfer import map_tensors, to_cpu
from protocol.rules.row_means import RowMeans

__all__ = ["FitResult", "FitSettings", "Fitting"]


@dataclass
class FitResult:
    """What a fit command produced.

    Attributes:
        output: the chain's output on the fitted data (``None`` for a single-node ``fit``).
        states: each fitted node's state, by node id.
        loss: the loss of the last differentiable run (mean over the last epoch for a training
            loop), ``None`` when no differentiable filter was involved.
        rows: how many rows were fitted on.
        epoch_losses: for a training loop, the mean loss of each epoch, in order.
        start_loss: asked for, the mean loss over the rows at the weights the loop started
            from, before any step (q-FedAvg's F_k(w_t)).
        clipped: with ``clip_norm``, whether the update had to be scaled down to it.
        history: for a training loop, a row per epoch: ``epoch`` (from 1), ``loss`` (its mean
            training loss), ``lr`` (the learning rate its last step took) and, with validation
            data, ``val_loss`` and each metric of the model at the epoch's end.
        step_scores: with validation data and ``validate_every`` (the last filter's), a row
            every that many optimizer steps within an epoch: ``epoch``, ``step`` (of the run,
            from 1), ``val_loss`` and each metric.
    """

    output: Any
    states: dict[str, Any]
    loss: float | None
    rows: int
    epoch_losses: list[float] = field(default_factory=list)
    start_loss: float | None = None
    clipped: bool | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    step_scores: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class _Pass(NamedTuple):
    """What a forward and backward through a run gave: its output, mean loss and the mean of
    each metric its step function returned."""

    out: Any
    loss: float
    metrics: dict[str, float]


_GENERATOR = threading.Lock()
"""Held while a seeded pass draws from torch's default generator (see :meth:`gradient_pass`)."""


class Fitting:
    """Fit, forward and train chains of ``nodes``, stepping ``optimizers``, scoring with
    ``evaluation``."""

    def __init__(self, nodes: Nodes, optimizers: Optimizers, evaluation: Evaluation) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self.evaluation = evaluation

    # -- fit ----------------------------------------------------------------------------------

    def fit(self, node_id: str, x: Any, y: Any = None) -> FitResult:
        """Fit one node on ``x``: a plain filter's ``fit``, or one gradient pass (no step)."""
        node = self.nodes.node(node_id)
        if node.differentiable:
            loss = self._backward_run([node], x, y).loss
            return FitResult(None, self.nodes.get_state([node_id]), loss, num_rows(x))
        state = self.nodes.fit_plain(node, x, y)
        return FitResult(None, {node_id: state}, None, num_rows(x))

    def composite_fit(self, node_ids: Sequence[str], x: Any, y: Any = None) -> FitResult:
        """One pass over a chain: plain filters fit then forward; each differentiable run does one
        forward, loss and backward over all of ``x`` and leaves its gradients on the parameters,
        without stepping (a data-parallel replica's half of a step)."""
        nodes = self.nodes.chain(node_ids, x, y)
        out, loss = x, None
        for segment in segments(nodes):
            if segment[0].differentiable:
                out, loss, _ = self._backward_run(segment, out, y)
            else:
                out = self._fit_plain(segment[0], out, y)
        return FitResult(to_cpu(out), self.nodes.get_state(node_ids), loss, num_rows(x))

    def gradient_pass(
        self, node_ids: Sequence[str], x: Any, y: Any = None, *, seed: int | None = None
    ) -> FitResult:
        """A replica's half of a data-parallel step: plain filters only *apply* the state they
        hold (fitted once, before training), each differentiable run does one forward, loss and
        backward over ``x`` — in ``accumulate`` slices, its last filter's — and leaves its
        gradients on the parameters. No step, no states. ``seed`` seeds torch's generator for
        it (dropout: the replica's and step's masks)."""
        nodes = self.nodes.chain(node_ids, x, y)
        if seed is None:
            return self._gradient_pass(nodes, x, y)
        # torch's default generator is the process's: engines in one process (in-process
        # workers) take turns with it, so each pass draws from its own seed.
        with _GENERATOR:
            torch.manual_seed(seed)
            return self._gradient_pass(nodes, x, y)

    def _gradient_pass(self, nodes: list[Node], x: Any, y: Any) -> FitResult:
        out, loss = x, None
        metrics: dict[str, float] = {}
        for segment in segments(nodes):
            if segment[0].differentiable:
                parts = run_training(segment).accumulate
                out, loss, metrics = self._backward_run(segment, out, y, parts)
            else:
                node = segment[0]
                out = self.nodes.apply(node, out, self.nodes.state_of(node))
        return FitResult(None, {}, loss, num_rows(x), metrics=metrics)

    def batched_fit(
        self,
        node_ids: Sequence[str],
        x: Any,
        y: Any = None,
        settings: FitSettings | None = None,
    ) -> FitResult:
        """Train a chain to completion: what ``graph.fit`` does.

        Plain filters are fitted on all rows, in order, each feeding the next. A differentiable
        run trains for the epochs of its last filter, in batches of ``batch_size`` (default: the
        last filter's), one optimizer step of every filter in the run per batch (or per
        ``accumulate`` batches), on the mean loss of the batch: :class:`TrainingLoop`. With
        ``shuffle`` the rows of each epoch are permuted by a ``torch.Generator`` seeded with
        the filter's ``seed``; without it they are taken in order.

        ``settings`` (:class:`FitSettings`) changes what the filters say: the epochs, FedProx's
        term, fresh optimizers, the learning rate and its schedule, validation data scored at
        the end of every epoch of the chain's last differentiable run, the loss before
        training, the clipping of the update.
        """
        settings = settings if settings is not None else FitSettings()
        nodes = self.nodes.chain(node_ids, x, y)
        if settings.reset_optimizer:
            self.optimizers.reset(nodes)
        torch_ids = [n.node_id for n in nodes if n.differentiable]
        start = self.nodes.get_state(torch_ids) if settings.clip_norm is not None else {}
        out, loss, first_loss = x, None, None
        history: list[dict[str, Any]] = []
        step_scores: list[dict[str, Any]] = []
        runs = list(segments(nodes))
        last_run = max((k for k, s in enumerate(runs) if s[0].differentiable), default=-1)
        validation = settings.validation
        val_x, val_y = validation if validation is not None else (None, None)
        for k, segment in enumerate(runs):
            if not segment[0].differentiable:  # a plain filter fits on all its rows at once
                out = self._fit_plain(segment[0], whole(out), whole(y))
                if validation is not None:
                    val_x = self.nodes.apply(segment[0], whole(val_x), segment[0].state)
                continue
            scores = None
            if validation is not None and k == last_run:
                ids = [n.node_id for n in segment]
                scores = functools.partial(self.evaluation.evaluate, ids, val_x, val_y)
            if settings.start_loss:
                first_loss = self.evaluation.mean_loss(segment, out, y, settings.batch_size)
            loop = TrainingLoop(self.nodes, self.optimizers, segment, settings, scores)
            history = loop.train(out, y)
            step_scores = loop.step_scores
            loss = history[-1]["loss"] if history else None
            if k == len(runs) - 1 and (on_disk(out) or not settings.output):
                out = None  # not asked for; of rows read from disk, all at once, never made
            else:  # batch by batch: the memory of a batch, not of the dataset
                out = self.evaluation.forward(segment, out)
            if validation is not None and k < last_run:
                val_x = self.evaluation.forward(segment, val_x)
        clipped = None
        if settings.clip_norm is not None:
            clipped = self._clip_update(start, settings.clip_norm)
        rows = num_rows(x)
        states = self.nodes.get_state(node_ids)
        epoch_losses = [row["loss"] for row in history]
        return FitResult(
            output=to_cpu(out),
            states=states,
            loss=loss,
            rows=rows,
            epoch_losses=epoch_losses,
            start_loss=first_loss,
            clipped=clipped,
            history=history,
            step_scores=step_scores,
        )

    # -- forward ------------------------------------------------------------------------------

    def forward(self, node_id: str, x: Any, state: Any = None) -> Any:
        """``forward`` of one node with ``state``, or with the state it holds."""
        node = self.nodes.node(node_id)
        held = self.nodes.state_of(node) if state is None else state
        return to_cpu(self.nodes.apply(node, x, held))

    def composite_forward(
        self, node_ids: Sequence[str], x: Any, states: Mapping[str, Any] | None = None
    ) -> Any:
        """Forward ``x`` through a chain, each node with ``states[id]`` or its held state."""
        for node in self.nodes.chain(node_ids, x):
            if states is not None and node.node_id in states:
                x = self.nodes.apply(node, x, states[node.node_id])
            else:
                x = self.nodes.apply(node, x, self.nodes.state_of(node))
        return to_cpu(x)

    # -- internals ----------------------------------------------------------------------------

    def _fit_plain(self, node: Node, x: Any, y: Any) -> Any:
        x = to_cpu(x)
        return node.filter.forward(x, self.nodes.fit_plain(node, x, y))

    def _backward_run(self, run: list[Node], x: Any, y: Any, parts: int = 1) -> _Pass:
        """Forward, loss and backward of ``x`` through the run, the gradients left on the
        parameters; with ``parts`` in that many slices one after the other (each loss weighted
        by its share of the rows, the gradients accumulating): the same gradient, a slice's
        memory. The output (``None`` from a step function), the mean loss and the mean of each
        metric a step function returned."""
        self.nodes.check_labels(run, y, "fitting")
        for node in run:
            node.filter.module.zero_grad(set_to_none=True)
        # The true gradients, never scaled: whoever steps on them (the data-parallel mean, say)
        # must not have to know this filter's precision.
        xt = self.nodes.on_device(run[0].filter.prepare_input(x))
        yt = self.nodes.on_device(run[-1].filter.prepare_target(y))
        n = num_rows(xt)
        if parts <= 1 or n <= 1:
            computed = self.nodes.batch_loss(run, xt, yt)
            backward(computed.loss, None)
            out = map_tensors(torch.Tensor.detach, computed.out)
            return _Pass(out, float(computed.loss.detach()), dict(computed.metrics))
        outs, sizes, total, metrics = [], [], 0.0, RowMeans()
        for part in np.array_split(np.arange(n), min(parts, n)):
            index = torch.from_numpy(part).to(self.nodes.device)
            computed = self.nodes.batch_loss(run, part_of(xt, index), part_of(yt, index))
            backward(computed.loss * (len(part) / n), None)
            outs.append(map_tensors(torch.Tensor.detach, computed.out))
            sizes.append(len(part))
            total += float(computed.loss.detach()) * len(part)
            metrics.add(computed.metrics, len(part))
        return _Pass(concat(outs, sizes), total / n, metrics.means())

    def _clip_update(self, start: Mapping[str, Any], clip_norm: float) -> bool:
        """Scale the update since ``start`` (the TorchFilters' states) down to ``clip_norm``
        when its L2 norm is larger; whether it was."""
        current = self.nodes.get_state(list(start))
        deltas = [
            (node_id, key, value - start[node_id][key])
            for node_id, state in current.items()
            for key, value in state.items()
            if value.is_floating_point()
        ]
        norm = math.sqrt(sum(float(d.double().square().sum()) for _, _, d in deltas))
        if norm <= clip_norm:
            return False
        scale = clip_norm / norm
        clipped = {node_id: dict(state) for node_id, state in current.items()}
        for node_id, key, delta in deltas:
            base = start[node_id][key]
            clipped[node_id][key] = (base.double() + delta.double() * scale).to(base.dtype)
        self.nodes.set_state(clipped)
        return True
