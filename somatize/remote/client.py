"""The client of a coordinator: submit jobs, follow them, fetch what they learned.

A synchronous API for scripts and notebooks over the coordinator's ``/client`` WebSocket::

    import somatize as sz

    with sz.connect("ws://127.0.0.1:8765") as client:
        job = client.submit(graph, x, y, strategy=sz.Local())
        for event in job.events():          # queued, placed, progress..., succeeded
            print(event.event, event.data)
        fitted = job.result()               # a FittedGraph, as graph.fit(x, y) returns

Under the sync surface, one background thread per :class:`Client` runs an event loop
(:mod:`somatize.remote.connection`) that owns the connection and its
:class:`~protocol.asyncio.channel.Channel`; each method hands a coroutine to that loop and waits for
it; a job's handle and its events are in :mod:`somatize.remote.jobs`. Every wait is bounded: a
request by the client's ``timeout`` (stretched for uploading a large submission, and while a large
reply keeps arriving); an event stream or a job's end by the caller's ``timeout`` and, when that is
``None``, by the connection's keepalive pings, so a coordinator that dies or goes silent surfaces as
:class:`~somatize.errors.ConnectionFailed` instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import ssl
import time
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from protocol.arrays import data_nbytes
from protocol.asyncio.channel import Channel
from protocol.errors import ChannelClosed, ErrorCode, ErrorInfo, RemoteError, RequestRefused
from protocol.filter_buffers import as_buffer
from protocol.filters import dump_filter
from protocol.messages import (
    CHUNK_BYTES,
    MAX_GRAPH_NODES,
    MAX_LISTED,
    SANDBOX_REQUIREMENTS,
    GetQueue,
    GraphSpec,
    JobEvent,
    ListJobs,
    NodeInfo,
    Ping,
    PruneJobs,
    Result,
    SandboxRequirement,
    Shutdown,
    Status,
    Submit,
    Watch,
)
from protocol.rules.equivalence import data_parallel_notes
from somatize.errors import ClientError, ConnectionFailed
from somatize.keywords import suggesting
from somatize.options.strategies import DataParallel, Local, Strategy, WorkerData
from somatize.remote.connection import MARGIN, LoopThread, client_url, dial, handshake
from somatize.remote.jobs import TERMINAL_EVENTS, Job, JobEventInfo, failure_of, result_field

if TYPE_CHECKING:
    from somatize.graph import Graph

__all__ = [
    "TERMINAL_EVENTS",
    "Client",
    "Job",
    "JobEventInfo",
    "client_url",
    "connect",
    "failure_of",
]

TOKEN_ENV = "SOMATIZE_TOKEN"
"""Where :func:`connect` finds the client token when it is not given one (as the CLI does)."""

_MIN_UPLOAD_RATE = 1e6
"""Bytes per second a submission is expected to upload at, at least: its reply timeout grows
by its size divided by this."""


@suggesting
def connect(
    url: str, token: str | None = None, *, timeout: float = 30.0, ca_file: str | None = None
) -> Client:
    """Connect to a coordinator.

    Args:
        url: ``ws://HOST:PORT`` or ``wss://HOST:PORT`` (``/client`` is appended when the URL has
            no path; a bare ``HOST:PORT`` means ``ws://``).
        token: the client token, sent as ``Authorization: Bearer <token>`` (default:
            ``$SOMATIZE_TOKEN``, if it is set and not empty).
        timeout: seconds to wait for the connection, and for each request's reply.
        ca_file: for ``wss://``, the certificate(s) to trust (default: the system's).

    Returns:
        A connected :class:`Client`; also a context manager that closes it.

    Raises:
        ConnectionFailed: the coordinator cannot be reached or refused the handshake.
        ValueError: a malformed URL, token or timeout.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return Client(url, token, timeout=timeout, ca_file=ca_file)


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
        self._ca_file = ca_file
        self._channel: Channel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._loop = LoopThread()
        try:
            self._loop.run(self._open(), self.timeout + MARGIN, f"connecting to {self.url}")
        except BaseException:
            self._loop.stop(self.timeout)
            self._closed = True
            raise

    # -- connection --------------------------------------------------------------------------

    async def _open(self) -> None:
        ws = await dial(self.url, self._token, self._ssl, self.timeout, self._ca_file)
        channel = Channel(ws, "coordinator", self._handle)
        welcome = await handshake(channel, self.url, self.timeout)
        self.server = welcome.server
        self._channel = channel
        self._reader = asyncio.ensure_future(channel.run())

    async def _handle(self, message: Any) -> BaseModel | None:
        if isinstance(message, Shutdown):  # the connection closes next: say why when it does
            if self._channel is not None:
                self._channel.close_reason = f"the coordinator is shutting down: {message.reason}"
            return None
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, f"a client takes no {message.kind!r}")

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
            raise _client_error(exc.info) from exc
        except ChannelClosed as exc:
            raise self._lost(exc) from exc
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

    # The SDK's public keyword API: each argument a documented keyword of its own.
    @suggesting
    def submit(  # noqa: PLR0913
        self,
        graph: Graph,
        x: Any,
        y: Any = None,
        strategy: Strategy | None = None,
        validation: tuple[Any, Any] | WorkerData | None = None,
        *,
        wait_for_workers: float | None = None,
        name: str | None = None,
        file: str | None = None,
        resume_from: str | Job | None = None,
        sandbox: SandboxRequirement = "any",
        priority: int = 0,
        preemptible: bool = True,
        time_limit: float | None = None,
        slots: int = 1,
    ) -> Job:
        """Queue a job: train ``graph`` on ``x`` (and labels ``y``) with ``strategy``.

        The filters travel pickled (:func:`protocol.filters.dump_filter`) as they are now, their
        modules' current weights being the initial weights; the data travels as raw tensors.

        Args:
            graph: the graph to train.
            x: input rows (numpy array or torch tensor).
            y: labels, row-aligned with ``x``.
            strategy: how to spread the job over workers (default :class:`Local`).
            validation: ``(x_val, y_val)``, sent with the job, or ``sz.WorkerData(name,
                split="val")``, each worker's own split of the dataset it trains on: the
                model is evaluated on it at the end of every epoch (every round for
                FedAvg/FedProx), its ``val_loss`` and metrics in the job's events and in the
                result's ``history``.
            wait_for_workers: ``None`` (default): a worker id, tag, dataset or device that no
                registered worker has is refused at once (``no_workers``, with the nearest
                names); seconds: the job waits that long for workers that can take it (ones
                yet to register included), then fails ``no_workers``.
            name: what the job list calls the job (``somatize jobs``, the status page).
            file: the job file it came from (``somatize submit`` gives it).
            resume_from: a job (or its id) to continue: this one starts from that job's newest
                checkpoint — its end, when it succeeded — every node's state, every optimizer's
                state and the position (step, epoch, round), and trains on to this job's end:
                the same graph and data with more epochs (rounds) equal one longer run. The
                job must have run the same strategy and kept a checkpoint (a cancelled or
                failed one keeps them all). Refused at submit otherwise.
            sandbox: ``"required"``: the job is placed only on workers that run job code
                sandboxed (``somatize-worker --sandbox`` bwrap or uid: ``status`` shows each
                worker's), refused at submit where no registered worker does; ``"any"``
                (default): on any worker.
            priority: among the jobs that can start, a higher one goes first, and may preempt
                a running job of a lower one; at most the client's ceiling (``max_priority``
                in the coordinator's clients file: 0 unless it says), refused at submit above.
            preemptible: ``False``: never stopped to make room for another job (its workers
                count against the client's ``max_workers``, which a preemptible job may
                borrow past while nobody else waits). A preempted job checkpoints, is queued
                again and resumes where it stopped: its result is an undisturbed run's.
            time_limit: seconds a run of the job may take, then it fails ``time_limit``; a
                job that declares one may start early on workers held for a larger job that
                it would be done before (backfill).
            slots: the slots it takes of each worker (``somatize-worker --slots``): a worker
                of four runs four one-slot jobs at once, each with a quarter of its threads.

        Returns:
            The job's handle; its :meth:`Job.result` is a :class:`FittedGraph` of ``graph``.
        """
        from somatize.graph import Graph  # (torch: imported when a job is submitted)

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
        if wait_for_workers is not None and not (
            isinstance(wait_for_workers, int | float)
            and math.isfinite(wait_for_workers)
            and wait_for_workers > 0
        ):
            raise ValueError(
                "wait_for_workers must be a positive number of seconds or None, not "
                f"{wait_for_workers!r}"
            )
        if time_limit is not None and not (
            isinstance(time_limit, int | float) and math.isfinite(time_limit) and time_limit > 0
        ):
            raise ValueError(
                f"time_limit must be a positive number of seconds or None, not {time_limit!r}"
            )
        for what, value, least in (("priority", priority, -1000), ("slots", slots, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{what} must be an integer of at least {least}, not {value!r}")
        if sandbox not in SANDBOX_REQUIREMENTS:
            raise ValueError(
                f"sandbox must be one of {', '.join(map(repr, SANDBOX_REQUIREMENTS))}, "
                f"not {sandbox!r}"
            )
        if len(graph.node_ids) > MAX_GRAPH_NODES:
            raise ValueError(
                f"the graph has {len(graph.node_ids)} nodes: a job's graph may have at most "
                f"{MAX_GRAPH_NODES} (merge small filters into one, e.g. a torch module of many "
                "layers)"
            )
        filters = {}
        for node_id, f in graph.items():
            try:
                # As an array: it comes out of the coordinator's frame as a view, not a copy.
                filters[node_id] = as_buffer(dump_filter(f))
            except Exception as exc:
                exc.add_note(f"while pickling the filter of node {node_id!r} for submission")
                raise
        dataset = x.name if isinstance(x, WorkerData) else None
        loader = None
        if isinstance(x, WorkerData) and x.loader is not None:
            try:
                loader = dump_filter(x.loader)
            except Exception as exc:
                exc.add_note(f"while pickling the loader of WorkerData({x.name!r})")
                raise
        if dataset is not None:
            if y is not None:
                raise ValueError("with WorkerData the labels are the workers' own: y must be None")
            x = None
        x, y = sent_data(x, y)
        info = graph_info(graph)
        x_val, y_val, val_split = _validation(validation, dataset)
        message = Submit(
            graph=GraphSpec(node_ids=graph.node_ids, filters=filters, nodes=info),
            x=x,
            y=y,
            dataset=dataset,
            loader=loader,
            strategy=strategy.spec(),
            x_val=x_val,
            y_val=y_val,
            val_split=val_split,
            wait_for_workers=wait_for_workers,
            name=name,
            file=file,
            resume_from=resume_from.id if isinstance(resume_from, Job) else resume_from,
            sandbox=sandbox,
            priority=priority,
            preemptible=preemptible,
            time_limit=time_limit,
            slots=slots,
        )
        nbytes = sum(len(b) for b in filters.values()) + data_nbytes(x) + data_nbytes(y)
        nbytes += data_nbytes(x_val) + data_nbytes(y_val)
        reply = self._call(message, allowance=nbytes / _MIN_UPLOAD_RATE)
        job_id = result_field(reply, "job_id", "submit")
        if not isinstance(job_id, str):
            raise ClientError(f"the coordinator answered submit with a job id {job_id!r}")
        return Job(self, job_id, graph, notes=_notes(strategy, info))

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
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LISTED:
            raise ValueError(
                f"limit must be a whole number from 1 to {MAX_LISTED} (a coordinator lists "
                f"at most that many), not {limit!r}"
            )
        jobs = result_field(self._call(ListJobs(limit=limit)), "jobs", "list_jobs")
        return list(jobs)

    def queue(self) -> dict[str, Any]:
        """The jobs running and queued that this client may see, in the order they go
        (``jobs``: records; a queued one's ``wait`` says its ``position``, the ``reason`` it
        waits — ``priority``, ``share``, ``workers_busy``, ``reservation``, ``preempting``,
        ``quota``, ``no_worker`` — in words (``detail``) and when it is expected to start
        (``starts_in`` seconds, ``None``: not known)); for an admin, ``clients``: each one's
        ``share``, the workers it ``holds``, has held lately (``recent``) and its ``fair``
        part."""
        reply = self._call(GetQueue())
        if not isinstance(reply, Result) or not isinstance(reply.result, dict):
            raise ClientError(f"the coordinator answered get_queue with {reply!r}")
        return dict(reply.result)

    @suggesting
    def prune(
        self,
        job_ids: Sequence[str] = (),
        *,
        older_than: float | None = None,
        keep: int | None = None,
        max_bytes: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Remove ended jobs of this client's (an admin's: anyone's) from the coordinator —
        record, events, result, checkpoints: ``job_ids``, those that ended more than
        ``older_than`` seconds ago, all but the ``keep`` newest, and the oldest until the
        rest hold ``max_bytes``. A live job is never removed. Returns ``{"jobs": [...],
        "bytes": N, "kept": [...]}``: the ids removed (``dry_run``: that would be), the bytes
        they held, and the ids asked for that are not an ended job of this client's."""
        ask = PruneJobs(
            job_ids=list(job_ids),
            older_than=older_than,
            keep=keep,
            max_bytes=max_bytes,
            dry_run=dry_run,
        )
        reply = self._call(ask)
        if not isinstance(reply, Result) or not isinstance(reply.result, dict):
            raise ClientError(f"the coordinator answered prune_jobs with {reply!r}")
        return dict(reply.result)

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
            raise _client_error(exc.info) from exc
        except ChannelClosed as exc:
            raise self._lost(exc) from exc

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


def sent_data(x: Any, y: Any) -> tuple[Any, Any]:
    """``x`` and ``y`` as a job sends them: a map-style dataset read into arrays (it travels
    with the job; to train on one without sending it, serve its files on the workers and give
    ``sz.WorkerData(name, loader=...)``)."""
    from engine.batches import whole
    from somatize.graph import dataset_data

    x, y = dataset_data(x, y)
    return whole(x), whole(y)


def graph_info(graph: Graph) -> dict[str, NodeInfo]:
    """What the coordinator is told of each node (it never unpickles the filters): whether it
    trains by gradient descent, and then its training settings."""
    from engine.step_functions import step_of, takes_labels
    from somatize.filters import TorchFilter, layer_kinds  # (torch: imported at a submit)

    info = {}
    for node_id, f in graph.items():
        if isinstance(f, TorchFilter):
            info[node_id] = NodeInfo(
                differentiable=True,
                training=f.training,
                labels=takes_labels(f),
                step=step_of(f) is not None,
                **layer_kinds(f.module),
            )
        else:
            info[node_id] = NodeInfo()
    return info


def _validation(validation: Any, dataset: str | None) -> tuple[Any, Any, str | None]:
    """``x_val``, ``y_val`` and ``val_split`` of a submission's ``validation``.

    Raises:
        ValueError: a split of another dataset than the job trains on, or a bad pair.
    """
    if isinstance(validation, WorkerData):
        if validation.name != dataset:
            raise ValueError(
                f"validation=WorkerData({validation.name!r}, split=...) is a split of the "
                f"dataset the job trains on ({'none: it sends x' if dataset is None else dataset})"
            )
        return None, None, validation.split or "val"
    from somatize.graph import checked_validation

    checked = checked_validation(validation)
    if checked is None:
        return None, None, None
    from engine.batches import whole  # a dataset's rows travel with the job

    return whole(checked[0]), whole(checked[1]), None


def _notes(strategy: Strategy, info: dict[str, NodeInfo]) -> list[str]:
    """Why ``strategy`` will not equal ``graph.fit`` exactly on a graph described by ``info``
    (the words the coordinator puts in the ``placed`` event)."""
    if not isinstance(strategy, DataParallel):
        return []
    torch_nodes = [n for n, i in info.items() if i.differentiable]
    return data_parallel_notes(info, torch_nodes, strategy.sync_batchnorm)


def _client_error(info: ErrorInfo) -> ClientError:
    return ClientError(f"[{info.code}] {info.message}", code=str(info.code), detail=info.detail)
