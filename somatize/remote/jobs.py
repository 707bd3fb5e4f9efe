"""A submitted job as the SDK shows it: its handle (:class:`Job`) and its events.

A :class:`Job` follows its job over its client's connection: the events as the coordinator
recorded them, the job's end, and the trained states once it succeeded, as a
:class:`~somatize.graph.FittedGraph` like the one ``graph.fit(x, y)`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from protocol.arrays import tree_map
from protocol.codec import decode
from protocol.errors import ErrorCode, FrameError
from protocol.files.shard_pieces import PiecesMismatch, joined
from protocol.messages import (
    MAX_READ_BYTES,
    Ack,
    Cancel,
    GetCheckpoint,
    GetJob,
    GetResult,
    Result,
)
from somatize.errors import ClientError, ConnectionFailed, GraphError, JobFailed
from somatize.remote.connection import MARGIN

if TYPE_CHECKING:
    from pydantic import BaseModel

    from somatize.graph import FittedGraph, Graph
    from somatize.remote.connection import LoopThread

T = TypeVar("T")

TERMINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled"})
"""The events that end a job (and its event stream)."""


class JobsConnection(Protocol):
    """What a :class:`Job` asks of the connection it follows its job over (a
    :class:`~somatize.remote.client.Client`'s)."""

    timeout: float
    _loop: LoopThread

    def _call(
        self, message: BaseModel, timeout: float | None = None, allowance: float = 0.0
    ) -> Any: ...

    def _watch(self, job_id: str, after_seq: int) -> AsyncGenerator[JobEventInfo, None]: ...

    async def _until_end(self, job_id: str, timeout: float | None) -> JobEventInfo | None: ...  # noqa: ASYNC109


@dataclass(frozen=True)
class JobEventInfo:
    """One event of a job, as the coordinator recorded it.

    Attributes:
        seq: position in the job's events, from 1.
        time: when it happened (Unix seconds).
        event: ``"queued"``, ``"placed"``, ``"progress"``, ``"succeeded"``, ``"failed"`` or
            ``"cancelled"``; an elastic job also tells ``"worker_lost"``,
            ``"worker_replaced"`` and ``"worker_restored"``.
        data: what the event says (``{"workers": [...]}`` when placed; ``phase``, ``epoch``,
            ``step``, ``loss``... on progress; ``code``, ``message``, ``detail`` when failed;
            ``worker``, ``replica``, ``step`` and ``lost`` or ``from`` for a replica).
    """

    seq: int
    time: float
    event: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        """The job ended with this event."""
        return self.event in TERMINAL_EVENTS


def failure_of(job_id: str, end: JobEventInfo) -> JobFailed:
    """The :class:`JobFailed` of a job that ended with a ``failed`` or ``cancelled`` event."""
    data = end.data
    code = data.get("code") or ("cancelled" if end.event == "cancelled" else "failed")
    message = data.get("message") or data.get("reason") or f"the job ended {end.event}"
    detail = data.get("detail")
    return JobFailed(job_id, str(code), str(message), detail if isinstance(detail, dict) else {})


@dataclass(frozen=True)
class JobCheckpoint:
    """One checkpoint of a job, as fetched (:meth:`Job.checkpoint`).

    Attributes:
        seq: its number (1, 2, ... per job).
        position: where the run stood: ``{"step": 40, "epoch": 2}``, ``{"round": 3}``.
        states: by node id: every node's state (DataParallel, ModelParallel), the
            differentiable nodes' global state (FedAvg/FedProx).
    """

    seq: int
    position: dict[str, Any]
    states: dict[str, Any]

    def fitted(self, graph: Graph) -> FittedGraph:
        """The graph as it stood at this checkpoint: predict with it, save it, as a result.

        Raises:
            GraphError: ``states`` does not hold every node of ``graph``.
        """
        from somatize.graph import FittedGraph  # (torch: imported when a graph is rebuilt)

        return FittedGraph(graph, dict(self.states))


class Job:
    """A submitted job: follow it, cancel it, fetch what it learned.

    Attributes:
        id: the job's id on the coordinator.
        graph: the graph the job trains, when this handle knows it (see :meth:`Client.job`).
        notes: said when it was submitted: why its strategy will not equal ``graph.fit``
            exactly (DataParallel over BatchNorm or Dropout: :mod:`protocol.rules.equivalence`).
    """

    def __init__(
        self,
        client: JobsConnection,
        job_id: str,
        graph: Graph | None = None,
        notes: list[str] | None = None,
    ) -> None:
        self._client = client
        self.id = job_id
        self.graph = graph
        self.notes = list(notes or [])

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def events(self, *, after_seq: int = 0, timeout: float | None = None) -> Iterator[JobEventInfo]:
        """The job's events in order, from its first (or after ``after_seq``) to its end.

        Events already recorded are replayed; the iterator then follows the job live and stops
        after the terminal event (``succeeded``, ``failed`` or ``cancelled``).

        Args:
            after_seq: skip the events up to this sequence number.
            timeout: most seconds to wait for each event (``None``: as long as the job runs and
                the connection lives).

        Raises:
            TimeoutError: no event within ``timeout``.
            ConnectionFailed: the connection was lost.
        """
        stream = self._client._watch(self.id, after_seq)

        async def step() -> JobEventInfo | None:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

        loop = self._client._loop
        try:
            while True:
                wait = None if timeout is None else timeout + MARGIN
                try:
                    event = loop.run(_bounded(step(), timeout), wait, f"events of job {self.id}")
                except TimeoutError:
                    raise TimeoutError(
                        f"job {self.id}: no event within {timeout:g} s"
                        if timeout is not None
                        else f"job {self.id}: the event stream stalled"
                    ) from None
                if event is None:
                    return
                yield event
                if event.terminal:
                    return
        finally:
            with contextlib.suppress(Exception):
                loop.run(stream.aclose(), self._client.timeout, "closing the event stream")

    def wait(self, timeout: float | None = None) -> JobEventInfo:
        """Wait for the job to end and return its terminal event (without raising on failure).

        Raises:
            TimeoutError: the job did not end within ``timeout`` seconds.
            ConnectionFailed: the connection was lost.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must not be negative, not {timeout!r}")
        wait = None if timeout is None else timeout + MARGIN
        end = self._client._loop.run(
            self._client._until_end(self.id, timeout), wait, f"waiting for job {self.id}"
        )
        if end is None:
            raise ClientError(f"the event stream of job {self.id} ended before the job did")
        return end

    def states(self, timeout: float | None = None) -> dict[str, Any]:
        """The trained state of every node, by node id, once the job succeeded.

        Args:
            timeout: most seconds to wait for the job to end (``None``: until it ends; ``0``:
                do not wait, the job must have finished).

        Raises:
            JobFailed: the job failed or was cancelled.
            TimeoutError: the job did not end within ``timeout`` seconds.
            ClientError: the coordinator does not know the job.
        """
        return self._states(self._fetch(timeout))

    def result(self, timeout: float | None = None, *, graph: Graph | None = None) -> FittedGraph:
        """The trained graph, once the job succeeded: what ``graph.fit(x, y)`` returns.

        Args:
            timeout: as in :meth:`states`.
            graph: the job's graph, when this handle does not know it (:meth:`Client.job`).

        Raises:
            GraphError: the handle has no graph (fetched by id): use :meth:`states` or pass it.
            JobFailed: the job failed or was cancelled.
            TimeoutError: the job did not end within ``timeout`` seconds.
        """
        graph = graph if graph is not None else self.graph
        if graph is None:
            raise GraphError(
                f"job {self.id} was opened by id, so its graph is unknown here: use "
                "job.states() for the states by node id, or pass the graph "
                "(job.result(graph=graph) or client.job(id, graph=graph))"
            )
        from somatize.graph import FittedGraph  # (torch: imported when a result is rebuilt)

        reply = self._fetch(timeout)
        result, states = reply.result, self._states(reply)
        history, validations = (
            _trained_rows(result, "history"),
            _trained_rows(result, "validations"),
        )
        return FittedGraph(graph, states, history=history, validations=validations)

    def _states(self, reply: Result) -> dict[str, Any]:
        """The states by node of ``reply`` to ``get_result``: as they came; or, of a sharded
        run, each replica's pieces asked for in turn and joined here (:func:`joined_states`)."""
        if not (isinstance(reply.result, dict) and "pieces" in reply.result):
            states: dict[str, Any] = _writable(dict(result_field(reply, "states", "get_result")))
            return states
        kept = reply.result["pieces"]
        sizes = kept.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != int(kept["replicas"]):
            raise ClientError(f"the coordinator's answer to get_result lists sizes {sizes!r}")
        return joined_states(kept, [self._pieces_of(r, size) for r, size in enumerate(sizes)])

    def _pieces_of(self, replica: int, size: int) -> Any:
        """A sharded run's replica's pieces: its file read in pieces and decoded here."""

        def ask(offset: int, length: int) -> Any:
            asked = GetResult(job_id=self.id, replica=replica, offset=offset, length=length)
            return self._client._call(asked)

        frame = read_in_pieces(ask, size, "get_result", f"replica {replica}'s pieces")
        try:
            return decode(frame)  # (over a bytearray: writable tensors, no copy)
        except FrameError as exc:
            raise ClientError(f"replica {replica}'s pieces of the result: {exc}") from exc

    def _fetch(self, timeout: float | None) -> Result:
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must not be negative, not {timeout!r}")
        if timeout != 0:
            end = self.wait(timeout)
            if end.event != "succeeded":
                raise failure_of(self.id, end)
        wait = 0.0 if timeout == 0 else self._client.timeout / 2
        try:
            reply = self._client._call(
                GetResult(job_id=self.id, wait=wait), self._client.timeout + wait
            )
        except ClientError as exc:
            if exc.code == ErrorCode.NOT_FINISHED:
                raise TimeoutError(f"job {self.id} has not finished: {exc.message}") from None
            if isinstance(exc, ConnectionFailed) or exc.code == ErrorCode.UNKNOWN_JOB:
                raise
            # The job ended without a result: its terminal event says how, in its own words.
            end = self.wait(self._client.timeout)
            if end.event != "succeeded":
                raise failure_of(self.id, end) from None
            raise
        if not isinstance(reply, Result) or not isinstance(reply.result, dict):
            raise ClientError(f"the coordinator answered get_result with {reply!r}")
        return reply

    def checkpoint(self, seq: int | None = None) -> JobCheckpoint:
        """One of the job's checkpoints (``None``: its newest), whatever its state: what a
        cancelled or failed job had learned, or where a running one stands.

        Raises:
            ClientError: ``no_checkpoint`` (saying which it has), ``unknown_job``.
        """
        reply = self._client._call(GetCheckpoint(job_id=self.id, seq=seq))
        sharded = isinstance(reply, Result) and isinstance(reply.result, dict)
        if sharded and "shards" in reply.result:  # a sharded run's: its shards joined here
            from somatize.remote.sharded_checkpoints import whole_states  # (torch: imported here)

            found = int(result_field(reply, "seq", "get_checkpoint"))
            listed = reply.result["shards"].get("files", {})

            def fetch(name: str) -> bytes | bytearray:
                def ask(offset: int, length: int) -> Any:
                    asked = GetCheckpoint(
                        job_id=self.id, seq=found, file=name, offset=offset, length=length
                    )
                    return self._client._call(asked)

                said = listed.get(name)
                if not isinstance(said, dict) or type(said.get("bytes")) is not int:
                    raise ClientError(f"the checkpoint's answer lists no size of its file {name}")
                data = read_in_pieces(ask, said["bytes"], "get_checkpoint", f"the file {name}")
                if hashlib.sha256(data).hexdigest() != said.get("sha256"):
                    raise ClientError(
                        f"checkpoint {found}'s file {name} came other than it was saved (its "
                        "SHA-256 differs)"
                    )
                return data

            states = whole_states(reply.result["shards"], fetch)
        else:
            states = _writable(dict(result_field(reply, "states", "get_checkpoint")))
        position = dict(result_field(reply, "position", "get_checkpoint"))
        return JobCheckpoint(int(result_field(reply, "seq", "get_checkpoint")), position, states)

    def cancel(self) -> None:
        """Cancel the job if it is queued or running (its end becomes ``cancelled``)."""
        reply = self._client._call(Cancel(job_id=self.id))
        if not isinstance(reply, Ack | Result):
            raise ClientError(f"the coordinator answered cancel with {reply!r}")

    def status(self) -> dict[str, Any]:
        """The job's record: ``id``, ``state``, ``strategy``, times, ``workers``, ``progress``,
        ``error``, ``summary``."""
        record = result_field(self._client._call(GetJob(job_id=self.id)), "record", "get_job")
        return dict(record)


def joined_states(kept: Mapping[str, Any], pieces: Sequence[Any]) -> dict[str, Any]:
    """A sharded run's states by node, joined here from every replica's ``pieces`` (in rank
    order) and what ``get_result`` said of them (``kept``: ``plain``, ``node_ids``;
    :mod:`protocol.files.shard_pieces`: the coordinator keeps them as the replicas held them).

    Raises:
        ClientError: the pieces are not of one model.
    """
    try:
        whole = joined(pieces)
        every = dict(kept["plain"]) | whole
        states: dict[str, Any] = _writable({node: every[node] for node in kept["node_ids"]})
    except (PiecesMismatch, KeyError, TypeError) as exc:
        raise ClientError(f"the sharded result's pieces cannot be joined: {exc}") from exc
    return states


def read_in_pieces(ask: Callable[[int, int], Any], size: int, request: str, what: str) -> bytearray:
    """The ``size`` bytes of a file the coordinator gives in pieces: ``ask(offset, length)``
    answers ``request`` with ``{"data": ...}``, at most ``length`` bytes from ``offset``, each
    asked for once the one before came (``what`` the file is, for the error).

    Raises:
        ClientError: a piece came as other than bytes, empty, or longer than asked for.
    """
    if type(size) is not int or size < 0:
        raise ClientError(f"the coordinator's answer to {request} gives {what} {size!r} bytes")
    data = bytearray(size)
    offset = 0
    while offset < size:
        length = min(MAX_READ_BYTES, size - offset)
        piece = result_field(ask(offset, length), "data", request)
        if not isinstance(piece, bytes | bytearray | memoryview) or not 0 < len(piece) <= length:
            got = len(piece) if isinstance(piece, bytes | bytearray | memoryview) else piece
            raise ClientError(
                f"the coordinator gave {what} at {offset} of {size} bytes as {got!r}, asked "
                f"for {length} bytes"
            )
        data[offset : offset + len(piece)] = piece
        offset += len(piece)
    return data


def result_field(reply: Any, key: str, request: str) -> Any:
    """``reply.result[key]`` of a reply to ``request``, or a :class:`ClientError` saying what
    the coordinator answered instead."""
    if not isinstance(reply, Result) or not isinstance(reply.result, dict):
        raise ClientError(f"the coordinator answered {request} with {reply!r}")
    if key not in reply.result:
        raise ClientError(f"the coordinator's answer to {request} has no {key!r}")
    return reply.result[key]


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float | None) -> T:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        return await coro


def _writable(value: Any) -> Any:
    """``value`` with its read-only numpy arrays copied.

    Arrays decoded from a small frame are views over immutable ``bytes``; a state handed to the
    user should behave like one ``graph.fit`` returned (writable, no torch warning on
    ``torch.as_tensor``). Torch tensors are always writable already.
    """
    return tree_map(_writable_leaf, value)


def _writable_leaf(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
        return leaf.copy()
    return leaf


def _trained_rows(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Rows a result's record carries in its run's last progress event (``phase``:
    ``"trained"``): its ``history`` (one per epoch or round) or its ``validations``
    (``validate_every``'s)."""
    record = result.get("record")
    progress = record.get("progress") if isinstance(record, dict) else None
    rows = progress.get(name) if isinstance(progress, dict) else None
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return [dict(row) for row in rows]
    return []
