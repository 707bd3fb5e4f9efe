"""engine.data.read_ahead: the next batch read while the current one trains, in order, one reader;
a replica's next step read while this one is averaged."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.data.npy_rows import NpyRows
from engine.data.read_ahead import NextRead, read_ahead
from engine.held_rows import HeldRows

WAIT = 10.0  # seconds a test waits for the other thread before it fails


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_every_key_is_read_once_and_yielded_in_order(depth):
    reads: list[int] = []

    def read(key: int) -> int:
        reads.append(key)
        return key * 10

    assert list(read_ahead(read, range(7), depth)) == [k * 10 for k in range(7)]
    assert reads == list(range(7))


def test_the_next_read_runs_while_the_current_batch_is_used():
    next_started = threading.Event()

    def read(key: int) -> int:
        if key == 1:
            next_started.set()
        return key

    batches = read_ahead(read, range(3), 1)
    assert next(batches) == 0
    # Batch 0 is in our hands and nothing more was asked for: batch 1 is being read anyway.
    assert next_started.wait(WAIT)
    assert list(batches) == [1, 2]


def test_reads_run_in_one_thread_other_than_the_loops_in_key_order():
    seen: list[tuple[int, str]] = []

    def read(key: int) -> int:
        seen.append((key, threading.current_thread().name))
        return key

    assert list(read_ahead(read, range(5), 2)) == list(range(5))
    assert [k for k, _ in seen] == list(range(5))
    names = {name for _, name in seen}
    assert len(names) == 1
    assert threading.current_thread().name not in names


def test_depth_zero_reads_inline_when_asked():
    threads: list[str] = []
    list(read_ahead(lambda k: threads.append(threading.current_thread().name), range(2), 0))
    assert threads == [threading.current_thread().name] * 2


def test_a_failed_read_raises_where_its_batch_would_come_and_the_rest_are_not_read():
    reads: list[int] = []

    def read(key: int) -> int:
        reads.append(key)
        if key == 2:
            raise OSError("the file ended while its rows were read")
        return key

    got: list[int] = []
    with pytest.raises(OSError, match="file ended"):
        for value in read_ahead(read, range(10), 1):
            got.append(value)
    assert got == [0, 1]
    assert max(reads) <= 3  # at most one read past the failed one had started


def test_a_loop_that_stops_early_leaves_no_reader_running():
    release = threading.Event()

    def read(key: int) -> int:
        if key == 1:
            assert release.wait(WAIT)
        return key

    batches = read_ahead(read, range(100), 1)
    assert next(batches) == 0
    before = threading.active_count()
    release.set()
    batches.close()  # what a `break` or an exception in the loop does
    assert threading.active_count() < before


def test_next_read_gives_the_read_started_for_its_key_and_waits_for_it():
    ahead: NextRead[str, int] = NextRead()
    release = threading.Event()

    def slow() -> int:
        assert release.wait(WAIT)
        return 7

    ahead.start("step 2", slow)
    future = ahead.take("step 2")
    assert future is not None and not future.done()
    release.set()
    assert future.result(WAIT) == 7
    assert ahead.take("step 2") is None  # taken once


def test_next_read_for_other_rows_is_waited_out_and_dropped():
    ahead: NextRead[str, int] = NextRead()
    running = threading.Event()
    finished: list[str] = []

    def read() -> int:
        running.set()
        time.sleep(0.05)
        finished.append("read")
        raise OSError("nobody wants this one")

    ahead.start("step 2", read)
    assert running.wait(WAIT)
    assert ahead.take("step 3") is None
    assert finished == ["read"]  # it ended before take returned: never two reads at once


def test_next_read_raises_what_the_read_raised_to_whoever_takes_it():
    ahead: NextRead[str, int] = NextRead()

    def read() -> int:
        raise OSError("the file ended while its rows were read")

    ahead.start("k", read)
    future = ahead.take("k")
    assert future is not None
    with pytest.raises(OSError, match="file ended"):
        future.result(WAIT)


def test_a_replica_told_its_next_rows_reads_them_ahead_and_hands_them_over(tmp_path, monkeypatch):
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    y = np.arange(40, dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    rows = HeldRows()
    rows.hold("train", NpyRows(tmp_path / "x.npy"), NpyRows(tmp_path / "y.npy"))
    readers: list[str] = []
    original = NpyRows._read

    def counting(self, index):
        readers.append(threading.current_thread().name)
        return original(self, index)

    monkeypatch.setattr(NpyRows, "_read", counting)
    rows.read_next("train", [5, 1, 9])
    xb, yb = rows.held("train", [5, 1, 9])
    assert len(readers) == 2 and all(name.startswith("read-next") for name in readers)
    np.testing.assert_array_equal(xb, x[[5, 1, 9]])
    np.testing.assert_array_equal(yb, y[[5, 1, 9]])
    readers.clear()
    rows.read_next("train", [2, 3])
    xb, _ = rows.held("train", [30, 31])  # not what was announced: read here, exactly
    np.testing.assert_array_equal(xb, x[[30, 31]])
    assert readers.count(threading.current_thread().name) == 2


def test_rows_held_in_memory_are_not_read_ahead():
    rows = HeldRows()
    rows.hold("train", np.zeros((4, 2), np.float32), np.zeros(4, np.int64))
    rows.read_next("train", [0, 1])
    assert rows._next.take(("train", np.asarray([0, 1], np.int64).tobytes())) is None
