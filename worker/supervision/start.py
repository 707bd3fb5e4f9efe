"""Where a job's daemon starts: one new filter daemon process, forked or fresh, inside its
sandbox, in a cgroup of its own, with its two shared-memory regions.

The chain above this module is one call each: the coordinator's ``OpenJob`` reaches
:meth:`~worker.job_handlers.JobHandlers.open_job`, which takes its daemon from
:meth:`DaemonPool.for_job <worker.supervision.pool.DaemonPool.for_job>` (a spare already up, or a
new one); :meth:`DaemonSupervisor.start <worker.supervision.supervisor.DaemonSupervisor.start>`
calls :func:`start_daemon` here, then waits for its first ``ping``. What runs is
:mod:`worker.daemon.main`.

:func:`start_daemon` chooses in one place how the process is made:

* **forked** — on a CPU worker whose sandbox allows it, by the agent's fork server
  (:mod:`worker.supervision.forked`, which imported torch once): in milliseconds, then moved
  into its cgroup;
* **fresh** — otherwise, or when the fork server is gone or refuses: :func:`spawn` runs
  ``python -m worker.daemon`` as the sandbox's command line
  (:meth:`~worker.confinement.sandbox.Sandbox.launch`), and puts it and what it forked in its
  own cgroup (:func:`enter`) before it runs anything of the job's.

Either way it inherits the two shared-memory regions of :func:`shared_regions` (one per
direction), which carry the frames too large for its pipes. A start given up while the process
was being made (its starter cancelled) leaves no process without an owner (:func:`discard`).
Making a process blocks (fork/exec, a socket round trip), so it runs in the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from protocol.errors import ErrorCode
from worker.confinement.cgroup import CgroupParent, JobCgroup
from worker.confinement.environment import daemon_environment
from worker.confinement.procfs import descendants, exited
from worker.confinement.sandbox import NO_SANDBOX, Launch, Sandbox, UidConfinement
from worker.daemon.allocator import Allocator
from worker.daemon.shared_memory import SharedRegion
from worker.errors import DaemonCrashed
from worker.supervision.forked import ForkedChild, ForkServer
from worker.supervision.process import REAP_SECONDS, reap

__all__ = [
    "Started",
    "discard",
    "enter",
    "environment",
    "shared_regions",
    "spawn",
    "start_daemon",
    "unnice",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ENTER_SECONDS = 10.0
"""How long the processes of a starting daemon get to all be in its cgroup (:func:`enter`)."""

# The directory holding the ``worker`` and ``protocol`` packages: put on the child's PYTHONPATH so
# ``python -m worker.daemon`` imports this very code whatever the cwd and the interpreter.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


class Started(NamedTuple):
    """A daemon process just started, and what it was given."""

    process: subprocess.Popen[bytes] | ForkedChild
    cgroup: JobCgroup | None
    """Its own cgroup, or ``None``: its process group only."""
    confinement: UidConfinement | None
    """What a ``uid`` sandbox gave it, or ``None``."""
    shared: tuple[SharedRegion, SharedRegion] | None
    """``(to the daemon, from the daemon)``, or ``None``: pipes only."""
    argv: list[str]
    """Its command line, as the log shows it."""


async def start_daemon(
    python: str,
    env: dict[str, str],
    *,
    threads: int,
    device: str,
    fork_server: ForkServer | Callable[[], Awaitable[ForkServer | None]] | None,
    cgroups: CgroupParent | None,
    sandbox: Sandbox,
    tmpfs_bytes: int | None,
    nice: int,
) -> Started:
    """Start one filter daemon, forked by ``fork_server`` (or what gives it once it is up) on
    a CPU ``device``, else fresh: ``python -m worker.daemon`` with ``env``
    (:func:`environment`) inside ``sandbox`` (``tmpfs_bytes``: the most its private ``/tmp``
    and ``/dev/shm`` may each hold), in a cgroup of its own under ``cgroups``, at niceness
    ``nice``.

    Raises:
        DaemonCrashed: it could not be started (a bad interpreter, say).
    """
    argv = [python, "-m", "worker.daemon", "--threads", str(threads)]
    argv += ["--device", device]
    shared = shared_regions()
    fds: tuple[int, ...] = ()
    if shared is not None:
        fds = (shared[0].fd, shared[1].fd)
        argv += ["--shared", f"{fds[0]},{fds[1]}"]
    loop = asyncio.get_running_loop()
    forks = fork_server
    if callable(forks):
        forks = await forks()
    forked: tuple[ForkedChild, JobCgroup | None] | None = None
    if forks is not None and forks.alive and device == "cpu":
        try:
            forked = await _discarded_if_cancelled(
                loop.run_in_executor(None, forks.fork, threads, env, fds, cgroups),
                lambda made: discard((*made, None)),
            )
            argv = [f"(forked by fork server {forks.pid})", "--threads", str(threads)]
        except OSError as exc:
            log.warning("the fork server could not start a daemon (%s): starting one anew", exc)
    try:
        started: tuple[
            subprocess.Popen[bytes] | ForkedChild, JobCgroup | None, UidConfinement | None
        ] = (
            (*forked, None)
            if forked is not None
            else await _discarded_if_cancelled(
                loop.run_in_executor(
                    None,
                    functools.partial(
                        spawn,
                        argv,
                        env,
                        pass_fds=fds,
                        cgroups=cgroups,
                        sandbox=sandbox,
                        tmpfs_bytes=tmpfs_bytes,
                        nice=nice,
                    ),
                ),
                discard,
            )
        )
    except OSError as exc:
        for region in shared or ():
            region.close()
        raise DaemonCrashed(
            ErrorCode.DAEMON_CRASHED,
            f"cannot start the filter daemon with {python}: {exc}",
            {"argv": argv},
        ) from exc
    return Started(*started, shared, argv)


def environment(
    set_by_agent: Mapping[str, str],
    passed_env: Sequence[str],
    allocator: Allocator,
    memory_bytes: int | None,
) -> dict[str, str]:
    """A daemon's environment: the allow-list of :mod:`worker.confinement.environment`, what
    the agent sets (``set_by_agent``: its datasets) and passes on (``passed_env``), its
    allocator's preload (for ``memory_bytes``) and this source tree on ``PYTHONPATH``."""
    env = daemon_environment(os.environ, passed_env, set_by_agent)
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if _SOURCE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *paths])
    env.update(allocator.environment(env.get("LD_PRELOAD"), memory_bytes))
    return env


def shared_regions() -> tuple[SharedRegion, SharedRegion] | None:
    """The two regions of a new daemon (to it, from it), or ``None`` without memfds."""
    to_daemon = SharedRegion.create("somatize-to-daemon")
    from_daemon = SharedRegion.create("somatize-from-daemon")
    if to_daemon is None or from_daemon is None:
        for region in (to_daemon, from_daemon):
            if region is not None:
                region.close()
        return None
    return to_daemon, from_daemon


def spawn(
    argv: list[str],
    env: dict[str, str],
    *,
    pass_fds: tuple[int, ...] = (),
    cgroups: CgroupParent | None = None,
    sandbox: Sandbox = NO_SANDBOX,
    tmpfs_bytes: int | None = None,
    nice: int = 0,
) -> tuple[subprocess.Popen[bytes], JobCgroup | None, UidConfinement | None]:
    """Start the daemon process, inside ``sandbox`` (``tmpfs_bytes``: the most its private
    ``/tmp`` and ``/dev/shm`` may each hold), and, with ``cgroups``, put it in a new cgroup of
    its own before it runs anything of the job's: a sandboxed daemon waits at its gate until
    every process of it is in (:func:`enter`); ``nice``: its niceness (and so of all it starts:
    a spare starting beside a job). The cgroup it is in, ``None`` without ``cgroups`` or when
    that failed, and the uid a sandbox gave it (blocking: fork/exec; run in an executor)."""
    cgroup = None if cgroups is None else cgroups.new()
    launch = sandbox.launch(argv, env, tmpfs_bytes)
    gate = () if launch.gate is None else (launch.gate,)
    try:
        popen = _popen(launch.argv, launch.options, pass_fds + gate)
    except BaseException:
        _close_gate(launch)
        if cgroup is not None:
            cgroup.remove()
        if launch.confinement is not None:
            launch.confinement.clear()
        raise
    if launch.gate is not None:
        os.close(launch.gate)
    if cgroup is not None and not enter(cgroup, popen.pid):
        cgroup.remove()
        cgroup = None
    if nice:  # before it goes on: what it starts is as nice
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, popen.pid, nice)
    if launch.release is not None:
        with contextlib.suppress(OSError):  # it died already: EOF on its stdout says how
            os.write(launch.release, b"\n")
        os.close(launch.release)
    return popen, cgroup, launch.confinement


def _popen(
    argv: list[str], options: dict[str, Any], pass_fds: tuple[int, ...]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,  # inherited: user prints and tracebacks go to the worker's log
        close_fds=True,
        pass_fds=pass_fds,
        # Its own session: a Ctrl-C meant for the agent must not hit the daemon mid-request;
        # the agent decides when it stops (and the daemon's watchdog follows the agent).
        start_new_session=True,
        **options,
    )


def _close_gate(launch: Launch) -> None:
    for fd in (launch.gate, launch.release):
        if fd is not None:
            os.close(fd)


def enter(cgroup: JobCgroup, pid: int, seconds: float = ENTER_SECONDS) -> bool:
    """Put ``pid`` and every process below it in ``cgroup``: ``pid`` first, so that what it
    forks from then on is born inside, then what it had forked already, until none is left
    outside (those wait at a gate, or are an interpreter starting: none forks meanwhile);
    ``False`` when a move failed, or when some were still outside after ``seconds``.

    A zombie is left out: it cannot be moved (the kernel takes the write and moves nothing),
    and its parent may reap it only once past the gate this opens — waiting for it to show
    inside spun for ever, and a test's event loop, joining its executor's threads at its end,
    hung with it."""
    if not cgroup.add(pid):
        return False
    deadline = time.monotonic() + seconds
    while True:
        inside = set(cgroup.pids())
        outside = [p for p in descendants(pid) if p not in inside and not exited(p)]
        if not outside:
            return True
        if time.monotonic() > deadline:
            log.warning("processes %s would not move into %s", outside, cgroup.path)
            return False
        for child in outside:
            if not cgroup.add(child) and not exited(child):
                return False


def unnice(pids: list[int]) -> None:
    """Give ``pids`` (a spare daemon's processes, now a job's) the default niceness back
    (a root agent may; elsewhere they stay as they were)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, 0)


def discard(
    started: tuple[subprocess.Popen[bytes] | ForkedChild, JobCgroup | None, UidConfinement | None],
) -> None:
    """Kill and reap a daemon whose start was given up before it was looked after (its
    starter was cancelled while the process was being made): its pipes closed, what it
    started, its cgroup and its uid's files gone. Blocking: run it in an executor."""
    child, cgroup, confinement = started
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            stream.close()
    if isinstance(child, ForkedChild):
        child.reap(cgroup, REAP_SECONDS)
    else:
        reap(child, cgroup, confinement)


async def _discarded_if_cancelled(making: asyncio.Future[T], discarded: Callable[[T], None]) -> T:
    """What ``making`` (a process being made in an executor) makes; when the caller is
    cancelled first, ``discarded(it)`` runs in an executor once it is made, so that no process
    is left without an owner (a spare daemon's start cancelled by the agent's close)."""
    try:
        return await asyncio.shield(making)
    except asyncio.CancelledError:

        def discard_when_made(made: asyncio.Future[T]) -> None:
            if made.cancelled() or made.exception() is not None:
                return
            try:
                asyncio.get_running_loop().run_in_executor(None, discarded, made.result())
            except RuntimeError:  # the loop is closing: discard it here, now
                discarded(made.result())

        making.add_done_callback(discard_when_made)
        raise
