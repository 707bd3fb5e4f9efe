"""The filter execution engine: fit, forward and train a chain of filters in one process.

This is the code that runs user filters, wherever they run: ``graph.fit`` in the user's process
builds an :class:`Engine` over copies of the graph's filters, and the filter daemon
(:mod:`worker.daemon`) holds one :class:`Engine` per job and maps each command onto one method.
There is no second copy of the training loop anywhere.

Two kinds of filter are told apart by duck typing, so that this module needs nothing from the SDK:

* a *plain* filter has ``fit(x, y) -> state`` and ``forward(x, state) -> output``; its state is
  whatever ``fit`` returned and the engine keeps it;
* a *differentiable* filter (the SDK's ``TorchFilter``) has ``differentiable = True`` and the
  members of :class:`DifferentiableFilter`; its state is its module's ``state_dict`` and the engine
  trains it by gradient descent with a persistent optimizer (moments survive across calls).

A chain is cut into *segments*: each plain filter alone, and each maximal run of consecutive
differentiable filters, which trains as one autograd graph (one loss, on the run's last filter;
every filter of the run steps its own optimizer).

The gradient primitives follow the lessons of the original runtime (reference §6.2): ``fit`` and
``composite_fit`` of a differentiable filter run forward, loss and backward but never step — whoever
owns the round owns the step; ``apply_gradients`` writes a gradient and steps the persistent
optimizer; no gradient at all is an error, never an empty success.

A pipeline stage (ModelParallel) uses :meth:`Engine.stage_forward`, :meth:`Engine.stage_backward`
and :meth:`Engine.stage_step`: the micro-batches of a global batch go forward and backward one by
one, their gradients accumulate on the parameters, and the stage steps once per global batch
(GPipe, Huang et al. 2019).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from protocol.batching import batches, generator
from protocol.errors import ErrorCode
from worker.errors import EngineError


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
    """

    output: Any
    states: dict[str, Any]
    loss: float | None
    rows: int
    epoch_losses: list[float] = field(default_factory=list)


_UNSET: Any = object()


@dataclass
class _Node:
    node_id: str
    filter: Any
    state: Any = _UNSET  # plain filters only: what fit returned
    optimizer: torch.optim.Optimizer | None = None

    @property
    def differentiable(self) -> bool:
        return is_differentiable(self.filter)


@dataclass
class _InFlight:
    """What a pipeline stage keeps of one micro-batch between its forward and its backward."""

    input: torch.Tensor | None  # the leaf whose gradient goes back; None on the first stage
    output: torch.Tensor  # the activation sent on, or (last stage) the scaled loss
    last: bool


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


class Engine:
    """Filters by node id (in graph order), their states and their persistent optimizers."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._staged: dict[str, tuple[Any, Any]] = {}
        self._in_flight: dict[int, _InFlight] = {}  # pipeline micro-batches, by micro id
        self._batch_open = False  # a pipeline global batch has started and not been stepped

    # -- loading ------------------------------------------------------------------------------

    def load(self, filters: Mapping[str, Any]) -> None:
        """Replace whatever was loaded by ``filters`` (node id -> filter, in graph order)."""
        self._nodes = {node_id: _Node(node_id, f) for node_id, f in filters.items()}
        self._in_flight.clear()  # they belong to the modules just replaced
        self._batch_open = False

    @property
    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def filter(self, node_id: str) -> Any:
        """The loaded filter object of ``node_id``."""
        return self._node(node_id).filter

    # -- staged data --------------------------------------------------------------------------

    def stage(self, name: str, x: Any, y: Any = None) -> int:
        """Keep ``x`` (and ``y``) under ``name`` for later commands; returns the row count.

        Data-parallel and federated jobs send a worker its data once and then only name rows
        of it, so that per step only gradients (or per round only states) cross the wire.
        """
        if y is not None and num_rows(x) != num_rows(y):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"x has {num_rows(x)} rows and y has {num_rows(y)}: they must match",
            )
        self._staged[name] = (x, y)
        return num_rows(x)

    def staged(self, name: str, rows: Sequence[int] | None = None) -> tuple[Any, Any]:
        """The data staged under ``name``, or its ``rows`` (in that order)."""
        try:
            x, y = self._staged[name]
        except KeyError:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"no data staged as {name!r} (staged: {sorted(self._staged)})",
            ) from None
        if rows is None:
            return x, y
        n = num_rows(x)
        index = np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= n):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"rows of {name!r} must lie in [0, {n}); "
                f"got {int(index.min())}..{int(index.max())}",
            )
        return _take(x, index), None if y is None else _take(y, index)

    # -- fit ----------------------------------------------------------------------------------

    def fit(self, node_id: str, x: Any, y: Any = None) -> FitResult:
        """Fit one node on ``x``: a plain filter's ``fit``, or one gradient pass (no step)."""
        node = self._node(node_id)
        if node.differentiable:
            loss = self._backward_run([node], x, y)[1]
            return FitResult(None, self.get_state([node_id]), loss, num_rows(x))
        node.state = node.filter.fit(x, y)
        return FitResult(None, {node_id: node.state}, None, num_rows(x))

    def composite_fit(self, node_ids: Sequence[str], x: Any, y: Any = None) -> FitResult:
        """One pass over a chain: plain filters fit then forward; each differentiable run does one
        forward, loss and backward over all of ``x`` and leaves its gradients on the parameters,
        without stepping (a data-parallel replica's half of a step)."""
        nodes = self._chain(node_ids, x, y)
        out, loss = x, None
        for segment in _segments(nodes):
            if segment[0].differentiable:
                out, loss = self._backward_run(segment, out, y)
            else:
                out = self._fit_plain(segment[0], out, y)
        return FitResult(out, self.get_state(node_ids), loss, num_rows(x))

    def gradient_pass(self, node_ids: Sequence[str], x: Any, y: Any = None) -> FitResult:
        """A replica's half of a data-parallel step: plain filters only *apply* the state they
        hold (fitted once, before training), each differentiable run does one forward, loss and
        backward over ``x`` and leaves its gradients on the parameters. No step, no states."""
        nodes = self._chain(node_ids, x, y)
        out, loss = x, None
        for segment in _segments(nodes):
            if segment[0].differentiable:
                out, loss = self._backward_run(segment, out, y)
            else:
                node = segment[0]
                out = node.filter.forward(out, self._state_for(node))
        return FitResult(None, {}, loss, num_rows(x))

    def batched_fit(
        self,
        node_ids: Sequence[str],
        x: Any,
        y: Any = None,
        batch_size: int | None = None,
        *,
        epochs: int | None = None,
        prox_mu: float = 0.0,
        reset_optimizer: bool = False,
    ) -> FitResult:
        """Train a chain to completion: what ``graph.fit`` does.

        Plain filters are fitted on all rows, in order, each feeding the next. A differentiable run
        trains for the epochs of its last filter, in batches of ``batch_size`` (default: the last
        filter's), one optimizer step of every filter in the run per batch, on the mean loss of the
        batch. With ``shuffle`` the rows of each epoch are permuted by a ``torch.Generator``
        seeded with the filter's ``seed``; without it they are taken in order.

        ``epochs`` overrides the filters' own (a federated round's local epochs); ``prox_mu``
        adds FedProx's proximal term (Li et al. 2020) to every batch's loss:
        ``mu / 2 * ||w - w_start||^2`` over the run's parameters, ``w_start`` being the weights
        this call started from (the round's global model). ``reset_optimizer`` drops the chain's
        kept optimizers first, so training starts from fresh ones (no momentum or moments left
        from earlier calls): a federated client's optimizer lives for one round.
        """
        nodes = self._chain(node_ids, x, y)
        if reset_optimizer:
            for node in nodes:
                node.optimizer = None
        out, loss, epoch_losses = x, None, []
        for segment in _segments(nodes):
            if segment[0].differentiable:
                epoch_losses = self._train_run(segment, out, y, batch_size, epochs, prox_mu)
                loss = epoch_losses[-1] if epoch_losses else None
                out = self._forward_segment(segment, out)
            else:
                out = self._fit_plain(segment[0], out, y)
        return FitResult(out, self.get_state(node_ids), loss, num_rows(x), epoch_losses)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, node_id: str, x: Any, state: Any = None) -> Any:
        """``forward`` of one node with ``state``, or with the state it holds."""
        node = self._node(node_id)
        return node.filter.forward(x, self._state_for(node) if state is None else state)

    def composite_forward(
        self, node_ids: Sequence[str], x: Any, states: Mapping[str, Any] | None = None
    ) -> Any:
        """Forward ``x`` through a chain, each node with ``states[id]`` or its held state."""
        for node in self._chain(node_ids, x):
            if states is not None and node.node_id in states:
                x = node.filter.forward(x, states[node.node_id])
            else:
                x = node.filter.forward(x, self._state_for(node))
        return x

    # -- state --------------------------------------------------------------------------------

    def get_state(self, node_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """A snapshot of each node's state: a differentiable filter's ``state_dict`` (detached
        copies of its tensors), a plain filter's fit result."""
        out: dict[str, Any] = {}
        for node in self._select(node_ids):
            if node.differentiable:
                sd = node.filter.module.state_dict()
                out[node.node_id] = {k: v.detach().clone() for k, v in sd.items()}
            else:
                out[node.node_id] = self._state_for(node)
        return out

    def set_state(self, states: Mapping[str, Any]) -> None:
        """Load states as :meth:`get_state` returns them (tensors may also be numpy arrays)."""
        nodes = [self._node(node_id) for node_id in states]
        for node in nodes:
            state = states[node.node_id]
            if node.differentiable:
                _load_module_state(node, state)
            else:
                node.state = state

    def get_optimizer_state(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """Each differentiable node's persistent optimizer, as its ``state_dict()``: momentum
        buffers, Adam moments, step counts and the hyperparameters of its groups; ``None`` for an
        optimizer not made yet (no step taken).

        With :meth:`get_state` this is all a replica is: an elastic data-parallel job brings a
        replacement worker to a survivor's exact point with the pair (the tensors are the live
        ones: the reply is encoded before the next command can step them).

        Raises:
            EngineError: ``BAD_REQUEST`` for a node that is not differentiable.
        """
        out: dict[str, Any] = {}
        for node in self._select(node_ids):
            self._check_trains(node)
            out[node.node_id] = None if node.optimizer is None else node.optimizer.state_dict()
        return out

    def set_optimizer_state(self, states: Mapping[str, Any]) -> None:
        """Replace nodes' optimizers by fresh ones loaded with ``states`` (as
        :meth:`get_optimizer_state` returns them; ``None`` drops the optimizer, so the next step
        makes a new one). Every state is loaded before any node's optimizer is replaced.

        Raises:
            EngineError: ``BAD_REQUEST`` for a node that is not differentiable,
                ``STATE_MISMATCH`` for a state that is not of this node's optimizer.
        """
        made: dict[str, torch.optim.Optimizer | None] = {}
        for node_id, state in states.items():
            node = self._node(node_id)
            self._check_trains(node)
            if state is None:
                made[node_id] = None
                continue
            params = _trainable(node)
            optimizer = node.filter.make_optimizer(list(params.values()))
            try:
                optimizer.load_state_dict(_cloned(state))
            except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"node {node_id!r}: the optimizer state does not fit its "
                    f"{type(optimizer).__name__}: {type(exc).__name__}: {exc}",
                    {"node_id": node_id},
                ) from exc
            _check_optimizer_shapes(node_id, optimizer, params)
            made[node_id] = optimizer
        for node_id, optimizer in made.items():
            self._nodes[node_id].optimizer = optimizer

    # -- gradients ----------------------------------------------------------------------------

    def get_gradients(self, node_ids: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The gradients left by the last ``fit``/``composite_fit``, by node and parameter name.

        ``node_ids=None`` means every differentiable node. The tensors are the live ``.grad``
        tensors (the engine always replaces, never mutates, a gradient): copy them to keep them
        across a later backward.

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
            params = _trainable(node)
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
            out[node.node_id] = {name: p.grad for name, p in params.items()}
        return out

    def apply_gradients(self, gradients: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        """Write ``gradients`` onto the parameters and step each node's persistent optimizer.

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
        plan: list[tuple[_Node, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = []
        for node_id, grads in gradients.items():
            node = self._node(node_id)
            params = _trainable(node) if node.differentiable else {}
            if not params:
                raise EngineError(
                    ErrorCode.GRADIENT_MISMATCH,
                    f"node {node_id!r} has no trainable parameters to apply gradients to",
                    {"node_id": node_id},
                )
            _check_same_names(node_id, "gradients", set(grads), set(params))
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
            self._optimizer(node).step()
            applied[node.node_id] = len(pairs)
        return applied

    # -- pipeline stage (ModelParallel) -------------------------------------------------------

    def stage_forward(
        self,
        node_ids: Sequence[str],
        micro: int,
        x: Any,
        y: Any = None,
        scale: float = 1.0,
        last: bool = False,
        *,
        first: bool = False,
    ) -> Any:
        """Forward micro-batch ``micro`` through this pipeline stage and keep what its backward
        needs.

        A stage is zero or more plain filters followed by one run of differentiable filters. The
        plain filters only *apply* the state they hold (fitted beforehand with :meth:`fit` or
        :meth:`composite_fit`, then held fixed, as single-process training holds them); the run
        goes forward in training mode. Gradients cannot flow back through a plain filter, so
        plain filters may only open the first stage.

        On a stage other than the first, a floating ``x`` is the previous stage's activation:
        it becomes a leaf that requires grad, so that :meth:`stage_backward` can send its
        gradient back. On the first stage (``first``, or an input that is not floating) the
        input needs no gradient.

        On the last stage the loss of the run's last filter is kept, multiplied by ``scale``:
        with ``scale = n_micro / N`` (rows of this micro-batch over rows of the global batch) the
        scaled losses of a global batch sum to its mean loss, so the gradients accumulated over
        its micro-batches are those of the whole batch (GPipe, Huang et al. 2019).

        Args:
            node_ids: the stage's nodes, in graph order.
            micro: the micro-batch id; unique among the micro-batches in flight.
            x: the micro-batch (first stage) or the previous stage's activation.
            y: the labels; required on the last stage, ignored elsewhere.
            scale: the weight of this micro-batch's loss (last stage only).
            last: this is the last stage: compute and keep the loss.
            first: this is the first stage: the input needs no gradient.

        Returns:
            The stage's output activation, detached; on the last stage
            ``{"loss": unscaled loss, "rows": rows}``.

        Raises:
            EngineError: ``BAD_REQUEST`` for a micro id already in flight, a last stage without
                labels, or a stage that is not plain filters then one differentiable run.
        """
        nodes = self._chain(node_ids, x, y if last else None)
        if micro in self._in_flight:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batch {micro} is already in flight (in flight: {sorted(self._in_flight)})",
                {"micro": micro, "in_flight": sorted(self._in_flight)},
            )
        plain, run = _stage_parts(nodes)
        if plain and not first:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"plain filters {[n.node_id for n in plain]} open a stage that is not the first: "
                "gradients cannot flow back through them",
                {"node_ids": [n.node_id for n in plain]},
            )
        if last and y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {run[-1].node_id!r} ends the last stage: its forward needs labels (y)",
                {"node_id": run[-1].node_id, "micro": micro},
            )
        if not self._batch_open:
            # The first forward since the last step (or the load) opens a global batch: only its
            # micro-batches may contribute, whatever fit or gradient_pass left on the parameters.
            for node in run:
                node.filter.module.zero_grad(set_to_none=True)
            self._batch_open = True
        for node in plain:
            x = node.filter.forward(x, self._state_for(node))
        xt = run[0].filter.prepare_input(x)
        leaf: torch.Tensor | None = None
        if not first and xt.is_floating_point():
            leaf = xt.detach().requires_grad_(True)  # detach: the caller's tensor is left alone
            xt = leaf
        out = self._train_forward(run, xt)
        if not last:
            self._in_flight[micro] = _InFlight(leaf, out, last=False)
            return out.detach()
        loss = run[-1].filter.compute_loss(out, run[-1].filter.prepare_target(y))
        self._in_flight[micro] = _InFlight(leaf, loss * scale, last=True)
        return {"loss": float(loss.detach()), "rows": num_rows(xt)}

    def stage_backward(self, micro: int, grad_output: Any = None) -> torch.Tensor | None:
        """Backward micro-batch ``micro`` through this stage; gradients accumulate.

        The last stage backpropagates its kept (scaled) loss, the others the gradient of the
        next stage's input, ``grad_output``. Parameter gradients are added to what the earlier
        micro-batches of the global batch left, never zeroed in between: GPipe's accumulation,
        so that :meth:`stage_step` applies the whole batch's gradient in one step.

        Returns:
            The gradient w.r.t. the stage's input, for the previous stage; ``None`` on the first
            stage (its input had no gradient).

        Raises:
            EngineError: ``BAD_REQUEST`` for a micro id not in flight (naming those that are), a
                ``grad_output`` on the last stage or none elsewhere, or one of the wrong shape.
        """
        flight = self._in_flight.get(micro)
        if flight is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batch {micro} is not in flight (in flight: {sorted(self._in_flight)})",
                {"micro": micro, "in_flight": sorted(self._in_flight)},
            )
        if flight.last:
            if grad_output is not None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro} ended on the last stage: it backpropagates its loss "
                    "and takes no grad_output",
                    {"micro": micro},
                )
            grad = None
        else:
            if grad_output is None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro} needs the gradient of this stage's output (grad_output)",
                    {"micro": micro},
                )
            grad = torch.as_tensor(grad_output)
            if tuple(grad.shape) != tuple(flight.output.shape):
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro}: grad_output has shape {list(grad.shape)}, the "
                    f"stage's output has {list(flight.output.shape)}",
                    {"micro": micro},
                )
            grad = grad.to(dtype=flight.output.dtype, device=flight.output.device)
        del self._in_flight[micro]
        torch.autograd.backward(flight.output, grad)
        if flight.input is None:
            return None
        if flight.input.grad is None:  # the output does not depend on the input
            return torch.zeros_like(flight.input, requires_grad=False)
        return flight.input.grad

    def stage_step(self, node_ids: Sequence[str]) -> int:
        """End a global batch: step every differentiable node's persistent optimizer once on the
        gradients its micro-batches accumulated, then zero them (``set_to_none``).

        Gradients start as ``None`` after :meth:`load` and are zeroed here after each step, so
        each global batch accumulates from zero without relying on the order of micro ids; the
        first :meth:`stage_forward` after a step also clears whatever another command left.

        Returns:
            How many parameters were stepped (those with a gradient).

        Raises:
            EngineError: ``BAD_REQUEST`` while micro-batches are in flight (naming them);
                ``NO_GRADIENTS`` when no differentiable node has a gradient to step on.
        """
        if self._in_flight:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batches {sorted(self._in_flight)} are still in flight: backward them "
                "before stepping",
                {"in_flight": sorted(self._in_flight)},
            )
        nodes = [n for n in self._select(node_ids) if n.differentiable]
        stepped = sum(1 for node in nodes for p in _trainable(node).values() if p.grad is not None)
        if not stepped:
            raise EngineError(
                ErrorCode.NO_GRADIENTS,
                f"nodes {list(node_ids)} have no gradients to step on "
                "(run stage_forward and stage_backward first)",
                {"node_ids": list(node_ids)},
            )
        for node in nodes:
            optimizer = self._optimizer(node)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self._batch_open = False
        return stepped

    # -- internals ----------------------------------------------------------------------------

    def _node(self, node_id: str) -> _Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise EngineError(
                ErrorCode.UNKNOWN_NODE,
                f"node {node_id!r} is not loaded (loaded: {list(self._nodes)})",
                {"node_id": node_id},
            ) from None

    def _select(self, node_ids: Sequence[str] | None) -> list[_Node]:
        return list(self._nodes.values()) if node_ids is None else [self._node(n) for n in node_ids]

    def _chain(self, node_ids: Sequence[str], x: Any, y: Any = None) -> list[_Node]:
        nodes = self._select(node_ids)
        if not nodes:
            raise EngineError(ErrorCode.BAD_REQUEST, "an empty chain of nodes was given")
        if y is not None and num_rows(x) != num_rows(y):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"x has {num_rows(x)} rows and y has {num_rows(y)}: they must match",
            )
        return nodes

    def _state_for(self, node: _Node) -> Any:
        if node.differentiable:
            return node.filter.module.state_dict()
        if node.state is _UNSET:
            raise EngineError(
                ErrorCode.NOT_FITTED,
                f"node {node.node_id!r} has no state: fit it or set its state first",
                {"node_id": node.node_id},
            )
        return node.state

    def _check_trains(self, node: _Node) -> None:
        if not node.differentiable:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {node.node_id!r} is not differentiable: it has no optimizer",
                {"node_id": node.node_id},
            )

    def _fit_plain(self, node: _Node, x: Any, y: Any) -> Any:
        node.state = node.filter.fit(x, y)
        return node.filter.forward(x, node.state)

    def _optimizer(self, node: _Node) -> torch.optim.Optimizer:
        """The node's optimizer, made on first use and kept (its moments survive)."""
        if node.optimizer is None:
            node.optimizer = node.filter.make_optimizer(list(_trainable(node).values()))
        return node.optimizer

    def _run_loss(self, run: list[_Node], x: torch.Tensor, y: torch.Tensor) -> Any:
        """Forward ``x`` through the run in training mode; the loss of its last filter."""
        out = self._train_forward(run, x)
        return run[-1].filter.compute_loss(out, y), out

    def _train_forward(self, run: list[_Node], x: torch.Tensor) -> torch.Tensor:
        """Forward ``x`` through the run in training mode, building the autograd graph."""
        out = x
        for node in run:
            node.filter.module.train()
            out = node.filter.module(out)
        return out

    def _backward_run(self, run: list[_Node], x: Any, y: Any) -> tuple[Any, float]:
        if y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {run[-1].node_id!r} is differentiable: fitting it needs labels (y)",
                {"node_id": run[-1].node_id},
            )
        for node in run:
            node.filter.module.zero_grad(set_to_none=True)
        xt, yt = run[0].filter.prepare_input(x), run[-1].filter.prepare_target(y)
        loss, out = self._run_loss(run, xt, yt)
        loss.backward()
        return out.detach(), float(loss.detach())

    def _train_run(
        self,
        run: list[_Node],
        x: Any,
        y: Any,
        batch_size: int | None,
        epochs: int | None = None,
        prox_mu: float = 0.0,
    ) -> list[float]:
        last = run[-1].filter
        if y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {run[-1].node_id!r} is differentiable: training it needs labels (y)",
                {"node_id": run[-1].node_id},
            )
        xt, yt = run[0].filter.prepare_input(x), last.prepare_target(y)
        n = num_rows(xt)
        size = batch_size or last.batch_size or n
        optimizers = [self._optimizer(node) for node in run]
        params = [p for node in run for p in _trainable(node).values()]
        anchor = [p.detach().clone() for p in params] if prox_mu else []
        epoch_losses = []
        # Seeded, and without touching the caller's global RNG: dropout and friends inside the
        # modules draw from the forked default generator.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(last.seed)
            order = generator(last.seed)
            for _ in range(last.epochs if epochs is None else epochs):
                total = 0.0
                for index in batches(n, size, order if last.shuffle else None):
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                    loss, _ = self._run_loss(run, xt[index], yt[index])
                    if prox_mu:
                        gap = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                        loss = loss + prox_mu / 2 * gap
                    loss.backward()
                    for opt in optimizers:
                        opt.step()
                    total += float(loss.detach()) * _len(index, n)
                epoch_losses.append(total / n if n else float("nan"))
        return epoch_losses

    def _forward_segment(self, run: list[_Node], x: Any) -> Any:
        for node in run:
            x = node.filter.forward(x, node.filter.module.state_dict())
        return x


def _take(data: Any, index: np.ndarray[Any, Any]) -> Any:
    """Rows ``index`` of an array or tensor (a copy: the staged data stays as it was)."""
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(index)]
    return np.asarray(data)[index]


def _segments(nodes: list[_Node]) -> Iterator[list[_Node]]:
    """Each plain node alone; each maximal run of differentiable nodes together."""
    for differentiable, group in itertools.groupby(nodes, key=lambda n: n.differentiable):
        if differentiable:
            yield list(group)
        else:
            yield from ([n] for n in group)


def _stage_parts(nodes: list[_Node]) -> tuple[list[_Node], list[_Node]]:
    """A pipeline stage's leading plain nodes and its one differentiable run.

    Raises:
        EngineError: ``BAD_REQUEST`` when the stage is anything else (no differentiable node,
            two runs, a plain filter after the run): its gradients could not flow as one graph.
    """
    segments = list(_segments(nodes))
    if not segments[-1][0].differentiable or sum(s[0].differentiable for s in segments) != 1:
        ids = [n.node_id for n in nodes]
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"a pipeline stage is plain filters followed by one run of differentiable filters; "
            f"{ids} is not",
            {"node_ids": ids},
        )
    return [s[0] for s in segments[:-1]], segments[-1]


def _len(index: Any, n: int) -> int:
    if isinstance(index, slice):
        return len(range(*index.indices(n)))
    return int(index.numel())


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


def _trainable(node: _Node) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in node.filter.module.named_parameters() if p.requires_grad}


def _check_same_names(node_id: str, what: str, given: set[str], expected: set[str]) -> None:
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


def _load_module_state(node: _Node, state: Any) -> None:
    module: torch.nn.Module = node.filter.module
    if not isinstance(state, Mapping):
        raise EngineError(
            ErrorCode.STATE_MISMATCH,
            f"node {node.node_id!r} is differentiable: its state is a mapping of tensors, "
            f"not {type(state).__name__}",
            {"node_id": node.node_id},
        )
    current = module.state_dict()
    _check_same_names(node.node_id, "state keys", set(state), set(current))
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
