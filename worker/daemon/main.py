"""The filter daemon: ``python -m worker.daemon [--threads N] [--device DEVICE]``.

One daemon runs the user filters of one job for the worker agent (through
:class:`worker.supervision.supervisor.DaemonSupervisor`), so that user code — which may hang, crash,
print or leak — lives in its own process. It reads requests (:mod:`protocol.daemon`) from its stdin
and writes replies to its stdout, one at a time, each a length-prefixed :mod:`protocol.codec` frame,
and maps each command onto one method of one part of one :class:`~engine.engine.Engine`.

Lifecycle: startup → serve → exit.

* Startup takes fds 0 and 1 for the protocol (duplicates of them), then points fd 1 and
  ``sys.stdout`` at stderr and fd 0 at ``/dev/null``: a ``print`` in a filter, or C code writing to
  fd 1, lands in the worker's log instead of in the middle of a frame. A watchdog thread exits the
  process when its parent is gone, even while the main thread is stuck in a filter.
* Serve answers every request, whatever it holds: a request that does not validate, an unknown
  command, bytes that are not a frame, a filter that raises — each gets an error reply
  (:class:`~protocol.errors.ErrorInfo`) and the daemon reads the next request. Only a broken
  stream (a length prefix that cannot be right, EOF mid-frame) ends it, because the next frame
  cannot be found any more.
* Exit: on ``shutdown`` (after its reply, status 0), on EOF of the protocol input (the agent closed
  it or died, status 0), on a broken stream (status 2), or by the watchdog (status 3).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from types import TracebackType
from typing import Any, NoReturn

import torch
from pydantic import BaseModel

from engine.data.datasets import load_dataset
from engine.devices import resolve_device
from engine.engine import Engine, FitSettings
from engine.errors import EngineError
from engine.stepping import Horizon
from protocol.asyncio.memory import keep_freed_memory
from protocol.codec import decode, encode
from protocol.daemon import (
    ApplyGradientsRequest,
    BatchedFitRequest,
    CompositeFitRequest,
    CompositeForwardRequest,
    EvaluateRequest,
    FitRequest,
    ForwardRequest,
    GetGradientsRequest,
    GetOptimizerStateRequest,
    GetStateRequest,
    GradientsRequest,
    LoadRequest,
    PingRequest,
    ScheduleRequest,
    SetOptimizerStateRequest,
    SetStateRequest,
    ShutdownRequest,
    StageBackwardRequest,
    StageForwardRequest,
    StageNormRequest,
    StageRequest,
    StageStepRequest,
)
from protocol.errors import ErrorCode, ErrorInfo, FrameError, RequestRefused
from protocol.filters import load_filter
from protocol.text.user_tracebacks import folded
from worker.daemon.allocator import HeapBound
from worker.daemon.group_commands import GroupCommands
from worker.daemon.pipe import FrameReader, FrameWriter
from worker.daemon.requests import parse_request
from worker.daemon.secagg_client import SecAggClients
from worker.daemon.shared_memory import SharedRegion, allocate_fast

__all__ = ["EXIT_BROKEN_STREAM", "EXIT_ORPHANED", "Daemon", "PipeChannel", "main", "run", "warm_up"]

EXIT_BROKEN_STREAM = 2
"""Exit status when the protocol stream cannot be read any more (bad length prefix, truncation)."""

EXIT_ORPHANED = 3
"""Exit status when the watchdog found the parent gone."""

WATCHDOG_INTERVAL = 0.2
"""Seconds between two checks of the parent pid."""

Handler = Callable[[Any], Any]


class Daemon:
    """Turns request frames into reply messages, running them on one :class:`Engine`.

    One handler per command, in one table: the daemon's own (``on_<cmd>``) and those of its
    :class:`~worker.daemon.group_commands.GroupCommands` (``dist_*``, ``pipe_*``).

    No I/O here: :meth:`handle` takes the bytes of one request frame and returns the reply
    message, :meth:`respond` the same reply encoded as frame parts. :func:`main` feeds it from
    the pipes; tests can feed it directly.
    """

    def __init__(self, engine: Engine | None = None, heap: HeapBound | None = None) -> None:
        self.engine = engine if engine is not None else Engine()
        self.heap = heap if heap is not None else HeapBound(None)
        """tcmalloc's heap limit under the job's ``--max-job-memory``: an allocation it refuses
        fails its request as ``resource_limit`` (:mod:`worker.daemon.allocator`)."""
        self.stopping = False
        """Set by ``shutdown``: the serve loop exits after sending the reply."""
        self._filters: dict[str, Any] = {}
        self._secagg = SecAggClients()  # secure aggregation's secrets, by virtual client
        self.group_commands = GroupCommands(self.engine)
        self._handlers: dict[str, Handler] = {
            "load": self.on_load,
            "fit": self.on_fit,
            "forward": self.on_forward,
            "composite_fit": self.on_composite_fit,
            "batched_fit": self.on_batched_fit,
            "composite_forward": self.on_composite_forward,
            "get_state": self.on_get_state,
            "set_state": self.on_set_state,
            "get_optimizer_state": self.on_get_optimizer_state,
            "set_optimizer_state": self.on_set_optimizer_state,
            "get_gradients": self.on_get_gradients,
            "apply_gradients": self.on_apply_gradients,
            "stage": self.on_stage,
            "gradients": self.on_gradients,
            "schedule": self.on_schedule,
            "evaluate": self.on_evaluate,
            "stage_forward": self.on_stage_forward,
            "stage_backward": self.on_stage_backward,
            "stage_norm": self.on_stage_norm,
            "stage_step": self.on_stage_step,
            "secagg": lambda req: self._secagg.handle(req, self.engine.nodes),
            "ping": self.on_ping,
            "shutdown": self.on_shutdown,
            **self.group_commands.handlers,
        }

    # -- one request --------------------------------------------------------------------------

    def handle(self, frame: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Run the request in ``frame`` and return the reply message (never raises ``Exception``).

        ``frame`` should be writable (a ``bytearray``, or what :class:`FrameReader` returns) so
        that the tensors decoded from it are zero-copy views the filters may use in place.
        """
        try:
            raw = decode(frame)
        except FrameError as exc:
            return _bad_frame(exc)
        return self.handle_decoded(raw)

    def handle_decoded(self, raw: Any) -> dict[str, Any]:
        """:meth:`handle` on a request already decoded (never raises ``Exception``)."""
        request_id = _request_id(raw)
        try:
            request = parse_request(raw)
        except RequestRefused as exc:
            return _error(request_id, exc.info)
        handler = self._handlers[request.cmd]
        try:
            result = handler(request)
        except RequestRefused as exc:
            return _error(request_id, exc.info)
        except EngineError as exc:
            return _error(request_id, exc.info())
        except (Exception, SystemExit) as exc:
            # User code raised (SystemExit too: a filter calling sys.exit() is a bug to report,
            # not a reason to take the daemon down), or an allocation over the job's limit.
            refused = self.heap.out_of_memory(exc, request.cmd)
            return _error(request_id, refused or self._filter_error(request, exc))
        return {"id": request_id, "ok": True, "result": result}

    def respond(self, frame: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """:meth:`handle`, encoded: the parts of the reply frame.

        A result the codec cannot carry (a filter state holding an arbitrary object) becomes an
        error reply, since it is the filter's doing and the request is over either way.
        """
        return self._encoded(lambda: self.handle(frame))

    def respond_decoded(self, raw: Any) -> list[bytes | memoryview]:
        """:meth:`respond` on a request already decoded."""
        return self._encoded(lambda: self.handle_decoded(raw))

    def _encoded(self, reply_to: Callable[[], dict[str, Any]]) -> list[bytes | memoryview]:
        try:
            reply = reply_to()
        except Exception as exc:  # a bug of ours: still answer, so the agent is not left waiting
            info = _exception_info(exc, "the daemon failed", "?")
            info.code = ErrorCode.INTERNAL
            reply = _error(-1, info)
        try:
            return encode(reply)
        except FrameError as exc:
            message = f"the result cannot be sent back: {exc}"
            info = ErrorInfo(code=ErrorCode.FILTER_ERROR, message=message)
            return encode(_error(reply["id"], info))

    # -- handlers -----------------------------------------------------------------------------

    def on_load(self, req: LoadRequest) -> list[str]:
        """Unpickle every filter, then replace the engine's; a failure leaves the old ones."""
        filters: dict[str, Any] = {}
        for node_id, data in req.filters.items():
            try:
                filters[node_id] = load_filter(data)
            except Exception as exc:
                info = _exception_info(exc, f"node {node_id!r} cannot be unpickled", "load")
                info.detail["node_id"] = node_id
                raise RequestRefused(info) from exc
        self.engine.load(filters)
        self._filters = filters
        return self.engine.nodes.node_ids

    def on_fit(self, req: FitRequest) -> dict[str, Any]:
        return _plain(self.engine.fitting.fit(req.node_id, req.x, req.y))

    def on_forward(self, req: ForwardRequest) -> Any:
        return self.engine.fitting.forward(req.node_id, req.x, req.state)

    def on_composite_fit(self, req: CompositeFitRequest) -> dict[str, Any]:
        return _plain(self.engine.fitting.composite_fit(req.node_ids, *self.engine.rows.of(req)))

    def on_batched_fit(self, req: BatchedFitRequest) -> dict[str, Any]:
        if req.start is not None:
            self.engine.nodes.set_state(req.start)
        # A dataset held whole is read from disk a batch at a time as the loop goes.
        x, y = self.engine.rows.of(req, lazy=req.rows is None)
        settings = FitSettings(
            batch_size=req.batch_size,
            epochs=req.epochs,
            prox_mu=req.prox_mu,
            reset_optimizer=req.reset_optimizer,
            schedule_before=req.schedule_before,
            schedule_epochs=req.schedule_epochs,
            validation=None
            if req.validation is None
            else self.engine.rows.held(req.validation, lazy=True),  # read a batch at a time
            lr=req.lr,
            start_loss=req.start_loss,
            clip_norm=req.clip_norm,
            # predictions on (perhaps private) data are not sent back: nor made
            output=req.return_output,
        )
        result = self.engine.fitting.batched_fit(req.node_ids, x, y, settings)
        if not req.return_states:
            result.states = {}  # the caller pulls them with get_state when it has room
        return _plain(result)

    def on_stage(self, req: StageRequest) -> dict[str, Any]:
        """Hold rows under ``req.name`` for later commands: the ones sent, or a dataset of this
        worker's own; returns how many."""
        x, y = req.x, req.y
        if req.dataset is not None:
            if x is not None or y is not None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST, "stage takes inline data (x, y) or a dataset, not both"
                )
            x, y = load_dataset(req.dataset, req.loader, req.split)
            if req.labels:  # a pipeline's last stage holds only the labels, as its rows
                x, y = y, None
        return {"rows": self.engine.rows.hold(req.name, x, y)}

    def on_gradients(self, req: GradientsRequest) -> dict[str, Any]:
        return self.engine.star_replica.step(req)

    def on_evaluate(self, req: EvaluateRequest) -> dict[str, Any]:
        with self.engine.replica.global_weights():  # (a DiLoCo replica's: the global model)
            return self.engine.evaluation.evaluate(
                req.node_ids, *self.engine.rows.of(req, lazy=True)
            )

    def on_schedule(self, req: ScheduleRequest) -> None:
        self.engine.optimizers.set_horizon(Horizon(req.steps_per_epoch, req.epochs, req.max_steps))

    def on_stage_forward(self, req: StageForwardRequest) -> Any:
        x, y = self.engine.rows.of(req)
        if req.labels is not None:
            y = self.engine.rows.held(req.labels, req.label_rows)[0]
        return self.engine.stage.stage_forward(
            req.node_ids, req.micro, x, y, req.scale, req.last, first=req.first
        )

    def on_stage_backward(self, req: StageBackwardRequest) -> torch.Tensor | None:
        return self.engine.stage.stage_backward(req.micro, req.grad_output)

    def on_stage_norm(self, req: StageNormRequest) -> float:
        return self.engine.stage.stage_norm(req.node_ids)

    def on_stage_step(self, req: StageStepRequest) -> int:
        return self.engine.stage.stage_step(
            req.node_ids, epoch_end=req.epoch_end, coefficient=req.coefficient
        )

    def on_composite_forward(self, req: CompositeForwardRequest) -> Any:
        return self.engine.fitting.composite_forward(req.node_ids, req.x, req.states)

    def on_get_state(self, req: GetStateRequest) -> dict[str, Any]:
        if req.digests:
            return self.engine.nodes.state_digests(req.node_ids)
        return self.engine.nodes.get_state(req.node_ids)

    def on_set_state(self, req: SetStateRequest) -> None:
        self.engine.nodes.set_state(req.states)

    def on_get_optimizer_state(self, req: GetOptimizerStateRequest) -> dict[str, Any]:
        return self.engine.optimizers.get_optimizer_state(req.node_ids)

    def on_set_optimizer_state(self, req: SetOptimizerStateRequest) -> None:
        self.engine.optimizers.set_optimizer_state(req.states)

    def on_get_gradients(self, req: GetGradientsRequest) -> dict[str, dict[str, Any]]:
        return self.engine.gradients.get_gradients(req.node_ids)

    def on_apply_gradients(self, req: ApplyGradientsRequest) -> dict[str, int]:
        applied = self.engine.gradients.apply_gradients(req.gradients, epoch_end=req.epoch_end)
        if req.buffers is not None:
            self.engine.nodes.set_buffers(req.buffers)
        return applied

    def on_ping(self, req: PingRequest) -> None:
        return None

    def on_shutdown(self, req: ShutdownRequest) -> None:
        self.stopping = True

    # -- errors -------------------------------------------------------------------------------

    def _filter_error(self, request: BaseModel, exc: BaseException) -> ErrorInfo:
        """A ``FILTER_ERROR`` saying which command and, when it can be told, which node raised."""
        cmd: str = getattr(request, "cmd", "?")
        node_id: str | None = getattr(request, "node_id", None)
        node_ids: Sequence[str] | None = getattr(request, "node_ids", None)
        if node_id is None:
            node_id = self._blame(exc.__traceback__, node_ids)
        where = f"{cmd} of node {node_id!r}" if node_id is not None else cmd
        info = _exception_info(exc, f"{where} failed", cmd)
        if node_id is not None:
            info.detail["node_id"] = node_id
        if node_ids is not None:
            info.detail["node_ids"] = list(node_ids)
        return info

    def _blame(self, tb: TracebackType | None, node_ids: Sequence[str] | None) -> str | None:
        """The node whose code raised: the innermost traceback frame whose ``self`` is one of
        the loaded filters, or a module inside one. The engine runs a chain in one call, so the
        traceback is the only record of which filter was running."""
        owners: dict[int, str] = {}
        for node_id, f in self._filters.items():
            if node_ids is not None and node_id not in node_ids:
                continue
            owners[id(f)] = node_id
            modules = getattr(getattr(f, "module", None), "modules", None)
            if callable(modules):
                for m in modules():
                    owners.setdefault(id(m), node_id)
        for frame, _ in reversed(list(traceback.walk_tb(tb))):
            owner = owners.get(id(frame.f_locals.get("self")))
            if owner is not None:
                return owner
        return None


def _plain(result: Any) -> dict[str, Any]:
    """A ``FitResult`` (dataclass) as the dict that travels; shallow, so tensors are not copied."""
    if is_dataclass(result) and not isinstance(result, type):
        return {f.name: getattr(result, f.name) for f in fields(result)}
    raise TypeError(f"expected a FitResult, got {type(result).__name__}")


def _bad_frame(exc: FrameError) -> dict[str, Any]:
    """The reply to bytes that are not a frame."""
    return _error(-1, ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)))


def _error(request_id: int, info: ErrorInfo) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": info.model_dump(mode="json")}


def _request_id(raw: Any) -> int:
    """The request's ``id`` if it has a usable one, else -1 (the reply still goes out)."""
    value = raw.get("id") if isinstance(raw, Mapping) else None
    return value if type(value) is int else -1


def _exception_info(exc: BaseException, what: str, cmd: str) -> ErrorInfo:
    return ErrorInfo(
        code=ErrorCode.FILTER_ERROR,
        message=f"{what}: {type(exc).__name__}: {exc}{_remedy(exc)}",
        detail={
            "type": type(exc).__name__,
            "traceback": folded(exc),  # the user's frames; ours and torch's folded
            "full_traceback": "".join(traceback.format_exception(exc)),
            "cmd": cmd,
        },
    )


def _remedy(exc: BaseException) -> str:
    """What to do about ``exc``, where it is a module this worker lacks ("" for others)."""
    missing = next(
        (e for e in (exc, exc.__cause__, exc.__context__) if isinstance(e, ModuleNotFoundError)),
        None,
    )
    if missing is None or not missing.name:
        return ""
    return (
        f" — module {missing.name!r} is not installed where this worker runs, and did not "
        "travel with the job: the modules of your own files that the submitting process has "
        f"imported travel with it, so import {missing.name!r} there (at the top of your "
        "model's file, not inside a function), or install it on the workers"
    )


# --------------------------------------------------------------------------------------------
# I/O


class PipeChannel:
    """Blocking, length-prefixed frames over a pair of file descriptors.

    ``shared``: the supervisor's shared-memory regions ``(requests, replies)``, for large frames
    (see :mod:`protocol.daemon`); ``None``: everything goes through the pipes.
    """

    def __init__(
        self, read_fd: int, write_fd: int, shared: tuple[SharedRegion, SharedRegion] | None = None
    ) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._replies = shared[1] if shared else None
        # Blocking reads on a process of its own: the faster allocator's occasional long page
        # fault stalls nobody else.
        self._reader = FrameReader(allocate=allocate_fast, shared=shared[0] if shared else None)

    def read_frame(self) -> memoryview | None:
        """The next frame, or ``None`` at a clean EOF (between two frames).

        Raises:
            FrameError: EOF in the middle of a frame, or an impossible length prefix.
        """
        while True:
            n = os.readv(self.read_fd, [self._reader.buffer()])
            if n == 0:
                if self._reader.mid_frame:
                    raise FrameError("end of input in the middle of a frame")
                return None
            frame = self._reader.advance(n)
            if frame is not None:
                return frame

    def write_frame(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write one frame made of ``parts``, gathering them with ``writev`` (no joining copy)."""
        writer = FrameWriter(parts, shared=self._replies)
        while not writer.done:
            writer.advance(os.writev(self.write_fd, writer.buffers()))


def take_stdio(shared: tuple[SharedRegion, SharedRegion] | None = None) -> PipeChannel:
    """Keep fds 0/1 as the protocol channel; give user code stderr and ``/dev/null`` instead."""
    channel = PipeChannel(os.dup(0), os.dup(1), shared)  # dup'ed: non-inheritable (PEP 446)
    sys.stdout.flush()
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # stderr is line-buffered, so prints show up in the worker log as they happen.
    sys.stdout = sys.stderr
    return channel


def start_watchdog(parent_pid: int, interval: float = WATCHDOG_INTERVAL) -> threading.Thread:
    """Exit the process when it is re-parented (its parent died), checking every ``interval``.

    A thread, so it works while the main thread is inside a filter; ``os._exit`` because a
    ``sys.exit`` from a thread would only end the thread.
    """

    def watch() -> NoReturn:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                print(
                    f"filter daemon {os.getpid()}: parent {parent_pid} is gone, exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def serve(channel: PipeChannel, daemon: Daemon) -> int:
    """Answer requests until shutdown or EOF; return the exit status."""
    while not daemon.stopping:
        try:
            frame = channel.read_frame()
        except FrameError as exc:
            # The stream is out of step: say why (the agent may still be reading), then go.
            info = ErrorInfo(code=ErrorCode.BAD_FRAME, message=f"protocol stream broken: {exc}")
            with contextlib.suppress(OSError):
                channel.write_frame(encode(_error(-1, info)))
            return EXIT_BROKEN_STREAM
        if frame is None:
            return 0
        try:
            raw = decode(frame)
        except FrameError as exc:
            parts = encode(_bad_frame(exc))
        else:
            # Dropped before the request runs: what it decoded to as bytes (a filter's pickle)
            # is a copy, so a frame that carried no tensor is freed now, not after the request
            # (loading a model does not hold it twice over). Tensors view the frame and keep it.
            del frame
            daemon.heap.update()  # what --max-job-memory leaves tcmalloc, as the job is now
            parts = daemon.respond_decoded(raw)
            del raw
        try:
            channel.write_frame(parts)
        except BrokenPipeError:
            return 0  # the agent is gone; nobody is left to answer
        del parts
        daemon.engine.group.release_broken()  # a group that broke, closed once it was said
    return 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.daemon", description=__doc__)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads: this daemon's share of the machine (default: all cores)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the engine trains: cpu, cuda, cuda:N or mps (default: cpu)",
    )
    parser.add_argument(
        "--shared",
        metavar="IN,OUT",
        help="file descriptors of the supervisor's shared-memory regions for large requests "
        "and replies (default: every frame through the pipes)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    try:
        args.device = resolve_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    if args.shared is not None:
        fds = args.shared.split(",")
        if len(fds) != 2 or not all(fd.isdigit() for fd in fds):
            parser.error(f"--shared takes two file descriptors, IN,OUT, not {args.shared!r}")
        for fd in fds:
            try:
                os.set_inheritable(int(fd), False)  # not for processes a filter starts
            except OSError as exc:
                parser.error(f"--shared: file descriptor {fd} is not usable: {exc}")
        args.shared = (SharedRegion(int(fds[0])), SharedRegion(int(fds[1])))
    return args


def warm_up() -> None:
    """Make (and drop) an optimizer: the first one a process makes imports what torch imports
    lazily for it (``torch._dynamo``, sympy: over a second of CPU). A daemon started ahead of its
    job (:mod:`worker.supervision.pool`) pays that while it waits, not in the job's first step."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def run(threads: int, device: str, shared: tuple[SharedRegion, SharedRegion] | None) -> NoReturn:
    """Serve on this process's stdin/stdout until shutdown, EOF or orphaning, then exit: a
    daemon's life once its process exists (started anew by :func:`main`, or forked by the
    agent's fork server, :mod:`worker.daemon.fork_server`, which did the imports and the
    warm-up)."""
    channel = take_stdio(shared)
    # A segfault in user code prints the Python stack to the worker log before the process dies.
    faulthandler.enable(file=sys.stderr)
    start_watchdog(os.getppid())
    torch.set_num_threads(threads)
    warm_up()
    status = serve(channel, Daemon(Engine(device=device), HeapBound.from_environment()))
    sys.stderr.flush()
    # os._exit: threads a filter started (non-daemon ones included) must not keep us alive.
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the daemon on this process's stdin/stdout until shutdown, EOF or orphaning."""
    args = _parse_args(argv)
    keep_freed_memory()
    run(args.threads, args.device, args.shared)
