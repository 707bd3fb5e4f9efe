"""The batching rule shared by the engine and the coordinator's strategies.

One epoch of ``n`` rows in batches of ``size``: in order (``slice(start, start + size)``) or, with
a ``torch.Generator``, in the order of one ``torch.randperm(n, generator=...)`` drawn per epoch
(the last batch may be shorter). ``graph.fit`` trains on exactly these batches, and
``DataParallel`` splits exactly these batches across its replicas, which is why the two agree.

Over data that lives on the workers (``WorkerData``) there is no one dataset to batch:
:func:`replica_batches` defines each step as every replica's next ``batch_size`` rows of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.rules.fragments import fragment_syncs

if TYPE_CHECKING:  # imported when a generator is made: the coordinator may never need torch
    import torch


def batches(n: int, size: int, order: torch.Generator | None) -> Iterator[Any]:
    """Row indices of each batch of one epoch: slices in order, or a seeded permutation."""
    if order is None:
        for start in range(0, n, size):
            yield slice(start, min(start + size, n))
        return
    import torch

    perm = torch.randperm(n, generator=order)
    for start in range(0, n, size):
        yield perm[start : start + size]


def batch_rows(index: Any, n: int) -> np.ndarray[Any, Any]:
    """A batch's rows as :func:`batches` gives them (a slice, or a tensor of a permutation)
    as a numpy index."""
    if isinstance(index, slice):
        return np.arange(*index.indices(n))
    return np.asarray(index.numpy(), dtype=np.int64)


def batch_len(index: Any, n: int) -> int:
    """How many rows a batch as :func:`batches` gives it holds."""
    if isinstance(index, slice):
        return len(range(*index.indices(n)))
    return int(index.numel())


def generator(seed: int) -> torch.Generator:
    """The generator that orders the epochs of a run seeded with ``seed``."""
    import torch

    return torch.Generator().manual_seed(seed)


def global_batches(
    rows: int,
    parts: int,
    epochs: int,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step of a data-parallel run: the global batch
    ``graph.fit`` would take (``batch_size`` rows, default all; in order, or shuffled by a
    generator seeded with ``seed``), its row indices split in ``parts`` slices by
    ``numpy.array_split`` (some may be empty when a batch has fewer rows than parts).

    The coordinator plans with it and, on the torch collective, every replica walks the same
    plan itself."""
    order = generator(seed) if shuffle else None
    size = batch_size or rows
    for epoch in range(epochs):
        for step, index in enumerate(batches(rows, size, order)):
            rows_ = np.arange(rows)[index] if isinstance(index, slice) else index.numpy()
            yield epoch, step, np.array_split(rows_, parts)


def replica_batches(
    sizes: Sequence[int],
    epochs: int,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step of a data-parallel run over the replicas' own
    datasets (``WorkerData``), replica ``r`` holding ``sizes[r]`` rows (replicas in the order
    of their worker ids).

    ``batch_size`` is per replica (default: all its rows): step ``s`` of an epoch takes rows
    ``[s·b, (s+1)·b)`` of every replica's own order, which is ``0, 1, ...`` or, with
    ``shuffle``, the permutation ``numpy.random.default_rng([seed, epoch, r]).permutation``.
    The global batch is the union of the slices; an epoch has as many steps as the largest
    replica needs, one that ran out contributing an empty slice to the rest. Slices hold row
    indices into each replica's own dataset."""
    steps = max((math.ceil(n / (batch_size or n)) for n in sizes if n), default=0)
    for epoch in range(epochs):
        orders = [
            np.random.default_rng([seed, epoch, r]).permutation(n) if shuffle else np.arange(n)
            for r, n in enumerate(sizes)
        ]
        for step in range(steps):
            slices = []
            for order, n in zip(orders, sizes, strict=True):
                size = batch_size or n
                slices.append(order[step * size : (step + 1) * size])
            yield epoch, step, slices


def replica_seed(seed: int, replica: int, step: int) -> int:
    """The seed of torch's generator for replica ``replica``'s forward of global step ``step``
    of a data-parallel run of a filter seeded with ``seed``: a dropout mask differs from
    replica to replica and step to step, and a rerun, a resumed run or a replacement draws the
    same ones (``numpy.random.SeedSequence([seed, replica, step])``)."""
    entropy = [seed % 2**64, replica, step]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def synchronises(steps: int, every: int, also: Iterable[int] = ()) -> list[bool]:
    """Per step of a run of ``steps``, whether DiLoCo's replicas synchronise after it: after
    every ``every``-th step counted over the run (as the paper and torchft count H: an epoch's
    end does not restart the count), after the run's last, and after each step of ``also``
    (counted from 1: where the global model is read — an evaluation — or where the job asks
    for a synchronisation at each epoch's end). Streaming DiLoCo's schedule of one fragment
    (:func:`protocol.rules.fragments.fragment_syncs`)."""
    return [bool(f) for f in fragment_syncs(steps, every, 1, also)]
