"""Issue 15: rows of an ``.npy`` read by spans, each row straight to its place.

Every index shape a training step asks for — a shuffled batch, rows in order, repeats, rows from
the end, rows a few bytes apart (labels) and far apart (16 KiB features) — is read with
:class:`engine.data.npy_rows.NpyRows` and compared with numpy's own indexing of the array written;
the plan is checked against a count made by hand; a read the system cuts short, or splits in
several calls, still fills every byte.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine.data import row_reads
from engine.data.npy_rows import NpyRows
from engine.data.row_reads import plan_reads, read_into

INDEXES = {
    "shuffled": np.random.default_rng(0).permutation(500)[:64],
    "in order": np.arange(100, 164),
    "repeats": np.array([7, 3, 7, 7, 499, 3, 0]),
    "from the end": np.array([-1, -2, 5, -500]),
    "one row": np.array([42]),
    "none": np.array([], dtype=np.int64),
    "reversed run": np.arange(200, 150, -1),
}


@pytest.mark.parametrize("name", sorted(INDEXES))
@pytest.mark.parametrize("width", [1, 4096])  # 8-byte rows (merged) and 16 KiB rows (not)
def test_rows_read_equal_numpys_indexing(tmp_path: Path, name: str, width: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, width)).astype(np.float32).squeeze()
    np.save(tmp_path / "x.npy", x)
    got = NpyRows(tmp_path / "x.npy")[INDEXES[name]]
    np.testing.assert_array_equal(got, x[INDEXES[name]])
    assert got.flags.c_contiguous and got.flags.writeable


def test_the_plan_reads_each_row_once_and_joins_rows_closer_than_the_gap() -> None:
    # 8-byte rows, a 64-byte gap: rows 0..3 and 10 join (6 rows between: 48 bytes); 100 and 101
    # are consecutive; 3 is asked for twice, and copied.
    index = np.array([101, 3, 0, 10, 100, 3])
    plan = plan_reads(index, 8, gap=64)
    assert (plan.firsts, plan.counts, plan.dense) == ([0, 100], [11, 2], [False, True])
    assert plan.wanted.tolist() == [0, 3, 10, 100, 101] and plan.bounds == [0, 3, 5]
    assert plan.into.tolist() == [2, 1, 3, 4, 0]
    assert (plan.copy_to.tolist(), plan.copy_from.tolist()) == ([5], [1])
    # 16 KiB rows: nothing between two rows is worth reading; rows 2, 3, 4 go to output rows
    # 1, 2, 0 (one buffer each), rows 7, 8 to 3, 4 (one buffer for both).
    far = plan_reads(np.array([4, 2, 3, 7, 8]), 16 << 10)
    assert (far.firsts, far.counts, far.dense, far.ordered) == (
        [2, 7],
        [3, 2],
        [True, True],
        [False, True],
    )


def test_what_the_page_cache_holds_is_read_without_waiting_and_the_rest_after(
    tmp_path: Path, monkeypatch
) -> None:
    x = np.arange(200 * 4096, dtype=np.float32).reshape(200, 4096)  # 16 KiB rows
    np.save(tmp_path / "x.npy", x)
    rows = NpyRows(tmp_path / "x.npy")
    index = np.array([190, 3, 100, 4, 5, 1, 150])  # spans: 1; 3..5; 100; 150; 190
    real = os.preadv
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(
        row_reads.os, "posix_fadvise", lambda fd, at, n, how: advised.append((at, n))
    )

    np.testing.assert_array_equal(rows[index], x[index])
    assert advised == []  # all of it came from the page cache: nothing announced

    tries = []

    def half_cached(fd, buffers, at, *flags):  # half of a span's first row, or none of it
        if not flags:
            return real(fd, buffers, at)
        tries.append(at)
        if len(tries) % 2:
            raise BlockingIOError
        return real(fd, [buffers[0][: len(buffers[0]) // 2]], at, *flags)

    monkeypatch.setattr(row_reads.os, "preadv", half_cached)
    np.testing.assert_array_equal(rows[index], x[index])
    assert len(tries) == 5 and len(advised) == 5  # every span was waited for, announced first
    row = 16 << 10  # rows 3..5 and 150 were read in part: the rest of them is announced
    assert sorted(n for _, n in advised) == [row // 2, row, row, row, 5 * row // 2]


def test_a_read_cut_short_or_split_still_fills_every_buffer(tmp_path: Path, monkeypatch) -> None:
    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    path.write_bytes(data)
    real = os.preadv
    calls = []

    def at_most_100_bytes(fd, buffers, at):  # what a signal or a busy device may do
        calls.append(len(buffers))
        first = buffers[0][: min(100, len(buffers[0]))]
        return real(fd, [first], at)

    monkeypatch.setattr(row_reads.os, "preadv", at_most_100_bytes)
    monkeypatch.setattr(row_reads, "IOV_MAX", 2)
    monkeypatch.setattr(row_reads, "MAX_READ", 700)
    buffers = [memoryview(bytearray(n)) for n in (300, 0, 1500, 7)]
    fd = os.open(path, os.O_RDONLY)
    try:
        read_into(fd, buffers, 13, "f")
        with pytest.raises(OSError, match="f: the file ended"):
            read_into(fd, [memoryview(bytearray(10))], len(data) - 5, "f")
    finally:
        os.close(fd)
    assert b"".join(bytes(b) for b in buffers) == data[13 : 13 + 1807]
    assert len(calls) > 18 and max(calls) <= 2
