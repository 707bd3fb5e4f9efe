"""protocol.rules.fragments: Streaming DiLoCo's fragments and their staggered schedule."""

from __future__ import annotations

import pytest

from protocol.rules.batching import synchronises
from protocol.rules.fragments import blocking_steps, fragment_groups, fragment_syncs


def test_parameters_are_cut_in_order_into_runs_of_about_equal_bytes():
    assert fragment_groups([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragment_groups([4] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert fragment_groups([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]  # never split
    assert fragment_groups([1, 1, 100], 3) == [[0], [1], [2]]  # each holds one at least
    assert fragment_groups([384, 64, 192, 12], 2) == [[0], [1, 2, 3]]  # the tests' MLP
    assert fragment_groups([5, 7], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="at least as many parameters"):
        fragment_groups([1, 2], 3)


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
