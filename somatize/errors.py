"""Exceptions of the SDK.

Exception tree::

    SomatizeError            root of everything raised by :mod:`somatize`
    └── GraphError           a graph that cannot be built (duplicate node ids, a filter used twice)

Errors raised while a graph trains come from the engine (:class:`worker.errors.EngineError`) or
from the user's own filters, unchanged.
"""


class SomatizeError(Exception):
    """Root of the errors raised by :mod:`somatize`."""


class GraphError(SomatizeError, ValueError):
    """A graph that cannot be built as asked."""
