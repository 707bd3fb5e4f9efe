"""Batches on the engine's side: their rows, their tensors, and how a module is called on one.

A batch is an array or tensor, or a tuple or dict of them with as many rows each
(:mod:`protocol.rules.rows` defines it and splits it alike on the coordinator). The engine
counts its rows (:func:`num_rows`), takes some of them from held data (:func:`take`) or from a
batch of tensors (:func:`part_of`), reads a dataset on disk whole only where asked
(:func:`whole`), cuts a run's rows in batches (:class:`Batches`), joins the outputs of a
batch's parts (:func:`concat`), and calls a module on one as its filter's ``inputs`` says
(:func:`call_module`): ``"auto"`` unpacks a tuple into positional arguments and a dict into
keywords, ``"one"`` passes the batch as one argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.data.npy_rows import Rows
from engine.errors import EngineError
from protocol.errors import ErrorCode
from protocol.rules.batching import batch_rows, batches
from protocol.rules.rows import is_batch_tree, leaves, map_leaves, rows_of

__all__ = [
    "INPUTS",
    "Batches",
    "arguments",
    "call_module",
    "concat",
    "num_rows",
    "on_disk",
    "part_of",
    "take",
    "whole",
]

INPUTS = ("auto", "one")
"""How a TorchFilter's module takes a batch: ``"auto"`` (``module(x)``, ``module(*x)`` for a
tuple, ``module(**x)`` for a dict), ``"one"`` (``module(x)``, whatever ``x`` is)."""


@dataclass(frozen=True)
class Batches:
    """The rows a run trains on (or is evaluated on), cut in batches: prepared once when they
    are in memory, read and prepared a batch at a time when they are on disk (:class:`Rows`,
    never read whole). ``first`` and ``last`` are the run's first filter (it prepares the
    inputs) and its last (it prepares the targets)."""

    x: Any
    y: Any
    rows: int
    size: int
    lazy: bool
    first: Any
    last: Any

    @classmethod
    def of(cls, run: Sequence[Any], x: Any, y: Any, batch_size: int | None) -> Batches:
        first, last = run[0].filter, run[-1].filter
        lazy = on_disk(x)
        xt, yt = (x, y) if lazy else (first.prepare_input(x), last.prepare_target(y))
        n = num_rows(xt)
        return cls(xt, yt, n, batch_size or last.training.batch_size or n, lazy, first, last)

    @classmethod
    def evaluated(cls, run: Sequence[Any], x: Any, y: Any, batch_size: int | None) -> Batches:
        """The rows a run is evaluated on (or forwarded), in batches of ``batch_size`` or its
        last filter's ``eval_batch_size`` (default its ``batch_size``)."""
        last = run[-1].filter
        size = batch_size or getattr(last, "eval_batch_size", None) or last.training.batch_size
        return cls.of(run, x, y, size)

    def steps_per_epoch(self, every: int) -> int:
        """Optimizer steps in an epoch, one every ``every`` batches (and after its last)."""
        return (-(-self.rows // self.size) + every - 1) // every if self.rows else 0

    def epoch(self, order: torch.Generator | None) -> list[Any]:
        """The batches of an epoch: row indices, shuffled by ``order``, or in order."""
        return list(batches(self.rows, self.size, order))

    def read(self, index: Any) -> tuple[Any, Any]:
        """A batch (on disk: in a read-ahead thread)."""
        if not self.lazy:
            return part_of(self.x, index), part_of(self.y, index)
        picked = batch_rows(index, self.rows)
        return self.first.prepare_input(take(self.x, picked)), self.last.prepare_target(
            take(self.y, picked)
        )


def on_disk(data: Any) -> bool:
    """Whether some array of ``data`` is read from disk (or a dataset) by rows (:class:`Rows`):
    it is then read a batch at a time, never whole."""
    return any(isinstance(array, Rows) for _, array in leaves(data))


def num_rows(x: Any) -> int:
    """Rows of a batch: the first dimension of its arrays or tensors, or ``len()``.

    Raises:
        EngineError: ``BAD_REQUEST`` for input without rows.
    """
    counted = rows_of(x)
    if counted is not None:
        return counted
    try:
        return len(x)
    except TypeError as exc:
        raise EngineError(
            ErrorCode.BAD_REQUEST, f"input of type {type(x).__name__} has no rows"
        ) from exc


def take(data: Any, index: np.ndarray[Any, Any]) -> Any:
    """Rows ``index`` of a batch of arrays or tensors (a copy: the held data stays as it was);
    of a dataset read from disk by rows, those rows only."""

    def one(array: Any) -> Any:
        if isinstance(array, torch.Tensor):
            return array[torch.from_numpy(index)]
        if isinstance(array, np.ndarray | Rows):
            return np.asarray(array[index])  # reads those rows only
        return np.asarray(array)[index]

    return None if data is None else map_leaves(one, data)


def part_of(batch: Any, index: Any) -> Any:
    """Rows ``index`` (a slice, or an index tensor on the batch's device) of a batch of
    tensors; ``None`` stays ``None``."""
    return None if batch is None else map_leaves(lambda t: t[index], batch)


def whole(data: Any) -> Any:
    """``data`` in memory: a dataset read by rows (:class:`Rows`) is read whole here."""
    return map_leaves(lambda a: np.asarray(a) if isinstance(a, Rows) else a, data)


def concat(parts: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The outputs of a batch's consecutive parts (of ``sizes`` rows) as one: tensors joined
    along their rows, through tuples and mappings alike; a scalar (a model's own loss) becomes
    the mean of the parts' weighted by their rows; ``None`` when the parts gave none."""
    first = parts[0]
    if first is None or len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            total = sum(float(n) for n in sizes)
            return sum(p * (n / total) for p, n in zip(parts, sizes, strict=True))
        return torch.cat(list(parts))
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts], sizes) for k in first}
    if isinstance(first, tuple | list):
        return type(first)(concat([p[k] for p in parts], sizes) for k in range(len(first)))
    return first


def arguments(inputs: str, x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a module with ``inputs`` is called with on ``x``."""
    if inputs == "auto" and is_batch_tree(x):
        if isinstance(x, Mapping):
            return (), dict(x)
        return tuple(x), {}
    return (x,), {}


def call_module(f: Any, x: Any, module: Callable[..., Any] | None = None) -> Any:
    """``f``'s module (or ``module``, standing for it) called on the batch ``x`` as ``f``'s
    ``inputs`` says; a call its ``forward`` cannot take refused with what to give instead.

    Raises:
        TypeError: the module's own; where its ``forward`` does not take a batch of several
            arrays spread over its arguments, saying so and ``inputs="one"``.
    """
    args, kwargs = arguments(getattr(f, "inputs", "auto"), x)
    called = module if module is not None else f.module
    try:
        return called(*args, **kwargs)
    except TypeError as exc:
        hint = _spread_hint(called, args, kwargs)
        if hint is None:
            raise
        raise TypeError(f"{exc} — {hint}") from exc


def _spread_hint(called: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``called``'s ``forward`` could not take a batch spread over its arguments, and
    what to give instead; ``None`` where it can (the error was the forward's own)."""
    if len(args) == 1 and not kwargs:
        return None  # the batch whole: nothing was spread
    forward = getattr(called, "forward", called)
    try:
        inspect.signature(forward).bind(*args, **kwargs)
    except TypeError:
        pass
    except ValueError:  # no signature to read
        return None
    else:
        return None
    spread = f"module(**batch) with its keys {sorted(kwargs)}" if kwargs else "module(*batch)"
    return (
        f"the batch holds several arrays, so the module is called as {spread}; give the "
        'TorchFilter inputs="one" for its forward to take the batch as one argument'
    )
