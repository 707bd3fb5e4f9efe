"""The daemon as a member of a torch.distributed process group: the rendezvous and the group.

The coordinator sets a group up for a job
(:mod:`coordinator.strategies.data_parallel.torch_collective`): replica 0 opens the group's store
on a free port (:meth:`GroupMember.open_store`: a :class:`~engine.rendezvous_store.StoreServer`
that only holders of the rendezvous's secret can use), every member checks it can reach it
(:meth:`probe`), then all join through it (:meth:`join`: gloo, or NCCL when every member is on
CUDA) under one key prefix per formation of the group. Every collective after that runs under
the join's timeout, never torch's 30-minute default; a broken group (a peer that died, a
timeout) becomes ``COLLECTIVE_FAILED`` carrying ``steps_done``, the steps this member
completed, which an elastic job needs to bring the members back to one point.

Gloo connects every pair of members through one network interface of each. Unless the operator
names it (``GLOO_SOCKET_IFNAME``), a member takes the interface whose address the kernel routes
to the rendezvous from (:func:`interface_towards`), never the one its host name resolves to: a
host name that resolves to 127.0.0.1 would have it offer the others a loopback address.

What a group is used for lives apart: data-parallel training (:mod:`engine.data_parallel.replica`)
and pipeline stages sending activations to each other (:mod:`engine.pipeline.linked_stage`).
"""

from __future__ import annotations

import datetime
import fcntl
import gc
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from engine.errors import EngineError
from engine.rendezvous_store import AuthenticatedStore, StoreRefused, StoreServer
from protocol.errors import ErrorCode

__all__ = ["GroupMember", "interface_towards", "looks_collective"]

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
"""The environment variable that names the interface gloo connects through."""

SIOCGIFADDR = 0x8915
"""Linux's ioctl for an interface's IPv4 address."""


class GroupMember:
    """The rendezvous (on replica 0) and the process group of this daemon.

    What trains over the group — a replica's plan (:mod:`engine.data_parallel.replica`), a linked
    stage's (:mod:`engine.pipeline.linked_stage`) — is dropped with it: each registers with
    :meth:`on_leave`.

    Args:
        device: the engine's device (NCCL binds the group to it).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._server: StoreServer | None = None  # the rendezvous, on replica 0 only
        self._store: AuthenticatedStore | None = None  # this member's connection to it
        self._store_at: tuple[str, int] | None = None
        self._rank = 0
        self._world = 1
        self._dropped_with_group: list[Callable[[], None]] = []
        self._last_left: object | None = None  # the group left last, kept: see _left_group
        self._broken = False  # a group that broke here, to close (release_broken)
        self._chose_interface = False  # GLOO_SOCKET_IFNAME is this member's choice, not set

    @property
    def rank(self) -> int:
        """This member's rank in the group it last joined."""
        return self._rank

    @property
    def world(self) -> int:
        """The size of the group it last joined."""
        return self._world

    def on_leave(self, drop: Callable[[], None]) -> None:
        """Call ``drop`` whenever this member leaves a group (and before it joins one): what
        ``drop`` forgets was made for that group."""
        self._dropped_with_group.append(drop)

    def open_store(self, secret: str, address: str, timeout: float) -> int:
        """Open the group's store on a free port of ``address`` (where it is one of this
        machine's: the address the others dial; else every interface), for holders of
        ``secret`` only; returns the port."""
        self.leave()
        self._server = StoreServer(secret, address, timeout)
        return self._server.port

    @staticmethod
    def probe(host: str, port: int, timeout: float) -> dict[str, Any]:
        """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return {"reachable": True, "error": None}
        except OSError as exc:
            return {"reachable": False, "error": f"{type(exc).__name__}: {exc}"}

    def join(
        self,
        host: str,
        port: int,
        secret: str,
        prefix: str,
        *,
        backend: str,
        rank: int,
        world: int,
        timeout: float,
    ) -> dict[str, Any]:
        """Join the group as ``rank`` of ``world`` (leaving any earlier one) through the store
        at ``host:port``, proving ``secret``.

        Raises:
            EngineError: ``COLLECTIVE_FAILED`` when the group does not form within ``timeout``.
        """
        self._left_group()
        wait = datetime.timedelta(seconds=timeout)
        if backend == "gloo" and (self._chose_interface or GLOO_INTERFACE not in os.environ):
            self._choose_interface(host, port)
        try:
            store = self._store
            if store is None or self._store_at != (host, port):  # a store of another group
                if store is not None:
                    store.close()
                store = self._store = AuthenticatedStore(host, port, secret, timeout)
                self._store_at = (host, port)
            dist.init_process_group(
                backend,
                store=PrefixStore(prefix, store),
                rank=rank,
                world_size=world,
                timeout=wait,
                device_id=self.device if backend == "nccl" else None,
            )
        except (RuntimeError, dist.DistError, StoreRefused) as exc:
            raise self.broken(f"joining the group as rank {rank} of {world}", exc) from exc
        self._rank, self._world = rank, world
        return {"backend": backend}

    def _choose_interface(self, host: str, port: int) -> None:
        """Have gloo connect through the interface that reaches ``host`` (module docstring)."""
        name = interface_towards(host, port)
        if name is None:
            os.environ.pop(GLOO_INTERFACE, None)
            self._chose_interface = False
        else:
            os.environ[GLOO_INTERFACE] = name
            self._chose_interface = True

    def place(self) -> tuple[int, int]:
        """This member's rank and the group's size.

        Raises:
            EngineError: ``BAD_REQUEST`` when it is in no group (``dist_join`` first).
        """
        if not dist.is_initialized():
            raise EngineError(ErrorCode.BAD_REQUEST, "not in a process group: dist_join first")
        return self._rank, self._world

    def leave(self) -> None:
        """Leave the group and close the store (and this member's connection to it); nothing
        to leave is fine."""
        self._left_group()
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def _left_group(self) -> None:
        """What uses the group is dropped first (:meth:`on_leave`), then the group.

        The group left is kept until the next leave, so its last reference is never dropped
        while gloo's worker threads may still be releasing what its last collectives left (a
        comm hook's closures, the work's saved thread state): those releases take the GIL, and
        the group's destructor joins those threads holding it. Dropped then, the daemon hung
        (the destructor on the main thread) or aborted (on the worker thread itself: "Resource
        deadlock avoided"). By the next leave they have long been idle.
        """
        for drop in self._dropped_with_group:
            drop()
        if dist.is_initialized():
            left = dist.group.WORLD
            dist.destroy_process_group()
            self._last_left = left  # (the one before it goes now)

    def break_off(self) -> None:
        """Have the group this member saw break closed once the request that saw it has
        answered (:meth:`release_broken`): gloo tells a member that a peer died only where it
        talks to that peer, so the others of a ring wait out the collective timeout (60 s)
        unless the members that saw it close their connections too. For a group without a
        communication hook only (see :meth:`_left_group`)."""
        self._broken = True

    def release_broken(self) -> None:
        """Close a group :meth:`break_off` marked: what uses it dropped, the group left and its
        last reference dropped now, which closes its connections (every peer's wait on this
        member then fails at once)."""
        if not self._broken:
            return
        self._broken = False
        self._left_group()
        self._last_left = None
        gc.collect()  # what the failure's frames held of the group, in cycles

    def broken(
        self,
        where: str,
        exc: BaseException,
        steps_done: int = 0,
        detail: dict[str, Any] | None = None,
    ) -> EngineError:
        """``COLLECTIVE_FAILED`` at ``where``, with ``steps_done``: the steps this member
        completed in the group's current work, which an elastic job brings the members back
        to; and what else the member says of where it stands (``detail``)."""
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        return EngineError(
            ErrorCode.COLLECTIVE_FAILED,
            f"the torch collective broke at {where}: {type(exc).__name__}: {first_line}",
            {"steps_done": steps_done} | (detail or {}),
        )


def interface_towards(host: str, port: int) -> str | None:
    """The name of this machine's network interface whose IPv4 address the kernel routes to
    ``host`` from; ``None`` when there is no such route or interface, or the system cannot say
    (not Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # a UDP "connection" sends nothing: it picks the route
            address = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _address_of(name) == address:
            return name
    return None


def _address_of(interface: str) -> str | None:
    """The IPv4 address of ``interface``; ``None`` without one."""
    request = struct.pack("256s", interface[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def looks_collective(exc: BaseException) -> bool:
    """An error raised by the group (gloo, NCCL, a closed peer, a timeout) rather than by user
    code: torch raises some transport failures as plain ``RuntimeError``."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return dist.is_initialized() and any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "peer")
    )
