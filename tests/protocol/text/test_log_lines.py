"""protocol.text.log_lines: a log record is one line, whatever it quotes (issue 53: a job's name
and an error text forged coordinator log lines, escape codes included)."""

from __future__ import annotations

import io
import logging

from protocol.text.log_lines import FORMAT, OneLineFormatter


def test_a_record_quoting_a_forged_line_and_escapes_stays_one_visible_line():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter(FORMAT))
    log = logging.getLogger("test.log_lines")
    log.addHandler(handler)
    log.propagate = False
    try:
        name = "x\n2026-12-05 01:00:00,000 INFO coordinator.server.app: worker w9 connected\x1b[2J"
        log.warning("job %s failed: %s", name, "boom\r")
        try:
            raise ValueError("inside")
        except ValueError:
            log.exception("with its traceback")
    finally:
        log.removeHandler(handler)
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith(
        "job x\\n2026-12-05 01:00:00,000 INFO coordinator.server.app: worker w9 connected"
        "\\x1b[2J failed: boom\\r"
    )
    assert rest[0].endswith("with its traceback")
    assert rest[1] == "Traceback (most recent call last):"  # a traceback keeps its lines
