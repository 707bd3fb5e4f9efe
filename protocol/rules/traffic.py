"""How many bytes a replica puts on the network: a DataParallel step's gradients, as they
travel uncompressed or compressed, and a DiLoCo synchronisation's pseudo-gradients.

Counted from the shapes of the trainable parameters (``NodeInfo.parameter_shapes``, which the
client reads off the model at submit) and 4-byte (fp32) gradients: what one replica contributes
to one all-reduce (or sends the coordinator), not what a ring all-reduce moves in all. PowerSGD
follows ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: each gradient viewed as
an ``n × m`` matrix (its first dimension by the rest) travels as its factors P and Q, of
``(n + m) · r`` values (``r = min(n, m, RANK)``), when that is under half of ``n · m``
(``min_compression_rate=2``), and whole otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protocol.compressed_trees import INT8_CHUNK
from protocol.options.compression import Compression

__all__ = ["BUCKET_BYTES", "FP32", "INT8_CHUNK", "buckets", "step_bytes", "sync_bytes"]

FP32 = 4
"""Bytes of one uncompressed gradient value."""

HALF = 2
"""Bytes of one value compressed to fp16 or bf16."""

BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket, and DiLoCo's largest all-reduce of pseudo-gradients."""

MIN_COMPRESSION_RATE = 2
"""PowerSGD compresses a matrix only when that makes it this many times smaller (torch's)."""


def step_bytes(shapes: Sequence[Sequence[int]], compression: Compression | None) -> int:
    """The bytes of one replica's gradients in one DataParallel step under ``compression``:
    PowerSGD's factors (module docstring), or as :func:`sync_bytes` counts the others (int8: a
    byte a value and a 4-byte scale a chunk of each bucket)."""
    if compression is None or compression.rank is None:
        return sync_bytes(shapes, compression)
    rank = compression.rank
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:])
        r = min(n, m, rank)
        factors = (n + m) * r
        total += FP32 * (factors if factors * MIN_COMPRESSION_RATE < n * m else n * m)
    return total


def sync_bytes(shapes: Sequence[Sequence[int]], compression: Compression | None = None) -> int:
    """The bytes of one replica's pseudo-gradients in one DiLoCo synchronisation under
    ``compression`` (int8: a byte a value and a 4-byte scale per :data:`INT8_CHUNK` values of
    each 25 MiB bucket)."""
    if compression is None:
        return FP32 * _values(shapes)
    if compression.half:
        return HALF * _values(shapes)
    if compression.kind == "int8":
        total = 0
        sizes = [math.prod(shape) for shape in shapes]
        for bucket in buckets([FP32 * size for size in sizes]):
            values = sum(sizes[k] for k in bucket)
            total += values + FP32 * math.ceil(values / INT8_CHUNK)
        return total
    return FP32 * _values(shapes)


def buckets(nbytes: Sequence[int]) -> list[list[int]]:
    """The tensors of ``nbytes`` bytes each, in order, cut in runs of at most
    :data:`BUCKET_BYTES` (a larger one alone): each run's indices. DiLoCo's synchronisation
    all-reduces one run at a time (``engine.data_parallel.outer_step``), and its bytes are counted
    so."""
    runs: list[list[int]] = []
    size = 0
    for k, n in enumerate(nbytes):
        if not runs or size + n > BUCKET_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(k)
        size += n
    return runs


def _values(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)
