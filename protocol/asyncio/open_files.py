"""The process's limit on open files, raised to what the system allows.

The coordinator keeps every job's submit file of 1 MiB or more mapped for the job's life, and a
message of 32 MiB or more lands in a mapped file of its own while it is received
(:mod:`protocol.asyncio.landing`). Python's ``mmap`` holds a descriptor of the file it maps until
it is closed, so beside its sockets the coordinator holds one descriptor per such live job. A
shell's soft limit is often 1024 (the hard one 524288 on systemd machines):
:func:`raise_open_files_limit` lifts the soft limit to the hard one, as servers that hold many
files do, so that a coordinator with a thousand jobs is not refused its next socket or file
(``EMFILE``). The worker agent does not: its daemons, which run job code, inherit its limits,
and it keeps one landed file per job.
"""

from __future__ import annotations

import logging
import resource

__all__ = ["raise_open_files_limit"]

log = logging.getLogger(__name__)

CEILING = 1 << 20
"""The soft limit asked for where the hard one is unlimited (Linux's default ``nr_open``)."""


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (or :data:`CEILING` where
    that is unlimited); where the system refuses, leave it. Returns ``(before, after)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.debug("open files limit left at %d: %s", soft, exc)
            return soft, soft
        return soft, wanted
    return soft, soft
