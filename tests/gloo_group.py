"""A one-rank gloo group for tests that run DDP and its communication hooks in the pytest
process itself.

The group is destroyed at the end but its process group object is kept until the process
exits. A Python hook's callback runs on one of gloo's own worker threads, and the closures it
leaves (PowerSGD's hold the group) are released there after the step's future completes: when
that drop was the last reference, the process group's destructor ran on the very thread it
joins, and the pytest worker aborted with ``std::system_error: Resource deadlock avoided``
between two tests. A kept reference makes the main thread's the last, at exit, with gloo's
threads idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

_KEPT: list[object] = []
"""Every group made here, never collected before the process exits (see the module's text)."""


@contextmanager
def one_rank_gloo_group() -> Iterator[None]:
    """The default group for the block: gloo, rank 0 of 1, over an in-memory store."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _KEPT.append(dist.group.WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
