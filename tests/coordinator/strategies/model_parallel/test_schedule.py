"""Pipeline schedules as data: built, printed, simulated and refused with no workers."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from coordinator.errors import CoordinatorError
from coordinator.strategies.model_parallel.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    max_in_flight,
    one_f_one_b,
    validate,
)

SIZES = [(2, 1), (2, 4), (3, 4), (4, 8), (3, 2)]
BUILDERS = [gpipe, one_f_one_b]


def parse(*stages: str, micro_batches: int, name: str = "hand") -> Schedule:
    """A schedule from one line per stage in the printed form, e.g. ``"F0 F1 B1 B0"``."""
    actions = tuple(
        tuple(Action("F" if word[0] == "F" else "B", int(word[1:])) for word in line.split())
        for line in stages
    )
    return Schedule(len(stages), micro_batches, actions, name=name)


def refused(message: str):
    """Expect a ScheduleError whose message is exactly ``message``."""
    return pytest.raises(ScheduleError, match=f"^{re.escape(message)}$")


# The two schedules ------------------------------------------------------------------------------


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_every_action_once_per_stage_and_valid(build, stages, micro_batches):
    schedule = build(stages, micro_batches)
    validate(schedule)
    assert (schedule.stages, schedule.micro_batches) == (stages, micro_batches)
    expected = Counter(Action(k, m) for k in ("F", "B") for m in range(micro_batches))
    for actions in schedule.actions:
        assert Counter(actions) == expected


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_simulation_runs_everything_without_deadlock(build, stages, micro_batches):
    ticks = build(stages, micro_batches).ticks()
    ran = [pair for tick in ticks for pair in tick]
    assert len(ran) == len(set(ran)) == 2 * stages * micro_batches
    for tick in ticks:
        busy = [stage for stage, _ in tick]
        assert busy == sorted(set(busy))  # at most one action per stage per tick


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_ticks_are_two_times_m_plus_s_minus_one(build, stages, micro_batches):
    assert len(build(stages, micro_batches).ticks()) == 2 * (micro_batches + stages - 1)


def test_gpipe_printed():
    assert str(gpipe(2, 4)) == (
        "stage 0: F0 F1 F2 F3 B3 B2 B1 B0\nstage 1: F0 F1 F2 F3 B3 B2 B1 B0"
    )
    assert str(Action("F", 0)) == "F0"
    assert str(Action("B", 3)) == "B3"


def test_one_f_one_b_printed():
    assert str(one_f_one_b(3, 4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    # fewer micro-batches than the warm-up would want: all forwards, then backwards in order
    assert str(one_f_one_b(4, 2)).splitlines()[0] == "stage 0: F0 F1 B0 B1"


def test_gpipe_timeline_2x2():
    ticks = [[(s, str(a)) for s, a in tick] for tick in gpipe(2, 2).ticks()]
    assert ticks == [
        [(0, "F0")],
        [(0, "F1"), (1, "F0")],
        [(1, "F1")],
        [(1, "B1")],
        [(0, "B1"), (1, "B0")],
        [(0, "B0")],
    ]


@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_in_flight(stages, micro_batches):
    assert max_in_flight(gpipe(stages, micro_batches)) == [micro_batches] * stages
    peaks = max_in_flight(one_f_one_b(stages, micro_batches))
    for stage, peak in enumerate(peaks):
        assert peak <= stages - stage
        assert peak == min(stages - stage, micro_batches)


@pytest.mark.parametrize(
    ("stages", "micro_batches", "bubble"),
    [(2, 1, 1 / 2), (2, 4, 1 / 5), (3, 4, 2 / 6), (4, 8, 3 / 11), (1, 5, 0.0)],
)
@pytest.mark.parametrize("build", BUILDERS)
def test_bubble_fraction(build, stages, micro_batches, bubble):
    assert build(stages, micro_batches).bubble_fraction() == pytest.approx(bubble)


# Arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", BUILDERS)
def test_sizes_checked(build):
    with pytest.raises(ValueError, match="at least 1 stage, got stages=0"):
        build(0, 4)
    with pytest.raises(ValueError, match="at least 1 micro-batch, got micro_batches=0"):
        build(2, 0)


def test_one_action_list_per_stage():
    with pytest.raises(ValueError, match=r"^hand: 1 action lists for 2 stages$"):
        Schedule(2, 1, ((Action("F", 0), Action("B", 0)),), name="hand")


# Bad schedules ----------------------------------------------------------------------------------


def test_backward_before_its_forward():
    bad = parse("F0 B1 F1 B0", "F0 F1 B1 B0", micro_batches=2)
    with refused("hand: stage 0: B1 comes before F1"):
        validate(bad)


def test_missing_micro_batch():
    bad = parse("F0 F1 B1 B0", "F0 B0", micro_batches=2)
    with refused("hand: stage 1: F1 B1 missing"):
        validate(bad)


def test_repeated_micro_batch():
    bad = parse("F0 F0 B0", "F0 B0", micro_batches=1)
    with refused("hand: stage 0: F0 appears 2 times"):
        validate(bad)


def test_out_of_range_micro_batch():
    bad = parse("F0 F2 B2 B0", "F0 B0", micro_batches=2)
    with refused("hand: stage 0: F2 is out of range (2 micro-batches)"):
        validate(bad)


def test_cross_stage_deadlock():
    # Stage 0 wants B0 before sending F1; stage 1 wants F1 before computing B0.
    bad = parse("F0 B0 F1 B1", "F0 F1 B1 B0", micro_batches=2)
    message = (
        "hand: deadlock after 2 ticks: stage 0 waits at B0 for B0 on stage 1; "
        "stage 1 waits at F1 for F1 on stage 0"
    )
    with refused(message):
        validate(bad)
    with refused(message):
        bad.ticks()


def test_errors_are_value_errors_of_the_coordinator():
    assert issubclass(ScheduleError, ValueError)
    assert issubclass(ScheduleError, CoordinatorError)
