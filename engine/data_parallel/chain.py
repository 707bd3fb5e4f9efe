"""The differentiable run a data-parallel replica trains, as one module: what every mode of the
replica wraps (:mod:`engine.data_parallel.modes`) — in ``DistributedDataParallel``, in FSDP2's
shards, or in nothing for a replica with no group.

A replica trains plain filters then one run of TorchFilters (:func:`prefix_and_run`): the plain
filters apply the states they hold to a step's rows, and the run is :class:`Chain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.batches import call_module
from engine.errors import EngineError
from engine.nodes import Node, Nodes
from engine.step_functions import step_of
from engine.transfer import autocast
from protocol.errors import ErrorCode

__all__ = ["Chain", "prefix_and_run", "synced_batchnorm"]


class Chain(torch.nn.Module):
    """The differentiable run as one module for DDP: each filter under its own autocast, its
    module called on a batch as its ``inputs`` says. A filter with a ``step`` function (alone
    in its run) is called with what the function passes."""

    def __init__(self, run: list[Node], device: torch.device) -> None:
        super().__init__()
        self.filters = [node.filter for node in run]
        self.parts = torch.nn.ModuleList([f.module for f in self.filters])
        self.device = device
        self.stepped = step_of(self.filters[-1]) is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stepped:
            with autocast(self.filters[0], self.device):
                return self.parts[0](*args, **kwargs)
        (x,) = args
        for f, module in zip(self.filters, self.parts, strict=True):
            with autocast(f, self.device):
                x = call_module(f, x, module)
        return x


def synced_batchnorm(chain: Chain) -> None:
    """Every BatchNorm layer of ``chain`` as a ``torch.nn.SyncBatchNorm`` over the group (the
    same parameters and buffers, now normalising with the global batch's statistics); each
    filter keeps the module it trains."""
    for k, module in enumerate(chain.parts):
        synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)  # type: ignore[no-untyped-call]
        chain.parts[k] = synced
        chain.filters[k].module = synced


def prefix_and_run(nodes: Nodes, node_ids: Sequence[str]) -> tuple[list[Node], list[Node]]:
    """The plain filters before the differentiable run, and the run.

    Raises:
        EngineError: ``BAD_REQUEST`` for nodes that are not plain filters then one run.
    """
    selected = nodes.select(node_ids)
    run = [n for n in selected if n.differentiable]
    first = selected.index(run[0]) if run else len(selected)
    if not run or any(not n.differentiable for n in selected[first:]):
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"a torch collective trains plain filters then one run of TorchFilters; "
            f"got {list(node_ids)}",
        )
    return selected[:first], run
