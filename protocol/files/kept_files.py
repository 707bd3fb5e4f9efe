"""Files a call's result holds that its worker keeps rather than sends (``Call.keep``).

A call may name, by the keys that lead to it, a part of its result holding files (``{name:
bytes}``: a sharded replica's checkpoint as torch.distributed.checkpoint wrote it; or ``{name:
value}``, a file of the value's codec frame, as a sharded replica's pieces of the model are
kept: :func:`file_parts`): the worker keeps them and puts ``{"kept": id, "files": {name:
size}}`` in their place, and the coordinator reads them a piece at a time. This is where both
ends find that part and check it; the worker's agent (:mod:`worker.kept_files`) and the
in-process workers (:class:`coordinator.context.InMemoryContext`) keep them. No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from protocol.codec import encode
from protocol.files.shard_files import is_plain_file_name

__all__ = ["file_parts", "files_at"]


def files_at(result: Any, keys: Sequence[str]) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The dict in ``result`` that holds the files at ``keys`` (whose last key is to be given
    what is kept in their place), and the files.

    Raises:
        ValueError: ``result`` holds nothing at ``keys``, or not files by plain name.
    """
    parent = result
    for key in keys[:-1]:
        parent = parent.get(key) if isinstance(parent, dict) else None
    if not isinstance(parent, dict) or keys[-1] not in parent:
        raise ValueError(f"the result holds no {'.'.join(keys)}")
    files = parent[keys[-1]]
    if not isinstance(files, Mapping) or not all(
        isinstance(name, str) and is_plain_file_name(name) for name in files
    ):
        raise ValueError(f"the result's {'.'.join(keys)} is not files by plain name")
    return parent, files


def file_parts(data: Any) -> Sequence[bytes | bytearray | memoryview]:
    """What a kept file holds, in parts to write one after another: ``data`` itself where it
    is bytes; else its codec frame (its arrays' memory as it is, not joined).

    Raises:
        protocol.errors.FrameError: ``data`` is not a value a frame carries.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        return [data]
    return encode(data)
