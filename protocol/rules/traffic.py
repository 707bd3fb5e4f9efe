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

MIN_COMPRESSION_RATE = 2
"""PowerSGD compresses a matrix only when that makes it this many times smaller (torch's)."""


def step_bytes(shapes: Sequence[Sequence[int]], compression: str | None) -> int:
    """The bytes of one replica's gradients in one DataParallel step under ``compression``."""
    if compression in ("fp16", "bf16"):
        return HALF * _values(shapes)
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


def sync_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """The bytes of one replica's pseudo-gradients in one DiLoCo synchronisation."""
    return FP32 * _values(shapes)


def _values(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)
