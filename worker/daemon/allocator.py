"""The memory allocator a filter daemon runs with: tcmalloc where the machine has it.

torch on a CPU allocates every tensor with ``malloc``, and a training step frees and allocates the
same large blocks again and again: activations, gradients and, in a sharded replica (FSDP2), each
unit's gathered parameters, its whole gradient and the collectives' buffers. glibc's ``malloc``
serves them badly both ways. From its heap they fragment it until it holds several times what is
live (a replica of sixteen 2048 × 2048 layers sharded over 4 held 1.6 GiB for 256 MiB of training
state); mapped on their own (:func:`protocol.asyncio.memory.map_tensor_blocks`, what a sharded
replica does under glibc) the heap stays small, but every block's pages are faulted in anew each
step: a 5.8M-parameter MLP's sharded step took 1.6× torch's own ``fully_shard`` with glibc's
defaults (``python -m benchmarks.sharded``).

tcmalloc (gperftools' ``libtcmalloc_minimal``: Debian's ``libtcmalloc-minimal4``) keeps the spans
it frees and hands them out again, coalesced, by size. On that job the sharded step took **0.93×**
``fully_shard``'s (140 against 150 ms; 1.01× ``fully_shard``'s with tcmalloc too), for 2–8 % more
memory than mapped blocks with a deep model (sixteen 2048 × 2048 layers: 1,101 / 614–630 /
351–356 MiB over idle at N = 1, 2, 4, against 1,081 / 584 / 338) and 5–26 % with a wide one (four
4096 × 4096 layers: 1,240 / 835 / 617–637 against 1,181 / 731 / 505: a freed 64 MiB span serves
smaller blocks before the next unit's), never near glibc's heap (``python -m
benchmarks.sharded_memory``).
Unsharded jobs train as fast with either (DataParallel 1.02× DDP's step at N = 2, 1.00× at 3; the
default checkpointed job 1.070× the same job without checkpoints, against 1.065× under glibc,
both measured before checkpoints were written around the page cache).

The agent picks it once (``--daemon-malloc``, :func:`choose`) and a daemon gets it through
``LD_PRELOAD`` in its environment (:meth:`Allocator.environment`), from its very first
allocation; the fork server's children inherit it. It is never loaded into a process that runs:
two allocators in one process would free each other's blocks.

What tcmalloc keeps must not cost a job its ``--max-job-memory``: a daemon under a limit keeps
tcmalloc's own heap limit at what the job's limit leaves beside the rest of its memory (the
libraries, Python's arenas, the shared regions: :class:`HeapBound`, before each request). Near
it tcmalloc gives its free spans back before it grows, as glibc's mapped blocks would; past it
an allocation fails, and the request with it, as ``resource_limit``
(:meth:`HeapBound.out_of_memory`) — the daemon answers, not killed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import ErrorCode, ErrorInfo
from worker.confinement.limits import mib, usage_of

__all__ = [
    "GLIBC",
    "LEVELS",
    "MEMORY_LIMIT_VARIABLE",
    "Allocator",
    "HeapBound",
    "choose",
    "heap_share",
]

LEVELS = ("auto", "tcmalloc", "glibc")
"""What ``--daemon-malloc`` takes."""
QUIET_LARGE_ALLOCATIONS = str(1 << 40)
"""tcmalloc's ``TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD``: it writes a line and a stack to stderr
for every allocation over it (1 GiB by default), and a large model's tensors are not news."""
MEMORY_LIMIT_VARIABLE = "SOMATIZE_MAX_JOB_MEMORY"
"""The job's ``--max-job-memory`` in bytes, in a tcmalloc daemon's environment."""


@dataclass(frozen=True)
class Allocator:
    """Which ``malloc`` this agent's daemons run with.

    Args:
        name: ``"tcmalloc"`` or ``"glibc"``.
        library: what ``LD_PRELOAD`` names for it; ``None``: the C library's own.
    """

    name: str
    library: str | None = None

    def environment(
        self, preload: str | None = None, memory_limit: int | None = None
    ) -> dict[str, str]:
        """What a daemon's environment gets for this allocator, over what it has.

        Args:
            preload: the ``LD_PRELOAD`` it would have otherwise (an operator's, passed with
                ``--daemon-env LD_PRELOAD``): kept after this allocator's library.
            memory_limit: the job's ``--max-job-memory`` (bytes), for :class:`HeapBound`.
        """
        if self.library is None:
            return {}
        env = {
            "LD_PRELOAD": " ".join(filter(None, (self.library, preload))),
            "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_LARGE_ALLOCATIONS,
        }
        if memory_limit is not None:
            env[MEMORY_LIMIT_VARIABLE] = str(memory_limit)
        return env

    def describe(self) -> str:
        """A line for the agent's log."""
        if self.library is None:
            return f"{self.name} (a sharded replica maps its large blocks)"
        return f"{self.name} ({self.library}, preloaded)"


GLIBC = Allocator("glibc")


def choose(
    requested: str, find: Callable[[str], str | None] = ctypes.util.find_library
) -> Allocator:
    """The allocator ``--daemon-malloc requested`` gets here (blocking: ``find`` may run
    ``ldconfig``).

    ``auto`` takes tcmalloc where the dynamic linker finds it and glibc's otherwise (the agent's
    log says which); ``tcmalloc`` needs it.

    Raises:
        ValueError: ``tcmalloc`` where it is not installed, or an unknown level.
    """
    if requested not in LEVELS:
        raise ValueError(f"--daemon-malloc takes one of {', '.join(LEVELS)}, not {requested!r}")
    if requested == "glibc":
        return GLIBC
    found = find("tcmalloc_minimal")
    if found is not None:
        return Allocator("tcmalloc", found)
    if requested == "tcmalloc":
        raise ValueError(
            "--daemon-malloc tcmalloc: libtcmalloc_minimal is not installed "
            "(apt-get install libtcmalloc-minimal4)"
        )
    return GLIBC


def heap_share(memory_limit: int, resident: int, heap_resident: int) -> int:
    """The bytes tcmalloc's heap may hold so that the process stays within ``memory_limit``:
    what the limit leaves once its memory outside the heap (``resident - heap_resident``) is
    counted."""
    return memory_limit - max(0, resident - heap_resident)


class HeapBound:
    """In a daemon: tcmalloc's heap limit, kept at what the job's memory limit leaves it.

    Args:
        memory_limit: the job's ``--max-job-memory`` (bytes); ``None``: no bound.

    Inert where there is no limit or no tcmalloc in this process (its ``MallocExtension``
    functions are looked up in the process, never loaded).
    """

    def __init__(self, memory_limit: int | None) -> None:
        self.memory_limit = memory_limit
        self.heap_limit: int | None = None
        """The heap limit set last (bytes); ``None``: none set."""
        self._set: Any = None
        self._get: Any = None
        if memory_limit is None:
            return
        process = ctypes.CDLL(None)
        try:
            self._set = process.MallocExtension_SetNumericProperty
            self._get = process.MallocExtension_GetNumericProperty
        except AttributeError:  # glibc's malloc
            return
        self._set.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self._set.restype = ctypes.c_int
        self._get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
        self._get.restype = ctypes.c_int

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> HeapBound:
        """The bound :data:`MEMORY_LIMIT_VARIABLE` asks for."""
        value = env.get(MEMORY_LIMIT_VARIABLE)
        return cls(int(value) if value and value.isdigit() else None)

    def update(self) -> int | None:
        """Set tcmalloc's heap limit from this process's memory now; the limit (bytes), or
        ``None`` where inert. Cheap (a read of ``/proc/<pid>/statm``): call before each request,
        as the memory outside the heap grows with the job."""
        if self._set is None or self.memory_limit is None:
            return None
        resident = usage_of([os.getpid()]).rss_bytes
        heap = self._property(b"generic.heap_size") - self._property(
            b"tcmalloc.pageheap_unmapped_bytes"
        )
        limit_mib = max(1, heap_share(self.memory_limit, resident, heap) >> 20)
        self._set(b"tcmalloc.heap_limit_mb", limit_mib)
        self.heap_limit = limit_mib << 20
        return self.heap_limit

    def out_of_memory(self, exc: BaseException, cmd: str) -> ErrorInfo | None:
        """``exc`` as ``resource_limit`` when it is an allocation the heap limit refused;
        ``None`` for anything else (a filter's own error)."""
        if self.heap_limit is None or self.memory_limit is None:
            return None
        refused = isinstance(exc, MemoryError) or (
            isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
        )
        if not refused:
            return None
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        said = next((line for line in lines if "allocate" in line), lines[0])
        return ErrorInfo(
            code=ErrorCode.RESOURCE_LIMIT,
            message=(
                f"{cmd} could not allocate within --max-job-memory {mib(self.memory_limit)} "
                f"(tcmalloc's heap was held to {mib(self.heap_limit)}, what the limit leaves "
                f"beside the daemon's other memory): {said}"
            ),
            detail={"cmd": cmd, "heap_limit_bytes": self.heap_limit},
        )

    def _property(self, name: bytes) -> int:
        value = ctypes.c_size_t()
        return value.value if self._get(name, ctypes.byref(value)) else 0
