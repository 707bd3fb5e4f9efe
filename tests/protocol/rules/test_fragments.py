"""protocol.rules.fragments: Streaming DiLoCo's fragments and their staggered schedule."""

from __future__ import annotations

import pytest

from protocol.rules.batching import synchronises
from protocol.rules.fragments import blocking_steps, fragment_pieces, fragment_syncs


def test_the_flattened_parameters_are_cut_in_order_into_runs_of_equal_values():
    # (index, start, stop) of each parameter's values a run holds, by hand
    assert fragment_pieces([10, 10, 10, 10], 2) == [
        [(0, 0, 10), (1, 0, 10)],
        [(2, 0, 10), (3, 0, 10)],
    ]
    assert fragment_pieces([100, 1, 1, 1], 2) == [
        [(0, 0, 51)],
        [(0, 51, 100), (1, 0, 1), (2, 0, 1), (3, 0, 1)],
    ]
    assert fragment_pieces([1, 1, 100], 3) == [
        [(0, 0, 1), (1, 0, 1), (2, 0, 32)],
        [(2, 32, 66)],
        [(2, 66, 100)],
    ]
    # the tests' MLP: 6·16, 16, 16·3 and 3 values, 163 in all: 81 and 82
    assert fragment_pieces([96, 16, 48, 3], 2) == [
        [(0, 0, 81)],
        [(0, 81, 96), (1, 0, 16), (2, 0, 48), (3, 0, 3)],
    ]
    assert fragment_pieces([5, 7], 1) == [[(0, 0, 5), (1, 0, 7)]]
    assert fragment_pieces([2, 1], 3) == [[(0, 0, 1)], [(0, 1, 2)], [(1, 0, 1)]]
    with pytest.raises(ValueError, match="at least as many trainable values"):
        fragment_pieces([1, 1], 3)


@pytest.mark.parametrize("fragments", [2, 3, 4, 7])
def test_no_run_holds_more_than_its_share_and_together_they_hold_every_value_once(fragments):
    numels = [256 * 96, 1024 * 256, 1024, 256 * 1024, 256, 96 * 256, 96]
    total = sum(numels)
    cut = fragment_pieces(numels, fragments)
    sizes = [sum(stop - start for _, start, stop in run) for run in cut]
    assert max(sizes) == -(-total // fragments) and min(sizes) == total // fragments
    held = [(k, v) for run in cut for k, start, stop in run for v in range(start, stop)]
    assert held == [(k, v) for k, n in enumerate(numels) for v in range(n)]


def test_each_fragment_syncs_every_h_steps_at_its_own_offset_and_all_at_the_end():
    # H = 4, two fragments: fragment 0 after 4, 8; fragment 1 (offset 2) after 2, 6, 10; both
    # after the last step (11) and after step 5, where the model is read
    syncs = fragment_syncs(11, 4, 2, also=[5])
    by_step = {s + 1: f for s, f in enumerate(syncs) if f}
    assert by_step == {2: (1,), 4: (0,), 5: (0, 1), 6: (1,), 8: (0,), 10: (1,), 11: (0, 1)}
    assert blocking_steps(11, [5, 40]) == {5, 11}
    # one fragment is DiLoCo's schedule
    assert [bool(f) for f in fragment_syncs(10, 3, 1, [7])] == synchronises(10, 3, [7])
    # as many fragments as steps between syncs: one fragment a step
    assert fragment_syncs(6, 3, 3)[:5] == [(1,), (2,), (0,), (1,), (2,)]
