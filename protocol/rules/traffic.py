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

from protocol.options.strategies import powersgd_rank

__all__ = ["FP32", "step_bytes", "sync_bytes"]

FP32 = 4
"""Bytes of one uncompressed gradient value."""

HALF = 2
"""Bytes of one value compressed to fp16 or bf16."""

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket, and DiLoCo's largest all-reduce (``engine.outer_step.BUCKET_BYTES``)."""

INT8_CHUNK = 4096
"""Values that share one scale in DiLoCo's int8 pseudo-gradients
(``engine.compression.INT8_CHUNK``)."""

MIN_COMPRESSION_RATE = 2
"""PowerSGD compresses a matrix only when that makes it this many times smaller (torch's)."""


def step_bytes(shapes: Sequence[Sequence[int]], compression: str | None) -> int:
    """The bytes of one replica's gradients in one DataParallel step under ``compression``
    (int8: a byte a value, and a scale and zero point, 8 bytes, per DDP bucket of 25 MiB of
    fp32 gradients)."""
    if compression in ("fp16", "bf16"):
        return HALF * _values(shapes)
    if compression == "int8":
        values = _values(shapes)
        return values + 2 * FP32 * math.ceil(FP32 * values / DDP_BUCKET_BYTES)
    rank = powersgd_rank(compression)
    if rank is None:
        return FP32 * _values(shapes)
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:])
        r = min(n, m, rank)
        factors = (n + m) * r
        total += FP32 * (factors if factors * MIN_COMPRESSION_RATE < n * m else n * m)
    return total


def sync_bytes(shapes: Sequence[Sequence[int]], compression: str | None = None) -> int:
    """The bytes of one replica's pseudo-gradients in one DiLoCo synchronisation under
    ``compression`` (int8: a byte a value and a 4-byte scale per :data:`INT8_CHUNK` values of
    each 25 MiB bucket)."""
    if compression in ("fp16", "bf16"):
        return HALF * _values(shapes)
    if compression == "int8":
        total = 0
        for bucket in _buckets([math.prod(shape) for shape in shapes]):
            total += bucket + FP32 * math.ceil(bucket / INT8_CHUNK)
        return total
    return FP32 * _values(shapes)


def _buckets(sizes: Sequence[int]) -> list[int]:
    """The values of each bucket DiLoCo's synchronisation cuts tensors of ``sizes`` into (runs
    of whole tensors of at most :data:`DDP_BUCKET_BYTES`, a larger one alone)."""
    buckets: list[int] = []
    current = 0
    for size in sizes:
        if current and (current + size) * FP32 > DDP_BUCKET_BYTES:
            buckets.append(current)
            current = 0
        current += size
    return buckets + ([current] if current else [])


def _values(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)
