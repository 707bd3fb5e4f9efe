"""coordinator.storage.disk: files written whole or not at all, around the page cache through
staging buffers where the file system allows it."""

from __future__ import annotations

import errno
import os
import random

import pytest

from coordinator.storage import disk
from coordinator.storage.disk import (
    DIRECT_ALIGNMENT,
    AtomicFile,
    DirectStaging,
    write_atomically,
)


def _accepts_direct(folder) -> bool:
    """Whether ``folder``'s file system opens files ``O_DIRECT`` (asked of it, not the code)."""
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def _open_flags(fd: int) -> int:
    """The flags the kernel holds for ``fd`` (``/proc/self/fdinfo``, octal)."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        line = next(line for line in info if line.startswith("flags:"))
    return int(line.split()[1], 8)


@pytest.mark.parametrize(
    "size",
    [0, 1, DIRECT_ALIGNMENT - 1, DIRECT_ALIGNMENT, DIRECT_ALIGNMENT + 1, 3 * 8192 + 17, 40_000],
)
def test_a_staged_file_holds_exactly_its_parts_whatever_their_sizes(tmp_path, size):
    """Staging buffers of 2 pages: files within one, across several, ending mid-page."""
    data = random.Random(size).randbytes(size)
    cut = sorted(random.Random(-size).randrange(size + 1) for _ in range(3))
    parts = [data[: cut[0]], memoryview(data)[cut[0] : cut[1]], data[cut[1] : cut[2]]]
    parts.append(bytearray(data[cut[2] :]))
    staging = DirectStaging(nbytes=2 * DIRECT_ALIGNMENT)
    assert write_atomically(tmp_path / "f", parts, staging=staging) == size
    assert (tmp_path / "f").read_bytes() == data
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no .partial left


def test_a_staged_file_is_written_o_direct_where_the_file_system_allows_it(tmp_path):
    expected = _accepts_direct(tmp_path) and hasattr(os, "O_DIRECT")
    file = AtomicFile(tmp_path / "f", staging=DirectStaging())
    assert file.direct is expected
    if expected:
        assert _open_flags(file._fd) & os.O_DIRECT
    file.write(b"x" * (5 * DIRECT_ALIGNMENT + 3))
    file.commit()
    assert (tmp_path / "f").read_bytes() == b"x" * (5 * DIRECT_ALIGNMENT + 3)
    plain = AtomicFile(tmp_path / "g")  # without staging: through the page cache
    assert not plain.direct and not _open_flags(plain._fd) & getattr(os, "O_DIRECT", 0)
    plain.abandon()


def test_a_file_system_that_refuses_o_direct_at_the_open_gets_the_file_through_the_cache(
    tmp_path, monkeypatch
):
    opened = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & disk.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return opened(path, flags, mode)

    monkeypatch.setattr(disk, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000))
    monkeypatch.setattr(os, "open", no_direct)
    file = AtomicFile(tmp_path / "f", staging=DirectStaging())
    assert not file.direct
    file.write(b"abc" * 10_000)
    assert file.commit() == 30_000
    assert (tmp_path / "f").read_bytes() == b"abc" * 10_000


def test_a_direct_write_the_file_system_refuses_is_written_again_through_the_cache(
    tmp_path, monkeypatch
):
    written = os.write
    refused = []

    def refuse_direct(fd, data):
        if _open_flags(fd) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return written(fd, data)

    if not _accepts_direct(tmp_path):
        pytest.fail(f"{tmp_path}'s file system does not take O_DIRECT: this test needs one")
    monkeypatch.setattr(os, "write", refuse_direct)
    data = random.Random(7).randbytes(3 * DIRECT_ALIGNMENT + 5)
    file = AtomicFile(tmp_path / "f", staging=DirectStaging(nbytes=DIRECT_ALIGNMENT))
    file.write(data)
    file.commit()
    assert refused == [DIRECT_ALIGNMENT] and not file.direct
    assert (tmp_path / "f").read_bytes() == data


def test_staging_buffers_are_page_aligned_kept_for_the_next_file_and_given_back_on_failure(
    tmp_path,
):
    staging = DirectStaging(nbytes=DIRECT_ALIGNMENT, kept=1)
    first = AtomicFile(tmp_path / "a", staging=staging)
    second = AtomicFile(tmp_path / "b", staging=staging)
    assert first._stage is not second._stage
    held = first._stage
    first.write(b"1" * 10)
    first.commit()
    second.abandon()  # given up: its buffer back too, but only one is kept
    assert staging._free == [held] and not (tmp_path / "b").exists()
    third = AtomicFile(tmp_path / "c", staging=staging)
    assert third._stage is held  # the warm one again
    third.abandon()
    with pytest.raises(ValueError, match="whole pages"):
        DirectStaging(nbytes=DIRECT_ALIGNMENT + 1)


def test_a_staged_file_written_over_a_retired_one_takes_its_blocks_and_its_length(tmp_path):
    old = tmp_path / "old"
    old.write_bytes(b"o" * 100_000)
    inode = old.stat().st_ino
    write_atomically(tmp_path / "new", [b"n" * 5000], reuse=old, staging=DirectStaging())
    assert not old.exists() and (tmp_path / "new").stat().st_ino == inode
    assert (tmp_path / "new").read_bytes() == b"n" * 5000
