"""Pipeline-parallel schedules as plain data: a list of actions per stage, built and checked with
no workers, no sockets and no event loop.

A pipeline of ``S`` stages trains one global batch as ``M`` micro-batches. Each stage runs a
sequence of actions: ``F{m}`` (forward micro-batch ``m`` through this stage) and ``B{m}`` (backward
micro-batch ``m``). Every stage steps its optimizer once after all its actions; that step is not
part of the schedule.

Dependencies between stages (the same rules for :func:`validate` and :meth:`Schedule.ticks`):

- ``F{m}`` on stage ``s > 0`` needs ``F{m}`` done on stage ``s - 1`` (its input activation);
- ``B{m}`` on stage ``s < S - 1`` needs ``B{m}`` done on stage ``s + 1`` (its output gradient);
- ``B{m}`` on the last stage needs only its own ``F{m}`` (the loss is computed there).

Two schedules are provided:

- :func:`gpipe` — GPipe (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks
  using Pipeline Parallelism", §2.2): "During the forward pass, GPipe first divides every
  mini-batch of size N into M equal micro-batches, which are pipelined through the K
  accelerators. During the backward pass, gradients for each micro-batch are computed based on the
  same model parameters used for the forward pass. At the end of each mini-batch, gradients from
  all M micro-batches are accumulated and applied to update the model parameters across all
  accelerators." Every stage runs ``F0 .. F(M-1)`` then ``B(M-1) .. B0`` and so keeps all ``M``
  micro-batches' activations alive.
- :func:`one_f_one_b` — 1F1B as in PipeDream-Flush (Narayanan et al., 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training"): after a warm-up of forwards, each stage alternates one forward
  and one backward, which bounds the micro-batches in flight (forwarded, backward outstanding,
  activations kept) by the pipeline depth; a flush at the end of the batch gives the same weight
  update semantics as GPipe. Stage ``s`` runs ``min(S - s - 1, M)`` warm-up forwards, then the
  1F1B steady state, then drains the remaining backwards; it never holds more than ``S - s``.

For ``S = 3, M = 4``::

    gpipe                                1f1b
    stage 0: F0 F1 F2 F3 B3 B2 B1 B0     stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    stage 1: F0 F1 F2 F3 B3 B2 B1 B0     stage 1: F0 F1 B0 F2 B1 F3 B2 B3
    stage 2: F0 F1 F2 F3 B3 B2 B1 B0     stage 2: F0 B0 F1 B1 F2 B2 F3 B3

Both have the same idealised bubble, ``(S - 1) / (M + S - 1)`` (GPipe writes it
``O((K - 1) / (M + K - 1))``); 1F1B gains memory (``S - s`` micro-batches' activations instead of
``M``), not time.

Example::

    >>> print(gpipe(2, 4))
    stage 0: F0 F1 F2 F3 B3 B2 B1 B0
    stage 1: F0 F1 F2 F3 B3 B2 B1 B0
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from coordinator.errors import CoordinatorError

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "gpipe",
    "max_in_flight",
    "one_f_one_b",
    "validate",
]


class ScheduleError(CoordinatorError, ValueError):
    """A pipeline schedule that cannot run: a micro-batch missing or repeated on a stage, a
    backward before its own forward, or cross-stage dependencies that deadlock. The message
    names the stage and the action."""


@dataclass(frozen=True)
class Action:
    """One step of one stage: forward (``F``) or backward (``B``) of micro-batch ``micro``."""

    kind: Literal["F", "B"]
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


Tick = list[tuple[int, Action]]
"""Actions that run at the same time step, as ``(stage, action)`` pairs in stage order."""


@dataclass(frozen=True)
class Schedule:
    """The actions of every stage of a pipeline, in the order each stage runs them.

    Constructing a schedule only checks its shape (counts, one tuple per stage); whether it can
    run is :func:`validate`'s job, so that broken schedules can be built and inspected.
    """

    stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        _check_sizes(self.stages, self.micro_batches)
        if len(self.actions) != self.stages:
            raise ValueError(
                f"{self.name}: {len(self.actions)} action lists for {self.stages} stages"
            )

    def __str__(self) -> str:
        return "\n".join(
            f"stage {stage}: " + " ".join(str(action) for action in actions)
            for stage, actions in enumerate(self.actions)
        )

    def ticks(self) -> list[Tick]:
        """Simulate an idealised lockstep execution.

        Every action takes one tick. At each tick, each stage runs its next action if that
        action's dependency (see the module docstring) was done in an earlier tick; stages run
        their actions strictly in order.

        Returns:
            One list per time step of the ``(stage, action)`` pairs that run concurrently.

        Raises:
            ScheduleError: no stage can make progress while actions remain (a deadlock); the
                message names every blocked stage, its next action and what it waits for.
        """
        done: set[tuple[int, Action]] = set()
        position = [0] * self.stages
        timeline: list[Tick] = []
        while any(position[s] < len(self.actions[s]) for s in range(self.stages)):
            tick: Tick = []
            for stage, actions in enumerate(self.actions):
                if position[stage] == len(actions):
                    continue
                action = actions[position[stage]]
                if _dependency(self.stages, stage, action) in done | {None}:
                    tick.append((stage, action))
            if not tick:
                raise ScheduleError(self._deadlock_message(position, len(timeline)))
            for stage, action in tick:
                done.add((stage, action))
                position[stage] += 1
            timeline.append(tick)
        return timeline

    def bubble_fraction(self) -> float:
        """The fraction of stage-ticks left idle in the lockstep simulation of :meth:`ticks`.

        This is the idealised figure where a forward and a backward cost the same and
        communication is free; real backwards cost about twice a forward. For GPipe and 1F1B it
        is ``(S - 1) / (M + S - 1)`` (GPipe's ``O((K - 1) / (M + K - 1))``).
        """
        timeline = self.ticks()
        busy = sum(len(tick) for tick in timeline)
        return float(1 - Fraction(busy, self.stages * len(timeline)))

    def _deadlock_message(self, position: list[int], ticks_done: int) -> str:
        waits = []
        for stage, actions in enumerate(self.actions):
            if position[stage] < len(actions):
                action = actions[position[stage]]
                needed = _dependency(self.stages, stage, action)
                assert needed is not None  # an action without dependency is always ready
                waits.append(
                    f"stage {stage} waits at {action} for {needed[1]} on stage {needed[0]}"
                )
        return f"{self.name}: deadlock after {ticks_done} ticks: " + "; ".join(waits)


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got stages={stages}")
    if micro_batches < 1:
        raise ValueError(
            f"a pipeline needs at least 1 micro-batch, got micro_batches={micro_batches}"
        )


def _dependency(stages: int, stage: int, action: Action) -> tuple[int, Action] | None:
    """The ``(stage, action)`` that must be done before ``action`` can run on ``stage``."""
    if action.kind == "F":
        return None if stage == 0 else (stage - 1, action)
    if stage == stages - 1:
        return (stage, Action("F", action.micro))
    return (stage + 1, action)


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: every stage runs all forwards ``F0 .. F(M-1)``, then all backwards in reverse.

    Raises:
        ValueError: ``stages`` or ``micro_batches`` is below 1.
    """
    _check_sizes(stages, micro_batches)
    forwards = tuple(Action("F", m) for m in range(micro_batches))
    backwards = tuple(Action("B", m) for m in reversed(range(micro_batches)))
    return Schedule(stages, micro_batches, (forwards + backwards,) * stages, name="gpipe")


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then the rest.

    Stage ``s`` runs ``warmup = min(S - s - 1, M)`` forwards, then ``M - warmup`` pairs
    ``F(warmup + i) B(i)``, then the remaining backwards ``B(M - warmup) .. B(M - 1)``; it holds at
    most ``S - s`` micro-batches in flight.

    Raises:
        ValueError: ``stages`` or ``micro_batches`` is below 1.
    """
    _check_sizes(stages, micro_batches)
    per_stage = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        actions = [Action("F", m) for m in range(warmup)]
        for i in range(micro_batches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", m) for m in range(micro_batches - warmup, micro_batches)]
        per_stage.append(tuple(actions))
    return Schedule(stages, micro_batches, tuple(per_stage), name="1f1b")


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""The schedules by the name ModelParallel's ``schedule`` option gives."""


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` runs every micro-batch once per stage and cannot deadlock.

    Raises:
        ScheduleError: naming the stage and action, when a micro-batch is out of range, missing
            or repeated on a stage, when a backward comes before its own forward on the same
            stage, or when the cross-stage dependencies deadlock.
    """
    expected = {Action(kind, m) for kind in ("F", "B") for m in range(schedule.micro_batches)}
    for stage, actions in enumerate(schedule.actions):
        where = f"{schedule.name}: stage {stage}"
        for action, count in Counter(actions).items():
            if action not in expected:
                raise ScheduleError(
                    f"{where}: {action} is out of range ({schedule.micro_batches} micro-batches)"
                )
            if count > 1:
                raise ScheduleError(f"{where}: {action} appears {count} times")
        missing = sorted(expected - set(actions), key=lambda a: (a.kind != "F", a.micro))
        if missing:
            raise ScheduleError(f"{where}: {' '.join(map(str, missing))} missing")
        forwarded: set[int] = set()
        for action in actions:
            if action.kind == "F":
                forwarded.add(action.micro)
            elif action.micro not in forwarded:
                raise ScheduleError(f"{where}: {action} comes before F{action.micro}")
    schedule.ticks()


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the largest number of micro-batches forwarded but not yet backwarded.

    This is the number of activations a stage keeps alive at its peak: ``M`` for GPipe,
    ``min(S - s, M)`` for 1F1B. Meaningful for schedules that pass :func:`validate`.
    """
    peaks = []
    for actions in schedule.actions:
        in_flight = peak = 0
        for action in actions:
            in_flight += 1 if action.kind == "F" else -1
            peak = max(peak, in_flight)
        peaks.append(peak)
    return peaks
