"""The file system a root agent's sandboxed daemons start from: the machine's, in a mount
namespace of the agent's where an unprivileged uid can reach the environment.

A root agent runs bubblewrap as an unprivileged uid of the daemon's own
(:mod:`worker.confinement.sandbox`): bubblewrap then makes a user namespace in which that uid holds
no capability over anything outside it, so a root-only file stays unreadable and nothing can be
remounted. But bubblewrap resolves what it binds as that uid too, and the environment a root
agent runs from often lies where only root may enter (``/root/.pyenv``, a virtualenv in
``/root``, a test's ``/tmp/pytest-of-root``). So the agent keeps one mount namespace of its
own (a small process holds it: ``unshare --mount``) in which each such directory that only root
may enter is covered by an empty ``tmpfs`` holding the paths the daemon needs and nothing else
(:func:`plan`); bubblewrap is started in it (``nsenter --mount``, as the daemon's uid) and binds
its ``/`` from there. What else lies in those directories — root's home, its keys — is not in
that namespace at all. The holder exits when the agent closes its stdin, or dies.

:func:`plan` is the logic (which directories to cover, which paths to put back), with no I/O;
:class:`SandboxRoot` runs it. Both need only what ``util-linux`` and ``mount`` give (Debian
installs them everywhere).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Cover", "SandboxRoot", "plan", "reachable_by_others"]

START_SECONDS = 10.0
"""How long the holder may take to make its namespace."""


def reachable_by_others(path: str) -> bool:
    """Whether a uid that is neither the owner nor in the group can enter ``path``'s
    directory (each directory above it searchable by others). Blocking: ``stat``."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o001 != 0
    except OSError:
        return False


@dataclass(frozen=True)
class Cover:
    """A directory only root may enter, covered by an empty tmpfs, and the paths under it put
    back as they are (each bound from the machine's file system)."""

    directory: str
    kept: tuple[str, ...]


def plan(paths: Iterable[str], searchable: Callable[[str], bool]) -> list[Cover]:
    """Which directories to cover so that every one of ``paths`` (absolute, resolved) can be
    reached by an unprivileged uid: for each path, its highest ancestor others cannot search
    (``searchable(directory)`` says), with the paths beneath it (a path inside another kept
    one comes with it). Being the highest, no cover lies inside another: a directory below
    one, blocked or not, is bypassed by the bind of the kept path beneath it.
    """
    kept: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        parts = path.strip("/").split("/")
        ancestors = ["/" + "/".join(parts[:k]) for k in range(1, len(parts))]
        blocked = next((a for a in ancestors if not searchable(a)), None)
        if blocked is None:
            continue
        under = kept.setdefault(blocked, [])
        if not any(path == k or path.startswith(k + "/") for k in under):
            under.append(path)
    return [Cover(d, tuple(p)) for d, p in kept.items()]


def script(covers: Sequence[Cover], staging: str) -> str:
    """The shell commands that make ``covers`` in a new mount namespace, then say ``ready``
    and wait for the agent to close their stdin. ``staging``: an empty directory on which a
    tmpfs holds each kept path between its bind and its move under its cover."""
    lines = ["set -e", f"mount -t tmpfs -o mode=0700 somatize-staging {shlex.quote(staging)}"]
    for c, cover in enumerate(covers):
        held = [shlex.quote(f"{staging}/{c}-{k}") for k in range(len(cover.kept))]
        for path, place in zip(cover.kept, held, strict=True):
            lines += [_mount_point(path, place), f"mount --rbind {shlex.quote(path)} {place}"]
        lines.append(f"mount -t tmpfs -o mode=0755 somatize-cover {shlex.quote(cover.directory)}")
        for path, place in zip(cover.kept, held, strict=True):
            parent = shlex.quote(os.path.dirname(path))
            lines += [f"mkdir -p {parent}", _mount_point(path, shlex.quote(path))]
            lines.append(f"mount --move {place} {shlex.quote(path)}")
    lines += [f"umount {shlex.quote(staging)}", "echo ready", "read -r _ || true"]
    return "\n".join(lines)


def _mount_point(path: str, place: str) -> str:
    """The command that makes ``place`` a mount point for ``path``: a folder or a file."""
    return f"mkdir -p {place}" if os.path.isdir(path) else f"touch {place}"


class SandboxRoot:
    """The namespace of :func:`plan` for ``paths``, held by a process of the agent's.

    Raises (from :meth:`start`):
        OSError: it could not be made here (no ``CAP_SYS_ADMIN``, no ``unshare``): says why.
    """

    def __init__(self, covers: Sequence[Cover]) -> None:
        self.covers = tuple(covers)
        self._holder: subprocess.Popen[bytes] | None = None
        self._staging: str | None = None

    @classmethod
    def needed_for(cls, paths: Iterable[str]) -> SandboxRoot | None:
        """The root for ``paths``, or ``None`` where others can reach all of them already."""
        covers = plan((os.path.realpath(p) for p in paths), reachable_by_others)
        return cls(covers) if covers else None

    @property
    def pid(self) -> int:
        assert self._holder is not None, "start() first"
        return self._holder.pid

    def start(self) -> None:
        """Make the namespace (blocking, a few milliseconds)."""
        unshare = shutil.which("unshare")
        if unshare is None:
            raise OSError("util-linux's unshare is not installed")
        self._staging = tempfile.mkdtemp(prefix="somatize-sandbox-root-")
        argv = [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c"]
        holder = subprocess.Popen(
            [*argv, script(self.covers, self._staging)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
        )
        assert holder.stdout is not None and holder.stderr is not None
        if holder.stdout.readline() != b"ready\n":
            with contextlib.suppress(subprocess.TimeoutExpired):
                holder.wait(START_SECONDS)
            said = holder.stderr.read().decode(errors="replace").strip().splitlines()
            why = [line.strip() for line in said if "dmesg" not in line]
            self._holder = holder
            self.close()
            raise OSError(" ".join(why) or f"the holder exited with {holder.returncode}")
        self._holder = holder

    def path(self, path: str) -> str:
        """Where ``path`` of the namespace is seen from the agent's (to test that it exists)."""
        return f"/proc/{self.pid}/root{path}"

    def entering(self, uid: int, gid: int) -> list[str]:
        """The command that runs the rest of an argv in the namespace as ``uid``/``gid`` (no
        supplementary groups)."""
        return [
            shutil.which("nsenter") or "nsenter",
            f"--mount=/proc/{self.pid}/ns/mnt",
            f"--setuid={uid}",
            f"--setgid={gid}",
            "--",
        ]

    def close(self) -> None:
        """End the holder and remove the staging directory (blocking)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            for stream in (holder.stdin, holder.stdout, holder.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            try:
                holder.wait(START_SECONDS)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
        if self._staging is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._staging)
            self._staging = None
