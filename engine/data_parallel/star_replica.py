"""A replica's step when the coordinator is the collective: the worker half of
:class:`~coordinator.strategies.data_parallel.star.StarTraining`'s loop.

Per step the coordinator sends each replica one :class:`~protocol.daemon.GradientsRequest`, and
:meth:`StarReplica.step` answers it: it applies the previous step's mean first (it travels with
this step's request, so a step is one round trip), sets replica 0's buffers (DDP's
``broadcast_buffers``), runs the forward, loss and backward over its slice of the global batch
(:meth:`~engine.fitting.Fitting.gradient_pass`: no optimizer step), starts reading the next
step's rows while the coordinator makes the mean, and replies with the loss, the rows it
counted, the learning rate the update will take and the gradients of the chain's torch nodes
(compressed with this replica's int8 residual where the run asks for it). The coordinator's
side — the mean folded as replies arrive, the next step launched while this one lands — is
:mod:`coordinator.strategies.data_parallel.star`. Over a torch.distributed group the loop is the
replica's own instead: :mod:`engine.data_parallel.replica`.
"""

from __future__ import annotations

from typing import Any

from engine.fitting import Fitting
from engine.gradients import Gradients
from engine.held_rows import HeldRows
from engine.nodes import Nodes, is_differentiable
from engine.optimizers import Optimizers
from protocol.daemon import GradientsRequest

__all__ = ["StarReplica"]


class StarReplica:
    """The step a replica trains when the coordinator averages its gradients: over ``nodes``
    stepped by ``optimizers``, on the rows ``rows`` holds, fitting with ``fitting`` and reading
    and applying ``gradients``."""

    def __init__(
        self,
        nodes: Nodes,
        optimizers: Optimizers,
        rows: HeldRows,
        fitting: Fitting,
        gradients: Gradients,
    ) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self.rows = rows
        self.fitting = fitting
        self.gradients = gradients

    def step(self, req: GradientsRequest) -> dict[str, Any]:
        """One step's half on this replica: the reply the coordinator averages (``loss``,
        ``rows``, ``lr``, ``gradients``; ``metrics`` and ``buffers`` where there are any)."""
        if req.apply is not None:  # finish the previous step first: one round trip per step
            self.gradients.apply_gradients(req.apply, epoch_end=req.apply_ends_epoch)
        if req.buffers is not None:  # replica 0's, as DDP broadcasts them before a forward
            self.nodes.set_buffers(req.buffers)
        x, y = self.rows.of(req)
        result = self.fitting.gradient_pass(req.node_ids, x, y, seed=req.seed)
        if req.data is not None and req.read_next is not None:  # read while the mean is made
            self.rows.read_next(req.data, req.read_next)
        torch_nodes = [n for n in req.node_ids if is_differentiable(self.nodes.filter(n))]
        gradients: dict[str, Any] = self.gradients.get_gradients(torch_nodes)
        if req.compression is not None:  # (with this replica's int8 residual)
            gradients = self.gradients.sent(gradients, req.compression)
        reply = {
            "loss": result.loss,
            "rows": result.rows,
            # what this step's update will take
            "lr": self.optimizers.learning_rate(torch_nodes),
            "gradients": gradients,
        }
        if result.metrics:  # a step function's, each the mean over this replica's rows
            reply["metrics"] = result.metrics
        if req.return_buffers:
            reply["buffers"] = self.nodes.get_buffers(torch_nodes)
        return reply
