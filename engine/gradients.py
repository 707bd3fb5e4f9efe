"""The optimizer state and the gradients of the loaded differentiable nodes.

The gradient primitives never report an empty success: no gradient at all is an error. Fitting
(:mod:`engine.training`) leaves gradients on the parameters without stepping, because whoever
owns the round owns the step: :meth:`Gradients.apply_gradients` writes a gradient (the mean of
the replicas', say) and steps the persistent optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from engine.errors import EngineError
from engine.nodes import Node, Nodes, check_same_names, trainable
from engine.stepping import current_lr
from engine.transfer import to_cpu
from protocol.errors import ErrorCode

SCHEDULER = "scheduler"
"""The key of a node's optimizer state that holds its learning-rate scheduler's state."""


class Gradients(Nodes):
    """Reading and writing the optimizers and the gradients of differentiable nodes."""

    def get_optimizer_state(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """Each differentiable node's persistent optimizer, as its ``state_dict()``: momentum
        buffers, Adam moments, step counts and the hyperparameters of its groups, and under
        ``"scheduler"`` its learning-rate scheduler's ``state_dict()`` when it has one; ``None``
        for an optimizer not made yet (no step taken).

        With :meth:`get_state` this is all a replica is: an elastic data-parallel job brings a
        replacement worker to a survivor's exact point with the pair (the tensors are the live
        ones: the reply is encoded before the next command can step them).

        Raises:
            EngineError: ``BAD_REQUEST`` for a node that is not differentiable.
        """
        out: dict[str, Any] = {}
        for node in self._select(node_ids):
            self._check_trains(node)
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
            node = self._node(node_id)
            self._check_trains(node)
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
            node = self._nodes[node_id]
            node.optimizer, node.scheduler = pair if pair is not None else (None, None)

    def get_gradients(self, node_ids: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The gradients left by the last ``fit``/``composite_fit``, by node and parameter name.

        ``node_ids=None`` means every differentiable node. The tensors are the live ``.grad``
        tensors on a CPU engine (the engine always replaces, never mutates, a gradient): copy
        them to keep them across a later backward. On another device, CPU copies.

        Raises:
            EngineError: ``NO_GRADIENTS`` for a node that is not differentiable, has no trainable
                parameters, or has parameters without a gradient (no backward ran).
        """
        if node_ids is None:
            nodes = [n for n in self._nodes.values() if n.differentiable]
            if not nodes:
                raise EngineError(ErrorCode.NO_GRADIENTS, "no differentiable filter is loaded")
        else:
            nodes = self._select(node_ids)
        out: dict[str, dict[str, Any]] = {}
        for node in nodes:
            if not node.differentiable:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r} is not differentiable: it has no gradients",
                    {"node_id": node.node_id},
                )
            params = trainable(node)
            if not params:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r} has no trainable parameters",
                    {"node_id": node.node_id},
                )
            missing = [name for name, p in params.items() if p.grad is None]
            if missing:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r}: no gradient on {missing} "
                    "(run fit or composite_fit with labels first)",
                    {"node_id": node.node_id, "parameters": missing},
                )
            out[node.node_id] = {name: to_cpu(p.grad) for name, p in params.items()}
        return out

    def apply_gradients(
        self, gradients: Mapping[str, Mapping[str, Any]], *, epoch_end: bool = False
    ) -> dict[str, int]:
        """Write ``gradients`` onto the parameters and take one step of the nodes as a run
        (:meth:`~engine.nodes.Nodes._step_run`: their gradient clipped as a whole, each node's
        persistent optimizer, then its scheduler; an epoch-wise one when ``epoch_end``).

        Every node and tensor is checked before anything is written, so a mismatch leaves the
        model untouched.

        Returns:
            How many parameters were stepped, by node id.

        Raises:
            EngineError: ``GRADIENT_MISMATCH`` when names or shapes are not the same model,
                ``NO_GRADIENTS`` for an empty gradient set.
        """
        if not gradients:
            raise EngineError(ErrorCode.NO_GRADIENTS, "apply_gradients was given no gradients")
        plan: list[tuple[Node, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = []
        for node_id, grads in gradients.items():
            node = self._node(node_id)
            params = trainable(node) if node.differentiable else {}
            if not params:
                raise EngineError(
                    ErrorCode.GRADIENT_MISMATCH,
                    f"node {node_id!r} has no trainable parameters to apply gradients to",
                    {"node_id": node_id},
                )
            check_same_names(node_id, "gradients", set(grads), set(params))
            pairs = []
            for name, p in params.items():
                g = torch.as_tensor(grads[name])
                if tuple(g.shape) != tuple(p.shape):
                    raise EngineError(
                        ErrorCode.GRADIENT_MISMATCH,
                        f"node {node_id!r}, parameter {name!r}: gradient has shape "
                        f"{list(g.shape)}, parameter has {list(p.shape)}",
                        {"node_id": node_id, "parameter": name},
                    )
                pairs.append((p, g))
            plan.append((node, pairs))
        applied: dict[str, int] = {}
        for node, pairs in plan:
            for p, g in pairs:
                p.grad = g.to(dtype=p.dtype, device=p.device)
            applied[node.node_id] = len(pairs)
        self._step_run([node for node, _ in plan], epoch_end=epoch_end)
        return applied

    def learning_rate(self, node_ids: Sequence[str]) -> float | None:
        """The learning rate the last differentiable node of ``node_ids`` steps with now (its
        optimizer and scheduler made if they were not yet); ``None`` without one."""
        nodes = [n for n in self._select(node_ids) if n.differentiable]
        return current_lr(self._optimizer(nodes[-1])) if nodes else None


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
