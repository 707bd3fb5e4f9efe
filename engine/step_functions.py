"""What a training step computes when the user says so: a ``step=`` function, or the model's
own loss (``loss="model"``).

A TorchFilter's ``step=fn`` is called as ``fn(model, batch)`` on every batch (training and
validation alike), ``batch`` being ``x`` — or ``(x, y)`` when there are labels — on the device,
``model`` the filter's module (in a data-parallel replica, a stand-in whose call goes through
DistributedDataParallel, so that its gradients are all-reduced, and whose attributes are the
module's). It returns the batch's mean loss (a scalar tensor), or ``(loss, {name: value})``: the
metrics, averaged over an epoch's rows into the history beside the loss. The engine still owns
the optimizer, accumulation, clipping, precision, the collectives and checkpoints.

``loss="model"`` takes the loss the module returned: ``output.loss`` (a Hugging Face
``ModelOutput``), ``output["loss"]``, or the output itself when it is a scalar.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import EngineError
from engine.metrics import RESERVED
from protocol.errors import ErrorCode

__all__ = [
    "BatchLoss",
    "StepModel",
    "model_loss",
    "step_of",
    "step_result",
    "takes_labels",
]


@dataclass
class BatchLoss:
    """What one training step computed on a batch: its mean ``loss`` (with its autograd graph),
    the run's output (``None`` from a step function) and the metrics a step function returned."""

    loss: torch.Tensor
    out: Any
    metrics: dict[str, float] = field(default_factory=dict)


def step_of(f: Any) -> Callable[[Any, Any], Any] | None:
    """The ``step`` function of a filter, if it has one."""
    step = getattr(f, "step", None)
    return step if callable(step) else None


def takes_labels(f: Any) -> bool:
    """Whether the loss of a differentiable filter needs labels: not with a step function (it
    takes what the batch holds) nor with a model that computes its own loss."""
    return step_of(f) is None and getattr(f, "loss", None) != "model"


class StepModel:
    """The module a step function is given inside a data-parallel replica: called, it runs
    ``through`` (DistributedDataParallel over the module), any other attribute is the
    module's."""

    def __init__(self, through: Callable[..., Any], module: torch.nn.Module) -> None:
        self._through = through
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._through(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def step_result(returned: Any, node_id: str) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and metrics of what a step function returned.

    Raises:
        EngineError: ``FILTER_ERROR`` for anything but a scalar tensor, or one with a mapping
            of numbers.
    """
    metrics: Any = {}
    loss = returned
    if isinstance(returned, tuple) and len(returned) == 2:
        loss, metrics = returned
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EngineError(
            ErrorCode.FILTER_ERROR,
            f"node {node_id!r}: step must return the batch's loss, a scalar tensor (or "
            f"(loss, {{name: value}})), not {_described(loss)}",
            {"node_id": node_id},
        )
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise EngineError(
            ErrorCode.FILTER_ERROR,
            f"node {node_id!r}: the metrics a step returns are a dict of name -> number, "
            f"not {_described(metrics)}",
            {"node_id": node_id},
        )
    reserved = sorted(n for n in metrics if n in RESERVED or n.startswith("val_"))
    if reserved:
        raise EngineError(
            ErrorCode.FILTER_ERROR,
            f"node {node_id!r}: step's metrics may not be named {reserved} (the history's "
            f"own columns are {sorted(RESERVED)}, and validation's are val_<name>)",
            {"node_id": node_id},
        )
    numbers = {}
    for name, value in metrics.items():
        try:
            numbers[name] = float(value.detach() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError):
            raise EngineError(
                ErrorCode.FILTER_ERROR,
                f"node {node_id!r}: step's metric {name!r} is not a number: {_described(value)}",
                {"node_id": node_id, "metric": name},
            ) from None
    return loss.reshape(()), numbers


def model_loss(output: Any, node_id: str) -> torch.Tensor:
    """The loss a model returned: ``output.loss``, ``output["loss"]``, or a scalar output.

    Raises:
        EngineError: ``FILTER_ERROR`` when the output holds no loss.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EngineError(
            ErrorCode.FILTER_ERROR,
            f"node {node_id!r} has loss='model', and its model returned {_described(output)}, "
            "with no loss: give it the labels in the batch (a Hugging Face model computes "
            "its loss when the batch has 'labels'), or return a scalar",
            {"node_id": node_id},
        )
    return loss.reshape(())


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, float) and math.isfinite(value):
        return f"the float {value} (return a tensor, for its gradient)"
    return f"{type(value).__name__}"
