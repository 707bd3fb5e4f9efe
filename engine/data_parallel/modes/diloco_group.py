"""DiLoCo over the torch group (Douillard et al. 2023): inner steps on each replica's own
slices, and at each synchronisation the outer step the replicas take together
(:class:`engine.data_parallel.outer_step.OuterStep`).

The run is wrapped in DDP as DataParallel's (:func:`~engine.data_parallel.modes.ddp.in_ddp`:
replica 0's weights broadcast, which start everyone's global weights) but its backward
all-reduces nothing (DDP's ``no_sync`` over every slice): each replica steps on its own slice's
gradient, and after the steps that end a round (the plan's ``syncs``) the replicas'
pseudo-gradients are averaged and one outer step taken on the global weights.

A group that breaks in a synchronisation leaves the replica as it stood before it — its local
weights, global weights, outer momentum and int8 residuals — owing that synchronisation
(``sync_pending`` in the error, with the losses of the chunk's steps so far). When the group is
left, what the replica holds of DiLoCo stays (:class:`OuterStepKept`); an elastic run forms the
group again with the replicas left (a plan that regroups takes all of it over, and DDP
broadcasts nothing) and the replica makes the synchronisation it owes first when next told to
train on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from engine.data_parallel.chain import Chain
from engine.data_parallel.modes.ddp import broadcast_buffers, in_ddp
from engine.data_parallel.modes.mode import ReplicaMode, ReplicaParts, whole_snapshot
from engine.data_parallel.outer_step import OuterStep
from engine.data_parallel.plan import ReplicaPlan
from engine.errors import EngineError
from engine.group_member import looks_collective
from engine.nodes import Node, trainable
from protocol.daemon import DiLoCoGroupSpec, OuterStepSpec, SnapshotWay
from protocol.errors import ErrorCode

__all__ = ["DiLoCoGroupMode", "OuterStepKept"]


class DiLoCoGroupMode(ReplicaMode):
    """A replica of ``plan`` taking DiLoCo's outer step with its group (module docstring);
    a plan that regroups takes over what ``carried`` kept of the group before."""

    plan: ReplicaPlan
    wrapped: DistributedDataParallel

    def __init__(
        self,
        spec: DiLoCoGroupSpec,
        plan: ReplicaPlan,
        run: list[Node],
        parts: ReplicaParts,
        carried: ReplicaMode,
    ) -> None:
        parts.group.place()
        self.plan, self.parts, self.run = plan, parts, run
        regroups = spec.regroup is not None  # its local weights differ from the others'
        self.wrapped = in_ddp(
            Chain(run, parts.nodes.device),
            plan,
            parts.group,
            sync_batchnorm=spec.sync_batchnorm,
            hook=None,  # (its pseudo-gradients are compressed at a sync)
            init_sync=not regroups,
        )
        # The global weights: replica 0's, as DDP broadcast them; or kept from the group before.
        trained = [p for p in self.wrapped.module.parameters() if p.requires_grad]
        kept = carried.kept_outer_step(spec.outer, trained) if regroups else None
        self.outer = kept or OuterStep(trained, spec.outer, plan.compression, len(plan.steps))
        self.pending = carried.owed_sync() if regroups else None  # (the sync it owes)

    def left_group(self) -> ReplicaMode:
        return OuterStepKept(self.outer, self.pending)

    def owed_sync(self) -> int | None:
        return self.pending

    def close(self) -> None:
        self.outer.close()  # (its exchange thread with it)

    def backward_scope(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """No slice all-reduces: DiLoCo's inner steps are each replica's own."""
        return self.wrapped.no_sync()

    def before_steps(
        self, start: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        """The synchronisation this replica owes, made before training on from ``start``.

        Raises:
            EngineError: ``BAD_REQUEST`` when ``start`` is not where it was owed;
                ``COLLECTIVE_FAILED`` when the group breaks in it.
        """
        owed = self.pending
        if owed is None:
            return
        if start != owed + 1:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"this replica owes the synchronisation after step {owed + 1}, and was told to "
                f"train from step {start + 1}",
            )
        self._synchronise(owed, inner, said)
        self.pending = None

    def after_step(
        self, step: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        self._synchronise(step, inner, said)  # (exchanges in flight may land after any step)

    def after_last_step(self, done: int) -> None:
        broadcast_buffers(self.wrapped, self.parts.group, done)

    def snapshot(
        self, prefix: list[Node], run: list[Node], done: int, way: SnapshotWay
    ) -> dict[str, Any]:
        return whole_snapshot(self.parts, self.plan, run, way, self.outer_momentum)

    def _synchronise(
        self, step: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        """DiLoCo's synchronisation of the fragments due after global step ``step``, and the
        exchanges that land there (:mod:`engine.data_parallel.outer_step`). When the group
        breaks in it, the replica owes it (module docstring): the error says so, with the
        chunk's results so far (``said``)."""
        try:
            self.outer.after(step, self.plan.syncs[step], inner)
        except RuntimeError as exc:
            if looks_collective(exc):
                self.pending = step
                group = self.parts.group
                group.break_off()  # (no communication hook on a DiLoCo replica)
                where = f"synchronising after step {step + 1}"
                owed = {"sync_pending": step + 1, "results": said}
                raise group.broken(where, exc, step + 1, owed) from exc
            raise

    def outer_momentum(self) -> dict[str, dict[str, torch.Tensor]]:
        """DiLoCo's outer momentum on this replica (torch SGD's buffers of the global
        weights), node → name → tensor; empty where there is none yet."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for (node, name), momentum in zip(self._names(), self.outer.momenta(), strict=True):
            if momentum is not None:
                held.setdefault(node, {})[name] = momentum.detach().clone()
        return held

    def set_outer_momentum(self, momentum: dict[str, dict[str, Any]]) -> None:
        """Set DiLoCo's outer momentum (as :meth:`outer_momentum` gives it; a parameter left
        out has none).

        Raises:
            EngineError: ``STATE_MISMATCH`` for momentum of parameters it does not have, or in
                another shape.
        """
        names = self._names()
        given = {(n, k) for n, named in momentum.items() for k in named}
        unknown = given - set(names)
        if unknown:
            raise EngineError(
                ErrorCode.STATE_MISMATCH, f"outer momentum of unknown parameters {sorted(unknown)}"
            )
        momenta: list[torch.Tensor | None] = []
        for (node, name), p in zip(names, self.outer.params, strict=True):
            value = momentum.get(node, {}).get(name)
            tensor = None if value is None else torch.as_tensor(value)
            if tensor is not None and tuple(tensor.shape) != tuple(p.shape):
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"outer momentum of {node}.{name} has shape {tuple(tensor.shape)}, the "
                    f"parameter {tuple(p.shape)}",
                )
            momenta.append(tensor)
        self.outer.load_momenta(momenta)

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights set to the global model while the block runs (what a read of the model
        sees: a Streaming DiLoCo replica does not synchronise there;
        :meth:`OuterStep.global_weights`)."""
        return self.outer.global_weights()

    def _names(self) -> list[tuple[str, str]]:
        """Each of the outer step's parameters' node and name, in its order."""
        named = {id(p): (node.node_id, k) for node in self.run for k, p in trainable(node).items()}
        return [named[id(p)] for p in self.outer.params]


class OuterStepKept(ReplicaMode):
    """A DiLoCo replica whose group was left: its ``outer`` step (global weights, outer
    momentum, int8 residuals) and the synchronisation it owes (``pending``), kept for a plan
    that regroups; it trains nothing until then."""

    def __init__(self, outer: OuterStep | None, pending: int | None) -> None:
        self.outer, self.pending = outer, pending

    def left_group(self) -> ReplicaMode:
        return self

    def kept_outer_step(
        self, spec: OuterStepSpec, trained: Sequence[torch.nn.Parameter]
    ) -> OuterStep | None:
        kept = self.outer
        if kept is None or kept.spec != spec or len(kept.params) != len(trained):
            return None
        if any(a is not b for a, b in zip(kept.params, trained, strict=True)):
            return None
        self.outer = None
        return kept

    def owed_sync(self) -> int | None:
        return self.pending

    def close(self) -> None:
        if self.outer is not None:
            self.outer.close()
