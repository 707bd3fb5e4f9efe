"""The persistent optimizers of the loaded differentiable nodes: made on first use and kept
(their moments survive across calls), with their learning-rate schedulers over the run's
horizon, the fp16 gradient scaler of a run, and one step of a run.

How a step goes — unscale, clip, step, schedule — is :mod:`engine.stepping`'s; this part holds
what steps. An optimizer's state travels with :meth:`Optimizers.get_optimizer_state` (an
elastic data-parallel job brings a replacement replica to a survivor's point with it and the
nodes' states).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from engine.errors import EngineError
from engine.nodes import Node, Nodes, check_trains, run_training, trainable
from engine.stepping import Horizon, current_lr
from engine.transfer import scaler_for, to_cpu
from protocol.errors import ErrorCode

__all__ = ["SCHEDULER", "Optimizers"]

SCHEDULER = "scheduler"
"""The key of a node's optimizer state that holds its learning-rate scheduler's state."""


class Optimizers:
    """The optimizers, schedulers and scalers of ``nodes``' differentiable filters (kept on
    each :class:`~engine.nodes.Node`, so that loading new filters drops them), and the
    horizon their named schedules span."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self._horizon: Horizon | None = None  # what named schedules span (None: not told)

    # -- the horizon of named schedules --------------------------------------------------------

    def set_horizon(self, horizon: Horizon) -> None:
        """Span the schedules made from now on over ``horizon``: told by whoever runs the loop
        (a training loop counts it; a replica or a pipeline stage gets the schedule command)."""
        self._horizon = horizon

    def ends_epoch(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) is the last of an epoch of the horizon
        (never, when none was told): an epoch-wise scheduler steps after it."""
        return self._horizon is not None and self._horizon.ends_epoch(step)

    # -- made on first use, kept --------------------------------------------------------------

    def optimizer(self, node: Node) -> torch.optim.Optimizer:
        """The node's optimizer, made on first use and kept (its moments survive), with its
        learning-rate scheduler, if the filter has one."""
        if node.optimizer is None:
            optimizer = node.filter.make_optimizer(list(trainable(node).values()))
            node.scheduler = self._make_scheduler(node, optimizer)
            node.optimizer = optimizer
        return node.optimizer

    def scaler(self, node: Node) -> torch.amp.GradScaler | None:
        """The run's gradient scaler (fp16 only; ``node`` is the run's last), made on first use
        and kept like an optimizer."""
        if node.scaler is None:
            node.scaler = scaler_for(node.filter, self.nodes.device)
        return node.scaler

    def reset(self, nodes: Sequence[Node]) -> None:
        """Drop the optimizers, schedulers and scalers of ``nodes``: the next step makes fresh
        ones (no momentum or moments left from earlier calls)."""
        for node in nodes:
            node.optimizer = node.scaler = node.scheduler = None

    def set_lr(
        self, run: Sequence[Node], optimizers: Sequence[torch.optim.Optimizer], lr: float
    ) -> None:
        """Every optimizer of the run to learning rate ``lr`` (a federated round's client
        config), as though its filter asked for it: a scheduler is made again from it."""
        for node, optimizer in zip(run, optimizers, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr
                if node.scheduler is not None:
                    group["initial_lr"] = lr  # the base a new scheduler starts from
            if node.scheduler is not None:
                node.scheduler = self._make_scheduler(node, optimizer)

    def _make_scheduler(self, node: Node, optimizer: torch.optim.Optimizer) -> Any:
        """The filter's scheduler over ``optimizer`` (``None`` without one); a named schedule
        spans the horizon (:meth:`set_horizon`; :mod:`engine.stepping`).

        Raises:
            EngineError: ``BAD_REQUEST`` for a named schedule when the horizon is not known.
        """
        make = getattr(node.filter, "make_scheduler", None)
        if make is None:
            return None
        named = isinstance(getattr(node.filter, "scheduler", None), str)
        if named and self._horizon is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {node.node_id!r}: its scheduler {node.filter.scheduler!r} spans the run, "
                "and this engine was not told its length (the schedule command)",
                {"node_id": node.node_id},
            )
        interval = getattr(node.filter, "scheduler_interval", "step")
        total = self._horizon.total(interval) if self._horizon is not None else None
        return make(optimizer, total)

    # -- one step of a run --------------------------------------------------------------------

    def step_run(
        self,
        run: Sequence[Node],
        scaler: torch.amp.GradScaler | None = None,
        *,
        epoch_end: bool = False,
        coefficient: float | None = None,
        clip: bool = True,
    ) -> float:
        """One step of a run on the gradients its parameters hold (:mod:`engine.stepping`):
        unscaled (fp16), clipped to the run's ``clip_grad_norm`` — or multiplied by
        ``coefficient``, a clipping computed over more than this run; not at all without
        ``clip`` — then every optimizer's step and every scheduler's (a step-wise one now, an
        epoch-wise one at ``epoch_end``).

        Returns:
            The learning rate the step took (the run's last filter's).
        """
        optimizers = [self.optimizer(node) for node in run]
        lr = current_lr(optimizers[-1])
        if scaler is not None:
            for opt in optimizers:
                scaler.unscale_(opt)
        params = [p for node in run for p in trainable(node).values()]
        if coefficient is not None:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        elif clip and (norm := run_training(run).clip_grad_norm) is not None:
            torch.nn.utils.clip_grad_norm_(params, norm)
        for opt in optimizers:
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
        if scaler is not None:
            scaler.update()
        for node in run:
            interval = getattr(node.filter, "scheduler_interval", "step")
            if node.scheduler is not None and (interval == "step" or epoch_end):
                node.scheduler.step()
        return lr

    def learning_rate(self, node_ids: Sequence[str]) -> float | None:
        """The learning rate the last differentiable node of ``node_ids`` steps with now (its
        optimizer and scheduler made if they were not yet); ``None`` without one."""
        nodes = [n for n in self.nodes.select(node_ids) if n.differentiable]
        return current_lr(self.optimizer(nodes[-1])) if nodes else None

    # -- their state --------------------------------------------------------------------------

    def get_optimizer_state(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """Each differentiable node's persistent optimizer, as its ``state_dict()``: momentum
        buffers, Adam moments, step counts and the hyperparameters of its groups, and under
        ``"scheduler"`` its learning-rate scheduler's ``state_dict()`` when it has one; ``None``
        for an optimizer not made yet (no step taken).

        With the nodes' states this is all a replica is: an elastic data-parallel job brings a
        replacement worker to a survivor's exact point with the pair (the tensors are the live
        ones: the reply is encoded before the next command can step them).

        Raises:
            EngineError: ``BAD_REQUEST`` for a node that is not differentiable.
        """
        out: dict[str, Any] = {}
        for node in self.nodes.select(node_ids):
            check_trains(node)
            optimizer = node.optimizer
            if optimizer is None:
                out[node.node_id] = None
                continue
            state = to_cpu(optimizer.state_dict())
            if node.scheduler is not None:
                state[SCHEDULER] = node.scheduler.state_dict()
            out[node.node_id] = state
        return out

    def set_optimizer_state(self, states: Mapping[str, Any]) -> None:
        """Replace nodes' optimizers by fresh ones loaded with ``states`` (as
        :meth:`get_optimizer_state` returns them; ``None`` drops the optimizer, so the next step
        makes a new one). Every state is loaded before any node's optimizer is replaced.

        Raises:
            EngineError: ``BAD_REQUEST`` for a node that is not differentiable,
                ``STATE_MISMATCH`` for a state that is not of this node's optimizer.
        """
        made: dict[str, tuple[torch.optim.Optimizer, Any] | None] = {}
        for node_id, state in states.items():
            node = self.nodes.node(node_id)
            check_trains(node)
            if state is None:
                made[node_id] = None
                continue
            params = trainable(node)
            optimizer = node.filter.make_optimizer(list(params.values()))
            # Made before the optimizer's state is loaded (making it sets the learning rate),
            # loaded after.
            scheduler = self._make_scheduler(node, optimizer)
            state = dict(state)
            scheduler_state = state.pop(SCHEDULER, None)
            try:
                optimizer.load_state_dict(_cloned(state))
                if scheduler is not None and scheduler_state is not None:
                    scheduler.load_state_dict(dict(scheduler_state))
            except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"node {node_id!r}: the optimizer state does not fit its "
                    f"{type(optimizer).__name__}: {type(exc).__name__}: {exc}",
                    {"node_id": node_id},
                ) from exc
            _check_optimizer_shapes(node_id, optimizer, params)
            made[node_id] = (optimizer, scheduler)
        for node_id, pair in made.items():
            node = self.nodes.node(node_id)
            node.optimizer, node.scheduler = pair if pair is not None else (None, None)


def _cloned(value: Any) -> Any:
    """``value`` with every tensor (or array) copied into memory of its own: an optimizer must
    not keep views over a received frame."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, Mapping):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def _check_optimizer_shapes(
    node_id: str, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.nn.Parameter]
) -> None:
    """torch loads an optimizer state of another model's shapes without a word (and fails at
    the next step): every per-parameter tensor that is not a scalar must have its parameter's
    shape."""
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"node {node_id!r}, parameter {name!r}: optimizer state {key!r} has shape "
                    f"{list(value.shape)}, parameter has {list(p.shape)}",
                    {"node_id": node_id, "parameter": name, "key": key},
                )
