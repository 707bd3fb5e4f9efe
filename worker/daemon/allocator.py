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
default checkpointed job 1.070× the same job without checkpoints, against 1.065× under glibc).

The agent picks it once (``--daemon-malloc``, :func:`choose`) and a daemon gets it through
``LD_PRELOAD`` in its environment (:meth:`Allocator.environment`), from its very first
allocation; the fork server's children inherit it. It is never loaded into a process that runs:
two allocators in one process would free each other's blocks. No I/O but :func:`choose`'s lookup.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GLIBC", "LEVELS", "Allocator", "choose"]

LEVELS = ("auto", "tcmalloc", "glibc")
"""What ``--daemon-malloc`` takes."""
QUIET_LARGE_ALLOCATIONS = str(1 << 40)
"""tcmalloc's ``TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD``: it writes a line and a stack to stderr
for every allocation over it (1 GiB by default), and a large model's tensors are not news."""


@dataclass(frozen=True)
class Allocator:
    """Which ``malloc`` this agent's daemons run with.

    Args:
        name: ``"tcmalloc"`` or ``"glibc"``.
        library: what ``LD_PRELOAD`` names for it; ``None``: the C library's own.
    """

    name: str
    library: str | None = None

    def environment(self, preload: str | None = None) -> dict[str, str]:
        """What a daemon's environment gets for this allocator, over what it has.

        Args:
            preload: the ``LD_PRELOAD`` it would have otherwise (an operator's, passed with
                ``--daemon-env LD_PRELOAD``): kept after this allocator's library.
        """
        if self.library is None:
            return {}
        return {
            "LD_PRELOAD": " ".join(filter(None, (self.library, preload))),
            "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_LARGE_ALLOCATIONS,
        }

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
