"""How the daemons (coordinator, agent) write a log line: one line per record, whatever a
record quotes of others.

A coordinator's log quotes what clients and workers sent it — a job's name, a filter's error —
and a newline or an escape sequence there once wrote lines that looked like the coordinator's
own (``2026-12-05 ... INFO worker w9 connected``) or rewrote the terminal showing them. Each
record's message is written with its control characters escaped
(:func:`protocol.text.wording.visible`, newlines included); a traceback logged with it keeps its
lines.
"""

from __future__ import annotations

import logging
from typing import TextIO

from protocol.text.wording import visible

__all__ = ["FORMAT", "OneLineFormatter", "log_to"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""What a line says: when, how bad, who, what."""


class OneLineFormatter(logging.Formatter):
    """A formatter whose record messages are one visible line each (module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = visible(record.message, lines=False)
        return super().formatMessage(record)


def log_to(stream: TextIO, level: str | int) -> None:
    """Log at ``level`` to ``stream``, one visible line per record (as
    :func:`logging.basicConfig` would, with :class:`OneLineFormatter`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
