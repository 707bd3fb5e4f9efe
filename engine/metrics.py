"""Metrics of a model's output against the labels: the names a TorchFilter may give, and its
evaluation on validation data.

``TorchFilter(metrics=("accuracy", ...))``, or callables ``(output, y) -> float``, each
evaluated on every validation batch (``eval_batch_size`` rows) with the model in eval mode, and
their mean weighted by the batches' rows taken (:class:`protocol.rules.row_means.RowMeans`),
beside ``val_loss``: the filter's own loss on it. The named ones are means over rows, so they
are exactly the whole set's; a metric that does not average over rows (an F1, an AUC) is the
whole set's when ``eval_batch_size`` holds all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["METRICS", "check_metrics", "metric_name"]

Metric = Callable[[torch.Tensor, torch.Tensor], Any]


def accuracy(output: torch.Tensor, y: torch.Tensor) -> float:
    """The share of rows whose predicted class is the label's: the largest of several outputs,
    or a single output's sign (a logit)."""
    if output.dim() > 1 and output.shape[-1] > 1:
        predicted = output.argmax(-1)
    else:
        predicted = (output.reshape(-1) > 0).to(torch.int64)
    return float((predicted.reshape(-1) == y.reshape(-1).to(predicted.dtype)).float().mean())


def mse(output: torch.Tensor, y: torch.Tensor) -> float:
    """The mean squared error."""
    return float(((output.float() - y.float().reshape(output.shape)) ** 2).mean())


def mae(output: torch.Tensor, y: torch.Tensor) -> float:
    """The mean absolute error."""
    return float((output.float() - y.float().reshape(output.shape)).abs().mean())


METRICS: dict[str, Metric] = {"accuracy": accuracy, "mse": mse, "mae": mae}
"""The metrics a TorchFilter may name."""

RESERVED = frozenset({"epoch", "round", "loss", "val_loss", "lr", "rows"})
"""Names a metric may not take: the other columns of a history row."""


def metric_name(metric: str | Metric) -> str:
    """How a metric is called in a history row: its name, or its function's."""
    return metric if isinstance(metric, str) else getattr(metric, "__name__", type(metric).__name__)


def check_metrics(metrics: Sequence[str | Metric] | None) -> tuple[str | Metric, ...]:
    """``metrics`` as a TorchFilter keeps them.

    Raises:
        ValueError: an unknown name, two metrics of one name, or a reserved one.
    """
    if metrics is None:
        return ()
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    checked = []
    for metric in metrics:
        if isinstance(metric, str) and metric not in METRICS:
            raise ValueError(
                f"unknown metric {metric!r}; choose among {sorted(METRICS)} or give a "
                "callable (output, y) -> float"
            )
        if not isinstance(metric, str) and not callable(metric):
            raise ValueError(f"a metric is a name or a callable, not {type(metric).__name__}")
        checked.append(metric)
    names = [metric_name(m) for m in checked]
    taken = sorted({n for n in names if names.count(n) > 1 or n in RESERVED})
    if taken:
        raise ValueError(f"metric names must be unique and not {sorted(RESERVED)}: {taken}")
    return tuple(checked)
