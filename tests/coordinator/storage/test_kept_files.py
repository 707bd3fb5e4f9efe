"""Reading a file left on a worker into the coordinator a piece at a time: in order, the next
piece asked for while one is written, never more than two in memory, and a file that ends
early or a piece longer than asked for refused."""

from __future__ import annotations

import asyncio
import threading

import pytest

from coordinator.storage.kept_files import fetch


class Left:
    """A file on a worker: ``read`` answers after the event loop turns once; ``asked`` and
    ``written`` say in what order pieces were asked for and written; ``held`` how many were
    asked for and not yet written, at most (``cut``: says it holds that many bytes more)."""

    def __init__(self, data: bytes, cut: int = 0, longer: bool = False) -> None:
        self.data, self.cut, self.longer = data, cut, longer
        self.log: list[tuple[str, int]] = []
        self.held = self.most = 0
        self.cancelled = False
        self._lock = threading.Lock()

    def sizes(self):
        return {"f": len(self.data) + self.cut}

    def read(self, name, offset, length):
        self.log.append(("asked", offset))  # (as it is asked for, not as it runs)
        self.held += 1
        self.most = max(self.most, self.held)
        return self._read(offset, length)

    async def _read(self, offset, length):
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.data[offset : offset + length] + (b"xx" if self.longer else b"")

    def write(self, piece):  # (called in a thread)
        with self._lock:
            self.log.append(("written", len(piece)))
            self.held -= 1


def test_pieces_are_written_in_order_the_next_read_as_one_is_written():
    left = Left(bytes(range(10)) * 3)
    got = bytearray()

    def write(piece):
        left.write(piece)
        got.extend(piece)

    assert asyncio.run(fetch(left, "f", write, 8)) == 30
    assert bytes(got) == left.data
    asked = [at for what, at in left.log if what == "asked"]
    assert asked == [0, 8, 16, 24]
    assert [n for what, n in left.log if what == "written"] == [8, 8, 8, 6]
    assert left.log.index(("asked", 8)) < left.log.index(("written", 8))  # read ahead
    assert left.most == 2  # never more than two pieces held


def test_an_empty_file_asks_for_nothing():
    left = Left(b"")
    assert asyncio.run(fetch(left, "f", left.write, 8)) == 0
    assert left.log == []


@pytest.mark.parametrize(
    ("left", "said"),
    [
        (Left(b"abcdefghij", cut=4), "gave 0 bytes at 10 of its 14, asked for 4"),
        (Left(b"abcdefghij", longer=True), "gave 10 bytes at 0 of its 10, asked for 8"),
    ],
    ids=["ended early", "longer than asked"],
)
def test_a_file_that_ends_early_or_a_piece_longer_than_asked_is_refused(left, said):
    with pytest.raises(OSError, match=said):
        asyncio.run(fetch(left, "f", left.write, 8))


def test_a_write_that_fails_gives_up_the_piece_being_read():
    left = Left(bytes(30))

    def write(piece):
        raise OSError("the disk is full")

    with pytest.raises(OSError, match="the disk is full"):
        asyncio.run(fetch(left, "f", write, 8))
    assert left.cancelled  # the next piece's read, asked for, is not left running
