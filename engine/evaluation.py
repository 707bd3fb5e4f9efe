"""Evaluating the loaded chain on validation data: its loss and its metrics, as it stands;
and a run's mean loss on its training rows before it trains (q-FedAvg's F_k(w_t)).

A chain is evaluated up to its last differentiable filter, whose loss (``val_loss``) and
``metrics`` (:mod:`engine.metrics`) are taken batch by batch (its ``eval_batch_size`` rows,
default its ``batch_size``: the memory of a batch, never of the validation set), the modules in
eval mode and no gradient kept, each figure the mean over the rows; with a ``step`` function,
what it returns (``val_loss``, ``val_<name>``). Plain filters apply the state they hold. It is
what ``graph.fit(..., validation=)`` and every strategy do at the end of an epoch (or round), on
a worker, or, in a pipeline, on the last stage with the stage before's activation.

A sharded data-parallel replica evaluates its part of the rows through its sharded run
(``through``), each forward a collective: every replica must forward as many batches, so a
``lockstep`` says how many the group forwards, and one with fewer forwards its first batch again
for the others' sake, counted for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.batches import Batches, concat, whole
from engine.errors import EngineError
from engine.nodes import Node, Nodes, segments
from engine.transfer import to_cpu
from protocol.errors import ErrorCode
from protocol.rules.batching import batch_len, batches
from protocol.rules.row_means import RowMeans

__all__ = ["Evaluation", "Lockstep"]

Lockstep = Callable[[int], int]
"""Given the batches a replica holds, how many every replica of its group forwards: the most
any holds (a collective)."""


class Evaluation:
    """``nodes`` evaluated on validation data, as they stand."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes

    def evaluate(
        self,
        node_ids: Sequence[str],
        x: Any,
        y: Any,
        through: Callable[..., Any] | None = None,
        lockstep: Lockstep | None = None,
    ) -> dict[str, Any]:
        """``x`` through ``node_ids`` up to the last differentiable one, with the states they
        hold; that run's loss and metrics against ``y``, batch by batch. ``through`` stands
        for the last run's modules (a sharded replica's), ``lockstep`` makes it forward as
        many batches as its group (module docstring; ``x`` must then have a row).

        Returns:
            ``{"val_loss": float, <metric>: float..., "rows": int}``.

        Raises:
            EngineError: ``BAD_REQUEST`` without a differentiable node, or without labels
                its loss needs.
        """
        nodes = self.nodes.chain(node_ids, x, y)
        last = max((k for k, n in enumerate(nodes) if n.differentiable), default=None)
        if last is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"nodes {list(node_ids)} have no TorchFilter to evaluate a loss with",
            )
        runs = list(segments(nodes[: last + 1]))
        out = x
        for segment in runs[:-1]:
            out = self.forward(segment, out)
        self.nodes.check_labels(runs[-1], y, "evaluating")
        return self._scores(runs[-1], out, y, through, lockstep)

    def forward(self, segment: list[Node], x: Any, batch_size: int | None = None) -> Any:
        """``x`` through one segment with the states its nodes hold, on the CPU: a plain
        filter's forward on all of it, a run of TorchFilters batch by batch (its
        ``eval_batch_size``, or ``batch_size``) in eval mode."""
        if not segment[0].differentiable:
            node = segment[0]
            return self.nodes.apply(node, whole(x), self.nodes.state_of(node))
        data = Batches.evaluated(segment, x, None, batch_size)
        outs, sizes = [], []
        cuts = list(batches(data.rows, data.size, None)) or [slice(0, 0)]  # no rows: their output
        with torch.no_grad():
            for index in cuts:
                xb, _ = data.read(index)
                out = self.nodes.train_forward(segment, self.nodes.on_device(xb), training=False)
                outs.append(to_cpu(out))
                sizes.append(batch_len(index, data.rows))
        return concat(outs, sizes)

    def _scores(
        self,
        run: list[Node],
        x: Any,
        y: Any,
        through: Callable[..., Any] | None,
        lockstep: Lockstep | None,
    ) -> dict[str, Any]:
        """The loss and metrics of ``run`` on ``x`` against ``y``, batch by batch (through
        ``through``, in ``lockstep``: :meth:`evaluate`)."""
        f = run[-1].filter
        data = Batches.evaluated(run, x, y, None)
        cuts = list(batches(data.rows, data.size, None))
        forwarded = len(cuts) if lockstep is None else lockstep(len(cuts))
        if forwarded > len(cuts) and not cuts:
            raise EngineError(ErrorCode.BAD_REQUEST, "a replica in lockstep needs a row")
        figures = RowMeans()
        with torch.no_grad():
            for j in range(forwarded):
                own = j < len(cuts)  # else the group's forward, not this replica's rows
                index = cuts[j] if own else cuts[0]
                xb, yb = data.read(index)
                xb, yb = self.nodes.on_device(xb), self.nodes.on_device(yb)
                computed = self.nodes.batch_loss(run, xb, yb, through, training=False)
                if not own:
                    continue
                scores = {"val_loss": float(computed.loss)}
                scores |= {f"val_{k}": v for k, v in computed.metrics.items()}
                metrics = getattr(f, "compute_metrics", None)
                if metrics is not None and computed.out is not None:
                    scores |= metrics(computed.out, yb)
                figures.add(scores, batch_len(index, data.rows))
        return {**figures.means(), "rows": data.rows}

    def mean_loss(self, run: list[Node], x: Any, y: Any, batch_size: int | None) -> float:
        """The run's mean loss over all rows of ``x`` at its current weights: batches in order,
        evaluation mode, no gradients, nothing changed (BatchNorm's running statistics kept)."""
        self.nodes.check_labels(run, y, "evaluating")
        data = Batches.of(run, x, y, batch_size)
        total = 0.0
        with torch.no_grad():
            for index in batches(data.rows, data.size, None):
                xb, yb = data.read(index)
                xb, yb = self.nodes.on_device(xb), self.nodes.on_device(yb)
                loss = self.nodes.batch_loss(run, xb, yb, training=False).loss
                total += float(loss) * batch_len(index, data.rows)
        return total / data.rows if data.rows else float("nan")
