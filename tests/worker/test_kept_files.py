"""worker.kept_files: a call's files kept on the worker's disk, read back in pieces, dropped."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorCode, RequestRefused
from worker.kept_files import KeptFiles


def test_kept_files_read_back_in_pieces_and_drop_by_call_or_by_job(tmp_path):
    kept = KeptFiles(tmp_path / "kept")
    first = kept.keep("j", {"a.distcp": b"0123456789", ".metadata": b"m"})
    second = kept.keep("j", {"a.distcp": b"other call"})
    assert first["files"] == {"a.distcp": 10, ".metadata": 1} and first["kept"] != second["kept"]
    assert kept.read("j", first["kept"], "a.distcp", 4, 4) == b"4567"
    assert kept.read("j", first["kept"], "a.distcp", 8, 100) == b"89"  # fewer where it ends
    assert kept.read("j", second["kept"], "a.distcp", 0, 5) == b"other"
    kept.drop("j", first["kept"])
    with pytest.raises(RequestRefused) as gone:
        kept.read("j", first["kept"], "a.distcp", 0, 1)
    assert gone.value.info.code is ErrorCode.BAD_REQUEST
    assert kept.read("j", second["kept"], "a.distcp", 0, 5) == b"other"
    kept.drop("j")
    assert list((tmp_path / "kept").iterdir()) == []
    kept.close()
    assert not (tmp_path / "kept").exists()


def test_files_that_cannot_be_written_are_a_resource_limit_and_nothing_is_kept(tmp_path):
    (tmp_path / "kept").write_bytes(b"a file where the folder should be")
    kept = KeptFiles(tmp_path / "kept")
    with pytest.raises(RequestRefused, match="keeping 1 files on the worker failed") as refused:
        kept.keep("j", {"a.distcp": b"x"})
    assert refused.value.info.code is ErrorCode.RESOURCE_LIMIT
    with pytest.raises(RequestRefused):
        kept.read("j", "anything", "a.distcp", 0, 1)
