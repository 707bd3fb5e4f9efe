"""A cgroup v2 of its own for each job's filter daemon, where the machine lets the agent make one.

A process group holds what a filter forks only until something in it calls ``setsid`` (a
daemonizing library, a shell's ``nohup``, a filter that means to stay): a cgroup holds its
processes whatever they do, and the kernel kills all of them at once (``cgroup.kill``). So when
the agent can write to its own cgroup v2 (a root agent on a cgroup v2 or hybrid machine, or a
delegated systemd unit), :meth:`CgroupParent.find` gives it a directory of its own there,
``somatize-agent-<pid>-<random>``, and each daemon gets a child of it, ``job-<n>``: the agent
moves the daemon in right after spawning it (before it reads a request, so before any filter runs),
counts the job's processes from it (``--max-job-procs``, ``--max-job-memory``) and kills it
whole when the job closes. Elsewhere (a read-only ``/sys/fs/cgroup`` in a container, cgroup
v1 only, not Linux) the agent says so once and isolates daemons by process group alone.

Only membership, counting and killing are used: kernel limits (``memory.max``, ``pids.max``)
need controllers delegated to the agent's cgroup, which machines rarely give; the limits are
enforced by :mod:`worker.confinement.limits`' watch either way. File I/O here blocks: call it off
the event loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import signal
import time
from pathlib import Path

__all__ = ["CgroupParent", "JobCgroup"]

log = logging.getLogger(__name__)

EMPTY_SECONDS = 2.0
"""How long a killed cgroup gets to empty before its directory is left for later."""


def _cgroup2_mount(mountinfo: str) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, from ``/proc/self/mountinfo``'s text."""
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        if rest.split(" ", 1)[0] == "cgroup2":
            return Path(fields.split()[4])
    return None


def _own_cgroup(cgroup: str) -> str | None:
    """This process's cgroup v2 path (``/...``), from ``/proc/self/cgroup``'s text."""
    for line in cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


class CgroupParent:
    """The agent's own cgroup directory, under which each job's daemon gets one.

    Args:
        path: the directory (it exists and the agent may write to it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._numbers = itertools.count()

    @classmethod
    def find(cls, proc: Path = Path("/proc")) -> CgroupParent | str:
        """A directory of the agent's own under its cgroup v2, or why there is none."""
        try:
            mount = _cgroup2_mount((proc / "self" / "mountinfo").read_text())
            own = _own_cgroup((proc / "self" / "cgroup").read_text())
        except OSError as exc:
            return f"cannot read this process's cgroups: {exc}"
        if mount is None or own is None:
            return "the machine has no cgroup v2 hierarchy"
        base = mount / own.lstrip("/")
        _remove_stale(base)
        path = base / f"somatize-agent-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            path.mkdir()
            probe = JobCgroup(path / "probe")
            probe.path.mkdir()
            probe.remove()
        except OSError as exc:
            return f"the agent cannot make cgroups under {base}: {exc.strerror or exc}"
        return cls(path)

    def new(self) -> JobCgroup | None:
        """A new, empty cgroup for one daemon (``None``: it could not be made; logged)."""
        job = JobCgroup(self.path / f"job-{next(self._numbers)}")
        try:
            job.path.mkdir()
        except OSError as exc:
            log.warning("cannot make the cgroup %s: %s (process group only)", job.path, exc)
            return None
        return job

    def remove(self) -> None:
        """Remove the agent's directory (its jobs' are removed as they close)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


class JobCgroup:
    """One daemon's cgroup: what is in it, and the end of all of it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, pid: int) -> bool:
        """Move ``pid`` (and what it forks from now on) in; ``False`` when that failed."""
        try:
            (self.path / "cgroup.procs").write_text(f"{pid}\n")
        except OSError as exc:
            log.warning("cannot move process %d into %s: %s", pid, self.path, exc)
            return False
        return True

    def pids(self) -> list[int]:
        """The processes in it now (none once it is removed)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(word) for word in text.split()]

    def kill(self) -> None:
        """SIGKILL every process in it, those that left their process group included."""
        try:
            (self.path / "cgroup.kill").write_text("1\n")
            return
        except OSError:  # before Linux 5.14: one by one, frozen so that nothing forks meanwhile
            pass
        frozen = _write(self.path / "cgroup.freeze", "1")
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if frozen:
            _write(self.path / "cgroup.freeze", "0")

    def remove(self) -> None:
        """Kill what is left and remove the directory, once it empties (the kernel refuses to
        remove a cgroup with processes in it; one that will not empty is left, and logged)."""
        deadline = time.monotonic() + EMPTY_SECONDS
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    log.warning("cannot remove the cgroup %s: %s", self.path, exc)
                    return
            self.kill()
            time.sleep(0.01)


def _remove_stale(base: Path) -> None:
    """Remove what agents that are gone left under ``base`` (a killed agent cannot clean up):
    empty cgroups only, the kernel refuses the others."""
    with contextlib.suppress(OSError):
        for agent in base.glob("somatize-agent-*"):
            pid = agent.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                for job in agent.glob("job-*"):
                    with contextlib.suppress(OSError):
                        job.rmdir()
                with contextlib.suppress(OSError):
                    agent.rmdir()


def _write(path: Path, text: str) -> bool:
    try:
        path.write_text(f"{text}\n")
    except OSError:
        return False
    return True
