"""A filter's bytes as they travel to a daemon: a one-dimensional ``uint8`` array.

A frame carries ``bytes`` as a copy out of itself (:mod:`protocol.codec`: bytes are immutable),
and an array as a view over it. So the coordinator sends each filter's bytes as an array
(:func:`as_buffer`, no copy): the agent passes it on without a copy of its own, and the daemon,
which reads a frame into writable memory, unpickles the filter over it
(:func:`~protocol.filters.load_filter`): the model's tensors are that memory, and a replica
loads a model at once its size rather than twice. ``bytes`` are still taken
(:data:`FilterBuffer`), and so is a :class:`~protocol.codec.Joined`, which the coordinator
sends a sharded replica's cut of a filter as (its rows, never joined in the coordinator:
:func:`~protocol.filters.split_rows`), and which arrives as the array.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import PlainValidator

from protocol.codec import Joined

__all__ = ["FilterBuffer", "as_buffer"]


def as_buffer(data: bytes | bytearray | memoryview | np.ndarray | Joined) -> np.ndarray | Joined:
    """``data``, a filter's bytes, as the ``uint8`` array it travels as (a view, no copy; a
    :class:`~protocol.codec.Joined` as it is: it travels as one)."""
    if isinstance(data, np.ndarray | Joined):
        _checked(data)
        return data
    return np.frombuffer(data, dtype=np.uint8)


def _checked(value: Any) -> bytes | np.ndarray | Joined:
    if isinstance(value, bytes | Joined):
        return value
    if (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value
    raise ValueError(
        f"a filter travels as its bytes or a one-dimensional uint8 array of them, not "
        f"{type(value).__name__}"
    )


FilterBuffer = Annotated[Any, PlainValidator(_checked)]
"""A message field holding a filter's bytes: ``bytes``, or a one-dimensional contiguous
``uint8`` array of them (or, to be sent, a :class:`~protocol.codec.Joined` of them)."""
