"""Streaming DiLoCo's fragments (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"): which parameters each fragment holds, and after which steps each synchronises.

Shared by the replicas (:mod:`engine.outer_step`), the coordinator (the ``placed`` event's peak
bytes) and the tests' hand-written loops, so all three cut and schedule alike. Pure functions.

* :func:`fragment_groups` cuts a model's parameters, in their order, into ``fragments``
  contiguous runs of about equal bytes (a parameter is never split).
* :func:`fragment_syncs` says, per step of a run, which fragments synchronise after it:
  fragment ``p`` every ``every`` steps counted over the run, at its own offset
  ``p * every // fragments`` (fragment 0 after steps ``every``, ``2 every``, ...: with one
  fragment, DiLoCo's own schedule), so the exchanges are spread over the ``every`` steps
  instead of all at once; and every fragment after the run's last step and after each step
  of ``also`` (where the global model is read). Those last are *blocking*
  (:func:`blocking_steps`): they wait for every exchange still in flight and overlap nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["blocking_steps", "fragment_groups", "fragment_syncs"]


def fragment_groups(nbytes: Sequence[int], fragments: int) -> list[list[int]]:
    """The indices of the parameters of ``nbytes`` bytes each, in order, cut into
    ``fragments`` contiguous non-empty runs of about ``sum / fragments`` bytes each.

    Raises:
        ValueError: fewer parameters than fragments, or fewer than one fragment.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be at least 1, not {fragments}")
    if len(nbytes) < fragments:
        raise ValueError(
            f"{fragments} fragments need at least as many parameters; the model has {len(nbytes)}"
        )
    total = sum(nbytes)
    groups: list[list[int]] = []
    current: list[int] = []
    done = 0
    for k, n in enumerate(nbytes):
        current.append(k)
        done += n
        after = fragments - len(groups) - 1  # fragments still to fill after this one
        left = len(nbytes) - k - 1  # parameters still to place
        if after and (done * fragments >= (len(groups) + 1) * total or left == after):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


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
