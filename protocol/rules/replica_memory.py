"""What one sharded DataParallel replica holds of the model at rest: its shard of the
parameters and of their gradients, counted from the trainable parameters' shapes
(``NodeInfo.parameter_shapes``) in 4-byte (fp32) values.

FSDP2 shards each parameter on its first dimension (``Shard(0)``), padded to a multiple of the
replicas: replica ``r`` of ``N`` holds ``ceil(n / N)`` of its ``n`` rows (the last ones fewer,
or none). The optimizer's state is that shard times its moments per value (Adam: two, SGD with
momentum: one). While a unit runs forward and backward its whole parameters are gathered too
(``sharding="gradients"`` keeps them from forward to backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protocol.rules.traffic import FP32

__all__ = ["replica_bytes"]


def replica_bytes(shapes: Sequence[Sequence[int]], replicas: int) -> dict[str, int]:
    """``{"parameters", "gradients"}``: the most bytes of each one replica of ``replicas``
    holds at rest."""
    values = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        values += math.ceil(rows / replicas) * math.prod(shape[1:])
    return {"parameters": FP32 * values, "gradients": FP32 * values}
