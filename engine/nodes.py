"""The loaded filters of an engine, and what every part of the engine needs from them.

Two kinds of filter are told apart by duck typing, so that the engine needs nothing from the SDK:

* a *plain* filter has ``fit(x, y) -> state`` and ``forward(x, state) -> output``; its state is
  whatever ``fit`` returned and the engine keeps it;
* a *differentiable* filter (the SDK's ``TorchFilter``) has ``differentiable = True`` and the
  members of :class:`DifferentiableFilter`; its state is its module's ``state_dict`` and the engine
  trains it by gradient descent with a persistent optimizer (moments survive across calls).

A chain is cut into *segments*: each plain filter alone, and each maximal run of consecutive
differentiable filters, which trains as one autograd graph (one loss, on the run's last filter;
every filter of the run steps its own optimizer).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from engine.batches import call_module, num_rows
from engine.errors import EngineError
from engine.step_functions import BatchLoss, StepModel, step_of, step_result, takes_labels
from engine.transfer import autocast, cpu_tensor, tensors_to, to_cpu, to_device
from protocol.errors import ErrorCode
from protocol.options.training import TrainingOptions
from protocol.rules.rows import (
    model_loss_with_labels,
    needs_labels,
    rows_disagree,
    step_not_alone,
)

UNSET: Any = object()
"""The state of a plain filter that was neither fitted nor given a state."""


@runtime_checkable
class DifferentiableFilter(Protocol):
    """What the engine needs from a filter it trains by gradient descent."""

    differentiable: bool
    module: torch.nn.Module
    training: TrainingOptions  # how a chain it ends trains

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer: ...

    def compute_loss(self, output: Any, y: Any) -> torch.Tensor: ...

    def prepare_input(self, x: Any) -> Any: ...

    def prepare_target(self, y: Any) -> Any: ...

    def forward(self, x: Any, state: Any) -> Any: ...


def is_differentiable(f: Any) -> bool:
    """True for a filter the engine trains by gradient descent."""
    return bool(getattr(f, "differentiable", False)) and isinstance(
        getattr(f, "module", None), torch.nn.Module
    )


def check_same_rows(x: Any, y: Any) -> None:
    """Refuse labels that do not have one row per input row (the coordinator refuses such a
    job at submit already, in the same words: :mod:`protocol.rules.rows`)."""
    if y is not None and num_rows(x) != num_rows(y):
        raise EngineError(ErrorCode.BAD_REQUEST, rows_disagree(num_rows(x), num_rows(y)))


@dataclass
class Node:
    """One loaded filter, with what the engine keeps for it: its state (plain filters), and
    what :class:`~engine.optimizers.Optimizers` makes and keeps for it (differentiable ones).
    A load replaces the nodes, and all of it with them."""

    node_id: str
    filter: Any
    state: Any = UNSET  # plain filters only: what fit returned
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # its learning-rate scheduler, made with the optimizer
    scaler: torch.amp.GradScaler | None = None  # fp16 training loop only, on a run's last node

    @property
    def differentiable(self) -> bool:
        return is_differentiable(self.filter)


class Nodes:
    """Filters by node id, in graph order: looking them up, their states, and forward passes
    through them on the engine's device.

    Every part of the engine (:class:`engine.engine.Engine`) holds the same one: what one part
    trains, the others see. Modules live on ``device`` from :meth:`load` on; plain filters see
    CPU data.

    Args:
        device: where the differentiable filters' modules live and train.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self._nodes: dict[str, Node] = {}

    def load(self, filters: Mapping[str, Any]) -> None:
        """Replace whatever was loaded by ``filters`` (node id -> filter, in graph order), and
        move each differentiable filter's module to the engine's device, once, for the job."""
        self._nodes = {node_id: Node(node_id, f) for node_id, f in filters.items()}
        for node in self._nodes.values():
            if node.differentiable and not holds_rows(node):  # (moved as it is sharded)
                node.filter.module.to(self.device)

    @property
    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def filter(self, node_id: str) -> Any:
        """The loaded filter object of ``node_id``."""
        return self.node(node_id).filter

    # -- looking nodes up ---------------------------------------------------------------------

    def node(self, node_id: str) -> Node:
        """The loaded node ``node_id``.

        Raises:
            EngineError: ``UNKNOWN_NODE`` for a node that is not loaded.
        """
        try:
            return self._nodes[node_id]
        except KeyError:
            raise EngineError(
                ErrorCode.UNKNOWN_NODE,
                f"node {node_id!r} is not loaded (loaded: {list(self._nodes)})",
                {"node_id": node_id},
            ) from None

    def select(self, node_ids: Sequence[str] | None) -> list[Node]:
        """The nodes ``node_ids``, in that order; every loaded node for ``None``."""
        return list(self._nodes.values()) if node_ids is None else [self.node(n) for n in node_ids]

    def chain(self, node_ids: Sequence[str], x: Any, y: Any = None) -> list[Node]:
        """The nodes of a chain that ``x`` (and labels ``y``, one per row) go through.

        Raises:
            EngineError: ``BAD_REQUEST`` for an empty chain or labels that are not one a row.
        """
        nodes = self.select(node_ids)
        if not nodes:
            raise EngineError(ErrorCode.BAD_REQUEST, "an empty chain of nodes was given")
        check_same_rows(x, y)
        return nodes

    # -- states -------------------------------------------------------------------------------

    def state_of(self, node: Node) -> Any:
        """The state ``node`` holds: a differentiable module's live ``state_dict``, a plain
        filter's fit result.

        Raises:
            EngineError: ``NOT_FITTED`` for a plain filter neither fitted nor given a state.
        """
        if node.differentiable:
            return node.filter.module.state_dict()
        if node.state is UNSET:
            raise EngineError(
                ErrorCode.NOT_FITTED,
                f"node {node.node_id!r} has no state: fit it or set its state first",
                {"node_id": node.node_id},
            )
        return node.state

    def fit_plain(self, node: Node, x: Any, y: Any) -> Any:
        """Fit the plain filter of ``node`` on ``x`` (and ``y``) and keep what its ``fit``
        returned: its state, which this returns."""
        node.state = node.filter.fit(x, y)
        return node.state

    def get_state(
        self, node_ids: Sequence[str] | None = None, live: bool = False
    ) -> dict[str, Any]:
        """A snapshot of each node's state: a differentiable filter's ``state_dict`` (detached
        copies of its tensors, on the CPU), a plain filter's fit result.

        ``live``: the tensors on the CPU as they stand, not copied (those elsewhere copied to
        it), for a reply encoded before the next request can step them — as the optimizers'
        states are (:meth:`engine.optimizers.Optimizers.get_optimizer_state`): a checkpoint's
        snapshot sent with a chunk's reply is copied once, into the reply.
        """
        out: dict[str, Any] = {}
        take = cpu_tensor if live else cpu_copy
        for node in self.select(node_ids):
            if node.differentiable:
                sd = _whole(node).state_dict()
                out[node.node_id] = {k: take(v.detach()) for k, v in sd.items()}
            else:
                out[node.node_id] = self.state_of(node)
        return out

    def state_digests(self, node_ids: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
        """Each differentiable node's state as digests: its ``state_dict``'s tensors' SHA-256
        (:func:`tensor_digest`) by name; plain nodes are left out."""
        return {
            node.node_id: {k: tensor_digest(v) for k, v in _whole(node).state_dict().items()}
            for node in self.select(node_ids)
            if node.differentiable
        }

    def set_state(self, states: Mapping[str, Any]) -> None:
        """Load states as :meth:`get_state` returns them (tensors may also be numpy arrays)."""
        nodes = [self.node(node_id) for node_id in states]
        for node in nodes:
            state = states[node.node_id]
            if node.differentiable:
                _load_module_state(node, state)
            else:
                node.state = state

    def get_buffers(self, node_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The buffers of the differentiable nodes that have any (BatchNorm's running
        statistics...), by node and name: CPU copies."""
        out: dict[str, dict[str, Any]] = {}
        for node in self.select(node_ids):
            if node.differentiable:
                named = dict(node.filter.module.named_buffers())
                if named:
                    out[node.node_id] = {k: cpu_copy(v) for k, v in named.items()}
        return out

    def set_buffers(self, buffers: Mapping[str, Mapping[str, Any]]) -> None:
        """Copy ``buffers`` (as :meth:`get_buffers` gives them) into the nodes' modules: a
        data-parallel replica takes replica 0's (DistributedDataParallel's
        ``broadcast_buffers``). Every one is checked before any is written.

        Raises:
            EngineError: ``STATE_MISMATCH`` for names or shapes that are not the module's.
        """
        plan = []
        for node_id, given in buffers.items():
            node = self.node(node_id)
            named = dict(node.filter.module.named_buffers()) if node.differentiable else {}
            check_same_names(node_id, "buffers", set(given), set(named))
            for name, value in given.items():
                tensor = torch.as_tensor(value)
                if tensor.shape != named[name].shape:
                    raise EngineError(
                        ErrorCode.STATE_MISMATCH,
                        f"node {node_id!r}, buffer {name!r}: has shape {list(tensor.shape)}, "
                        f"the module's has {list(named[name].shape)}",
                        {"node_id": node_id, "key": name},
                    )
                plan.append((named[name], tensor))
        with torch.no_grad():
            for target, tensor in plan:
                target.copy_(tensor)

    # -- forward passes on the device ---------------------------------------------------------

    def on_device(self, batch: Any) -> Any:
        """``batch`` (a tensor, or a tuple or dict of them) on the engine's device."""
        if isinstance(batch, torch.Tensor):
            return to_device(batch, self.device)
        return tensors_to(batch, self.device)

    def apply(self, node: Node, x: Any, state: Any) -> Any:
        """``forward`` of one node: a differentiable one on the device (input and ``state``
        moved there), a plain one on CPU data. The output may be on the device."""
        if not node.differentiable:
            return node.filter.forward(to_cpu(x), state)
        x = self.on_device(node.filter.prepare_input(x))
        return node.filter.forward(x, tensors_to(state, self.device))

    def train_forward(self, run: list[Node], x: Any, *, training: bool = True) -> Any:
        """Forward ``x`` through the run in training mode (building the autograd graph) or in
        evaluation mode; each filter under its own precision's autocast, its module called as
        its ``inputs`` says."""
        out = x
        for node in run:
            node.filter.module.train(training)
            with autocast(node.filter, self.device):
                out = call_module(node.filter, out)
        return out

    def loss(self, run: list[Node], out: Any, y: Any) -> torch.Tensor:
        """The loss of the run's last filter, under its precision's autocast."""
        last = run[-1].filter
        with autocast(last, self.device):
            loss: torch.Tensor = last.compute_loss(out, y)
        return loss

    def batch_loss(
        self,
        run: list[Node],
        x: Any,
        y: Any,
        through: Callable[..., Any] | None = None,
        *,
        training: bool = True,
    ) -> BatchLoss:
        """What one training step computes on a batch already on the device, in training (or
        evaluation) mode: its run's output and loss, or, with a ``step`` function on the run's
        filter, what that returns (:mod:`engine.step_functions`). ``through`` stands for the
        run's modules (a DistributedDataParallel wrapping them, whose forward all-reduces).

        Raises:
            EngineError: ``BAD_REQUEST`` for a step function in a run of several filters.
        """
        last = run[-1].filter
        step = step_of(last)
        if step is None:
            out = self.train_forward(run, x, training=training) if through is None else through(x)
            return BatchLoss(self.loss(run, out, y), out, {})
        if len(run) > 1:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                step_not_alone(run[-1].node_id, [n.node_id for n in run[:-1]]),
                {"node_id": run[-1].node_id},
            )
        last.module.train(training)
        model = last.module if through is None else StepModel(through, last.module)
        with autocast(last, self.device):
            returned = step(model, x if y is None else (x, y))
        loss, metrics = step_result(returned, run[-1].node_id)
        return BatchLoss(loss, None, metrics)

    def check_labels(self, run: list[Node], y: Any, doing: str) -> None:
        """Refuse to train or evaluate ``run`` without labels its loss needs, or with labels
        that a model computing its own loss has nowhere to put.

        Raises:
            EngineError: ``BAD_REQUEST``, naming the run's last node.
        """
        last = run[-1]
        if y is None and takes_labels(last.filter):
            raise EngineError(
                ErrorCode.BAD_REQUEST, needs_labels(last.node_id, doing), {"node_id": last.node_id}
            )
        if y is not None and getattr(last.filter, "loss", None) == "model":
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                model_loss_with_labels(last.node_id),
                {"node_id": last.node_id},
            )


def segments(nodes: list[Node]) -> Iterator[list[Node]]:
    """Each plain node alone; each maximal run of differentiable nodes together."""
    for differentiable, group in itertools.groupby(nodes, key=lambda n: n.differentiable):
        if differentiable:
            yield list(group)
        else:
            yield from ([n] for n in group)


def run_training(run: Sequence[Node]) -> TrainingOptions:
    """How a run trains: its last filter's training options."""
    training: TrainingOptions = run[-1].filter.training
    return training


def trainable(node: Node) -> dict[str, torch.nn.Parameter]:
    """The parameters of a differentiable node that take gradients, by name."""
    return {n: p for n, p in node.filter.module.named_parameters() if p.requires_grad}


def check_trains(node: Node) -> None:
    """Refuse a plain node where an optimizer is asked for.

    Raises:
        EngineError: ``BAD_REQUEST``: the node is not differentiable.
    """
    if not node.differentiable:
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"node {node.node_id!r} is not differentiable: it has no optimizer",
            {"node_id": node.node_id},
        )


def check_same_names(node_id: str, what: str, given: set[str], expected: set[str]) -> None:
    """Refuse gradients or states whose names are not those of this node's model."""
    if given != expected:
        raise EngineError(
            ErrorCode.GRADIENT_MISMATCH if what == "gradients" else ErrorCode.STATE_MISMATCH,
            f"node {node_id!r}: {what} are not for the same model: missing "
            f"{sorted(expected - given)}, unexpected {sorted(given - expected)}",
            {
                "node_id": node_id,
                "missing": sorted(expected - given),
                "unexpected": sorted(given - expected),
            },
        )


def tensor_digest(tensor: torch.Tensor) -> str:
    """The SHA-256 (hex) of ``tensor``'s dtype, shape and bytes: equal for equal tensors, and
    two that differ anywhere differ."""
    flat = cpu_tensor(tensor.detach()).contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(flat.numpy().data)
    return digest.hexdigest()


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor`` on the CPU, its memory its own."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def holds_rows(node: Node) -> bool:
    """Whether ``node``'s module holds only this replica's rows of some parameter (a sharded
    job's replica, :func:`protocol.filters.split_rows`): they are ``meta`` until it is
    sharded."""
    return any(p.is_meta for p in node.filter.module.parameters())


def _whole(node: Node) -> torch.nn.Module:
    """``node``'s module, whose state can be read or set whole.

    Raises:
        EngineError: ``BAD_REQUEST``: it holds only this replica's rows of its parameters.
    """
    if holds_rows(node):
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"node {node.node_id!r} holds only this replica's rows of its parameters until it "
            "is sharded (a sharded plan): its state cannot be read or set whole",
            {"node_id": node.node_id},
        )
    module: torch.nn.Module = node.filter.module
    return module


def _load_module_state(node: Node, state: Any) -> None:
    module = _whole(node)
    if not isinstance(state, Mapping):
        raise EngineError(
            ErrorCode.STATE_MISMATCH,
            f"node {node.node_id!r} is differentiable: its state is a mapping of tensors, "
            f"not {type(state).__name__}",
            {"node_id": node.node_id},
        )
    current = module.state_dict()
    check_same_names(node.node_id, "state keys", set(state), set(current))
    converted = {}
    for key, value in state.items():
        tensor = torch.as_tensor(value) if isinstance(value, np.ndarray | np.generic) else value
        if not isinstance(tensor, torch.Tensor) or tensor.shape != current[key].shape:
            shape = list(getattr(tensor, "shape", [])) if tensor is not None else None
            raise EngineError(
                ErrorCode.STATE_MISMATCH,
                f"node {node.node_id!r}, key {key!r}: state has shape {shape}, "
                f"module has {list(current[key].shape)}",
                {"node_id": node.node_id, "key": key},
            )
        converted[key] = tensor
    module.load_state_dict(converted)
