"""Process-wide malloc settings for the processes that move large frames.

The coordinator, the worker agent and the filter daemon copy tensor bytes through many short-lived
buffers of the same few sizes: 1 MiB WebSocket chunks (``websockets`` masks, frames and parses
each into a new ``bytes``), 23 MB gradient frames, their reassembly buffers. With glibc's default
settings much of that memory is handed back to the kernel as soon as it is freed — blocks above the
(adaptive) mmap threshold are unmapped, and the top of the heap is trimmed once more than twice
that threshold is free — so the next buffer of the same size faults its pages in again, 4 KiB at
a time, each one zeroed by the kernel. Measured here: ``websockets`` serializing one masked 1 MiB
frame took 0.77 ms so and 0.04 ms with freed memory kept (the cost of its copies); 23 MB sent
from a client to a server in 1 MiB messages took 26 + 19 ms of CPU so, 6.4 + 6.0 ms kept.

:func:`keep_freed_memory` fixes both thresholds, so blocks up to 32 MiB come from the heap and up
to ``trim_threshold`` bytes of freed heap stay mapped for the next buffer.

A filter daemon training a sharded replica under glibc's ``malloc`` is the other way round
(:func:`map_tensor_blocks`, called as its plan arrives; a daemon runs tcmalloc instead where the
machine has it, :mod:`worker.daemon.allocator`, and these thresholds then govern nothing): FSDP2
allocates and frees its tensors step after step in many sizes (each unit's gathered parameters,
their gradients, the shards), and from the heap they fragment it until it holds several times what
is live. Measured on ``fully_shard`` in 2 plain processes over gloo (Adam, 4 steps and more): 64 ×
Linear(1024) held 2.0 GiB at its peak for 512 MiB of training state per rank with the 32 MiB
threshold, 581 MiB with blocks of 1 MiB and more mapped; 16 × Linear(2048), 2.0 GiB and 610 MiB.
Mapped anew, a block's pages are faulted in again each time: a 5.8M-parameter MLP's sharded step
took 262 ms against 172 ms from the heap (``python -m benchmarks.sharded``). Transparent huge pages
make those faults cheaper (197 against 158 ms) where the operator asks for them —
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the agent's environment and ``--daemon-env
GLIBC_TUNABLES`` — but they are not the default: in every daemon they took the default checkpointed
DataParallel job from 1.02–1.06× of the same job without checkpoints to 1.09–1.13× (``python -m
benchmarks.checkpoints``), its heap's pages faulted in 2 MiB at a time. An unsharded replica keeps
the heap: its parameters, gradients and moments live as long as it does, and mapping its
activations anew each step cost DataParallel 8 % (1.01× DDP's step to 1.09×).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = [
    "MMAP_THRESHOLD",
    "TENSOR_MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "keep_freed_memory",
    "map_tensor_blocks",
]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap: glibc's largest accepted value on 64-bit."""

TRIM_THRESHOLD = 256 << 20
"""Free memory at the top of the heap kept mapped (the rest is given back to the kernel)."""

TENSOR_MMAP_THRESHOLD = 1 << 20
"""A filter daemon's mmap threshold: blocks from this size on are mapped and unmapped whole."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Make glibc's malloc keep freed memory for the next buffer instead of unmapping it.

    Call once at the start of a process (its entry point, not a library import: it changes the
    whole process). Fixing the thresholds also turns off glibc's adaptive mmap threshold.

    Returns:
        ``True`` when the settings were applied; ``False`` where there is no glibc ``mallopt``
        (musl, macOS): nothing changes there.
    """
    return _thresholds(mmap_threshold, trim_threshold)


def map_tensor_blocks(mmap_threshold: int = TENSOR_MMAP_THRESHOLD) -> bool:
    """Make glibc's malloc map every block of ``mmap_threshold`` bytes or more on its own, and
    unmap it once freed, so that a filter daemon's tensors never fragment its heap (module
    docstring). Call in a daemon before it trains a sharded replica (as its plan arrives): it
    holds for every block allocated after it.

    Returns:
        As :func:`keep_freed_memory`.
    """
    return _thresholds(mmap_threshold, TRIM_THRESHOLD)


def _thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's two thresholds (``False`` where there is no glibc ``mallopt``)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    applied = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold)) and applied
    if not applied:
        log.debug("mallopt refused the thresholds %d/%d", mmap_threshold, trim_threshold)
    return applied
