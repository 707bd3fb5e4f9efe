"""The client of a coordinator: submit jobs, follow them, fetch what they learned.

A synchronous API for scripts and notebooks over the coordinator's ``/client`` WebSocket::

    import somatize as sz

    with sz.connect("ws://127.0.0.1:8765") as client:
        job = client.submit(graph, x, y, strategy=sz.Local())
        for event in job.events():          # queued, placed, progress..., succeeded
            print(event.event, event.data)
        fitted = job.result()               # a FittedGraph, as graph.fit(x, y) returns

Under the sync surface, one background thread per :class:`Client` runs an event loop (uvloop when
it is installed) that owns the connection and its
:class:`~protocol.asyncio.channel.Channel`; each method hands a coroutine to that loop and waits for
it. Every wait is bounded: a request by the client's ``timeout`` (stretched for uploading a large
submission, and while a large reply keeps arriving); an event stream or a job's end by the caller's
``timeout`` and, when that is ``None``, by the connection's keepalive pings, so a coordinator that
dies or goes silent surfaces as :class:`~somatize.errors.ConnectionFailed` instead of a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import ssl
import threading
import time
import urllib.parse
from collections.abc import AsyncGenerator, Coroutine, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import torch
import websockets
from pydantic import BaseModel

from protocol.asyncio.channel import Channel
from protocol.errors import ChannelClosed, ErrorCode, ErrorInfo, ProtocolError, RemoteError
from protocol.filters import dump_filter
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Cancel,
    ClientHello,
    Error,
    GetJob,
    GetResult,
    GraphSpec,
    JobEvent,
    ListJobs,
    NodeInfo,
    Ping,
    Result,
    Shutdown,
    Status,
    Submit,
    Watch,
    Welcome,
)
from somatize.errors import ClientError, ConnectionFailed, GraphError, JobFailed
from somatize.graph import FittedGraph, Graph
from somatize.strategies import Local, Strategy, WorkerData

__all__ = [
    "TERMINAL_EVENTS",
    "Client",
    "Job",
    "JobEventInfo",
    "client_url",
    "connect",
    "failure_of",
]

T = TypeVar("T")

TERMINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled"})
"""The events that end a job (and its event stream)."""

_MARGIN = 5.0
"""Extra seconds the calling thread waits beyond a coroutine's own timeout, so that the
coroutine's clearer error, not the thread's, reports a timeout."""

_MIN_UPLOAD_RATE = 1e6
"""Bytes per second a submission is expected to upload at, at least: its reply timeout grows
by its size divided by this."""

_KEEPALIVE = 20.0
"""Seconds between keepalive pings, and to wait for their answer: a silent coordinator is
declared lost within twice this."""


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


def connect(
    url: str, token: str | None = None, *, timeout: float = 30.0, ca_file: str | None = None
) -> Client:
    """Connect to a coordinator.

    Args:
        url: ``ws://HOST:PORT`` or ``wss://HOST:PORT`` (``/client`` is appended when the URL has
            no path; a bare ``HOST:PORT`` means ``ws://``).
        token: the client token, sent as ``Authorization: Bearer <token>``.
        timeout: seconds to wait for the connection, and for each request's reply.
        ca_file: for ``wss://``, the certificate(s) to trust (default: the system's).

    Returns:
        A connected :class:`Client`; also a context manager that closes it.

    Raises:
        ConnectionFailed: the coordinator cannot be reached or refused the handshake.
        ValueError: a malformed URL, token or timeout.
    """
    return Client(url, token, timeout=timeout, ca_file=ca_file)


def client_url(url: str) -> str:
    """The ``/client`` WebSocket URL of a coordinator given as ``ws://HOST:PORT[/path]``."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a coordinator URL is a non-empty string, not {url!r}")
    url = url.strip()
    if "://" not in url:
        url = "ws://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(
            f"a coordinator URL starts with ws:// or wss://, not {parts.scheme}:// ({url!r})"
        )
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"bad port in the coordinator URL {url!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"no host in the coordinator URL {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/client"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An event loop running in a daemon thread, and a way to run coroutines on it."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self._main, name="somatize-client-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # What asyncio.run does on the way out: no task or generator left half-done.
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop and wait for it at most ``timeout`` seconds."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("the somatize client cannot be called from its own event loop")
        if not self._thread.is_alive():
            coro.close()
            raise ClientError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # (the built-in TimeoutError, since 3.11)
            if future.done():  # the coroutine's own timeout, or it ended just now
                return future.result()
            future.cancel()
            raise TimeoutError(f"{what}: no answer within {timeout:g} s") from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: stop the coroutine too
            raise

    def stop(self, timeout: float) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


class Client:
    """A connection to a coordinator (see :func:`connect`).

    Methods are synchronous and thread-safe. A request's reply must begin within ``timeout``
    seconds (plus time to upload a large submission); a large reply may take longer as long as
    its bytes keep coming.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        ca_file: str | None = None,
    ) -> None:
        if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        self.url = client_url(url)
        self.timeout = float(timeout)
        self.server = ""
        self._token = token
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._channel: Channel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._loop = _LoopThread()
        try:
            self._loop.run(self._open(), self.timeout + _MARGIN, f"connecting to {self.url}")
        except BaseException:
            self._loop.stop(self.timeout)
            self._closed = True
            raise

    # -- connection --------------------------------------------------------------------------

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            ws = await websockets.connect(
                self.url,
                **_tls(self.url, self._ssl),
                additional_headers=headers,
                compression=None,
                max_size=4 * CHUNK_BYTES,
                open_timeout=self.timeout,
                ping_interval=_KEEPALIVE,
                ping_timeout=_KEEPALIVE,
                close_timeout=min(self.timeout, 5.0),
            )
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            raise ConnectionFailed(
                f"cannot reach the coordinator at {self.url}: {_describe(exc, self.timeout)}"
            ) from exc
        channel = Channel(ws, "coordinator", self._handle)
        try:
            await channel.send(ClientHello(name="somatize"))
            async with asyncio.timeout(self.timeout):
                reply = await channel.receive(first=True)
        except BaseException as exc:
            await channel.close(1002, "handshake failed")
            if isinstance(exc, TimeoutError):
                raise ConnectionFailed(
                    f"the coordinator at {self.url} did not answer the hello within "
                    f"{self.timeout:g} s"
                ) from None
            if isinstance(exc, ProtocolError | websockets.exceptions.WebSocketException):
                raise ConnectionFailed(
                    f"the coordinator at {self.url} refused the connection: {exc}"
                ) from exc
            raise
        if not isinstance(reply, Welcome):
            await channel.close(1002, "handshake failed")
            if isinstance(reply, Error):
                raise ConnectionFailed(
                    f"the coordinator at {self.url} refused the connection: "
                    f"[{reply.error.code}] {reply.error.message}",
                    code=str(reply.error.code),
                    detail=reply.error.detail,
                )
            raise ConnectionFailed(
                f"the coordinator at {self.url} answered the hello with {reply.kind!r}, "
                "not 'welcome'"
            )
        self.server = reply.server
        self._channel = channel
        self._reader = asyncio.ensure_future(channel.run())

    async def _handle(self, message: Any) -> BaseModel | None:
        if isinstance(message, Shutdown):  # the connection closes next: say why when it does
            if self._channel is not None:
                self._channel.close_reason = f"the coordinator is shutting down: {message.reason}"
            return None
        raise RemoteError(
            ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"a client takes no {message.kind!r}")
        )

    def _lost(self, exc: BaseException) -> ConnectionFailed:
        return ConnectionFailed(f"lost the connection to the coordinator at {self.url}: {exc}")

    def _live_channel(self) -> Channel:
        if self._closed or self._channel is None:
            raise ClientError("the client is closed")
        return self._channel

    async def _request(
        self,
        message: BaseModel,
        timeout: float,  # noqa: ASYNC109
        allowance: float = 0.0,
    ) -> Any:
        """Send ``message`` and return its reply.

        The reply must come within ``timeout + allowance`` seconds (the allowance pays for
        sending a large request), except while a large reply is arriving: as long as at least a
        chunk's worth of bytes came in during the last ``timeout`` seconds, the wait goes on. A
        big result on a slow link is not cut off; a silent coordinator still times out.
        """
        channel = self._live_channel()
        kind = getattr(message, "kind", type(message).__name__)

        async def first_reply() -> Any:
            async for reply in channel.stream(message, None):
                return reply
            raise ChannelClosed("no reply")  # pragma: no cover - a stream always yields

        pending = asyncio.ensure_future(first_reply())
        try:
            window, seen = timeout + allowance, channel.bytes_in
            while True:
                done, _ = await asyncio.wait({pending}, timeout=window)
                if done:
                    return pending.result()
                if channel.bytes_in - seen < CHUNK_BYTES:
                    raise TimeoutError(
                        f"the coordinator at {self.url} did not answer {kind!r} within {window:g} s"
                    )
                window, seen = timeout, channel.bytes_in
        except RemoteError as exc:
            raise _client_error(exc.info) from None
        except ChannelClosed as exc:
            raise self._lost(exc) from None
        finally:
            pending.cancel()

    def _call(
        self, message: BaseModel, timeout: float | None = None, allowance: float = 0.0
    ) -> Any:
        """Send ``message`` and return its reply (``Result``/``Ack``), from any thread.

        The request bounds its own wait (see :meth:`_request`), so this thread waits for it.
        """
        timeout = self.timeout if timeout is None else timeout
        kind = getattr(message, "kind", "request")
        return self._loop.run(self._request(message, timeout, allowance), None, kind)

    def close(self) -> None:
        """Close the connection and stop the client's thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(Exception):
                self._loop.run(
                    channel.close(1000, "client closed"), self.timeout, "closing the connection"
                )
        self._loop.stop(self.timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Client({self.url!r}, {state})"

    # -- requests ----------------------------------------------------------------------------

    def submit(self, graph: Graph, x: Any, y: Any = None, strategy: Strategy | None = None) -> Job:
        """Queue a job: train ``graph`` on ``x`` (and labels ``y``) with ``strategy``.

        The filters travel pickled (:func:`protocol.filters.dump_filter`) as they are now, their
        modules' current weights being the initial weights; the data travels as raw tensors.

        Args:
            graph: the graph to train.
            x: input rows (numpy array or torch tensor).
            y: labels, row-aligned with ``x``.
            strategy: how to spread the job over workers (default :class:`Local`).

        Returns:
            The job's handle; its :meth:`Job.result` is a :class:`FittedGraph` of ``graph``.
        """
        if not isinstance(graph, Graph):
            raise TypeError(
                f"submit takes a somatize.Graph, not {type(graph).__name__} "
                "(make one with a >> b, or Graph([f]) for a single filter)"
            )
        strategy = Local() if strategy is None else strategy
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy must be a somatize strategy (Local...), not {type(strategy).__name__}"
            )
        filters = {}
        for node_id, f in graph.items():
            try:
                filters[node_id] = dump_filter(f)
            except Exception as exc:
                exc.add_note(f"while pickling the filter of node {node_id!r} for submission")
                raise
        dataset = x.name if isinstance(x, WorkerData) else None
        if dataset is not None:
            if y is not None:
                raise ValueError("with WorkerData the labels are the workers' own: y must be None")
            x = None
        message = Submit(
            graph=GraphSpec(node_ids=graph.node_ids, filters=filters, nodes=graph_info(graph)),
            x=x,
            y=y,
            dataset=dataset,
            strategy=strategy.spec(),
        )
        nbytes = sum(len(b) for b in filters.values()) + _nbytes(x) + _nbytes(y)
        reply = self._call(message, allowance=nbytes / _MIN_UPLOAD_RATE)
        job_id = _result_field(reply, "job_id", "submit")
        if not isinstance(job_id, str):
            raise ClientError(f"the coordinator answered submit with a job id {job_id!r}")
        return Job(self, job_id, graph)

    def job(self, job_id: str, graph: Graph | None = None) -> Job:
        """The handle of an existing job (submitted by anyone, any time).

        Args:
            job_id: the job.
            graph: the graph it trains, for :meth:`Job.result` to build a :class:`FittedGraph`;
                without it, use :meth:`Job.states`.
        """
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"a job id is a non-empty string, not {job_id!r}")
        return Job(self, job_id, graph)

    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest jobs' records, newest first (``id``, ``state``, ``strategy``, times...)."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, not {limit!r}")
        jobs = _result_field(self._call(ListJobs(limit=limit)), "jobs", "list_jobs")
        return list(jobs)

    def status(self) -> dict[str, Any]:
        """Workers (``id``, ``tags``, ``state``, ``last_heartbeat_age``, ``job_id``,
        ``capabilities``) and jobs at a glance."""
        reply = self._call(Status())
        if not isinstance(reply, Result) or not isinstance(reply.result, dict):
            raise ClientError(f"the coordinator answered status with {reply!r}")
        return dict(reply.result)

    def ping(self, worker_id: str | None = None) -> float:
        """Seconds of one no-op round trip: to the coordinator, or with ``worker_id`` on through
        that worker's agent to its filter daemon and back."""
        started = time.perf_counter()
        self._call(Ping(worker_id=worker_id))
        return time.perf_counter() - started

    # -- what Job uses -----------------------------------------------------------------------

    async def _watch(self, job_id: str, after_seq: int) -> AsyncGenerator[JobEventInfo, None]:
        channel = self._live_channel()
        try:
            async for message in channel.stream(
                Watch(job_id=job_id, after_seq=after_seq), timeout=None
            ):
                if isinstance(message, JobEvent):
                    yield JobEventInfo(message.seq, message.time, message.event, message.data)
        except RemoteError as exc:
            raise _client_error(exc.info) from None
        except ChannelClosed as exc:
            raise self._lost(exc) from None

    async def _until_end(self, job_id: str, timeout: float | None) -> JobEventInfo | None:  # noqa: ASYNC109
        end = None
        try:
            async with asyncio.timeout(timeout):
                async for event in self._watch(job_id, 0):
                    if event.terminal:
                        end = event
        except TimeoutError:
            if end is not None:  # only the closing ack was late
                return end
            raise TimeoutError(f"job {job_id} did not finish within {timeout} s") from None
        return end


def graph_info(graph: Graph) -> dict[str, NodeInfo]:
    """What the coordinator is told of each node (it never unpickles the filters): whether it
    trains by gradient descent, and then its training settings."""
    info = {}
    for node_id, f in graph.items():
        if getattr(f, "differentiable", False):
            info[node_id] = NodeInfo(
                differentiable=True,
                epochs=getattr(f, "epochs", None),
                batch_size=getattr(f, "batch_size", None),
                shuffle=getattr(f, "shuffle", None),
                seed=getattr(f, "seed", None),
            )
        else:
            info[node_id] = NodeInfo()
    return info


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the coordinator running?)"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, websockets.exceptions.InvalidStatus):
        status = exc.response.status_code
        if status in (401, 403):
            return f"HTTP {status}: the coordinator refused the token"
        if status == 503:  # too many connections waiting for their hello: a retry may pass
            said = (exc.response.body or b"").decode(errors="replace").strip()[:200]
            return f"HTTP 503: the coordinator is busy: {said}"
        return f"HTTP {status} (is this a somatize coordinator?)"
    return str(exc) or type(exc).__name__


def _client_error(info: ErrorInfo) -> ClientError:
    return ClientError(f"[{info.code}] {info.message}", code=str(info.code), detail=info.detail)


def _result_field(reply: Any, key: str, request: str) -> Any:
    if not isinstance(reply, Result) or not isinstance(reply.result, dict):
        raise ClientError(f"the coordinator answered {request} with {reply!r}")
    if key not in reply.result:
        raise ClientError(f"the coordinator's answer to {request} has no {key!r}")
    return reply.result[key]


def failure_of(job_id: str, end: JobEventInfo) -> JobFailed:
    """The :class:`JobFailed` of a job that ended with a ``failed`` or ``cancelled`` event."""
    data = end.data
    code = data.get("code") or ("cancelled" if end.event == "cancelled" else "failed")
    message = data.get("message") or data.get("reason") or f"the job ended {end.event}"
    detail = data.get("detail")
    return JobFailed(job_id, str(code), str(message), detail if isinstance(detail, dict) else {})


class Job:
    """A submitted job: follow it, cancel it, fetch what it learned.

    Attributes:
        id: the job's id on the coordinator.
        graph: the graph the job trains, when this handle knows it (see :meth:`Client.job`).
    """

    def __init__(self, client: Client, job_id: str, graph: Graph | None = None) -> None:
        self._client = client
        self.id = job_id
        self.graph = graph

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
                wait = None if timeout is None else timeout + _MARGIN
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
        wait = None if timeout is None else timeout + _MARGIN
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
        states: dict[str, Any] = _writable(
            dict(_result_field(self._fetch(timeout), "states", "get_result"))
        )
        return states

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
        result = self._fetch(timeout).result
        states = _writable(dict(_result_field(Result(result=result), "states", "get_result")))
        return FittedGraph(graph, states, epoch_losses=_epoch_losses(result))

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

    def cancel(self) -> None:
        """Cancel the job if it is queued or running (its end becomes ``cancelled``)."""
        reply = self._client._call(Cancel(job_id=self.id))
        if not isinstance(reply, Ack | Result):
            raise ClientError(f"the coordinator answered cancel with {reply!r}")

    def status(self) -> dict[str, Any]:
        """The job's record: ``id``, ``state``, ``strategy``, times, ``workers``, ``progress``,
        ``error``, ``summary``."""
        record = _result_field(self._client._call(GetJob(job_id=self.id)), "record", "get_job")
        return dict(record)


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float | None) -> T:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        return await coro


def _nbytes(value: Any) -> int:
    """Bytes of a numpy array or torch tensor (0 for anything else: it is small)."""
    if isinstance(value, torch.Tensor):
        return int(value.element_size() * value.nelement())
    nbytes = getattr(value, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) else 0


def _writable(value: Any) -> Any:
    """``value`` with its read-only numpy arrays copied.

    Arrays decoded from a small frame are views over immutable ``bytes``; a state handed to the
    user should behave like one ``graph.fit`` returned (writable, no torch warning on
    ``torch.as_tensor``). Torch tensors are always writable already.
    """
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, dict):
        return {k: _writable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_writable(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_writable(v) for v in value)
    return value


def _epoch_losses(result: dict[str, Any]) -> list[float] | None:
    """The epoch losses a result carries: its own, or its record's last progress or summary."""
    record = result.get("record")
    record = record if isinstance(record, dict) else {}
    for source in (result, record.get("progress"), record.get("summary")):
        losses = source.get("epoch_losses") if isinstance(source, dict) else None
        if isinstance(losses, list) and all(isinstance(v, int | float) for v in losses):
            return [float(v) for v in losses]
    return None


def _tls(url: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """``ssl=`` for :func:`websockets.connect`: a custom context for ``wss://`` only (the
    system's trust store otherwise)."""
    return {"ssl": context} if context is not None and url.startswith("wss:") else {}
