"""Streaming DiLoCo's fragments (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"): which parameters each fragment holds, and after which steps each synchronises.

Shared by the replicas (:mod:`engine.data_parallel.outer_step`), the coordinator (the ``placed``
event's peak bytes) and the tests' hand-written loops, so all three cut and schedule alike. Pure
functions.

* :func:`fragment_pieces` cuts a model's parameters, flattened and laid end to end in their
  order, into ``fragments`` contiguous runs of equal numbers of values (within one): a
  parameter may be cut between two fragments, so that no fragment's exchange is larger than
  ``1 / fragments`` of the model's (whole parameters overshot it by up to the largest: 0.306
  of a 3.2 M-parameter char LM in four fragments, against 0.25).
* :func:`fragment_syncs` says, per step of a run, which fragments synchronise after it:
  fragment ``p`` every ``every`` steps counted over the run, at its own offset
  ``p * every // fragments`` (fragment 0 after steps ``every``, ``2 every``, ...: with one
  fragment, DiLoCo's own schedule), so the exchanges are spread over the ``every`` steps
  instead of all at once; and every fragment after the run's last step and after each step
  of ``also`` (where the global model is read). Those last are *blocking*
  (:func:`blocking_steps`): they wait for every exchange still in flight and overlap nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

__all__ = ["Piece", "blocking_steps", "fragment_pieces", "fragment_syncs"]

Piece = tuple[int, int, int]
"""Values ``[start, stop)`` of parameter ``index`` (flattened), as ``(index, start, stop)``."""


def fragment_pieces(numels: Sequence[int], fragments: int) -> list[list[Piece]]:
    """The parameters of ``numels`` values each, flattened and laid end to end in order, cut
    into ``fragments`` contiguous runs of ``total * (p + 1) // fragments - total * p //
    fragments`` values (run ``p``): each run's pieces of parameters, in order.

    Raises:
        ValueError: fewer values than fragments, or fewer than one fragment.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be at least 1, not {fragments}")
    total = sum(numels)
    if total < fragments:
        raise ValueError(
            f"{fragments} fragments need at least as many trainable values; the model has {total}"
        )
    cuts = [total * p // fragments for p in range(fragments + 1)]
    runs: list[list[Piece]] = []
    for begin, end in itertools.pairwise(cuts):
        run: list[Piece] = []
        at = 0  # where parameter k's values begin
        for k, n in enumerate(numels):
            start, stop = max(begin, at), min(end, at + n)
            if start < stop:
                run.append((k, start - at, stop - at))
            at += n
        runs.append(run)
    return runs


def fragment_syncs(
    steps: int, every: int, fragments: int = 1, also: Iterable[int] = ()
) -> list[tuple[int, ...]]:
    """Per step of a run of ``steps``, the fragments that synchronise after it (module
    docstring); ``()`` where none does."""
    offsets = [p * every // fragments for p in range(fragments)]
    closing = blocking_steps(steps, also)
    out: list[tuple[int, ...]] = []
    for g in range(steps):
        s = g + 1
        if s in closing:
            out.append(tuple(range(fragments)))
        else:
            out.append(tuple(p for p, o in enumerate(offsets) if s % every == o % every))
    return out


def blocking_steps(steps: int, also: Iterable[int] = ()) -> set[int]:
    """The steps (from 1) after which every fragment synchronises and nothing is left in
    flight: the run's last, and each of ``also`` within it."""
    return {s for s in also if 0 < s <= steps} | ({steps} if steps > 0 else set())
