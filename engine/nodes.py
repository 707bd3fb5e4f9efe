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

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from engine.data.npy_rows import Rows
from engine.errors import EngineError
from engine.stepping import Horizon, current_lr
from engine.transfer import autocast, tensors_to, to_cpu, to_device
from protocol.errors import ErrorCode
from protocol.rules.rows import rows_disagree

UNSET: Any = object()
"""The state of a plain filter that was neither fitted nor given a state."""


@runtime_checkable
class DifferentiableFilter(Protocol):
    """What the engine needs from a filter it trains by gradient descent."""

    differentiable: bool
    module: torch.nn.Module
    epochs: int
    batch_size: int | None
    shuffle: bool
    seed: int

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer: ...

    def compute_loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def prepare_input(self, x: Any) -> torch.Tensor: ...

    def prepare_target(self, y: Any) -> torch.Tensor: ...

    def forward(self, x: Any, state: Any) -> Any: ...


def is_differentiable(f: Any) -> bool:
    """True for a filter the engine trains by gradient descent."""
    return bool(getattr(f, "differentiable", False)) and isinstance(
        getattr(f, "module", None), torch.nn.Module
    )


def num_rows(x: Any) -> int:
    """Rows of a batch: the first dimension of an array/tensor, or ``len()``."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    try:
        return len(x)
    except TypeError as exc:
        raise EngineError(
            ErrorCode.BAD_REQUEST, f"input of type {type(x).__name__} has no rows"
        ) from exc


def check_same_rows(x: Any, y: Any) -> None:
    """Refuse labels that do not have one row per input row (the coordinator refuses such a
    job at submit already, in the same words: :mod:`protocol.rules.rows`)."""
    if y is not None and num_rows(x) != num_rows(y):
        raise EngineError(ErrorCode.BAD_REQUEST, rows_disagree(num_rows(x), num_rows(y)))


@dataclass
class Node:
    """One loaded filter, with what the engine keeps for it."""

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
    """Filters by node id, in graph order: looking them up, their states and their optimizers.

    The base of the engine's parts (:mod:`engine.training`, :mod:`engine.gradients`,
    :mod:`engine.stage`), which all work on the same nodes. Modules live on
    ``device`` from :meth:`load` on; plain filters see CPU data.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self.device = torch.device("cpu")
        #: What a named learning-rate schedule spans (``None``: not told yet).
        self.horizon: Horizon | None = None

    def load(self, filters: Mapping[str, Any]) -> None:
        """Replace whatever was loaded by ``filters`` (node id -> filter, in graph order), and
        move each differentiable filter's module to the engine's device, once, for the job."""
        self._nodes = {node_id: Node(node_id, f) for node_id, f in filters.items()}
        for node in self._nodes.values():
            if node.differentiable:
                node.filter.module.to(self.device)

    @property
    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def filter(self, node_id: str) -> Any:
        """The loaded filter object of ``node_id``."""
        return self._node(node_id).filter

    def _node(self, node_id: str) -> Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise EngineError(
                ErrorCode.UNKNOWN_NODE,
                f"node {node_id!r} is not loaded (loaded: {list(self._nodes)})",
                {"node_id": node_id},
            ) from None

    def _select(self, node_ids: Sequence[str] | None) -> list[Node]:
        return list(self._nodes.values()) if node_ids is None else [self._node(n) for n in node_ids]

    def _chain(self, node_ids: Sequence[str], x: Any, y: Any = None) -> list[Node]:
        nodes = self._select(node_ids)
        if not nodes:
            raise EngineError(ErrorCode.BAD_REQUEST, "an empty chain of nodes was given")
        check_same_rows(x, y)
        return nodes

    def _state_for(self, node: Node) -> Any:
        if node.differentiable:
            return node.filter.module.state_dict()
        if node.state is UNSET:
            raise EngineError(
                ErrorCode.NOT_FITTED,
                f"node {node.node_id!r} has no state: fit it or set its state first",
                {"node_id": node.node_id},
            )
        return node.state

    def _check_trains(self, node: Node) -> None:
        if not node.differentiable:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {node.node_id!r} is not differentiable: it has no optimizer",
                {"node_id": node.node_id},
            )

    def _optimizer(self, node: Node) -> torch.optim.Optimizer:
        """The node's optimizer, made on first use and kept (its moments survive), with its
        learning-rate scheduler, if the filter has one."""
        if node.optimizer is None:
            optimizer = node.filter.make_optimizer(list(trainable(node).values()))
            node.scheduler = self._make_scheduler(node, optimizer)
            node.optimizer = optimizer
        return node.optimizer

    def _make_scheduler(self, node: Node, optimizer: torch.optim.Optimizer) -> Any:
        """The filter's scheduler over ``optimizer`` (``None`` without one); a named schedule
        spans :attr:`horizon` (:mod:`engine.stepping`).

        Raises:
            EngineError: ``BAD_REQUEST`` for a named schedule when the horizon is not known.
        """
        make = getattr(node.filter, "make_scheduler", None)
        if make is None:
            return None
        named = isinstance(getattr(node.filter, "scheduler", None), str)
        if named and self.horizon is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {node.node_id!r}: its scheduler {node.filter.scheduler!r} spans the run, "
                "and this engine was not told its length (the schedule command)",
                {"node_id": node.node_id},
            )
        interval = getattr(node.filter, "scheduler_interval", "step")
        total = self.horizon.total(interval) if self.horizon is not None else None
        return make(optimizer, total)

    def _set_lr(
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

    def _step_run(
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
        optimizers = [self._optimizer(node) for node in run]
        lr = current_lr(optimizers[-1])
        if scaler is not None:
            for opt in optimizers:
                scaler.unscale_(opt)
        params = [p for node in run for p in trainable(node).values()]
        if coefficient is not None:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        elif clip and run_setting(run, "clip_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, run_setting(run, "clip_grad_norm"))
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

    def _train_forward(self, run: list[Node], x: torch.Tensor) -> torch.Tensor:
        """Forward ``x`` through the run in training mode, building the autograd graph; each
        filter under its own precision's autocast."""
        out = x
        for node in run:
            node.filter.module.train()
            with autocast(node.filter, self.device):
                out = node.filter.module(out)
        return out

    def _loss(self, run: list[Node], out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of the run's last filter, under its precision's autocast."""
        last = run[-1].filter
        with autocast(last, self.device):
            loss: torch.Tensor = last.compute_loss(out, y)
        return loss

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def _apply(self, node: Node, x: Any, state: Any) -> Any:
        """``forward`` of one node: a differentiable one on the device (input and ``state``
        moved there), a plain one on CPU data. The output may be on the device."""
        if not node.differentiable:
            return node.filter.forward(to_cpu(x), state)
        x = self._on_device(node.filter.prepare_input(x))
        return node.filter.forward(x, tensors_to(state, self.device))


def segments(nodes: list[Node]) -> Iterator[list[Node]]:
    """Each plain node alone; each maximal run of differentiable nodes together."""
    for differentiable, group in itertools.groupby(nodes, key=lambda n: n.differentiable):
        if differentiable:
            yield list(group)
        else:
            yield from ([n] for n in group)


def run_setting(run: Sequence[Node], name: str, default: Any = None) -> Any:
    """A training setting of a run: its last filter's (``clip_grad_norm``, ``accumulate``...),
    as ``batch_size`` and ``epochs`` are."""
    return getattr(run[-1].filter, name, default)


def trainable(node: Node) -> dict[str, torch.nn.Parameter]:
    """The parameters of a differentiable node that take gradients, by name."""
    return {n: p for n, p in node.filter.module.named_parameters() if p.requires_grad}


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


def take(data: Any, index: np.ndarray[Any, Any]) -> Any:
    """Rows ``index`` of an array or tensor (a copy: the held data stays as it was)."""
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(index)]
    if isinstance(data, np.ndarray | Rows):  # a dataset read from disk by rows too
        return np.asarray(data[index])  # reads those rows only
    return np.asarray(data)[index]
