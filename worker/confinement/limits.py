"""What a job's filter daemon may use: memory and processes, counted over its cgroup or its
process group.

Each daemon leads a process group of its own (it starts a session), and whatever its filters
fork stays in that group unless it leaves on purpose (``setsid``); where the machine lets the
agent make cgroups, the daemon also has a cgroup of its own, which nothing leaves
(:mod:`worker.confinement.cgroup`). The agent kills both when the job closes. With
``--max-job-memory`` or ``--max-job-procs`` the supervisor also reads the job's use every
:data:`POLL_SECONDS` (from ``/proc``: :func:`job_usage` of the cgroup's members, else
:func:`group_usage`; a sandbox's private ``/tmp`` and ``/dev/shm`` count too) and kills the job's
processes once they are over (:func:`over`), failing the request in flight with ``resource_limit``.
A limit on the address space (``RLIMIT_AS``) would not do: torch and CUDA reserve far more virtual
memory than they use, and ``RLIMIT_NPROC`` counts every process of the user, not the job's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NO_LIMITS",
    "POLL_SECONDS",
    "JobLimits",
    "Usage",
    "group_usage",
    "job_usage",
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
    """What a process group holds now: the sum of its processes' resident bytes, and them;
    ``file_bytes``: what the private ``/tmp`` and ``/dev/shm`` of a sandboxed daemon hold
    (memory too: tmpfs pages, not resident in any process until mapped)."""

    rss_bytes: int
    procs: int
    file_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """What it holds in all, against ``--max-job-memory``."""
        return self.rss_bytes + self.file_bytes


def group_usage(pgid: int, proc: Path = Path("/proc")) -> Usage:
    """:func:`job_usage` of process group ``pgid``'s members (a process that ends while it is
    read is left out)."""
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
    return job_usage(members, proc)


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


def job_usage(pids: Sequence[int], proc: Path = Path("/proc")) -> Usage:
    """:func:`usage_of` ``pids``, with what the private ``/tmp`` and ``/dev/shm`` of their
    mount namespaces hold (:func:`private_file_bytes`): what a job's limits are held to."""
    usage = usage_of(pids, proc)
    return dataclasses.replace(usage, file_bytes=private_file_bytes(pids, proc))


PRIVATE_MEMORY = ("tmp", "dev/shm")
"""Where a sandboxed daemon's files take memory: the tmpfs bubblewrap gives it."""


def private_file_bytes(pids: Iterable[int], proc: Path = Path("/proc")) -> int:
    """The bytes used in :data:`PRIVATE_MEMORY` of ``pids``' mount namespaces where they are
    file systems of their own (a sandbox's tmpfs; the machine's ``/tmp``, seen from another
    namespace, is not the job's), each namespace once."""
    machine = {}
    for place in PRIVATE_MEMORY:
        with contextlib.suppress(OSError):
            machine[place] = os.stat(f"/{place}").st_dev
    seen: set[str] = set()
    used = 0
    for pid in pids:
        try:
            namespace = os.readlink(proc / str(pid) / "ns" / "mnt")
        except OSError:
            continue
        if namespace in seen:
            continue
        seen.add(namespace)
        for place in PRIVATE_MEMORY:
            where = proc / str(pid) / "root" / place
            try:
                if os.stat(where).st_dev == machine.get(place):
                    continue
                found = os.statvfs(where)
            except OSError:
                continue
            used += (found.f_blocks - found.f_bfree) * found.f_frsize
    return used


def over(usage: Usage, limits: JobLimits) -> str | None:
    """Which limit ``usage`` is over, in words; ``None`` when within them."""
    if limits.memory_bytes is not None and usage.memory_bytes > limits.memory_bytes:
        files = f" and {mib(usage.file_bytes)} in its /tmp and /dev/shm" if usage.file_bytes else ""
        return (
            f"its processes held {mib(usage.rss_bytes)} resident{files}, over --max-job-memory "
            f"{mib(limits.memory_bytes)}"
        )
    if limits.procs is not None and usage.procs > limits.procs:
        return f"it ran {usage.procs} processes, over --max-job-procs {limits.procs}"
    return None


def mib(n: int) -> str:
    """Bytes as the limits' messages say them (``1350 MiB``)."""
    return f"{n / 2**20:.0f} MiB"
