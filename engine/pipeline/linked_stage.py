"""A pipeline stage that runs its part of the schedule itself, sending activations and their
gradients straight to the neighbouring stages' daemons (torch.distributed point-to-point).

ModelParallel's torch transport (:mod:`coordinator.strategies.model_parallel.torch_transport`): the
stages join one process group (:mod:`engine.group_member`; a stage's rank is its place in the
pipeline), take the plan (:meth:`LinkedStage.set_plan`: the micro-batches of every global
batch and this stage's actions of the schedule, GPipe or 1F1B) and then train the global batches
they are told (:meth:`LinkedStage.train`, the loop a linked stage runs), as
``torch.distributed.pipelining`` does: per
action a forward (input from the staged rows, or received from the stage before; output sent on) or
a backward (the output's gradient received from the stage after; the input's sent back), through
the very :meth:`~engine.pipeline.stage.PipelineStage.stage_forward` and ``stage_backward`` the
WebSocket path uses, then one optimizer step. Sends are asynchronous and waited for at the end
of the batch, so a stage never blocks on a neighbour that is itself waiting to receive.

A tensor travels as a header (dtype and shape, 9 int64s) and then its bytes, each with a tag of
its micro-batch and direction, so the receiver allocates exactly what comes; every header of a
batch is asked for when the batch starts, so it is in by the time its action comes. The tensors
cross on the CPU (gloo), as the stage methods hand them out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.batches import on_disk
from engine.data.read_ahead import read_ahead
from engine.errors import EngineError
from engine.group_member import GroupMember, looks_collective
from engine.held_rows import HeldRows
from engine.nodes import Nodes
from engine.optimizers import Optimizers
from engine.pipeline.stage import PipelineStage
from engine.stepping import current_lr
from protocol.errors import ErrorCode
from protocol.rules.clipping import clip_coefficient

__all__ = ["LinkedStage"]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
"""The dtypes an activation may have, by their code in a header."""

MAX_DIMS = 7
"""The most dimensions an activation may have."""


@dataclass(frozen=True)
class _StagePlan:
    """What a linked stage walks: its nodes, its actions of the schedule (``("F", micro)``,
    ``("B", micro)``), the micro-batches of every global batch."""

    node_ids: list[str]
    actions: list[tuple[str, int]]
    batches: list[list[np.ndarray[Any, Any]]]  # per global batch, the rows of each micro-batch
    data: str | None  # the first stage's staged rows
    labels: str | None  # the last stage's staged labels
    clip: float | None  # the clip_grad_norm of the whole pipeline's gradient


class LinkedStage:
    """``nodes`` as one stage of a pipeline whose stages talk to each other directly: the
    plan it walks and the loop it runs (:meth:`train`), each micro-batch through ``stage``, its
    rows and labels from ``rows``, over ``group``."""

    def __init__(
        self,
        nodes: Nodes,
        optimizers: Optimizers,
        rows: HeldRows,
        stage: PipelineStage,
        group: GroupMember,
    ) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self.rows = rows
        self.stage = stage
        self.group = group
        self._plan: _StagePlan | None = None
        group.on_leave(self._forget)  # the plan was for that group

    def set_plan(
        self,
        node_ids: Sequence[str],
        actions: Sequence[tuple[str, int]],
        batches: Sequence[Sequence[np.ndarray[Any, Any]]],
        data: str | None,
        labels: str | None,
        clip: float | None = None,
    ) -> None:
        """Take this stage's plan (the rank and world of the group it joined say where it is);
        ``clip``: the norm the whole pipeline's gradient is clipped to (the last TorchFilter's
        ``clip_grad_norm``, which the other stages do not hold).

        Raises:
            EngineError: ``BAD_REQUEST`` before a join, for a first stage without its rows or a
                last one without its labels.
        """
        rank, world = self.group.place()
        if rank == 0 and data is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "the first stage reads staged rows: name them")
        if rank == world - 1 and labels is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "the last stage needs its labels staged")
        for name in (data, labels):
            if name is not None:
                self.rows.held(name, lazy=True)  # staged (not read), or a clear error now
        micro = [[m for m in batch if len(m)] for batch in batches]
        self._plan = _StagePlan(list(node_ids), list(actions), micro, data, labels, clip)

    def train(self, start: int, stop: int, snapshot: bool = False) -> dict[str, Any]:
        """Global batches ``[start, stop)`` (module docstring): per batch this stage's actions
        of the schedule, the clipping of the whole pipeline's gradient, one step.

        Returns:
            ``{"losses", "rows", "lrs"}``: per batch, each micro-batch's loss and rows (the
            last stage only; empty lists elsewhere) and the learning rate of its step; with
            ``snapshot``, also what a checkpoint saves of the stage now (``"snapshot"``: its
            nodes' states and its TorchFilters' optimizer states), in this reply, which is
            encoded before the next request can step them.

        Raises:
            EngineError: ``BAD_REQUEST`` before a plan or for batches outside it;
                ``COLLECTIVE_FAILED`` when the group breaks, with the batches completed.
        """
        plan = self._planned(stop)
        losses, rows, lrs = [], [], []
        first, last = self.group.rank == 0, self.group.rank == self.group.world - 1

        def read(b: int) -> list[tuple[Any, Any]]:  # the x (first) and y (last) of b's micros
            return [
                (
                    self.rows.held(plan.data or "", m)[0] if first else None,
                    self.rows.held(plan.labels or "", m)[0] if last else None,
                )
                for m in plan.batches[b]
            ]

        names = [n for n, reads in ((plan.data, first), (plan.labels, last)) if n and reads]
        from_disk = any(on_disk(self.rows.held(n, lazy=True)[0]) for n in names)
        batches = range(start, stop)
        for b, data in zip(batches, read_ahead(read, batches, 1 if from_disk else 0), strict=True):
            try:
                batch_losses, batch_rows = self._one_batch(plan, plan.batches[b], data)
                coefficient = None if plan.clip is None else self._clip_coefficient(plan)
            except RuntimeError as exc:
                if looks_collective(exc):
                    raise self.group.broken(f"global batch {b + 1}", exc, steps_done=b) from exc
                raise
            lrs.append(self._step(plan, b, coefficient))
            losses.append(batch_losses)
            rows.append(batch_rows)
        said: dict[str, Any] = {"losses": losses, "rows": rows, "lrs": lrs}
        if snapshot:
            trained = [n.node_id for n in self.nodes.select(plan.node_ids) if n.differentiable]
            said["snapshot"] = {
                "states": self.nodes.get_state(plan.node_ids, live=True),
                "optimizers": self.optimizers.get_optimizer_state(trained) if trained else {},
            }
        return said

    def _planned(self, stop: int) -> _StagePlan:
        """The plan, when it goes as far as ``stop``."""
        plan = self._plan
        if plan is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "pipe_train before pipe_plan")
        if stop > len(plan.batches):
            raise EngineError(
                ErrorCode.BAD_REQUEST, f"the plan has {len(plan.batches)} batches, not {stop}"
            )
        return plan

    def _one_batch(
        self, plan: _StagePlan, micro: list[np.ndarray[Any, Any]], data: list[tuple[Any, Any]]
    ) -> tuple[list[float], list[int]]:
        """This stage's actions of one global batch: each forward (input received or read,
        output sent on) and backward (gradient received, the input's sent back), the sends
        waited for at the end. Each micro-batch's loss and rows (the last stage only)."""
        rank, world = self.group.rank, self.group.world
        first, last = rank == 0, rank == world - 1
        total = sum(len(m) for m in micro)
        losses = [0.0] * len(micro) if last else []
        actions = [(kind, m) for kind, m in plan.actions if m < len(micro)]  # a short last batch
        # Every header this stage will receive in the batch is asked for now, so each arrives
        # while the stage computes; at its action only the tensor's bytes are waited for.
        headers = {
            (kind, m): _Header.posted(rank - 1 if kind == "F" else rank + 1, _tag(kind, m))
            for kind, m in actions
            if (kind == "F" and not first) or (kind == "B" and not last)
        }
        sent: list[tuple[Any, torch.Tensor]] = []  # in flight until the batch ends
        for kind, m in actions:
            if kind == "F":
                x, y = data[m]
                if not first:
                    x = headers[(kind, m)].tensor()
                scale = len(micro[m]) / total
                out = self.stage.stage_forward(plan.node_ids, m, x, y, scale, last, first=first)
                if last:
                    losses[m] = float(out["loss"])
                else:
                    sent += _send(out, rank + 1, _tag("F", m))
            else:
                grad = None if last else headers[(kind, m)].tensor()
                back = self.stage.stage_backward(m, grad)
                if not first:
                    assert back is not None
                    sent += _send(back, rank - 1, _tag("B", m))
        for work, _ in sent:
            work.wait()
        return losses, [len(m) for m in micro] if last else []

    def _clip_coefficient(self, plan: _StagePlan) -> float:
        """The clipping of the whole pipeline's gradient: every stage's squared norm summed
        over the group (an all-reduce of one float64), then ``torch.nn.utils.clip_grad_norm_``'s
        coefficient."""
        assert plan.clip is not None
        total = torch.tensor([self.stage.stage_norm(plan.node_ids)], dtype=torch.float64)
        dist.all_reduce(total)
        return clip_coefficient(math.sqrt(float(total[0])), plan.clip)

    def _step(self, plan: _StagePlan, b: int, coefficient: float | None) -> float:
        """The step that ends global batch ``b``; the learning rate it took."""
        run = [n for n in self.nodes.select(plan.node_ids) if n.differentiable]
        lr = current_lr(self.optimizers.optimizer(run[-1]))
        ends = self.optimizers.ends_epoch(b + 1)
        self.stage.stage_step(plan.node_ids, epoch_end=ends, coefficient=coefficient)
        return lr

    def _forget(self) -> None:
        self._plan = None


def _send(tensor: torch.Tensor, peer: int, tag: int) -> list[tuple[Any, torch.Tensor]]:
    """Send ``tensor``'s header then its bytes to ``peer``, asynchronously; the works with the
    tensors they read (which must live until the works are waited for)."""
    tensor = tensor.detach().contiguous()
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"an activation of dtype {tensor.dtype} and {tensor.dim()} dimensions cannot cross "
            f"the torch transport (at most {MAX_DIMS}, dtypes {[str(d) for d in DTYPES]})",
        )
    dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    header = torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *dims], dtype=torch.int64)
    return [
        (dist.isend(header, peer, tag=tag), header),
        (dist.isend(tensor, peer, tag=tag + 1), tensor),
    ]


def _tag(kind: str, micro: int) -> int:
    """The tag of micro-batch ``micro``'s activation (``F``) or gradient (``B``) header; its
    bytes travel with the tag after it."""
    return 4 * micro + (0 if kind == "F" else 2)


@dataclass
class _Header:
    """A tensor on its way from ``peer``: its header asked for, its bytes not yet."""

    peer: int
    tag: int
    buffer: torch.Tensor
    work: Any

    @classmethod
    def posted(cls, peer: int, tag: int) -> _Header:
        buffer = torch.empty(2 + MAX_DIMS, dtype=torch.int64)
        return cls(peer, tag, buffer, dist.irecv(buffer, peer, tag=tag))

    def tensor(self) -> torch.Tensor:
        """The tensor, once its header is in and its bytes received."""
        self.work.wait()
        code, ndim, *dims = self.buffer.tolist()
        tensor = torch.empty(dims[:ndim], dtype=DTYPES[code])
        dist.recv(tensor, self.peer, tag=self.tag + 1)
        return tensor
