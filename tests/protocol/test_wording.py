"""Messages that name many things name a few and say how many."""

from __future__ import annotations

from protocol.wording import LISTED, listed


def test_a_short_list_is_shown_whole_and_a_long_one_cut_with_its_count():
    assert listed(["a", "b"]) == "['a', 'b']"
    assert listed([]) == "[]"
    many = [f"n{i}" for i in range(50_000)]
    shown = listed(many)
    assert shown.startswith("['n0', 'n1', ") and shown.endswith(", ... (50000 in all)]")
    assert shown.count("'n") == LISTED
    assert listed([1, 2, 3], limit=2) == "[1, 2, ... (3 in all)]"
