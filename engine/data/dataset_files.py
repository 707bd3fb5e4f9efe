"""The datasets a worker serves from its disk, opened without reading them whole.

``somatize-worker --data NAME=PATH`` takes three kinds of ``PATH``:

* an ``.npz`` file with ``x`` (and ``y``): read whole when a job opens it (``np.load`` cannot
  map an archive's members);
* a directory holding ``x.npy`` (and ``y.npy``): each opened as
  :class:`~engine.data.npy_rows.NpyRows` — a job reads the rows it trains on, a step at a time,
  never the whole file, and holds none of it once the step is done;
* a directory of shards, each an ``.npz`` file or a directory of ``x.npy``/``y.npy``: their
  rows one after the other, in name order, as :class:`ShardedRows` (a row index finds its
  shard; only the rows asked for are read).

:func:`describe` checks a path as the agent starts (every shard must agree on dtypes and
trailing shapes, and ``y`` on rows with ``x``: a file that does not is refused, named) and says
what it holds — rows, shapes, dtypes, never content — for the hello. :func:`open_dataset` opens
it in the filter daemon. Nothing here opens a path a client sent: only those the worker was
started with.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from engine.data.npy_rows import NpyRows, Rows, npy_header

__all__ = ["ArrayInfo", "DatasetInfo", "NotADataset", "ShardedRows", "describe", "open_dataset"]

Array = Any
"""A numpy array or a :class:`~engine.data.npy_rows.Rows` (:class:`~engine.data.npy_rows.NpyRows`,
:class:`ShardedRows`)."""


@dataclass(frozen=True)
class ArrayInfo:
    """One array of a dataset: its shape (rows first) and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, array: Array) -> ArrayInfo:
        return cls(tuple(int(n) for n in array.shape), str(array.dtype))


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset holds, without its content: for the hello and ``somatize status``."""

    kind: Literal["npz", "npy", "shards", "path"]
    rows: int | None  # None: a path only a job's loader can open
    x: ArrayInfo | None
    y: ArrayInfo | None
    shards: int = 1


class NotADataset(ValueError):
    """A path that holds none of the kinds above: only a job's ``loader`` can open it."""


class ShardedRows(Rows):
    """The rows of several tables, one after the other, as one read-only table: an index finds
    each row's shard, and only the rows asked for are read (:class:`~engine.data.npy_rows.Rows`)."""

    def __init__(self, parts: Sequence[Array], names: Sequence[str]) -> None:
        if not parts:
            raise ValueError("a sharded dataset needs at least one shard")
        first = parts[0]
        for part, name in zip(parts, names, strict=True):
            if part.dtype != first.dtype or part.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"shard {name} holds {part.dtype} rows of shape {tuple(part.shape[1:])}, "
                    f"the first shard ({names[0]}) {first.dtype} of shape "
                    f"{tuple(first.shape[1:])}: every shard must agree"
                )
        self._parts = list(parts)
        self._starts = np.cumsum([0, *(int(p.shape[0]) for p in parts)])
        self.dtype = first.dtype
        self.shape = (int(self._starts[-1]), *(int(n) for n in first.shape[1:]))

    def _read(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out = np.empty((index.size, *self.shape[1:]), self.dtype)
        shard = np.searchsorted(self._starts, index, side="right") - 1
        for s in np.unique(shard):
            mine = np.flatnonzero(shard == s)
            local = index[mine] - self._starts[s]
            order = np.argsort(local, kind="stable")  # ascending reads: sequential pages
            out[mine[order]] = self._parts[s][local[order]]
        return out


def _npz_info(path: Path) -> tuple[ArrayInfo, ArrayInfo | None]:
    """The shapes and dtypes of an ``.npz``'s ``x`` and ``y``, from their headers alone (the
    agent describes its datasets at start: it must not read a 4 GB archive to do so)."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        if "x.npy" not in names:
            raise ValueError(f"{path} has no array named 'x' (it has {names})")

        def header(member: str) -> ArrayInfo:
            with archive.open(member) as file:
                shape, _, dtype = npy_header(file)  # type: ignore[arg-type]
            return ArrayInfo(shape, str(dtype))

        return header("x.npy"), header("y.npy") if "y.npy" in names else None


def _npz(path: Path) -> tuple[Array, Array | None]:
    with np.load(path, allow_pickle=False) as npz:
        if "x" not in npz.files:
            raise ValueError(f"{path} has no array named 'x' (it has {npz.files})")
        return npz["x"], (npz["y"] if "y" in npz.files else None)


def _npy_dir(path: Path) -> tuple[Array, Array | None]:
    y_path = path / "y.npy"
    return NpyRows(path / "x.npy"), NpyRows(y_path) if y_path.exists() else None


def _is_npy_dir(path: Path) -> bool:
    return path.is_dir() and (path / "x.npy").is_file()


def _shards(path: Path) -> list[Path]:
    return sorted(
        (p for p in path.iterdir() if p.suffix == ".npz" or _is_npy_dir(p)), key=lambda p: p.name
    )


def _open(path: Path) -> tuple[Literal["npz", "npy", "shards"], tuple[Array, Array | None], int]:
    if path.is_file():
        if path.suffix != ".npz":
            raise NotADataset("not an .npz file")
        return "npz", _npz(path), 1
    if _is_npy_dir(path):
        return "npy", _npy_dir(path), 1
    if not path.is_dir():
        raise ValueError("no such file or directory")
    shards = _shards(path)
    if not shards:
        raise NotADataset(
            "a directory must hold x.npy (and y.npy), or shards: .npz files or directories of "
            "x.npy/y.npy"
        )
    opened = [_npz(s) if s.is_file() else _npy_dir(s) for s in shards]
    names = [s.name for s in shards]
    for (x, y), name in zip(opened, names, strict=True):
        _check_rows(x, y, name)
    with_y = [y is not None for _, y in opened]
    if any(with_y) and not all(with_y):
        missing = [n for n, has in zip(names, with_y, strict=True) if not has]
        raise ValueError(f"shards {missing} have no y while others do")
    x = ShardedRows([x for x, _ in opened], names)
    y = ShardedRows([y for _, y in opened], names) if all(with_y) else None
    return "shards", (x, y), len(shards)


def _check_rows(x: Array, y: Array | None, where: str) -> None:
    if x.ndim == 0 or (y is not None and (y.ndim == 0 or y.shape[0] != x.shape[0])):
        raise ValueError(f"{where}: x and y must have the same number of rows")


def open_dataset(path: Path, split: str | None = None) -> tuple[Array, Array | None]:
    """``x`` and ``y`` (or ``None``) of the dataset at ``path`` (see the module's kinds); or
    its ``split`` (validation: ``"val"``): an ``.npz``'s ``x_val``/``y_val``, a directory's
    ``x_val.npy``/``y_val.npy``, or a dataset of any kind in its directory ``val/``.

    Raises:
        ValueError: naming the path (and the shard) that is not a dataset, or the split that
            is not there.
    """
    if split is not None:
        return _split(path, split)
    try:
        _, (x, y), _ = _open(path)
        _check_rows(x, y, str(path))
    except NotADataset as exc:
        raise ValueError(
            f"dataset {path}: {exc}; a job opens it with its own code: "
            "sz.WorkerData(name, loader=make_dataset)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset {path}: {exc}") from exc
    return x, y


def _split(path: Path, split: str) -> tuple[Array, Array | None]:
    """The split ``split`` of the dataset at ``path`` (:func:`open_dataset`)."""
    if not split.isidentifier():
        raise ValueError(f"dataset {path}: a split is a name like 'val', not {split!r}")
    x_name, y_name = f"x_{split}", f"y_{split}"
    if path.is_file() and path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            if x_name not in npz.files:
                raise ValueError(f"dataset {path} has no split {split!r}: no array {x_name!r}")
            return npz[x_name], (npz[y_name] if y_name in npz.files else None)
    if path.is_dir() and (path / f"{x_name}.npy").is_file():
        y_path = path / f"{y_name}.npy"
        return NpyRows(path / f"{x_name}.npy"), NpyRows(y_path) if y_path.exists() else None
    if path.is_dir() and (path / split).exists():
        return open_dataset(path / split)
    raise ValueError(
        f"dataset {path} has no split {split!r} ({x_name} in an .npz, {x_name}.npy or a "
        f"directory {split}/ beside x.npy)"
    )


def describe(path: Path) -> DatasetInfo:
    """What the dataset at ``path`` holds (checked: see :func:`open_dataset`); an existing path
    of no known kind is the kind ``path``, for a job's loader."""
    try:
        if path.is_file() and path.suffix == ".npz":  # headers only: never the arrays
            x_info, y_info = _npz_info(path)
            if not x_info.shape or (y_info is not None and y_info.shape[:1] != x_info.shape[:1]):
                raise ValueError("x and y must have the same number of rows")
            return DatasetInfo("npz", x_info.shape[0], x_info, y_info)
        kind, (x, y), shards = _open(path)
        _check_rows(x, y, str(path))
    except NotADataset:
        return DatasetInfo("path", None, None, None)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"dataset {path}: not a readable .npz: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset {path}: {exc}") from exc
    return DatasetInfo(
        kind, int(x.shape[0]), ArrayInfo.of(x), None if y is None else ArrayInfo.of(y), shards
    )
