"""Data held under a name, and fitting, forwarding and the states of a chain of filters.

``fit`` and ``composite_fit`` of a differentiable filter run forward, loss and backward but never
step: whoever owns the round owns the step (see :mod:`engine.gradients`). ``batched_fit`` is the
whole training loop, what ``graph.fit`` runs.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.data.npy_rows import Rows
from engine.data.read_ahead import NextRead, read_ahead
from engine.errors import EngineError
from engine.evaluation import Evaluation
from engine.nodes import (
    Node,
    check_same_names,
    check_same_rows,
    num_rows,
    run_setting,
    segments,
    take,
    trainable,
)
from engine.stepping import Horizon, fast_forward
from engine.transfer import scaler_for, to_cpu
from protocol.errors import ErrorCode
from protocol.rules.batching import batch_len, batch_rows, batches, generator
from protocol.rules.rows import needs_labels


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
    """

    output: Any
    states: dict[str, Any]
    loss: float | None
    rows: int
    epoch_losses: list[float] = field(default_factory=list)
    start_loss: float | None = None
    clipped: bool | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


_GENERATOR = threading.Lock()
"""Held while a seeded pass draws from torch's default generator (see :meth:`gradient_pass`)."""


class Training(Evaluation):
    """Rows held under a name; fit, forward and the states of the loaded nodes."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[str, tuple[Any, Any]] = {}  # on the CPU: batches go to the device
        self._next: NextRead[tuple[str, bytes], tuple[Any, Any]] = NextRead()

    # -- data held under a name ---------------------------------------------------------------

    def hold(self, name: str, x: Any, y: Any = None) -> int:
        """Keep ``x`` (and ``y``) under ``name`` for later commands; returns the row count.

        Data-parallel and federated jobs send a worker its data once and then only name rows
        of it, so that per step only gradients (or per round only states) cross the wire.
        """
        check_same_rows(x, y)
        self._next.drop()
        self._held[name] = (x, y)
        return num_rows(x)

    def held(
        self,
        name: str,
        rows: Sequence[int] | np.ndarray[Any, Any] | None = None,
        *,
        lazy: bool = False,
    ) -> tuple[Any, Any]:
        """The data held under ``name``, or its ``rows`` (in that order; a list, or an index
        array taken as it is). A dataset read from disk by rows (:class:`Rows`) is read whole
        for the whole of it, unless ``lazy``: then it is returned as it is, for a training loop
        that reads it a batch at a time (:meth:`batched_fit`)."""
        try:
            x, y = self._held[name]
        except KeyError:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"no data held under {name!r} (held: {sorted(self._held)})",
            ) from None
        if rows is None:
            if lazy:
                return x, y
            return _whole(x), _whole(y)
        n = num_rows(x)
        index = np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= n):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"rows of {name!r} must lie in [0, {n}); "
                f"got {int(index.min())}..{int(index.max())}",
            )
        ahead = self._next.take((name, index.tobytes()))
        if ahead is not None:
            return ahead.result()
        return take(x, index), None if y is None else take(y, index)

    def read_next(self, name: str, rows: Sequence[int] | np.ndarray[Any, Any]) -> None:
        """Start reading ``rows`` of the data held under ``name`` in the background, for the
        :meth:`held` call that will ask for them: a data-parallel step's rows, read while the
        step before is averaged. Data in memory needs no reading ahead: nothing is done."""
        x, y = self._held.get(name, (None, None))
        index = np.asarray(rows, dtype=np.int64)
        if isinstance(x, Rows) and index.size and 0 <= index.min() <= index.max() < len(x):

            def read() -> tuple[Any, Any]:
                return take(x, index), None if y is None else take(y, index)

            self._next.start((name, index.tobytes()), read)

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
        for segment in segments(nodes):
            if segment[0].differentiable:
                out, loss = self._backward_run(segment, out, y)
            else:
                out = self._fit_plain(segment[0], out, y)
        return FitResult(to_cpu(out), self.get_state(node_ids), loss, num_rows(x))

    def gradient_pass(
        self, node_ids: Sequence[str], x: Any, y: Any = None, *, seed: int | None = None
    ) -> FitResult:
        """A replica's half of a data-parallel step: plain filters only *apply* the state they
        hold (fitted once, before training), each differentiable run does one forward, loss and
        backward over ``x`` — in ``accumulate`` slices, its last filter's — and leaves its
        gradients on the parameters. No step, no states. ``seed`` seeds torch's generator for
        it (dropout: the replica's and step's masks)."""
        nodes = self._chain(node_ids, x, y)
        if seed is None:
            return self._gradient_pass(nodes, x, y)
        # torch's default generator is the process's: engines in one process (in-process
        # workers) take turns with it, so each pass draws from its own seed.
        with _GENERATOR:
            torch.manual_seed(seed)
            return self._gradient_pass(nodes, x, y)

    def _gradient_pass(self, nodes: list[Node], x: Any, y: Any) -> FitResult:
        out, loss = x, None
        for segment in segments(nodes):
            if segment[0].differentiable:
                parts = int(run_setting(segment, "accumulate", 1) or 1)
                out, loss = self._backward_run(segment, out, y, parts)
            else:
                node = segment[0]
                out = self._apply(node, out, self._state_for(node))
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
        schedule: tuple[int, int | None] = (0, None),
        validation: tuple[Any, Any] | None = None,
        lr: float | None = None,
        start_loss: bool = False,
        clip_norm: float | None = None,
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

        A run's optimizer steps every ``accumulate`` batches of its last filter, and its filters'
        learning-rate schedulers step with it (:mod:`engine.stepping`) over the epochs of this
        call, or with ``schedule=(before, span)`` over ``span`` epochs of which ``before`` were
        trained earlier (a federated run's rounds: a fresh scheduler starts where they left it).

        ``validation=(x_val, y_val)``: at the end of every epoch of the chain's last
        differentiable run the chain is evaluated on them (:mod:`engine.evaluation`), its
        ``val_loss`` and metrics going into that epoch's row of the history.

        ``lr`` sets the learning rate of the optimizers (a federated round's client config).
        ``start_loss`` asks for the mean loss of the last differentiable run at the weights it
        starts from, over all its rows, before training (evaluation mode, no gradients).
        ``clip_norm`` scales the update of the chain's TorchFilters, w − w_start over their
        float state entries taken as one vector, down to that L2 norm when it is longer
        (client-side clipping for differential privacy, McMahan et al. 2018).
        """
        nodes = self._chain(node_ids, x, y)
        if reset_optimizer:
            for node in nodes:
                node.optimizer = node.scaler = node.scheduler = None
        torch_ids = [n.node_id for n in nodes if n.differentiable]
        start = self.get_state(torch_ids) if clip_norm is not None else {}
        out, loss, first_loss = x, None, None
        history: list[dict[str, Any]] = []
        runs = list(segments(nodes))
        last_run = max((k for k, s in enumerate(runs) if s[0].differentiable), default=-1)
        val_x, val_y = validation if validation is not None else (None, None)
        for k, segment in enumerate(runs):
            if segment[0].differentiable:
                scores = None
                if validation is not None and k == last_run:
                    ids = [n.node_id for n in segment]
                    scores = functools.partial(self.evaluate, ids, val_x, val_y)
                if start_loss:
                    first_loss = self._mean_loss(segment, out, y, batch_size)
                history = self._train_run(
                    segment, out, y, batch_size, epochs, prox_mu, schedule, scores, lr
                )
                loss = history[-1]["loss"] if history else None
                if isinstance(out, Rows) and k == len(runs) - 1:
                    out = None  # rows read from disk: their output, all at once, is not made
                else:
                    out = self._forward_segment(segment, _whole(out))
                if validation is not None and k < last_run:
                    val_x = self._forward_segment(segment, _whole(val_x))
            else:  # a plain filter fits on all its rows at once
                out = self._fit_plain(segment[0], _whole(out), _whole(y))
                if validation is not None:
                    val_x = self._apply(segment[0], _whole(val_x), segment[0].state)
        clipped = self._clip_update(start, clip_norm) if clip_norm is not None else None
        rows = num_rows(x)
        states = self.get_state(node_ids)
        epoch_losses = [row["loss"] for row in history]
        return FitResult(
            to_cpu(out), states, loss, rows, epoch_losses, first_loss, clipped, history
        )

    # -- forward ------------------------------------------------------------------------------

    def forward(self, node_id: str, x: Any, state: Any = None) -> Any:
        """``forward`` of one node with ``state``, or with the state it holds."""
        node = self._node(node_id)
        return to_cpu(self._apply(node, x, self._state_for(node) if state is None else state))

    def composite_forward(
        self, node_ids: Sequence[str], x: Any, states: Mapping[str, Any] | None = None
    ) -> Any:
        """Forward ``x`` through a chain, each node with ``states[id]`` or its held state."""
        for node in self._chain(node_ids, x):
            if states is not None and node.node_id in states:
                x = self._apply(node, x, states[node.node_id])
            else:
                x = self._apply(node, x, self._state_for(node))
        return to_cpu(x)

    # -- state --------------------------------------------------------------------------------

    def get_state(self, node_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """A snapshot of each node's state: a differentiable filter's ``state_dict`` (detached
        copies of its tensors, on the CPU), a plain filter's fit result."""
        out: dict[str, Any] = {}
        for node in self._select(node_ids):
            if node.differentiable:
                sd = node.filter.module.state_dict()
                out[node.node_id] = {k: _cpu_copy(v) for k, v in sd.items()}
            else:
                out[node.node_id] = self._state_for(node)
        return out

    def get_buffers(self, node_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The buffers of the differentiable nodes that have any (BatchNorm's running
        statistics...), by node and name: CPU copies."""
        out: dict[str, dict[str, Any]] = {}
        for node in self._select(node_ids):
            if node.differentiable:
                named = dict(node.filter.module.named_buffers())
                if named:
                    out[node.node_id] = {k: _cpu_copy(v) for k, v in named.items()}
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
            node = self._node(node_id)
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

    def set_state(self, states: Mapping[str, Any]) -> None:
        """Load states as :meth:`get_state` returns them (tensors may also be numpy arrays)."""
        nodes = [self._node(node_id) for node_id in states]
        for node in nodes:
            state = states[node.node_id]
            if node.differentiable:
                _load_module_state(node, state)
            else:
                node.state = state

    # -- internals ----------------------------------------------------------------------------

    def _fit_plain(self, node: Node, x: Any, y: Any) -> Any:
        x = to_cpu(x)
        node.state = node.filter.fit(x, y)
        return node.filter.forward(x, node.state)

    def _run_loss(self, run: list[Node], x: torch.Tensor, y: torch.Tensor) -> Any:
        """Forward a batch through the run in training mode (moved to the device once, here);
        the loss of its last filter."""
        out = self._train_forward(run, self._on_device(x))
        return self._loss(run, out, self._on_device(y)), out

    def _backward_run(self, run: list[Node], x: Any, y: Any, parts: int = 1) -> tuple[Any, float]:
        """Forward, loss and backward of ``x`` through the run, the gradients left on the
        parameters; with ``parts`` in that many slices one after the other (each loss weighted
        by its share of the rows, the gradients accumulating): the same gradient, a slice's
        memory. The output and the mean loss."""
        if y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                needs_labels(run[-1].node_id, "fitting"),
                {"node_id": run[-1].node_id},
            )
        for node in run:
            node.filter.module.zero_grad(set_to_none=True)
        # The true gradients, never scaled: whoever steps on them (the data-parallel mean, say)
        # must not have to know this filter's precision.
        xt, yt = run[0].filter.prepare_input(x), run[-1].filter.prepare_target(y)
        n = num_rows(xt)
        if parts <= 1 or n <= 1:
            loss, out = self._run_loss(run, xt, yt)
            loss.backward()
            return out.detach(), float(loss.detach())
        outs, total = [], 0.0
        for rows in np.array_split(np.arange(n), min(parts, n)):
            index = torch.from_numpy(rows)
            loss, out = self._run_loss(run, xt[index], yt[index])
            (loss * (len(rows) / n)).backward()
            outs.append(out.detach())
            total += float(loss.detach()) * len(rows)
        return torch.cat(outs), total / n

    def _train_run(
        self,
        run: list[Node],
        x: Any,
        y: Any,
        batch_size: int | None,
        epochs: int | None = None,
        prox_mu: float = 0.0,
        schedule: tuple[int, int | None] = (0, None),
        scores: Callable[[], dict[str, Any]] | None = None,
        lr: float | None = None,
    ) -> list[dict[str, Any]]:
        """The training loop of one differentiable run; a history row per epoch: its number,
        mean loss, the learning rate its last step took and what ``scores`` gives then.

        With ``accumulate=k`` (the run's last filter's) an optimizer step is taken every k
        batches (and after an epoch's last), each batch's loss weighted by its share of the
        rows of those batches: the step is the one a batch k times larger takes.
        ``schedule``: the epochs of the run trained before this call, and the epochs its
        schedules span (``None``: this call's), for a federated client's rounds. ``lr``
        replaces the optimizers' learning rate (and their schedules' base)."""
        last = run[-1].filter
        if y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                needs_labels(run[-1].node_id, "training"),
                {"node_id": run[-1].node_id},
            )
        first = run[0].filter
        lazy = isinstance(x, Rows)  # read from disk a batch at a time, never whole
        xt, yt = (x, y) if lazy else (first.prepare_input(x), last.prepare_target(y))
        n = num_rows(xt)
        size = batch_size or last.batch_size or n
        every = max(1, int(run_setting(run, "accumulate", 1) or 1))
        epochs = last.epochs if epochs is None else epochs
        done, span = schedule
        per_epoch = (-(-n // size) + every - 1) // every if n else 0  # steps: batches / every
        fresh = any(node.optimizer is None for node in run)
        self.horizon = Horizon(per_epoch, span if span is not None else done + epochs)
        optimizers = [self._optimizer(node) for node in run]
        if lr is not None:
            self._set_lr(run, optimizers, lr)
        if fresh and done:
            for node in run:  # the schedule stands where the epochs before left it
                interval = getattr(node.filter, "scheduler_interval", "step")
                if node.scheduler is not None:
                    fast_forward(node.scheduler, done * (1 if interval == "epoch" else per_epoch))
        scaler = self._scaler(run[-1])
        params = [p for node in run for p in trainable(node).values()]
        anchor = [p.detach().clone() for p in params] if prox_mu else []
        history: list[dict[str, Any]] = []

        def read(index: Any) -> tuple[Any, Any]:  # a batch (on disk: in a read-ahead thread)
            if not lazy:
                return xt[index], yt[index]
            picked = batch_rows(index, n)
            return first.prepare_input(xt[picked]), last.prepare_target(yt[picked])

        # Seeded, and without touching the caller's global RNG: dropout and friends inside the
        # modules draw from the forked default generator.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(last.seed)
            order = generator(last.seed)
            for e in range(epochs):
                total, lr = 0.0, float("nan")
                epoch = list(batches(n, size, order if last.shuffle else None))
                sizes = [batch_len(index, n) for index in epoch]
                groups = [sum(sizes[g : g + every]) for g in range(0, len(epoch), every)]
                for j, (xb, yb) in enumerate(read_ahead(read, epoch, 1 if lazy else 0)):
                    if j % every == 0:
                        for opt in optimizers:
                            opt.zero_grad(set_to_none=True)
                    loss, _ = self._run_loss(run, xb, yb)
                    if prox_mu:
                        gap = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                        loss = loss + prox_mu / 2 * gap
                    backward(loss * (sizes[j] / groups[j // every]) if every > 1 else loss, scaler)
                    total += float(loss.detach()) * sizes[j]
                    if (j + 1) % every == 0 or j == len(epoch) - 1:
                        lr = self._step_run(run, scaler, epoch_end=j == len(epoch) - 1)
                row = {"epoch": e + 1, "loss": total / n if n else float("nan"), "lr": lr}
                if scores is not None:
                    # Evaluating leaves the training's generator where it was: the dropout
                    # masks are the same with validation data or without.
                    with torch.random.fork_rng(devices=[]):
                        scored = scores()
                    row |= {k: v for k, v in scored.items() if k != "rows"}
                history.append(row)
        return history

    def _clip_update(self, start: Mapping[str, Any], clip_norm: float) -> bool:
        """Scale the update since ``start`` (the TorchFilters' states) down to ``clip_norm``
        when its L2 norm is larger; whether it was."""
        current = self.get_state(list(start))
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
        self.set_state(clipped)
        return True

    def _scaler(self, node: Node) -> torch.amp.GradScaler | None:
        """The run's gradient scaler (fp16 only), made on first use and kept like an optimizer."""
        if node.scaler is None:
            node.scaler = scaler_for(node.filter, self.device)
        return node.scaler

    def _forward_segment(self, run: list[Node], x: Any) -> Any:
        for node in run:
            x = self._apply(node, x, node.filter.module.state_dict())
        return x


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Backward of ``loss``, through ``scaler`` for fp16 (the loss scaled; the step that
    follows unscales, skips a step whose gradients overflowed and updates the scale)."""
    torch.autograd.backward(loss if scaler is None else scaler.scale(loss))


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def _whole(data: Any) -> Any:
    """``data`` in memory: a dataset read by rows (:class:`Rows`) is read whole here."""
    return np.asarray(data) if isinstance(data, Rows) else data


def _load_module_state(node: Node, state: Any) -> None:
    module: torch.nn.Module = node.filter.module
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
