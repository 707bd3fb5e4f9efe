"""Rows of a ``.npy`` file, read with ``pread`` as they are asked for: never mapped, never whole.

A memory map would read only the pages a job touches too, but every page touched stays in the
process's resident set (``RssFile``) until the map goes, so a daemon training an epoch over a
50 GB ``x.npy`` would end with 50 GB resident (the kernel may drop them under pressure; its peak,
``VmHWM``, still says 50 GB). :class:`NpyRows` reads the rows a step needs into a fresh array
(the page cache keeps what the kernel likes, outside the process) and holds nothing else: a
daemon's memory follows its batches, not its dataset. How a step's rows are read, few calls
and straight to their places, is :mod:`engine.data.row_reads`'s.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine.data.row_reads import plan_reads, read_spans

__all__ = ["NpyRows", "Rows", "npy_header"]


def npy_header(file: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` whose first byte ``file`` is at; it is
    left at the first byte of the array."""
    version = np.lib.format.read_magic(file)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(file)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(file)
    return tuple(int(n) for n in shape), bool(fortran), dtype


class Rows:
    """A read-only table of rows that reads what it is indexed with (an int, a slice or an
    index array) and nothing else; ``np.asarray`` reads it whole."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * int(self.dtype.itemsize)

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, index: Any) -> np.ndarray[Any, Any]:
        if isinstance(index, int | np.integer):
            row: np.ndarray[Any, Any] = self.rows(np.asarray([index]))[0]
            return row
        if isinstance(index, slice):
            return self.rows(np.arange(*index.indices(len(self))))
        return self.rows(np.asarray(index))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        whole = self.rows(np.arange(len(self)))  # reads everything: only where code asks for it
        return whole if dtype is None else np.asarray(whole, dtype=dtype)

    def rows(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The rows ``index`` (1-D; negative counts from the end), in that order, as a new
        array.

        Raises:
            IndexError: a row outside the table, or an index that is not 1-D.
        """
        index = index.astype(np.int64, copy=False)
        if index.ndim != 1:
            raise IndexError("rows are taken with a 1-D index")
        index = np.where(index < 0, index + len(self), index)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"rows must lie in [0, {len(self)})")
        return self._read(index)

    def _read(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        raise NotImplementedError


class NpyRows(Rows):
    """The rows of one C-ordered ``.npy`` file (a Fortran-ordered or object one is refused).

    Raises:
        ValueError: the file is not such an ``.npy``.
        OSError: it cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as file:
            shape, fortran, dtype = npy_header(file)
            self._offset = file.tell()
        if fortran and len(shape) > 1:
            raise ValueError(f"{path.name} is Fortran-ordered: save it C-ordered to train on it")
        if dtype.hasobject:
            raise ValueError(f"{path.name} holds Python objects: it cannot be read without pickle")
        if not shape:
            raise ValueError(f"{path.name} holds a scalar, not rows")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self._row_bytes = math.prod(self.shape[1:]) * int(dtype.itemsize)
        expected = self._offset + self.shape[0] * self._row_bytes
        if path.stat().st_size < expected:
            raise ValueError(f"{path.name} is truncated: {expected} bytes expected")
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)
            self._fd = -1

    def _read(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out = np.empty((index.size, *self.shape[1:]), self.dtype)
        if out.size:
            plan = plan_reads(index, self._row_bytes)
            read_spans(self._fd, self._offset, out, plan, self.path.name)
        return out
