"""The machine's process table, read from ``/proc`` (Linux): who started whom, who runs as
whom. Blocking file reads; a process that goes while it is read is skipped."""

from __future__ import annotations

import os

__all__ = ["descendants", "exited", "running_as"]


def _parent(entry: os.DirEntry[str]) -> int | None:
    """The parent pid of the process of ``/proc`` entry ``entry`` (``None``: gone)."""
    try:
        with open(f"{entry.path}/stat", encoding="ascii", errors="replace") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (exited, not yet reaped: it can no longer be moved
    into a cgroup, and a write of it to ``cgroup.procs`` succeeds without moving it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _uid(entry: os.DirEntry[str]) -> int | None:
    """The real uid of the process of ``/proc`` entry ``entry`` (``None``: gone)."""
    try:
        with open(f"{entry.path}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _processes() -> list[os.DirEntry[str]]:
    return [entry for entry in os.scandir("/proc") if entry.name.isdigit()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs...) as of now."""
    children: dict[int, list[int]] = {}
    for entry in _processes():
        parent = _parent(entry)
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running_as(uid: int) -> list[int]:
    """Every process whose real uid is ``uid``."""
    return [int(entry.name) for entry in _processes() if _uid(entry) == uid]
