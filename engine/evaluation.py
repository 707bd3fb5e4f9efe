"""Evaluating the loaded chain on validation data: its loss and its metrics, as it stands;
and a run's mean loss on its training rows before it trains (q-FedAvg's F_k(w_t)).

A chain is evaluated up to its last differentiable filter, whose loss (``val_loss``) and
``metrics`` (:mod:`engine.metrics`) are taken on the whole validation set at once, the modules
in eval mode and no gradient kept — plain filters apply the state they hold. It is what
``graph.fit(..., validation=)`` and every strategy do at the end of an epoch (or round), on a
worker, or, in a pipeline, on the last stage with the stage before's activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.data.npy_rows import Rows
from engine.errors import EngineError
from engine.nodes import Node, Nodes, num_rows, whole
from engine.transfer import autocast, to_cpu
from protocol.errors import ErrorCode
from protocol.rules.batching import batch_len, batch_rows, batches

__all__ = ["Evaluation"]


class Evaluation:
    """``nodes`` evaluated on validation data, as they stand."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes

    def evaluate(self, node_ids: Sequence[str], x: Any, y: Any) -> dict[str, Any]:
        """``x`` through ``node_ids`` up to the last differentiable one, with the states they
        hold; that filter's loss and metrics against ``y``.

        Returns:
            ``{"val_loss": float, <metric>: float..., "rows": int}``.

        Raises:
            EngineError: ``BAD_REQUEST`` without labels or a differentiable node.
        """
        nodes = self.nodes.chain(node_ids, x, y)
        last = max((k for k, n in enumerate(nodes) if n.differentiable), default=None)
        if last is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"nodes {list(node_ids)} have no TorchFilter to evaluate a loss with",
            )
        if y is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "evaluating needs the validation labels (y)")
        x, y = whole(x), whole(y)
        out = x
        for node in nodes[: last + 1]:
            out = self.nodes.apply(node, out, self.nodes.state_of(node))
        return self._scores(nodes[last], out, y)

    def _scores(self, node: Node, out: Any, y: Any) -> dict[str, Any]:
        """The loss and metrics of ``node``'s output ``out`` against ``y``."""
        f = node.filter
        target = self.nodes.on_device(f.prepare_target(y))
        with torch.no_grad():
            loss = float(f.compute_loss(out, target))
            metrics = getattr(f, "compute_metrics", None)
            scores = metrics(out, target) if metrics is not None else {}
        return {"val_loss": loss, **scores, "rows": num_rows(to_cpu(out))}

    def mean_loss(self, run: list[Node], x: Any, y: Any, batch_size: int | None) -> float:
        """The run's mean loss over all rows of ``x`` at its current weights: batches in order,
        evaluation mode, no gradients, nothing changed (BatchNorm's running statistics kept)."""
        if y is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"node {run[-1].node_id!r} is differentiable: its loss needs labels (y)",
                {"node_id": run[-1].node_id},
            )
        first, last = run[0].filter, run[-1].filter
        lazy = isinstance(x, Rows)
        xt, yt = (x, y) if lazy else (first.prepare_input(x), last.prepare_target(y))
        n = num_rows(xt)
        total = 0.0
        with torch.no_grad():
            for node in run:
                node.filter.module.eval()
            for index in batches(n, batch_size or last.batch_size or n, None):
                if lazy:
                    picked = batch_rows(index, n)
                    xb, yb = first.prepare_input(xt[picked]), last.prepare_target(yt[picked])
                else:
                    xb, yb = xt[index], yt[index]
                out = self.nodes.on_device(xb)
                for node in run:
                    with autocast(node.filter, self.nodes.device):
                        out = node.filter.module(out)
                loss = self.nodes.loss(run, out, self.nodes.on_device(yb))
                total += float(loss) * batch_len(index, n)
        return total / n if n else float("nan")
