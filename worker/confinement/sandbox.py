"""What a job's filter daemon runs inside: a sandbox made by bubblewrap, another uid, or none.

A job's filters are code its client wrote. The levels, from the strongest (``--sandbox``):

* ``bwrap`` — the daemon runs under `bubblewrap <https://github.com/containers/bubblewrap>`_
  (Debian's ``bubblewrap``) in a user namespace of its own, as an unprivileged uid with no
  capability (``--unshare-user``, ``--cap-drop ALL``, no further user namespaces): on a root
  agent bubblewrap itself is started as a uid of the daemon's own (one per daemon, from
  :data:`UID_BASE`), so a root-only file is unreadable to it and nothing can be unmounted or
  remounted, whatever the job tries; a non-root agent's daemons run as the agent's user, less
  every capability. The whole file system is read-only (the project's environment too: no
  ``.pth`` file planted for the next job), with a private ``/tmp`` and ``/dev/shm`` that go
  with the daemon (counted in its memory: :mod:`worker.confinement.limits`; each no larger than
  ``--max-job-memory``); the agent's secrets — its token file, its identity key and the folder
  of such keys, its peer TLS key — are replaced by an empty file or folder; its own PID, IPC,
  UTS and cgroup namespaces with a ``/proc`` of its own (the agent's ``/proc/<pid>`` is not
  there to read), ``/sys`` read-only, a new session, and death with its parent; with
  ``--job-network off``, a network namespace of its own too (loopback only). Where the
  environment lies in a directory only root may enter (``/root``), bubblewrap starts from the
  agent's :class:`~worker.confinement.sandbox_root.SandboxRoot`, which shows that environment and
  nothing else of the directory. Each daemon is started anew in it (the fork server, which
  would share its memory with every job, is not used), and held at bubblewrap's
  ``--block-fd`` until the agent has put it in its job's cgroup: it runs nothing of the job's
  outside it.
* ``uid`` — a root agent starts each daemon as an unprivileged uid of its own (one per daemon,
  from :data:`UID_BASE`), no supplementary groups, ``umask 077``, with a private ``TMPDIR``: it
  cannot read the agent's files or another job's, nor write the environment, nor ``/proc`` of
  the agent. The file system is otherwise the machine's: the datasets it trains on must be
  readable by others. Where bubblewrap cannot make namespaces (a container's default seccomp
  profile) this is the strongest there is.
* ``none`` — the daemon runs as the agent's user and can read what it can: only when asked for
  (``--sandbox none``), and the agent says so at start, loudly.

``auto`` (the default) takes ``bwrap`` where bubblewrap is installed and can make its
namespaces here, else ``uid`` on a root agent whose interpreter an unprivileged uid can run, else
refuses to start, naming what each level lacked. The agent logs which level it got and
announces it in its hello (``status`` shows it; a coordinator with ``--require-sandbox`` and a
job asking ``sandbox="required"`` refuse ``none``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from glob import glob
from typing import Any

from worker.confinement.environment import daemon_environment
from worker.confinement.procfs import running_as
from worker.confinement.sandbox_root import SandboxRoot

__all__ = [
    "LEVELS",
    "NO_SANDBOX",
    "UID_BASE",
    "Launch",
    "Sandbox",
    "SandboxRefused",
    "UidConfinement",
    "choose",
]

LEVELS = ("auto", "bwrap", "uid", "none")
"""What ``--sandbox`` takes."""
UID_BASE = 61000
"""The first uid a sandbox gives a daemon (then the next free one, one per daemon)."""
UIDS = 1000
"""How many uids it cycles through."""
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""This source tree (on the daemon's ``PYTHONPATH``)."""
PROBE_TIMEOUT = 10.0
"""Seconds bubblewrap may take to show it works here."""
DEVICES = ("/dev/nvidia*", "/dev/dri")
"""Device nodes a daemon on a GPU opens, bound into its ``/dev`` where the machine has them."""


class SandboxRefused(ValueError):
    """The sandbox asked for cannot be had here; the message says what is missing."""


UID_LOCKS = ("/run/lock/somatize-uids", "/tmp/somatize-uids")
"""Where agents on one machine mark the uids their daemons hold (the first that can be made)."""


class _Uids:
    """The uids given to daemons: the next one of the range that no agent of this machine holds
    (an exclusive ``flock`` on a file named for it, held until the daemon's uid is cleared:
    two agents starting together would otherwise take the same uid, and one's clearing kill
    the other's daemon) and no process runs as."""

    def __init__(self) -> None:
        self._next = 0

    def take(self) -> tuple[int, int | None]:
        """A uid and the descriptor of its lock (``None``: no lock could be made)."""
        folder = _lock_folder()
        for _ in range(UIDS):
            uid = UID_BASE + self._next % UIDS
            self._next += 1
            lock = None if folder is None else _locked(f"{folder}/{uid}")
            if (folder is None or lock is not None) and not running_as(uid):
                return uid, lock
            if lock is not None:
                os.close(lock)
        return UID_BASE + self._next % UIDS, None  # all taken: share one (not the agent's)


def _lock_folder() -> str | None:
    for folder in UID_LOCKS:
        with contextlib.suppress(OSError):
            os.makedirs(folder, mode=0o700, exist_ok=True)
            return folder
    return None


def _locked(path: str) -> int | None:
    """An exclusive ``flock`` on ``path`` (made if need be), or ``None`` when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_UIDS = _Uids()


@dataclass(frozen=True)
class Launch:
    """How to start one daemon: its command, :class:`subprocess.Popen`'s options, what a
    sandbox gave it (cleared once it is gone), and the gate it waits at.

    ``gate``: the read end of a pipe the command blocks on before it runs the daemon
    (bubblewrap's ``--block-fd``): the starter puts every process of it in the job's cgroup,
    then writes a byte to ``release``. ``None``: nothing waits (the process is the daemon's
    interpreter, which starts nothing before its first request).
    """

    argv: list[str]
    options: dict[str, Any]
    confinement: UidConfinement | None = None
    gate: int | None = None
    release: int | None = None


@dataclass(frozen=True)
class Sandbox:
    """How this agent starts its daemons (module docstring).

    Args:
        level: ``"bwrap"``, ``"uid"`` or ``"none"``.
        hidden: files a job must not read (the agent's token file, its identity key, its peer
            TLS key): under bubblewrap an empty file stands in their place.
        hidden_folders: folders a job must not read (where identity keys are kept): an empty
            one stands in their place.
        bwrap: the bubblewrap executable.
        exposed: paths a daemon reads that may lie under ``/tmp`` (the project's environment
            and sources, the worker's datasets): bound read-only over the private ``/tmp``.
        unprivileged: each daemon runs as an unprivileged uid of its own (a root agent).
        network: the daemon shares the machine's network (``False``: loopback of its own).
        root: where a root agent's bubblewrap starts from (``None``: the machine's ``/``).
    """

    level: str
    hidden: tuple[str, ...] = ()
    hidden_folders: tuple[str, ...] = ()
    bwrap: str = "bwrap"
    exposed: tuple[str, ...] = ()
    unprivileged: bool = False
    network: bool = True
    root: SandboxRoot | None = field(default=None, compare=False)
    forks: bool = field(init=False)
    """Whether daemons may be forked from the fork server (only without a sandbox)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "forks", self.level == "none")

    def launch(
        self, argv: Sequence[str], env: dict[str, str], tmpfs_bytes: int | None = None
    ) -> Launch:
        """How to start the daemon ``argv`` with ``env`` at this level (blocking: it may read
        ``/proc`` for a free uid); ``tmpfs_bytes``: the most its private ``/tmp`` and
        ``/dev/shm`` may each hold (``--max-job-memory``)."""
        if self.level == "uid":
            return self._as_uid(list(argv), env)
        if self.level != "bwrap":
            return Launch(list(argv), {"env": env})
        uid, lock = _UIDS.take() if self.unprivileged else (os.getuid(), None)
        gid = uid if self.unprivileged else os.getgid()
        gate, release = os.pipe()
        bwrap = self.bwrap_options(uid, gid, env.get("PYTHONPATH", ""), tmpfs_bytes)
        wrapped = [*self._start_as(uid, gid), *bwrap]
        wrapped += ["--block-fd", str(gate), "--", *argv]
        options: dict[str, Any] = {"env": env | {"TMPDIR": "/tmp", "HOME": "/tmp"}}
        confinement = None
        if self.unprivileged:
            confinement = UidConfinement(uid, None, lock)
            if self.root is None:  # else nsenter gives the uid, once in the root's namespace
                options |= {"user": uid, "group": gid, "extra_groups": []}
        return Launch(wrapped, options, confinement, gate, release)

    def _start_as(self, uid: int, gid: int) -> list[str]:
        """What starts bubblewrap as ``uid`` in the sandbox root's namespace, where it has one."""
        return [] if self.root is None else self.root.entering(uid, gid)

    def bwrap_options(
        self, uid: int, gid: int, python_path: str = "", tmpfs_bytes: int | None = None
    ) -> list[str]:
        """bubblewrap's options for a daemon run as ``uid``/``gid`` with ``python_path``
        (module docstring)."""
        size = [] if tmpfs_bytes is None else ["--size", str(tmpfs_bytes)]
        options = [
            self.bwrap,
            *("--unshare-user", "--uid", str(uid), "--gid", str(gid), "--disable-userns"),
            *("--cap-drop", "ALL"),
            *("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"),
            *([] if self.network else ["--unshare-net"]),
            *("--die-with-parent", "--new-session"),
            *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
            *size,
            *("--tmpfs", "/tmp"),
            *size,
            *("--tmpfs", "/dev/shm"),
        ]
        for pattern in DEVICES:
            for device in sorted(glob(pattern)):
                options += ["--dev-bind", device, device]
        paths = [p for p in python_path.split(os.pathsep) if p]
        for path in dict.fromkeys(os.path.realpath(p) for p in (*self.exposed, *paths)):
            if path.startswith(("/tmp/", "/dev/shm/")) and self._exists(path):
                options += ["--ro-bind", path, path]
        for folder in self.hidden_folders:
            if self._exists(folder) and not self._holds_exposed(folder):
                options += ["--tmpfs", os.path.realpath(folder)]
        for path in self.hidden:
            if self._exists(path):
                options += ["--ro-bind", "/dev/null", os.path.realpath(path)]
        return [*options, "--chdir", "/tmp"]

    def _exists(self, path: str) -> bool:
        """Whether ``path`` is there in what bubblewrap binds ``/`` from."""
        real = os.path.realpath(path)
        return os.path.exists(real if self.root is None else self.root.path(real))

    def _holds_exposed(self, folder: str) -> bool:
        real = os.path.realpath(folder).rstrip("/") + "/"
        return any(os.path.realpath(p).startswith(real) for p in self.exposed)

    def _as_uid(self, argv: list[str], env: dict[str, str]) -> Launch:
        uid, lock = _UIDS.take()
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
        return Launch(argv, options, UidConfinement(uid, private, lock))

    def describe(self) -> str:
        """What a job's code can reach, in a few words (the agent's log, ``status``)."""
        if self.level == "bwrap":
            who = "an unprivileged uid of its own" if self.unprivileged else "this agent's user"
            net = "" if self.network else ", no network"
            return f"{_SAID['bwrap']}, as {who} with no capabilities{net}"
        return _SAID[self.level]

    def close(self) -> None:
        """End what this sandbox keeps running (the sandbox root's holder; blocking)."""
        if self.root is not None:
            self.root.close()


@dataclass(frozen=True)
class UidConfinement:
    """The uid, and at ``uid``, the private directory a sandbox gave one daemon; ``lock``: the
    descriptor that holds the uid for it among this machine's agents."""

    uid: int
    private: str | None
    lock: int | None = None

    def clear(self) -> None:
        """Once the daemon is gone: SIGKILL whatever still runs as its uid (what its filters
        forked, even out of its process group); at ``uid``, remove its private directory and
        what it left in ``/tmp`` and ``/dev/shm``; then give the uid back (blocking)."""
        for pid in running_as(self.uid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.private is not None:
            self._remove_files()
        if self.lock is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock)

    def _remove_files(self) -> None:
        """What the daemon left where it could write (bubblewrap's went with its tmpfs)."""
        assert self.private is not None
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

_SAID = {
    "bwrap": "bwrap: file system read-only, private /tmp and /dev/shm, own /proc and PIDs, "
    "the agent's secrets hidden",
    "uid": "uid: an unprivileged uid of its own per daemon, a private TMPDIR",
    "none": "none: job code runs as the agent's user and can read its token and identity key",
}


def choose(
    requested: str,
    hidden: Sequence[str] = (),
    exposed: Sequence[str] = (),
    hidden_folders: Sequence[str] = (),
    network: bool = True,
) -> Sandbox:
    """The sandbox ``--sandbox requested`` gets here (blocking: it may run bubblewrap and the
    interpreter once, and start the sandbox root); ``exposed``: the worker's datasets (the
    project's environment is added).

    Raises:
        SandboxRefused: ``bwrap`` without a bubblewrap that works here, ``uid`` without root or
            an interpreter others may run, ``auto`` where neither works, or an unknown level;
            each says what is missing.
    """
    if requested not in LEVELS:
        raise SandboxRefused(f"--sandbox takes one of {', '.join(LEVELS)}, not {requested!r}")
    hidden, hidden_folders = tuple(hidden), tuple(hidden_folders)
    if requested == "none":
        return Sandbox("none", hidden, hidden_folders)
    problems: dict[str, str] = {}
    if requested in ("auto", "bwrap"):
        made = _bubblewrap(hidden, hidden_folders, tuple(map(str, exposed)), network)
        if isinstance(made, Sandbox):
            return made
        problems["bwrap"] = made
        if requested == "bwrap":
            raise SandboxRefused(f"--sandbox bwrap: {made}")
    problem = _uid_problem()
    if problem is None:
        return Sandbox("uid", hidden, hidden_folders)
    if requested == "uid":
        raise SandboxRefused(f"--sandbox uid: {problem}")
    problems["uid"] = problem
    said = "; ".join(f"{level}: {why}" for level, why in problems.items())
    raise SandboxRefused(
        f"no sandbox for job code works here ({said}); give --sandbox none to run job code "
        "as this agent's user, able to read what it can"
    )


def _environment() -> tuple[str, ...]:
    """What every daemon reads: the interpreter's installation, its environment, this tree,
    and the agent's ``PYTHONPATH`` (which daemons inherit: the modules a job's filters name)."""
    interpreter = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isdir(p)]
    found = (sys.prefix, sys.base_prefix, interpreter, _SOURCE_ROOT, *paths)
    return tuple(dict.fromkeys(os.path.realpath(p) for p in found))


def _bubblewrap(
    hidden: tuple[str, ...],
    hidden_folders: tuple[str, ...],
    exposed: tuple[str, ...],
    network: bool,
) -> Sandbox | str:
    """The ``bwrap`` sandbox here, or why bubblewrap cannot make it."""
    found = shutil.which("bwrap")
    if found is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    unprivileged = os.geteuid() == 0
    environment = _environment()
    root = None
    if unprivileged:
        root = SandboxRoot.needed_for((*environment, *exposed))
        if root is not None:
            try:
                root.start()
            except OSError as exc:
                return f"the environment lies where only root may enter, and cannot be shown: {exc}"
    sandbox = Sandbox(
        "bwrap",
        hidden,
        hidden_folders,
        found,
        (*environment, *exposed),
        unprivileged=unprivileged,
        network=network,
        root=root,
    )
    problem = _probe(sandbox)
    if problem is not None:
        sandbox.close()
        return problem
    return sandbox


def _uid_problem() -> str | None:
    """Why the ``uid`` level cannot be had here; ``None`` when it can."""
    if os.geteuid() != 0:
        return "it needs the agent to run as root (to give uids)"
    return _runs_unprivileged(sys.executable)


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


def _probe(sandbox: Sandbox) -> str | None:
    """Why ``sandbox`` cannot start a daemon's interpreter here; ``None`` when it can."""
    env = daemon_environment(os.environ, (), {"PYTHONPATH": _SOURCE_ROOT})
    launch = sandbox.launch([sys.executable, "-c", "import numpy, worker"], env)
    assert launch.gate is not None and launch.release is not None
    try:
        os.write(launch.release, b"\n")  # nothing to put in a cgroup: go at once
        os.close(launch.release)
        done = subprocess.run(
            launch.argv,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            check=False,
            pass_fds=(launch.gate,),
            **launch.options,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not run: {exc}"
    finally:
        os.close(launch.gate)
        if launch.confinement is not None:
            launch.confinement.clear()
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        return f"bubblewrap cannot start a daemon here ({why})"
    return None
