"""What may name a sharded checkpoint's file on the wire."""

from __future__ import annotations

import pytest

from protocol.files.shard_files import METADATA, is_plain_file_name


@pytest.mark.parametrize("name", ["__0_0.distcp", METADATA, "a.b", "shard-1"])
def test_a_plain_file_name_passes(name):
    assert is_plain_file_name(name)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "/etc/passwd", "dir/", "..\\x", "a\\b"]
)
def test_a_path_or_a_dot_name_is_refused(name):
    assert not is_plain_file_name(name)
