"""The face every mode of a data-parallel replica has: what the step loop
(:meth:`engine.data_parallel.replica.Replica.train`) calls around its steps, what outlives a
plan or a group, and the requests that are one mode's.

The loop asks a mode for the run as it trains it (:attr:`ReplicaMode.wrapped`), the context
each accumulated slice's backward runs in (:meth:`ReplicaMode.backward_scope`: the all-reduce
on the last slice, or none), and what to do before a chunk's steps, after each step, after
the run's last and for a checkpoint's snapshot. Between plans a mode says what the next one
takes over (:meth:`ReplicaMode.before_plan`, :meth:`ReplicaMode.kept_outer_step`,
:meth:`ReplicaMode.owed_sync`) and what stays when the group is left
(:meth:`ReplicaMode.left_group`). This base is a replica with no plan (:class:`Unplanned`): it
trains nothing, and refuses every request that is one mode's, as each of those modes words it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from tempfile import TemporaryDirectory
from typing import Any, Protocol

import numpy as np
import torch

from engine.data_parallel.outer_step import OuterStep
from engine.data_parallel.plan import ReplicaPlan
from engine.errors import EngineError
from engine.group_member import GroupMember
from engine.held_rows import HeldRows
from engine.nodes import Node, Nodes
from engine.optimizers import Optimizers
from protocol.codec import encode_frame
from protocol.daemon import OuterStepSpec, SnapshotWay
from protocol.errors import ErrorCode
from protocol.files.shard_files import SNAPSHOT_FILE
from protocol.options.compression import Compression

__all__ = [
    "ONE_ROW",
    "ReplicaMode",
    "ReplicaParts",
    "Unplanned",
    "Wrapped",
    "node_ids",
    "whole_snapshot",
]

ONE_ROW = np.zeros(1, dtype=np.int64)
"""The held row a replica runs through, loss times zero, on a step it has no rows of."""


class Wrapped(Protocol):
    """The differentiable run as a replica trains it (DDP's face): its ``module``, a call, and
    ``no_sync`` (no reduction in the backwards it covers)."""

    @property
    def module(self) -> torch.nn.Module: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...


@dataclass(frozen=True)
class ReplicaParts:
    """What a replica's mode works with: the engine's ``nodes``, ``optimizers`` and staged
    ``rows``, and the ``group`` it trains over."""

    nodes: Nodes
    optimizers: Optimizers
    rows: HeldRows
    group: GroupMember


def node_ids(nodes: Sequence[Node]) -> list[str]:
    return [node.node_id for node in nodes]


def whole_snapshot(
    parts: ReplicaParts,
    plan: ReplicaPlan,
    run: list[Node],
    way: SnapshotWay,
    outer: Callable[[], dict[str, dict[str, torch.Tensor]]] | None = None,
) -> dict[str, Any]:
    """What a checkpoint saves of a replica that holds the whole model: its run's optimizer
    states, its states and (``outer``: a DiLoCo replica's) its outer momentum, in the chunk's
    reply (``"in_reply"``); or as one file for the worker to keep (``{"shards":
    {SNAPSHOT_FILE: frame}}``), all of it (``"kept_whole"``) or its optimizer states alone
    (``"kept_inner"``)."""
    taken = {"optimizers": parts.optimizers.get_optimizer_state(node_ids(run))}
    if way != "kept_inner":
        taken["states"] = parts.nodes.get_state(plan.node_ids, live=True)
        if outer is not None:
            taken["outer"] = outer()
    if way == "in_reply":
        return taken
    return {"shards": {SNAPSHOT_FILE: encode_frame(taken)}}


class ReplicaMode:
    """How a replica trains (module docstring); as it stands, a replica with no plan."""

    plan: ReplicaPlan | None = None
    wrapped: Wrapped | None = None

    # -- set up, and what outlives a plan or a group -------------------------------------------

    def held(self) -> dict[str, int] | None:
        """What ``dist_plan`` answers: a sharded replica's share of the model; else nothing."""
        return None

    def before_plan(self, run: list[Node]) -> ReplicaMode:
        """Before a new plan over ``run``: what of this mode the plan may take over.

        Raises:
            EngineError: ``BAD_REQUEST`` where ``run`` cannot train a new plan.
        """
        return self

    def kept_outer_step(
        self, spec: OuterStepSpec, trained: Sequence[torch.nn.Parameter]
    ) -> OuterStep | None:
        """DiLoCo's outer step of the group this replica left, for a plan that regroups with
        the same ``spec`` over the same ``trained`` parameters (then taken: no longer kept)."""
        return None

    def owed_sync(self) -> int | None:
        """The step after which a synchronisation is owed, its group having broken in it."""
        return None

    def left_group(self) -> ReplicaMode:
        """What stays of this mode once its group is left: nothing (a replica with no plan)."""
        return Unplanned()

    def close(self) -> None:
        """Let go of what this mode holds that the next one did not take."""

    # -- the step loop's face ------------------------------------------------------------------

    def backward_scope(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """The context a slice of a step runs its forward and backward in: the gradients
        reduced on the step's ``last`` slice only (DDP's ``no_sync`` before it)."""
        if last or self.wrapped is None:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def before_steps(
        self, start: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        """Before training on from step ``start`` with the ``inner`` optimizers; ``said``: the
        chunk's results so far."""

    def after_step(
        self, step: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        """After global step ``step`` (from 0)."""

    def after_last_step(self, done: int) -> None:
        """After the plan's last step (``done`` steps in all)."""

    def snapshot(
        self, prefix: list[Node], run: list[Node], done: int, way: SnapshotWay
    ) -> dict[str, Any]:
        """What a checkpoint saves of this replica as its chunk ends, ``done`` steps taken,
        ``prefix`` the plain filters before the ``run`` (:class:`~protocol.daemon.
        DistTrainRequest`'s ``snapshot``)."""
        raise EngineError(ErrorCode.BAD_REQUEST, "dist_train before dist_plan")

    # -- requests that are one mode's ------------------------------------------------------------

    def evaluate(self, node_ids: Sequence[str], x: Any, y: Any) -> dict[str, Any]:
        """A sharded replica's evaluation (:mod:`engine.data_parallel.modes.sharded`)."""
        raise EngineError(
            ErrorCode.BAD_REQUEST, "dist_evaluate evaluates a sharded replica, and this one is not"
        )

    def pieces(self) -> dict[str, Any]:
        """A sharded replica's shards of its model, where they lie."""
        raise EngineError(
            ErrorCode.BAD_REQUEST, "dist_pieces reads a sharded replica, and this one is not"
        )

    def load_shards(self, files: TemporaryDirectory[str] | None, rest: dict[str, Any]) -> None:
        """A sharded checkpoint's ``files`` loaded into a sharded replica's shards."""
        if files is not None:
            files.cleanup()
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            "dist_load_shards loads a sharded replica from the files dist_shard_file gave it",
        )

    def pseudo_gradients(self, compression: Compression) -> dict[str, Any]:
        """A replica alone at a synchronisation: its pseudo-gradients, compressed."""
        raise _not_alone()

    def outer_update(self, update: dict[str, Any]) -> None:
        """A replica alone takes the coordinator's outer update."""
        raise _not_alone()

    def outer_momentum(self) -> dict[str, dict[str, torch.Tensor]]:
        """DiLoCo's outer momentum on a replica of a torch group."""
        raise _not_on_group()

    def set_outer_momentum(self, momentum: dict[str, dict[str, Any]]) -> None:
        """Set DiLoCo's outer momentum on a replica of a torch group."""
        raise _not_on_group()

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """A DiLoCo replica's weights set to the global model while the block runs; nothing
        here."""
        return contextlib.nullcontext()


class Unplanned(ReplicaMode):
    """A replica with no plan: before its first ``dist_plan``, or once its group was left."""


def _not_alone() -> EngineError:
    return EngineError(
        ErrorCode.BAD_REQUEST,
        "pseudo-gradients and outer updates are for a replica planned alone, with compression",
    )


def _not_on_group() -> EngineError:
    return EngineError(
        ErrorCode.BAD_REQUEST, "the outer state is a DiLoCo replica's, in a torch group"
    )
