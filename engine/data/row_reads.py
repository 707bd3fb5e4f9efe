"""Which byte ranges of a file of fixed-size rows to read for an index of rows, and where each row
read goes: the plan (no I/O, vectorised) and the ``preadv`` calls that carry it out.

A step of a shuffled epoch asks for hundreds of rows scattered over a file, in random order, and
reads them in a background thread while the step before trains: every Python instruction of the
read holds the interpreter's lock the training thread needs too. So the plan is made with numpy
in a few calls, and the read is one ``preadv`` per *span* with nothing else around it:

- rows that are consecutive in the file make one span, read straight into the output rows they
  belong to (one buffer per output row when the output order is not the file's), so no second
  copy puts a shuffled batch in order;
- rows separated by less than ``gap`` bytes join one span too, read into a scratch buffer and
  picked from it: for small rows (labels of 8 bytes) one read of a few pages costs less than a
  system call per row, and the kernel reads whole pages anyway;
- a row asked for twice is read once and copied.

Each span is first read with ``RWF_NOWAIT``: what the page cache holds comes at once, and only
the spans it does not hold are announced to the storage together (``POSIX_FADV_WILLNEED``: all
in flight at once, 3x faster from a cold cache on this project's benchmark) and then read.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MERGE_GAP", "ReadPlan", "plan_reads", "read_into", "read_spans"]

MERGE_GAP = 16 << 10
"""Bytes between two wanted rows below which one read of both (and what lies between) is taken
over two: a system call costs about what copying this much from the page cache does."""

MAX_READ = 1 << 30
"""Bytes one ``preadv`` asks for at most (Linux caps a read just under 2 GiB)."""

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Buffers one ``preadv`` takes at most."""

READAHEAD_BYTES = 128 << 10
"""What the kernel reads ahead of a read by itself (its default window): a longer read, or many,
are announced with ``POSIX_FADV_WILLNEED`` first."""

NOWAIT = getattr(os, "RWF_NOWAIT", 0)
WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)


@dataclass(frozen=True)
class ReadPlan:
    """Span ``j`` reads ``counts[j]`` rows of the file from row ``firsts[j]``: the wanted rows
    ``bounds[j]:bounds[j + 1]`` (sorted, ``wanted``), which go to output rows ``into`` of those;
    it is ``dense`` when it reads only wanted rows, ``ordered`` when they also go to consecutive
    output rows. Then output rows ``copy_to`` are filled from rows ``copy_from`` (repeats)."""

    firsts: list[int]
    counts: list[int]
    bounds: list[int]
    dense: list[bool]
    ordered: list[bool]
    wanted: np.ndarray[Any, Any]
    into: np.ndarray[Any, Any]
    copy_to: np.ndarray[Any, Any]
    copy_from: np.ndarray[Any, Any]


def plan_reads(index: np.ndarray[Any, Any], row_bytes: int, gap: int = MERGE_GAP) -> ReadPlan:
    """The reads that fill an output of ``len(index)`` rows with file rows ``index`` (non-
    negative, in range: the caller checked them; at least one), rows of ``row_bytes`` bytes,
    rows less than ``gap`` bytes apart read together."""
    order = np.argsort(index, kind="stable")
    ordered_rows = index[order]
    fresh = np.ones(ordered_rows.size, dtype=bool)
    fresh[1:] = ordered_rows[1:] != ordered_rows[:-1]
    wanted, into = ordered_rows[fresh], order[fresh]
    firsts_seen = into[np.cumsum(fresh) - 1]  # each sorted entry's first place in the output
    skipped = np.diff(wanted) - 1  # rows between two wanted ones
    joined = (skipped == 0) | (skipped * row_bytes < gap)
    breaks = np.flatnonzero(~joined) + 1
    lo = np.concatenate([[0], breaks])
    hi = np.concatenate([breaks, [wanted.size]])
    counts = wanted[hi - 1] - wanted[lo] + 1
    # A span's output rows are consecutive when every step inside it is +1.
    steps_off = np.concatenate([[0], np.cumsum(np.diff(into) != 1)])
    ordered = (steps_off[hi - 1] - steps_off[lo]) == 0
    dense = counts == hi - lo
    return ReadPlan(
        firsts=wanted[lo].tolist(),
        counts=counts.tolist(),
        bounds=[*lo.tolist(), int(wanted.size)],
        dense=dense.tolist(),
        ordered=(dense & ordered).tolist(),
        wanted=wanted,
        into=into,
        copy_to=order[~fresh],
        copy_from=firsts_seen[~fresh],
    )


def read_spans(fd: int, offset: int, out: np.ndarray[Any, Any], plan: ReadPlan, name: str) -> None:
    """Fill ``out`` (C-contiguous, a row per entry of the index planned) from the rows of the file
    ``fd`` whose first row starts at byte ``offset``, following ``plan``.

    Raises:
        OSError: the file ended first (naming ``name``), or a read failed.
    """
    size = out.nbytes // len(out)
    flat = out.reshape(-1).view(np.uint8).data
    into = plan.into.tolist()
    picks: list[tuple[np.ndarray[Any, Any], int, int]] = []  # scratch, its span's bounds
    waiting: list[tuple[list[memoryview], int, int]] = []  # not in the page cache: rest, at, bytes
    spans = zip(plan.firsts, plan.counts, plan.dense, plan.ordered, strict=True)
    for j, (first, count, dense, ordered) in enumerate(spans):
        at = offset + first * size
        if ordered:
            start = into[plan.bounds[j]] * size
            buffers = [flat[start : start + count * size]]
        elif dense:  # each row straight to its place in the output
            buffers = [
                flat[i * size : (i + 1) * size] for i in into[plan.bounds[j] : plan.bounds[j + 1]]
            ]
        else:  # rows a few bytes apart: one read of the stretch, picked from it below
            scratch = np.empty(count * size, np.uint8)
            picks.append((scratch, plan.bounds[j], plan.bounds[j + 1]))
            buffers = [scratch.data]
        rest = _cached(fd, buffers, at, count * size)
        if rest is not None:
            waiting.append(rest)
    if len(waiting) > 1 or (waiting and waiting[0][2] > READAHEAD_BYTES):
        for _, at, left in waiting:
            os.posix_fadvise(fd, at, left, WILLNEED)
    for buffers, at, _ in waiting:
        read_into(fd, buffers, at, name)
    if picks:
        rows = out.reshape(len(out), -1).view(np.uint8)
        for scratch, lo, hi in picks:
            stretch = scratch.reshape(-1, size)
            rows[plan.into[lo:hi]] = stretch[plan.wanted[lo:hi] - plan.wanted[lo]]
    if plan.copy_to.size:
        out[plan.copy_to] = out[plan.copy_from]


_nowait = [bool(NOWAIT)]  # False once the file system refused RWF_NOWAIT


def _cached(
    fd: int, buffers: list[memoryview], at: int, size: int
) -> tuple[list[memoryview], int, int] | None:
    """Read what the page cache holds of ``buffers`` (``size`` bytes from byte ``at``) without
    waiting for storage; ``None`` when that was all, else the buffers' unread rest, where it
    starts and its bytes."""
    if len(buffers) > IOV_MAX or size > MAX_READ or not _nowait[0]:
        return buffers, at, size
    try:
        done = os.preadv(fd, buffers, at, NOWAIT)
    except BlockingIOError:
        return buffers, at, size
    except OSError:  # EOPNOTSUPP: a file system that cannot say; read it all the plain way
        _nowait[0] = False
        return buffers, at, size
    if done == size:
        return None
    return _after(buffers, done), at + done, size - done


def _after(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What of ``buffers`` is left once their first ``done`` bytes are filled."""
    rest = []
    for buffer in buffers:
        if done >= len(buffer):
            done -= len(buffer)
            continue
        rest.append(buffer[done:])
        done = 0
    return rest


def read_into(fd: int, buffers: list[memoryview], at: int, name: str) -> None:
    """Fill ``buffers``, in order, from byte ``at`` of ``fd`` on (``preadv``, as many buffers and
    bytes a call as the system takes; a short read goes on where it stopped).

    Raises:
        OSError: the file ended first (naming ``name``), or the read failed.
    """
    pending = deque(b for b in buffers if len(b))
    while pending:
        batch: list[memoryview] = []
        size = 0
        while pending and len(batch) < IOV_MAX and size < MAX_READ:
            buffer = pending.popleft()
            if size + len(buffer) > MAX_READ:
                take = MAX_READ - size
                pending.appendleft(buffer[take:])
                buffer = buffer[:take]
            batch.append(buffer)
            size += len(buffer)
        done = os.preadv(fd, batch, at)
        if done == 0:
            raise OSError(f"{name}: the file ended while its rows were read")
        at += done
        if done < size:  # the unread rest goes back to the front, in order
            pending.extendleft(reversed(_after(batch, done)))
