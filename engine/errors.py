"""The engine's one exception: a request it refuses, with the code that says why.

An :class:`EngineError` is how the engine refuses what it is asked (an unknown node, no
gradients, rows that do not match...): in the filter daemon it becomes the ``error`` reply of
the command (:meth:`EngineError.info`), in ``graph.fit`` it reaches the user as it is. A filter's
own exception is never wrapped in one.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ErrorCode, ErrorInfo


class EngineError(Exception):
    """The engine refused a request; ``code`` says why (see :class:`ErrorCode`)."""

    def __init__(self, code: ErrorCode, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail: dict[str, Any] = detail or {}

    def info(self) -> ErrorInfo:
        """This error as the payload of an error reply."""
        return ErrorInfo(code=self.code, message=self.message, detail=self.detail)
