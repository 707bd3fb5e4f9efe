"""A job's submit message kept on disk: what the job then runs from is a map of that file.

Where an array's memory lies is read from ``/proc/self/maps`` (the kernel's own account of
this process's mappings), not from the code that made it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coordinator.jobs.files import JobFiles
from protocol.filter_buffers import as_buffer
from protocol.filters import dump_filter
from protocol.messages import GraphSpec, StrategySpec, Submit
from tests.utils import Center


def _mapped_from(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _within(array: np.ndarray, ranges: list[tuple[int, int]]) -> bool:
    address = array.__array_interface__["data"][0]
    return any(start <= address and address + array.nbytes <= end for start, end in ranges)


def _submit(filters: dict[str, object], x: np.ndarray) -> Submit:
    return Submit(
        graph=GraphSpec(node_ids=list(filters), filters=filters),
        x=x,
        strategy=StrategySpec(name="local"),
    )


def test_a_kept_jobs_filters_and_rows_are_views_over_its_submit_file(tmp_path):
    files = JobFiles(tmp_path)
    pickled = dump_filter(Center())
    x = np.arange(1 << 18, dtype=np.float64).reshape(-1, 8)  # 2 MiB
    kept = files.keep("j1", _submit({"c": as_buffer(pickled)}, x), "alice")

    path = tmp_path / "jobs" / "j1.submit"
    mapped = _mapped_from(path)
    assert mapped, "nothing of the submit file is mapped"
    filt = kept.graph.filters["c"]
    assert _within(filt, mapped) and _within(kept.x, mapped)
    assert filt.tobytes() == pickled
    np.testing.assert_array_equal(kept.x, x)

    on_disk = path.read_bytes()
    kept.x[:] = -1.0  # writable, but a private copy of the page: the file stays as written
    assert path.read_bytes() == on_disk
    again, owner = files.submits.load("j1")
    assert owner == "alice"
    np.testing.assert_array_equal(again.x, x)


def test_a_small_submit_is_read_into_memory_and_a_filter_sent_as_bytes_comes_back(tmp_path):
    """Under MAP_MIN_BYTES a map is not worth the file descriptor it holds for the job's life."""
    files = JobFiles(tmp_path)
    pickled = dump_filter(Center())
    kept = files.keep("j1", _submit({"c": pickled}, np.zeros((4, 2))), "alice")
    assert bytes(kept.graph.filters["c"]) == pickled
    assert not _mapped_from(tmp_path / "jobs" / "j1.submit")


def test_a_submit_that_cannot_be_written_runs_from_the_message_received(tmp_path):
    files = JobFiles(tmp_path)
    (tmp_path / "jobs").rmdir()
    (tmp_path / "jobs").write_text("not a directory")
    msg = _submit({"c": as_buffer(dump_filter(Center()))}, np.zeros((4, 2)))
    assert files.keep("j1", msg, "alice") is msg
