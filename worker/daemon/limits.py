"""What a job's filter daemon may use: memory and processes, counted over its cgroup or its
process group.

Each daemon leads a process group of its own (it starts a session), and whatever its filters
fork stays in that group unless it leaves on purpose (``setsid``); where the machine lets the
agent make cgroups, the daemon also has a cgroup of its own, which nothing leaves
(:mod:`worker.daemon.cgroup`). The agent kills both when the job closes. With ``--max-job-memory``
or ``--max-job-procs`` the supervisor also reads the job's use every :data:`POLL_SECONDS` (from
``/proc``: :func:`usage_of` the cgroup's members, else :func:`group_usage`) and kills the job's
processes once they are over (:func:`over`), failing the request in flight with
``resource_limit``. A limit
on the address space (``RLIMIT_AS``) would not do: torch and CUDA reserve far more virtual
memory than they use, and ``RLIMIT_NPROC`` counts every process of the user, not the job's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NO_LIMITS",
    "POLL_SECONDS",
    "JobLimits",
    "Usage",
    "group_usage",
    "mib",
    "over",
    "usage_of",
]

POLL_SECONDS = 0.25
"""How often a limited daemon's use is read."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class JobLimits:
    """The most a job's daemon group may hold: resident bytes, processes (``None``: any)."""

    memory_bytes: int | None = None
    procs: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("memory", self.memory_bytes), ("procs", self.procs)):
            if value is not None and value < 1:
                raise ValueError(f"the job {name} limit must be positive, not {value}")

    @property
    def any(self) -> bool:
        """Whether there is a limit to watch."""
        return self.memory_bytes is not None or self.procs is not None


NO_LIMITS = JobLimits()
"""A daemon held to nothing."""


@dataclass(frozen=True)
class Usage:
    """What a process group holds now: the sum of its processes' resident bytes, and them."""

    rss_bytes: int
    procs: int


def group_usage(pgid: int, proc: Path = Path("/proc")) -> Usage:
    """The resident memory and the processes of process group ``pgid`` (a process that ends
    while it is read is left out)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # The command name, in parentheses, may hold spaces: the fields follow its ")".
            fields = stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):  # state, ppid, pgrp
            members.append(int(entry.name))
    return usage_of(members, proc)


def usage_of(pids: Iterable[int], proc: Path = Path("/proc")) -> Usage:
    """The resident memory and the number of the processes ``pids`` (the members of a job's
    cgroup, say); a process that ends while it is read is left out."""
    rss = procs = 0
    for pid in pids:
        try:
            resident = int((proc / str(pid) / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        rss += resident * _PAGE
        procs += 1
    return Usage(rss, procs)


def over(usage: Usage, limits: JobLimits) -> str | None:
    """Which limit ``usage`` is over, in words; ``None`` when within them."""
    if limits.memory_bytes is not None and usage.rss_bytes > limits.memory_bytes:
        return (
            f"its processes held {mib(usage.rss_bytes)} resident, over --max-job-memory "
            f"{mib(limits.memory_bytes)}"
        )
    if limits.procs is not None and usage.procs > limits.procs:
        return f"it ran {usage.procs} processes, over --max-job-procs {limits.procs}"
    return None


def mib(n: int) -> str:
    """Bytes as the limits' messages say them (``1350 MiB``)."""
    return f"{n / 2**20:.0f} MiB"
