"""What a job's filter daemon runs inside: a sandbox made by bubblewrap, another uid, or none.

A job's filters are code its client wrote. The levels, from the strongest (``--sandbox``):

* ``bwrap`` — the daemon runs under `bubblewrap <https://github.com/containers/bubblewrap>`_
  (Debian's ``bubblewrap``): the whole file system read-only (the project's environment too:
  no ``.pth`` file planted for the next job), a private ``/tmp`` and ``/dev/shm`` that go with
  the daemon, the agent's secrets (its token file, its identity key) replaced by an empty file,
  its own PID, IPC and UTS namespaces with a ``/proc`` of its own (the agent's ``/proc/<pid>``,
  its environment and memory, are not there to read), ``/sys`` read-only (its cgroup cannot be
  left), a new session, and death with its parent. Each daemon is started anew in it (the fork
  server, which would share its memory with every job, is not used).
* ``uid`` — a root agent starts each daemon as an unprivileged uid of its own (one per daemon,
  from :data:`UID_BASE`), no supplementary groups, ``umask 077``, with a private ``TMPDIR``: it
  cannot read the agent's files or another job's, nor write the environment, nor ``/proc`` of
  the agent. The file system is otherwise the machine's: the datasets it trains on must be
  readable by others.
* ``none`` — the daemon runs as the agent's user and can read what it can: the agent says so
  at start, loudly.

``auto`` (the default) takes ``bwrap`` where bubblewrap is installed and can make its
namespaces here, else ``none``: ``uid`` changes what a job can read of the machine's data, so it
is only taken when asked for. The agent logs which level it got and announces it in its hello
(``status`` shows it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.daemon.procfs import running_as

__all__ = ["LEVELS", "NO_SANDBOX", "UID_BASE", "Sandbox", "UidConfinement", "choose"]

LEVELS = ("auto", "bwrap", "uid", "none")
"""What ``--sandbox`` takes."""
UID_BASE = 61000
"""The first uid a ``uid`` sandbox gives a daemon (then the next, one per daemon)."""
UIDS = 1000
"""How many uids it cycles through."""
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""This source tree (on the daemon's ``PYTHONPATH``)."""
PROBE_TIMEOUT = 10.0
"""Seconds bubblewrap may take to show it works here."""

_next_uid = itertools.count()


@dataclass(frozen=True)
class Sandbox:
    """How this agent starts its daemons (module docstring).

    Args:
        level: ``"bwrap"``, ``"uid"`` or ``"none"``.
        hidden: files a job must not read (the agent's token file, its identity key): under
            bubblewrap an empty file stands in their place.
        bwrap: the bubblewrap executable.
        exposed: paths a daemon reads that may lie under ``/tmp`` (the project's environment
            and sources, the worker's datasets): bound read-only over the private ``/tmp``.
    """

    level: str
    hidden: tuple[str, ...] = ()
    bwrap: str = "bwrap"
    exposed: tuple[str, ...] = ()
    forks: bool = field(init=False)
    """Whether daemons may be forked from the fork server (only without a sandbox)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "forks", self.level == "none")

    def command(self, argv: Sequence[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The daemon's command and environment, inside the sandbox."""
        if self.level != "bwrap":
            return list(argv), env
        wrapped = [self.bwrap, *_BWRAP]
        python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        for path in dict.fromkeys(os.path.realpath(p) for p in (*self.exposed, *python_path)):
            if path.startswith("/tmp/") and os.path.exists(path):
                wrapped += ["--ro-bind", path, path]
        for path in self.hidden:
            if os.path.exists(path):
                wrapped += ["--ro-bind", "/dev/null", os.path.realpath(path)]
        return [*wrapped, "--", *argv], env | {"TMPDIR": "/tmp", "HOME": "/tmp"}

    def process(self, env: dict[str, str]) -> tuple[dict[str, Any], UidConfinement | None]:
        """What :class:`subprocess.Popen` takes to start a daemon at this level, with its
        environment; at ``uid``, the uid and private directory given to it (the caller clears
        them once the daemon is gone)."""
        if self.level != "uid":
            return {"env": env}, None
        uid = UID_BASE + next(_next_uid) % UIDS
        private = tempfile.mkdtemp(prefix=f"somatize-job-{uid}-")
        os.chown(private, uid, uid)
        options = {
            "user": uid,
            "group": uid,
            "extra_groups": [],
            "umask": 0o077,
            "env": env | {"TMPDIR": private, "HOME": private},
            "cwd": private,
        }
        return options, UidConfinement(uid, private)

    def describe(self) -> str:
        """What a job's code can reach, in a few words (the agent's log, ``status``)."""
        return _SAID[self.level]


@dataclass(frozen=True)
class UidConfinement:
    """The uid and private directory a ``uid`` sandbox gave one daemon."""

    uid: int
    private: str

    def clear(self) -> None:
        """Once the daemon is gone: SIGKILL whatever still runs as its uid (what its filters
        forked, even out of its process group), remove its private directory and what it left
        in ``/tmp`` and ``/dev/shm`` (blocking)."""
        for pid in running_as(self.uid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.private, ignore_errors=True)
        for shared in ("/tmp", "/dev/shm"):  # what it left where everyone may write
            with contextlib.suppress(OSError):
                for entry in os.scandir(shared):
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_uid == self.uid:
                            _remove(entry.path)


def _remove(path: str) -> None:
    """Remove a file or a directory tree (its symlinks, not what they point to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


NO_SANDBOX = Sandbox("none")
"""Daemons as the agent's user (``--sandbox none``)."""

_BWRAP = (
    *("--ro-bind", "/", "/"),
    *("--dev", "/dev"),
    *("--proc", "/proc"),
    *("--tmpfs", "/tmp"),
    *("--tmpfs", "/dev/shm"),
    *("--unshare-pid", "--unshare-ipc", "--unshare-uts"),
    "--die-with-parent",
    "--new-session",
    *("--chdir", "/tmp"),
)
"""bubblewrap's options for a daemon (module docstring), its secrets hidden after them."""

_SAID = {
    "bwrap": "bwrap: file system read-only, private /tmp and /dev/shm, own /proc and PIDs, "
    "the agent's secrets hidden",
    "uid": "uid: an unprivileged uid of its own per daemon, a private TMPDIR",
    "none": "none: job code runs as the agent's user and can read its token and identity key",
}


def choose(requested: str, hidden: Sequence[str] = (), exposed: Sequence[str] = ()) -> Sandbox:
    """The sandbox ``--sandbox requested`` gets here (blocking: it may run bubblewrap once);
    ``exposed``: the worker's datasets (the project's environment is added).

    Raises:
        ValueError: ``bwrap`` without a bubblewrap that works here, ``uid`` without root, or
            an unknown level; each says what is missing.
    """
    if requested not in LEVELS:
        raise ValueError(f"--sandbox takes one of {', '.join(LEVELS)}, not {requested!r}")
    hidden = tuple(hidden)
    if requested == "none":
        return Sandbox("none", hidden)
    if requested == "uid":
        if os.geteuid() != 0:
            raise ValueError("--sandbox uid needs the agent to run as root (to give uids)")
        problem = _runs_unprivileged(sys.executable)
        if problem is not None:
            raise ValueError(f"--sandbox uid: {problem}")
        return Sandbox("uid", hidden)
    found = shutil.which("bwrap")
    problem = "bubblewrap is not installed (apt-get install bubblewrap)" if found is None else None
    if found is not None:
        problem = _probe(found)
    if problem is None and found is not None:
        environment = (sys.prefix, sys.base_prefix, _SOURCE_ROOT)
        return Sandbox("bwrap", hidden, found, (*environment, *map(str, exposed)))
    if requested == "bwrap":
        raise ValueError(f"--sandbox bwrap: {problem}")
    return Sandbox("none", hidden)


def _runs_unprivileged(python: str) -> str | None:
    """Why a daemon's interpreter cannot run as an unprivileged uid here (a home directory only
    root may enter, say); ``None`` when it can."""
    try:
        done = subprocess.run(
            [python, "-c", "import numpy, torch"],
            user=UID_BASE,
            group=UID_BASE,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=6 * PROBE_TIMEOUT,
            check=False,
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot be run by an unprivileged uid: {exc}"
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        return f"{python} cannot be run by an unprivileged uid ({why})"
    return None


def _probe(bwrap: str) -> str | None:
    """Why bubblewrap cannot make a daemon's sandbox here; ``None`` when it can."""
    try:
        done = subprocess.run(
            [bwrap, *_BWRAP, "--", "true"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not run: {exc}"
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        return f"bubblewrap cannot make namespaces here ({said[-1] if said else done.returncode})"
    return None
