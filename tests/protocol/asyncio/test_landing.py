"""A large chunked message is reassembled in an unnamed file's map, not in memory.

Where the bytes lie is read from ``/proc/self/maps``, the kernel's account of this process's
mappings: a file made with ``O_TMPFILE`` shows there as ``<directory>/#<inode> (deleted)``.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import numpy as np

from protocol.asyncio.landing import Landing
from protocol.chunking import chunk_messages
from protocol.codec import encode
from protocol.inbox import Inbox
from protocol.messages import CHUNK_BYTES, Call
from protocol.parsing import dump


def _maps_under(directory: Path) -> list[tuple[int, int, str]]:
    """This process's mappings of files in ``directory``: (start, end, path as shown)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{directory}/"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            found.append((start, end, fields[5]))
    return found


def _received(inbox: Inbox, x: np.ndarray) -> Call:
    chunks = list(chunk_messages(encode(dump(Call(id=1, job_id="j", request={"x": x}))), 1))
    assert len(chunks) > 1
    messages = [inbox.take(c) for c in chunks]
    assert messages[:-1] == [None] * (len(chunks) - 1)
    return messages[-1]


def test_a_large_message_lands_in_an_unnamed_file_that_leaves_nothing_behind(tmp_path):
    landing = Landing(tmp_path, 1 << 30, min_bytes=2 * CHUNK_BYTES)
    x = np.arange(3 * CHUNK_BYTES // 8, dtype=np.float64)
    message = _received(Inbox(1 << 30, buffer_for=landing), x)
    np.testing.assert_array_equal(message.request["x"], x)
    maps = _maps_under(tmp_path)
    address = message.request["x"].ctypes.data
    assert [m for m in maps if m[0] <= address < m[1] and m[2].endswith("(deleted)")]
    assert list((tmp_path).iterdir()) == []  # no name: a crash leaves no file
    assert landing.on_disk >= x.nbytes
    del message, maps
    gc.collect()
    assert landing.on_disk == 0 and not _maps_under(tmp_path)


def test_files_in_use_hold_no_more_than_the_bound_the_rest_land_in_memory(tmp_path):
    landing = Landing(tmp_path, 5 * CHUNK_BYTES, min_bytes=2 * CHUNK_BYTES)
    first, second = landing(3 * CHUNK_BYTES), landing(3 * CHUNK_BYTES)
    assert len(_maps_under(tmp_path)) == 1 and landing.on_disk == 3 * CHUNK_BYTES
    assert second.nbytes == 3 * CHUNK_BYTES  # in memory: over the bound together
    del first
    gc.collect()
    third = landing(3 * CHUNK_BYTES)
    assert len(_maps_under(tmp_path)) == 1 and third.nbytes == 3 * CHUNK_BYTES


def test_a_small_message_and_one_with_nowhere_to_land_are_received_in_memory(tmp_path, caplog):
    directory = tmp_path / "incoming"
    directory.mkdir()
    landing = Landing(directory, 1 << 30, min_bytes=2 * CHUNK_BYTES)
    small = _received(Inbox(1 << 30, buffer_for=landing), np.ones(CHUNK_BYTES // 8))
    assert small.request["x"].sum() == CHUNK_BYTES // 8 and not _maps_under(directory)

    directory.rmdir()
    directory.write_text("no longer a directory")
    x = np.arange(3 * CHUNK_BYTES // 8, dtype=np.float64)
    with caplog.at_level(logging.WARNING, logger="protocol.asyncio.landing"):
        for _ in range(2):
            np.testing.assert_array_equal(
                _received(Inbox(1 << 30, buffer_for=landing), x).request["x"], x
            )
    said = [r for r in caplog.records if "received in memory" in r.getMessage()]
    assert len(said) == 1 and str(directory) in said[0].getMessage()
