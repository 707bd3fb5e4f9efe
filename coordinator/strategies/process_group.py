"""Forming a torch.distributed process group over some of a job's workers, and awaiting work
that all of them must finish.

The coordinator is the group's rendezvous broker, never a member: the first member's daemon
opens the group's store on a free port (``dist_store``: :mod:`engine.rendezvous_store`, usable
only by connections that prove the secret the coordinator made for it and gives only to the
members, over its authenticated links to their agents), every other member checks, within a short
probe timeout, that it can open a connection to it (``dist_probe``), and then all join under a
key prefix of their own (``dist_join``; gloo, or NCCL when every member trains on CUDA).
:func:`rendezvous` answers where the group meets, or why it cannot (in-process workers, an
address not known, a member that cannot reach the store) — which lets ``auto`` fall back to the
WebSocket path and say why.

:func:`settle` awaits one call per member. The members of a group wait on each other, so when
one call fails the others are cancelled — which kills their daemons: nothing is left waiting in
a collective — as soon as a member is known lost, or (an elastic job, whose survivors' state
matters) given the collective timeout to end by themselves first (they end at once when the
group broke: a dead peer's sockets close). :class:`Broken` then says who failed how, and blames
the failure that explains the others (a lost worker, over a survivor that only saw the group
break).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.context import StrategyContext
from coordinator.errors import WorkerCallError
from coordinator.strategies.base import concurrently
from protocol.daemon import DistJoinRequest, DistLeaveRequest, DistProbeRequest, DistStoreRequest
from protocol.errors import ErrorCode, ErrorInfo
from protocol.options.devices import device_fits

__all__ = ["PROBE_TIMEOUT", "Broken", "Rendezvous", "cannot_form", "join", "rendezvous", "settle"]

PROBE_TIMEOUT = 3.0
"""Seconds a member may take to open a connection to the rendezvous before ``auto`` decides it
cannot reach it."""

RECOVERABLE = frozenset({ErrorCode.WORKER_LOST, ErrorCode.DAEMON_CRASHED})
"""Failures that are a member gone, not a member wrong."""


def new_secret() -> str:
    """A fresh rendezvous secret (32 bytes, hex: :data:`protocol.daemon.Secret`)."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: the store on its first member, and the backend all use."""

    host: str
    port: int
    backend: Literal["gloo", "nccl"]
    reason: str  # why the group can form, in words
    secret: str = field(repr=False)  # what every member proves to its store


def cannot_form(ctx: StrategyContext, members: Sequence[int]) -> str | None:
    """Why these workers cannot form a torch group at all, or ``None``."""
    if not ctx.supports_process_groups:
        return "the workers are in-process and share one process"
    unknown = [ctx.workers[i].id for i in members if ctx.workers[i].host is None]
    if unknown:
        return f"no address is known for {unknown}"
    return None


async def rendezvous(
    ctx: StrategyContext,
    members: Sequence[int],
    probe: float,
    limit: float,
    nccl: bool = True,
    member: str = "replica",
) -> Rendezvous | str:
    """Open the store on ``members[0]`` and have every other member try to reach it: where
    the group meets, or why it cannot (the store is closed again then). ``nccl=False`` keeps
    gloo even on CUDA workers (tensors that cross on the CPU); ``member`` is what the reason
    calls a member."""
    why_not = cannot_form(ctx, members)
    if why_not is not None:
        return why_not
    head = members[0]
    host = ctx.workers[head].host
    assert host is not None  # cannot_form checked
    secret = new_secret()  # one for each store: a job's group is closed to every other
    opened = await ctx.call(head, DistStoreRequest(timeout=limit, secret=secret, address=host))
    port = int(opened["port"])
    others = members[1:]
    request = DistProbeRequest(host=host, port=port, timeout=probe)
    answers = await concurrently(*(ctx.call(i, request) for i in others))
    unreachable = {
        ctx.workers[i].id: answer["error"]
        for i, answer in zip(others, answers, strict=True)
        if not answer["reachable"]
    }
    where = f"the rendezvous on {ctx.workers[head].id!r} at {host}:{port}"
    if unreachable:
        await ctx.call(head, DistLeaveRequest())
        return f"{sorted(unreachable)} cannot reach {where}: {unreachable}"
    cuda = nccl and all(device_fits("cuda", ctx.workers[i].device) for i in members)
    places = {(ctx.workers[i].host, ctx.workers[i].device) for i in members}
    if len(places) < len(members):
        cuda = False  # NCCL refuses two ranks on one GPU; gloo reduces CUDA tensors too
    members_said = f"every {member}" if len(members) > 1 else f"the one {member}"
    reason = f"{members_said} reached {where}"
    return Rendezvous(host, port, "nccl" if cuda else "gloo", reason, secret)


async def join(
    ctx: StrategyContext,
    members: Sequence[int],
    meet: Rendezvous,
    prefix: str,
    limit: float,
) -> None:
    """Every member joins the group, ``members[k]`` as rank ``k``.

    Raises:
        WorkerCallError: the failure that explains the others, when the group did not form.
    """

    def request(rank: int) -> DistJoinRequest:
        return DistJoinRequest(
            host=meet.host,
            port=meet.port,
            secret=meet.secret,
            prefix=prefix,
            backend=meet.backend,
            rank=rank,
            world=len(members),
            timeout=limit,
        )

    calls = {i: ctx.call(i, request(rank)) for rank, i in enumerate(members)}
    try:
        await settle(calls, [w.id for w in ctx.workers], limit, 0)
    except Broken as broken:
        raise broken.blame() from None


async def leave(ctx: StrategyContext, members: Sequence[int]) -> None:
    """Every member leaves its group (and the first closes the store)."""
    await concurrently(*(ctx.call(i, DistLeaveRequest()) for i in members))


class Broken(Exception):
    """Work that did not complete on every member: each one's error, the steps each member
    that answered (or only saw the group break) has completed, and the answers of those that
    completed it."""

    def __init__(
        self,
        errors: dict[int, WorkerCallError],
        done: dict[int, int],
        stopped: frozenset[int] = frozenset(),
        results: dict[int, Any] | None = None,
    ) -> None:
        super().__init__(", ".join(str(e) for e in errors.values()))
        self.errors = errors
        self.done = done
        self.stopped = stopped  # members whose call was cancelled here (their daemon stopped)
        self.results = results or {}

    def blame(self) -> WorkerCallError:
        """The failure that explains the others: a lost worker over a survivor that only saw
        the group break, and either over a member this side stopped."""
        own = [e for i, e in self.errors.items() if i not in self.stopped]
        lost = [e for e in own if e.code in RECOVERABLE]
        real = [e for e in own if e.code is not ErrorCode.COLLECTIVE_FAILED]
        return (lost or real or own or list(self.errors.values()))[0]


async def settle(
    calls: Mapping[int, Awaitable[Any]],
    ids: Sequence[str],
    grace: float,
    completed: int,
    patient: bool = False,
) -> dict[int, Any]:
    """Await one call per member (worker index → call), each of which, when it succeeds, has
    completed the steps up to ``completed``.

    When one fails, the others get ``grace`` seconds to end and are then cancelled (module
    docstring) — at once, unless ``patient``, as soon as a member is known lost: what the others
    still hold is of no use to a job that fails, and waiting on them could take the collective
    timeout. ``patient`` (an elastic job) lets the survivors end by themselves, their state
    intact, within the grace.

    Raises:
        Broken: some call did not complete.
    """
    tasks = {i: asyncio.ensure_future(call) for i, call in calls.items()}
    loop = asyncio.get_running_loop()
    try:
        pending, deadline = set(tasks.values()), None
        while pending:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            _, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            failed = [t.exception() for t in tasks.values() if t.done() and t.exception()]
            if not failed:
                continue
            lost = any(getattr(e, "code", None) in RECOVERABLE for e in failed)
            if lost and not patient:
                break
            deadline = loop.time() + grace if deadline is None else deadline
            if loop.time() >= deadline:
                break
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    results: dict[int, Any] = {}
    errors: dict[int, WorkerCallError] = {}
    done_steps: dict[int, int] = {}
    stopped = frozenset(i for i, task in tasks.items() if task.cancelled())
    for i, task in tasks.items():
        if i in stopped:
            errors[i] = WorkerCallError(ids[i], _hung(grace))
            continue
        exc = task.exception()
        if exc is None:
            results[i] = task.result()
        elif isinstance(exc, WorkerCallError):
            errors[i] = exc
            if exc.code is ErrorCode.COLLECTIVE_FAILED:
                done_steps[i] = int(exc.info.detail.get("steps_done", 0))
        else:
            raise exc
    if errors:
        raise Broken(errors, done_steps | {i: completed for i in results}, stopped, results)
    return results


def _hung(timeout: float) -> ErrorInfo:
    return ErrorInfo(
        code=ErrorCode.DAEMON_CRASHED,
        message=f"did not leave the broken group within {timeout:g}s; its daemon was stopped",
    )
