"""What a data-parallel replica walks: its slice of every global batch among the rows staged
on it, and how it trains (:class:`ReplicaPlan`, made from a ``dist_plan`` request whole).

Every replica computes the same global batches as ``graph.fit`` would take
(:func:`protocol.rules.batching.global_batches`) and finds its slice of each among the rows it
was sent; on the replicas' own datasets (``WorkerData``) each step is every replica's next
batch of its own (:func:`protocol.rules.batching.replica_batches`). A DiLoCo mode adds where
the replicas synchronise (:func:`protocol.rules.fragments.fragment_syncs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import EngineError
from protocol.daemon import DistPlanRequest, OuterStepSpec, ReplicaModeSpec
from protocol.errors import ErrorCode
from protocol.options.compression import Compression
from protocol.rules.batching import global_batches, replica_batches
from protocol.rules.fragments import fragment_syncs

__all__ = ["ReplicaPlan"]


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    """What a replica walks: per global step the positions of its slice in the rows staged
    under ``data``, and the global batch's size; and per step the fewest rows a replica has
    (``least``: every replica runs as many forwards a step, each of which broadcasts buffers,
    so a step is cut in at most that many ``accumulate`` slices); how it trains (``mode``)."""

    data: str
    node_ids: list[str]
    steps: list[tuple[np.ndarray[Any, Any], int]]
    least: list[int] = field(default_factory=list)
    seed: int = 0  # with the rank and the step, torch's generator's (dropout masks)
    rank: int = 0  # this replica's place, and the replicas there are
    world: int = 1
    mode: ReplicaModeSpec
    # the gradients (DiLoCo's: pseudo-gradients) as they travel
    compression: Compression | None = None
    # per step, with DiLoCo's outer step: the fragments that synchronise after it (``(0,)``: the
    # model)
    syncs: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def of(cls, request: DistPlanRequest, *, rank: int, world: int) -> ReplicaPlan:
        """The plan ``request`` says, for the replica at ``rank`` of ``world``.

        Raises:
            EngineError: ``BAD_REQUEST`` for a slice with rows that were not staged here.
        """
        r = request
        batches = (r.epochs, r.batch_size, r.shuffle, r.seed)
        if r.sizes is not None:  # each replica on its own dataset
            own = list(itertools.islice(replica_batches(r.sizes, *batches), r.max_steps))
            steps = [(s[r.position], sum(len(p) for p in s)) for _, _, s in own]
            least = [min(len(p) for p in s) for _, _, s in own]
        else:
            in_order = global_batches(r.rows, world, *batches)
            steps, least = _slices(r.held, rank, itertools.islice(in_order, r.max_steps))
        return cls(
            data=r.data,
            node_ids=list(r.node_ids),
            steps=steps,
            least=least,
            seed=r.seed,
            rank=rank,
            world=world,
            mode=r.mode,
            compression=r.compression,
            syncs=_rounds(len(steps), r.mode.outer_step()),
        )


def _slices(
    held: Sequence[int], rank: int, batches: Iterable[tuple[int, int, list[np.ndarray[Any, Any]]]]
) -> tuple[list[tuple[np.ndarray[Any, Any], int]], list[int]]:
    """Replica ``rank``'s slice of every global batch of ``batches``, as positions among the
    rows ``held`` here, with the batch's size; the fewest rows a replica has per step.

    Raises:
        EngineError: ``BAD_REQUEST`` for a slice with rows that were not staged here.
    """
    staged = np.asarray(held, dtype=np.int64)
    steps, least = [], []
    for _, _, slices in batches:
        least.append(min(len(s) for s in slices))
        mine = slices[rank]
        local = np.searchsorted(staged, mine)
        if len(mine) and (local.max() >= len(staged) or not np.array_equal(staged[local], mine)):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"replica {rank}'s slice of a step has rows that were not staged here",
            )
        steps.append((local, sum(len(s) for s in slices)))
    return steps, least


def _rounds(steps: int, outer: OuterStepSpec | None) -> list[tuple[int, ...]]:
    """Per step of a run of ``steps``, the fragments DiLoCo synchronises after it; nothing
    without ``outer``."""
    if outer is None:
        return []
    return fragment_syncs(steps, outer.sync_every, outer.fragments, outer.also)
