"""``StrategyContext``: what a strategy sees of the workers of its job.

A strategy asks for fits, states and gradients by worker *index* and never touches a socket.
Every method is built on one primitive, :meth:`StrategyContext.call`, which runs one
filter-daemon command (a typed request of :mod:`protocol.daemon`) on one worker; two
implementations provide it:

* :class:`TransportContext` — live workers over their WebSocket connections (the agent forwards
  each command to the job's filter daemon);
* :class:`InMemoryContext` — in-process workers, each a :class:`worker.daemon.main.Daemon` over its
  own engine, every request and reply passing through the frame codec as on the wire.

Both run the same strategies and the same conformance tests. Calls to different workers run
concurrently (``asyncio.gather``); calls to one worker are serialised by its daemon.

A failed call raises :class:`WorkerCallError` naming the worker, with the remote ``code``,
``message`` and ``detail`` (a filter's traceback, for one): remote failures are data, and the
strategy decides whether a round can go on without that worker.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.errors import NoReplacement, TargetError, WorkerCallError
from protocol.codec import decode, encode, frame_nbytes
from protocol.daemon import (
    ApplyGradientsRequest,
    BatchedFitRequest,
    CompositeFitRequest,
    DaemonRequest,
    GetGradientsRequest,
    GetOptimizerStateRequest,
    GetStateRequest,
    LoadRequest,
    SetOptimizerStateRequest,
    SetStateRequest,
    request_fields,
)
from protocol.errors import ErrorCode, ErrorInfo
from protocol.files.kept_files import file_parts, files_at
from protocol.filter_buffers import FilterBuffer, as_buffer
from protocol.options.devices import device_fits

if TYPE_CHECKING:
    from protocol.asyncio.channel import Pacer
    from protocol.chunking import StreamSink

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "FrameHandler",
    "InMemoryContext",
    "NoReplacement",
    "StrategyContext",
    "Target",
    "TargetError",
    "WorkerCallError",
    "WorkerIdentity",
]

DEFAULT_CALL_TIMEOUT = 600.0
"""Seconds one command may take on a worker unless the job says otherwise."""


@dataclass(frozen=True)
class WorkerIdentity:
    """A worker as strategies know it: an id, tags that partitions can be pinned to, its local
    datasets, the device it trains on (``"cpu"``, ``"cuda:N"``, ``"mps"``) and the address
    other workers reach it at (``None``: not known, as for in-process workers)."""

    id: str
    tags: frozenset[str] = field(default_factory=frozenset)
    datasets: Mapping[str, int | None] = field(default_factory=dict)  # name → rows (None: unknown)
    device: str = "cpu"
    host: str | None = None
    sandbox: str = ""  # what job code runs inside there ("bwrap", "uid", "none"; "": unsaid)
    network: bool = True  # whether job code there shares the machine's network


@dataclass(frozen=True)
class Target:
    """Where a partition must run: a worker ``id``, or any worker carrying ``tag`` (neither: any
    worker, as a pipeline's spares); on a worker training on ``device`` if one is given
    (``"cuda"``: any CUDA device), serving ``dataset`` if one is given (a stage that reads the
    job's ``WorkerData``)."""

    id: str | None = None
    tag: str | None = None
    device: str | None = None
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.id is not None and self.tag is not None:
            raise ValueError("a target names at most one of a worker id or a tag")

    def __str__(self) -> str:
        where = (
            f"worker {self.id!r}"
            if self.id is not None
            else f"tag {self.tag!r}"
            if self.tag is not None
            else "any worker"
        )
        if self.device is not None:
            where += f" on {self.device}"
        return where if self.dataset is None else f"{where} serving dataset {self.dataset!r}"

    def answers(self, worker: WorkerIdentity) -> bool:
        """Whether ``worker`` may run what is pinned here."""
        if not device_fits(self.device, worker.device):
            return False
        if self.dataset is not None and self.dataset not in worker.datasets:
            return False
        if self.id is not None:
            return worker.id == self.id
        return self.tag is None or self.tag in worker.tags


class StrategyContext(ABC):
    """The workers of one job, by index, and the commands a strategy can run on them."""

    def __init__(self, workers: Sequence[WorkerIdentity], timeout: float = DEFAULT_CALL_TIMEOUT):
        self.workers = list(workers)
        self.timeout = timeout

    def num_workers(self) -> int:
        """How many workers the job has."""
        return len(self.workers)

    def observe(self, cmd: str, seconds: float) -> None:  # noqa: B027 (a hook: no-op here)
        """A measurement for the coordinator's metrics (``somatize_worker_call_seconds``):
        a command's round trip, or the job's own work named so (nothing here)."""

    #: Whether workers can pass tensors to each other (:meth:`links`, ``routed`` calls).
    supports_peer_links = False

    #: Whether each worker's daemon is a process of its own that can join a torch.distributed
    #: group (in-process workers share one process, and so cannot).
    supports_process_groups = False

    @abstractmethod
    async def call(
        self,
        worker_idx: int,
        request: DaemonRequest,
        *,
        pace: Pacer | None = None,
        sink: StreamSink | None = None,
        relayed: bool = False,
    ) -> Any:
        """Run one daemon command (a :mod:`protocol.daemon` request) on a worker and return
        its result.

        Args:
            worker_idx: the worker.
            request: the command.
            pace: the request holds bytes still being written (a mean being folded): it is
                sent as they become final (:class:`~protocol.asyncio.channel.Pacer`).
            sink: where the reply's frame lands as it arrives
                (:class:`~protocol.chunking.StreamSink`).
            relayed: the result's tensors stay the bytes they came as
                (:class:`~protocol.arrays.RelayedTensor`): for a result the coordinator only
                passes on (into the job's result, a checkpoint, another worker) and never
                computes on, so that it need not import torch (a second or more of CPU) for it.
                Without it they are torch tensors.

        Raises:
            WorkerCallError: the command failed there, timed out, or the worker was lost.
        """

    async def routed(
        self,
        worker_idx: int,
        request: DaemonRequest,
        *,
        input_from: str | None = None,
        input_field: str = "x",
        output_to: tuple[int, str] | None = None,
        seq: int | None = None,
    ) -> Any:
        """A command whose input comes from, or whose result goes to, another worker's mailbox
        (``output_to``: the receiving worker's index and the key), not through the strategy.
        With ``seq`` (0, 1, 2, ... per worker and job) the worker runs such commands strictly
        in that order, so a caller may send many at once (:class:`~protocol.messages.Call`).

        Raises:
            NotImplementedError: this context cannot pass tensors between workers.
        """
        raise NotImplementedError(f"{type(self).__name__} has no peer links")

    async def links(self, worker_idx: int, expects: Mapping[int, str]) -> dict[str, Any]:
        """Tell a worker which workers it exchanges tensors with (the keys of ``expects``) and
        the prefix of the mailbox keys each may deliver to it (a delivery from any other
        worker, or to any other key, is refused); ``{"direct", "relay"}``."""
        raise NotImplementedError(f"{type(self).__name__} has no peer links")

    async def call_keeping(
        self,
        worker_idx: int,
        request: DaemonRequest,
        keep: Sequence[str],
        *,
        relayed: bool = False,
    ) -> Any:
        """:meth:`call`, the files in its result at the keys ``keep`` (``{name: bytes}``) left
        on the worker: in their place the result holds ``{"kept": id, "files": {name: size}}``
        for :meth:`read_kept` and :meth:`drop_kept` (:attr:`protocol.messages.Call.keep`);
        ``relayed`` as :meth:`call`'s.

        Raises:
            NotImplementedError: this context's workers keep no files.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no files on its workers")

    async def read_kept(
        self, worker_idx: int, kept: str, name: str, offset: int, length: int
    ) -> bytes:
        """Bytes ``[offset, offset + length)`` of file ``name`` a :meth:`call_keeping` left on
        the worker under ``kept`` (fewer where it ends)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no files on its workers")

    async def drop_kept(self, worker_idx: int, kept: str) -> None:
        """Remove the files a :meth:`call_keeping` left on the worker under ``kept``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no files on its workers")

    async def load(self, worker_idx: int, filters: Mapping[str, FilterBuffer]) -> None:
        """Load the job's pickled filters (node id → bytes, graph order) on a worker."""
        buffers = {node: as_buffer(data) for node, data in filters.items()}
        await self.call(worker_idx, LoadRequest(filters=buffers))

    async def execute_on_worker(
        self,
        worker_idx: int,
        node_ids: Sequence[str],
        x: Any,
        y: Any = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """Train the chain ``node_ids`` on a worker to completion; returns what the fit gave
        (``states``, ``loss``, ``epoch_losses``, ``history``, ``rows``; ``output`` is not sent
        back)."""
        request = BatchedFitRequest(
            node_ids=list(node_ids), x=x, y=y, batch_size=batch_size, return_output=False
        )
        result: dict[str, Any] = await self.call(worker_idx, request)
        result.pop("output", None)
        return result

    async def get_state(
        self, worker_idx: int, node_ids: Sequence[str], *, relayed: bool = False
    ) -> dict[str, Any]:
        """States of ``node_ids`` on a worker, read over the wire now (``relayed``: to be
        passed on only, as :meth:`call`'s)."""
        states: dict[str, Any] = await self.call(
            worker_idx, GetStateRequest(node_ids=list(node_ids)), relayed=relayed
        )
        return states

    async def state_digests(self, worker_idx: int, node_ids: Sequence[str]) -> dict[str, Any]:
        """The SHA-256 of each tensor of ``node_ids``' states on a worker (differentiable nodes
        only), read over the wire now: to compare workers' states without sending them."""
        digests: dict[str, Any] = await self.call(
            worker_idx, GetStateRequest(node_ids=list(node_ids), digests=True)
        )
        return digests

    async def set_state(self, worker_idx: int, states: Mapping[str, Any]) -> None:
        """Load states on a worker (what a later :meth:`get_state` there returns)."""
        await self.call(worker_idx, SetStateRequest(states=dict(states)))

    async def get_gradients(self, worker_idx: int, node_ids: Sequence[str]) -> dict[str, Any]:
        """Gradients left on a worker by its last gradient pass, by node and parameter."""
        grads: dict[str, Any] = await self.call(
            worker_idx, GetGradientsRequest(node_ids=list(node_ids))
        )
        return grads

    async def get_optimizer_state(
        self, worker_idx: int, node_ids: Sequence[str], *, relayed: bool = False
    ) -> dict[str, Any]:
        """The persistent optimizers of differentiable nodes on a worker, read now (node →
        ``state_dict()``, ``None`` before the first step; ``relayed`` as :meth:`call`'s)."""
        states: dict[str, Any] = await self.call(
            worker_idx, GetOptimizerStateRequest(node_ids=list(node_ids)), relayed=relayed
        )
        return states

    async def set_optimizer_state(self, worker_idx: int, states: Mapping[str, Any]) -> None:
        """Give a worker's nodes optimizers loaded with ``states`` (from
        :meth:`get_optimizer_state` on another worker)."""
        await self.call(worker_idx, SetOptimizerStateRequest(states=dict(states)))

    async def apply_gradients(
        self,
        worker_idx: int,
        gradients: Mapping[str, Any],
        pace: Pacer | None = None,
        epoch_end: bool = False,
    ) -> None:
        """Write gradients on a worker and step its persistent optimizers and schedulers
        (``epoch_end``: the step ends an epoch; ``pace``: as :meth:`call`'s)."""
        request = ApplyGradientsRequest(gradients=dict(gradients), epoch_end=epoch_end)
        await self.call(worker_idx, request, pace=pace)

    async def read_back_state(
        self, worker_idx: int, node_ids: Sequence[str], *, relayed: bool = False
    ) -> dict[str, Any]:
        """A worker's state read now, over the wire — never recalled from an earlier fit
        (``relayed`` as :meth:`call`'s).

        After ``apply_gradients`` the two differ: a recalled state would miss the last step.
        """
        return await self.get_state(worker_idx, node_ids, relayed=relayed)

    async def execute_partition(
        self, worker_idx: int, node_ids: Sequence[str], x: Any, y: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """One pass of part of the graph on a worker: its output and the states it learned."""
        result = await self.call(worker_idx, CompositeFitRequest(node_ids=list(node_ids), x=x, y=y))
        return result["output"], result["states"]

    async def replace(self, worker_idx: int, timeout: float) -> WorkerIdentity:  # noqa: ASYNC109
        """Put a fresh worker at ``worker_idx`` in place of a lost one, and return it.

        The replacement is an idle worker that matches the job's placement — a new one, or the
        lost one reconnecting — reserved for this job from then on. Nothing is loaded on it:
        the strategy brings it to where the others are.

        Raises:
            NoReplacement: none came within ``timeout`` seconds (or this context has none).
        """
        raise NoReplacement(f"{type(self).__name__} cannot replace workers")

    def swap(self, a: int, b: int) -> None:
        """Exchange the workers at indices ``a`` and ``b`` (a spare takes a lost one's place:
        a strategy that runs stage ``s`` on worker ``s`` goes on unchanged)."""
        self.workers[a], self.workers[b] = self.workers[b], self.workers[a]

    def worker_for(self, target: Target) -> int:
        """The index of the worker that answers to ``target`` (by id, or the first with the tag).

        Raises:
            TargetError: no worker matches; the message lists the ids and tags that exist.
        """
        for idx, worker in enumerate(self.workers):
            if target.answers(worker):
                return idx
        ids = [w.id for w in self.workers]
        tags = sorted(set(itertools.chain.from_iterable(w.tags for w in self.workers)))
        raise TargetError(f"no worker answers to {target}: workers {ids}, tags {tags}")


class FrameHandler(Protocol):
    """What an in-memory worker is: a request frame in, reply frame parts out
    (:class:`worker.daemon.main.Daemon` is one)."""

    def respond(self, frame: bytes | bytearray | memoryview) -> list[bytes | memoryview]: ...


class InMemoryContext(StrategyContext):
    """Workers that are in-process daemons: the real command handling, no processes or sockets.

    Each request and reply goes through the frame codec, as on the wire, so a strategy gets
    copies, never the worker's live tensors; always torch tensors (a call's ``relayed`` is
    ignored: the daemons in this process imported torch, and what the strategy gives back is
    the caller's result). Commands run in threads: calls to different workers overlap as they
    would across machines.

    Args:
        workers: the workers' identities, or how many anonymous ones (``mem-0``, ``mem-1``...).
        make_daemon: makes one worker's daemon; pass :class:`worker.daemon.main.Daemon` (the
            coordinator does not import worker code itself).
        timeout: seconds one command may take.
        spares: how many more workers :meth:`replace` can bring in (``mem-N``, ``mem-N+1``...)
            in place of workers lost with :meth:`lose`.
    """

    def __init__(
        self,
        workers: Sequence[WorkerIdentity] | int,
        make_daemon: Callable[[], FrameHandler],
        timeout: float = DEFAULT_CALL_TIMEOUT,
        spares: int = 0,
    ) -> None:
        if isinstance(workers, int):
            workers = [WorkerIdentity(f"mem-{i}") for i in range(workers)]
        super().__init__(workers, timeout)
        self.make_daemon = make_daemon
        self.daemons = [make_daemon() for _ in self.workers]
        self.spares = spares
        self._gone: dict[str, str] = {}  # worker id → why it is lost
        self._locks = [asyncio.Lock() for _ in self.workers]
        self._ids = itertools.count(1)
        self._names = itertools.count(len(self.workers))
        self._kept: dict[tuple[str, str], dict[str, bytes]] = {}  # (worker, id) → files

    def lose(self, worker_idx: int, reason: str = "its connection closed") -> None:
        """The in-memory counterpart of a worker's connection closing: the call it is running
        (whose reply is thrown away) and every later one fail with ``worker_lost``."""
        self._gone[self.workers[worker_idx].id] = reason

    async def replace(self, worker_idx: int, timeout: float) -> WorkerIdentity:  # noqa: ASYNC109
        if self.spares <= 0:
            await asyncio.sleep(timeout)  # nothing can arrive: wait as a live context would
            raise NoReplacement(f"no worker came within {timeout:g}s")
        self.spares -= 1
        identity = WorkerIdentity(f"mem-{next(self._names)}")
        self.workers[worker_idx] = identity
        self.daemons[worker_idx] = self.make_daemon()
        self._locks[worker_idx] = asyncio.Lock()
        return identity

    def swap(self, a: int, b: int) -> None:
        super().swap(a, b)
        self.daemons[a], self.daemons[b] = self.daemons[b], self.daemons[a]
        self._locks[a], self._locks[b] = self._locks[b], self._locks[a]

    async def call(
        self,
        worker_idx: int,
        request: DaemonRequest,
        *,
        pace: Pacer | None = None,
        sink: StreamSink | None = None,
        relayed: bool = False,
    ) -> Any:
        worker = self.workers[worker_idx]
        parts = encode({**request_fields(request), "id": next(self._ids)})
        if pace is not None:  # the whole request must be final before it is copied
            await pace.bind(parts)(frame_nbytes(parts))
        frame = bytearray().join(parts)
        daemon = self.daemons[worker_idx]
        async with self._locks[worker_idx]:
            self._check_alive(worker, request.cmd)
            try:
                async with asyncio.timeout(self.timeout):
                    reply_frame = await asyncio.to_thread(self._run, daemon, frame)
            except TimeoutError:
                info = ErrorInfo(
                    code=ErrorCode.TIMEOUT,
                    message=f"{request.cmd} did not finish within {self.timeout}s",
                )
                raise WorkerCallError(worker.id, info) from None
            self._check_alive(worker, request.cmd)
        landed: bytearray | memoryview = reply_frame
        if sink is not None:  # it lands where the caller wants it, whole
            landed = sink.buffer(len(reply_frame))
            landed[:] = reply_frame
            sink.received(len(reply_frame))
        reply = decode(landed)  # (never relayed: the daemons here imported torch already)
        if not reply["ok"]:
            raise WorkerCallError(worker.id, ErrorInfo.model_validate(reply["error"]))
        return reply["result"]

    async def call_keeping(
        self,
        worker_idx: int,
        request: DaemonRequest,
        keep: Sequence[str],
        *,
        relayed: bool = False,
    ) -> Any:
        result = await self.call(worker_idx, request)
        worker = self.workers[worker_idx]
        try:
            parent, files = files_at(result, keep)
        except ValueError as exc:
            info = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"{request.cmd}'s reply: {exc}")
            raise WorkerCallError(worker.id, info) from None
        kept = f"{next(self._ids)}"
        written = {name: b"".join(file_parts(data)) for name, data in files.items()}
        self._kept[(worker.id, kept)] = written
        parent[keep[-1]] = {"kept": kept, "files": {n: len(d) for n, d in written.items()}}
        return result

    async def read_kept(
        self, worker_idx: int, kept: str, name: str, offset: int, length: int
    ) -> bytes:
        worker = self.workers[worker_idx]
        self._check_alive(worker, "read_kept")
        files = self._kept.get((worker.id, kept), {})
        if name not in files:
            info = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"no file {name!r} kept here")
            raise WorkerCallError(worker.id, info)
        return files[name][offset : offset + length]

    async def drop_kept(self, worker_idx: int, kept: str) -> None:
        self._kept.pop((self.workers[worker_idx].id, kept), None)

    def _check_alive(self, worker: WorkerIdentity, cmd: str) -> None:
        if worker.id in self._gone:
            reason = self._gone[worker.id]
            info = ErrorInfo(
                code=ErrorCode.WORKER_LOST,
                message=f"lost during {cmd}: {reason}",
                detail={"cmd": cmd, "reason": reason},
            )
            raise WorkerCallError(worker.id, info)

    @staticmethod
    def _run(daemon: FrameHandler, frame: bytearray) -> bytearray:
        # One copy into a writable buffer (decoded tensors are views over it), as on the wire.
        return bytearray().join(daemon.respond(frame))
