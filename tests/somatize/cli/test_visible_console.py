"""somatize.cli.visible_console: what ``somatize`` prints of others' text shows as what it says
(issue 53: ``somatize result`` printed a filter's escape sequences raw)."""

from __future__ import annotations

import io

from somatize.cli.visible_console import VisibleConsole


def test_a_filters_escape_sequences_are_printed_as_text_and_its_traceback_keeps_its_lines():
    out = io.StringIO()
    console = VisibleConsole(file=out, highlight=False, width=200)
    console.print(
        "job failed: boom\x1b[2J\x1b]0;owned\x07\nTraceback:\n  line", markup=False, soft_wrap=True
    )
    printed = out.getvalue()
    assert "\x1b" not in printed and "\x07" not in printed
    assert printed == "job failed: boom\\x1b[2J\\x1b]0;owned\\x07\nTraceback:\n  line\n"
