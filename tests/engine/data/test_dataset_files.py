"""Issue 15: the dataset kinds a worker serves, opened without reading them whole.

Each kind is written here with numpy, opened by :func:`engine.data.dataset_files.open_dataset`, and
compared row for row with the arrays written; shards that disagree are refused naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.data.dataset_files import ArrayInfo, DatasetInfo, ShardedRows, describe, open_dataset
from engine.data.npy_rows import NpyRows


def _arrays(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 3)).astype(np.float32), rng.integers(0, 9, rows)


def _npy_dir(path: Path, x: np.ndarray, y: np.ndarray | None) -> Path:
    path.mkdir(parents=True)
    np.save(path / "x.npy", x)
    if y is not None:
        np.save(path / "y.npy", y)
    return path


def test_an_npz_is_read_as_it_was_written(tmp_path):
    x, y = _arrays(10, 0)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    got_x, got_y = open_dataset(tmp_path / "d.npz")
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    info = describe(tmp_path / "d.npz")
    assert (info.kind, info.rows, info.x, info.shards) == (
        "npz",
        10,
        ArrayInfo((10, 3), "float32"),
        1,
    )


def test_a_directory_of_npy_files_is_read_by_rows_not_whole(tmp_path):
    x, y = _arrays(1000, 1)
    path = _npy_dir(tmp_path / "d", x, y)
    got_x, got_y = open_dataset(path)
    assert isinstance(got_x, NpyRows) and isinstance(got_y, NpyRows)
    index = np.array([5, 2, 999, 5, 3, 4, -1])  # repeats, runs, out of order, from the end
    np.testing.assert_array_equal(got_x[index], x[index])
    np.testing.assert_array_equal(got_y[index], y[index])
    np.testing.assert_array_equal(got_x[10:20], x[10:20])
    picked = got_x[[7]]
    picked[0] = 0  # a copy: the worker's file is not changed through it
    np.testing.assert_array_equal(got_x[[7]], x[[7]])
    assert describe(path).y == ArrayInfo((1000,), str(y.dtype))


def test_shards_are_their_rows_one_after_the_other_in_name_order(tmp_path):
    parts = [_arrays(rows, seed) for seed, rows in enumerate((7, 1, 12))]
    root = tmp_path / "shards"
    _npy_dir(root / "b-second", *parts[1])
    np.savez(root / "a-first.npz", x=parts[0][0], y=parts[0][1])
    _npy_dir(root / "c-third", *parts[2])
    (root / "README.txt").write_text("not a shard: ignored")
    x, y = open_dataset(root)
    whole_x = np.concatenate([p[0] for p in parts])
    whole_y = np.concatenate([p[1] for p in parts])
    assert isinstance(x, ShardedRows) and x.shape == whole_x.shape and len(y) == 20
    index = np.array([19, 0, 7, 8, 3, 7, -1])
    np.testing.assert_array_equal(x[index], whole_x[index])
    np.testing.assert_array_equal(y[index], whole_y[index])
    np.testing.assert_array_equal(x[6:9], whole_x[6:9])
    np.testing.assert_array_equal(x[8], whole_x[8])
    np.testing.assert_array_equal(np.asarray(x), whole_x)
    info = describe(root)
    assert (info.kind, info.rows, info.shards) == ("shards", 20, 3)
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 20\)"):
        x[np.array([20])]


def test_a_shard_that_disagrees_is_refused_naming_it(tmp_path):
    root = tmp_path / "shards"
    x, y = _arrays(4, 0)
    _npy_dir(root / "s0", x, y)
    _npy_dir(root / "s1", x.astype(np.float64), y)
    with pytest.raises(ValueError, match="shard s1 holds float64 rows of shape"):
        describe(root)
    _npy_dir(tmp_path / "bad" / "s0", x, y[:3])
    with pytest.raises(ValueError, match="s0: x and y must have the same number of rows"):
        describe(tmp_path / "bad")
    # A path of no known kind (empty, or another format) is for a job's own loader.
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(b"\x89PNG")
    assert describe(tmp_path / "images") == DatasetInfo("path", None, None, None)
    with pytest.raises(ValueError, match=r"must hold x\.npy.*loader=make_dataset"):
        open_dataset(tmp_path / "images")
    with pytest.raises(ValueError, match="no such file"):
        describe(tmp_path / "missing")
