"""Messages that name many things name a few and say how many."""

from __future__ import annotations

from protocol.text.wording import LISTED, listed


def test_a_short_list_is_shown_whole_and_a_long_one_cut_with_its_count():
    assert listed(["a", "b"]) == "['a', 'b']"
    assert listed([]) == "[]"
    many = [f"n{i}" for i in range(50_000)]
    shown = listed(many)
    assert shown.startswith("['n0', 'n1', ") and shown.endswith(", ... (50000 in all)]")
    assert shown.count("'n") == LISTED
    assert listed([1, 2, 3], limit=2) == "[1, 2, ... (3 in all)]"


def test_text_others_wrote_shows_what_it_says():
    from protocol.text.wording import visible

    sent = "bad\x1b[2J\x1b]0;owned\x07 \u202eexe.txt\rnext\tline\nline two"
    assert visible(sent) == ("bad\\x1b[2J\\x1b]0;owned\\x07 \\u202eexe.txt\\rnext\tline\nline two")
    assert visible("job\n2026-12-05 INFO forged", lines=False) == ("job\\n2026-12-05 INFO forged")
    assert visible("plain, ünïcode ✓") == "plain, ünïcode ✓"
