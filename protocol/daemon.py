"""The agent ↔ filter-daemon link: its messages and its framing over pipes.

The worker agent drives one filter daemon (``python -m worker.daemon``) per job through the
daemon's stdin/stdout. Each direction carries a stream of frames, each one preceded by its length::

    u64 little-endian frame length | frame          (frame = protocol.codec)

A request is one of the command models below (``cmd`` names it, ``id`` is chosen by the agent); the
daemon answers every request, in order, with an :class:`OkReply` or an :class:`ErrorReply` carrying
the same ``id`` (``-1`` when the request was too broken to read one). Strictly one request at a
time: the daemon is a single thread running user code.

Fields that carry data (``x``, ``y``, states, gradients, results) are typed ``Any`` so that pydantic
never walks a tensor: the codec already decoded them, zero-copy, and validating them would copy.

:class:`FrameReader` and :class:`FrameWriter` split and join that stream without doing any I/O
themselves, so the blocking daemon and the non-blocking supervisor share them: the reader hands
out the buffer the next bytes belong in (a frame is read straight into a writable buffer of its
own, which keeps decoded tensors writable and zero-copy), the writer hands out the memoryviews
still to send (tensor bytes go from their own memory to the pipe, never joined into one big
``bytes``).

Large frames can skip the pipe: with a :class:`SharedRegion` per direction (a memfd both
processes map, set up by the supervisor), a frame of :data:`SHARED_MIN_BYTES` to
:data:`SHARED_MAX_BYTES` is copied into the region and only its length goes down the pipe,
flagged with :data:`SHARED_FLAG`::

    u64 little-endian (SHARED_FLAG | frame length)  (the frame is in the region, from byte 0)

The reader copies it out into a buffer of its own as soon as it reads that length. A pipe moves
each byte twice through the kernel, in 4 KiB pages it allocates and frees (23 MB of gradients
took the daemon ~5 ms to write and the agent ~3 ms to read); the region is one copy in and one
copy out of memory that stays mapped. One frame per region at a time, which the protocol
guarantees: a request is written only after the reply to the previous one was read, and a reply
only after its request was.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    StrictBytes,
    StrictInt,
    TypeAdapter,
    model_validator,
)

from protocol.errors import ErrorInfo, FrameError

__all__ = [
    "MAX_FRAME_BYTES",
    "ApplyGradientsRequest",
    "BatchedFitRequest",
    "CompositeFitRequest",
    "CompositeForwardRequest",
    "DaemonReply",
    "DaemonRequest",
    "DataSource",
    "ErrorReply",
    "FitRequest",
    "ForwardRequest",
    "FrameReader",
    "FrameWriter",
    "GetGradientsRequest",
    "GetOptimizerStateRequest",
    "GetStateRequest",
    "GradientsRequest",
    "LoadRequest",
    "OkReply",
    "PingRequest",
    "SetOptimizerStateRequest",
    "SetStateRequest",
    "SharedRegion",
    "ShutdownRequest",
    "StageBackwardRequest",
    "StageForwardRequest",
    "StageRequest",
    "StageStepRequest",
    "allocate_fast",
    "allocate_paged",
    "reply_adapter",
    "request_adapter",
    "request_fields",
]

LENGTH = struct.Struct("<Q")
"""The length prefix in front of every frame on the daemon pipes."""

MAX_FRAME_BYTES = 1 << 36
"""Largest frame either side accepts (64 GiB): a longer length prefix means a garbled stream."""

SHARED_FLAG = 1 << 63
"""Set in a length prefix: the frame is in the direction's :class:`SharedRegion`, not the pipe."""

SHARED_MIN_BYTES = 256 << 10
"""Frames from this size on go through the shared region when there is one."""

SHARED_MAX_BYTES = 32 << 20
"""Larger frames still go down the pipe: a copy in or out of the region is one call (~3 ms for
32 MiB), and an event loop must not stall on a GB-sized one; the pipe moves them in slices."""

HEAP_FRAME_BYTES = 32 << 20
"""Frames up to this size are read into heap memory by :func:`allocate_paged` (see there)."""


# --------------------------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    """Fields every command has. Unknown fields are refused, so a typo is an error, not a no-op.

    ``cmd`` defaults to the command's own name (a sender writes ``GetStateRequest(node_ids=...)``);
    ``id`` is the numbering sender's (the agent's supervisor), 0 until it numbers the request;
    one read off the pipe (:data:`request_adapter`) must have it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: StrictInt = 0  # strict: the id echoed in the reply is exactly the one that was sent


class LoadRequest(_Request):
    """Replace the loaded filters: node id → cloudpickle bytes, in graph order."""

    cmd: Literal["load"] = "load"
    filters: dict[str, StrictBytes]


class FitRequest(_Request):
    """Fit one node on ``x`` (and ``y``); a torch node runs forward+loss+backward, no step."""

    cmd: Literal["fit"] = "fit"
    node_id: str
    x: Any
    y: Any = None


class ForwardRequest(_Request):
    """Run one node's forward on ``x`` with ``state`` (``None``: the state the node holds)."""

    cmd: Literal["forward"] = "forward"
    node_id: str
    x: Any
    state: Any = None


class DataSource(_Request):
    """Data given inline (``x``, ``y``) or by the name it was staged under (``data``), optionally
    only some of its ``rows``."""

    x: Any = None
    y: Any = None
    data: str | None = None
    rows: list[int] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if self.data is None and self.rows is not None:
            raise ValueError("rows select from staged data: give data as well")
        if self.data is not None and (self.x is not None or self.y is not None):
            raise ValueError("give the data inline (x, y) or by name (data), not both")
        return self


class CompositeFitRequest(DataSource):
    """One pass over a chain of nodes: plain filters fit then forward; torch: one backward."""

    cmd: Literal["composite_fit"] = "composite_fit"
    node_ids: Annotated[list[str], Field(min_length=1)]


class BatchedFitRequest(DataSource):
    """The full training loop over a chain (epochs, batches, optimizer steps): ``graph.fit``.

    ``epochs`` overrides the filters' own; ``prox_mu`` adds FedProx's proximal term;
    ``reset_optimizer`` trains with fresh optimizers instead of the kept ones."""

    cmd: Literal["batched_fit"] = "batched_fit"
    node_ids: Annotated[list[str], Field(min_length=1)]
    batch_size: PositiveInt | None = None
    epochs: NonNegativeInt | None = None
    prox_mu: NonNegativeFloat = 0.0
    reset_optimizer: bool = False
    return_output: bool = True  # False: the chain's output on the data stays on the worker
    return_states: bool = True  # False: the caller reads them later (get_state), when it can


class StageRequest(_Request):
    """Keep data under ``name`` for later commands: sent inline (``x``, ``y``), or a dataset of
    the worker's own (``dataset``: a name the agent was given with ``--data NAME=PATH``)."""

    cmd: Literal["stage"] = "stage"
    name: str
    x: Any = None
    y: Any = None
    dataset: str | None = None


class GradientsRequest(DataSource):
    """A data-parallel replica's half of a step: forward, loss and backward over the rows (plain
    filters apply the state they hold), then the gradients of the chain's torch nodes."""

    cmd: Literal["gradients"] = "gradients"
    node_ids: Annotated[list[str], Field(min_length=1)]
    apply: dict[str, dict[str, Any]] | None = None  # the previous step's mean, applied first


class StageForwardRequest(DataSource):
    """A pipeline stage's forward of micro-batch ``micro`` (ModelParallel, GPipe).

    Plain filters apply their held state, the differentiable run goes forward in training mode
    and what its backward needs is kept under ``micro``. ``first``: the input needs no gradient;
    ``last``: labels are required and the loss, times ``scale`` (the micro-batch's share of the
    global batch's rows), is kept. Returns the activation, or ``{"loss", "rows"}`` when ``last``.
    """

    cmd: Literal["stage_forward"] = "stage_forward"
    node_ids: Annotated[list[str], Field(min_length=1)]
    micro: NonNegativeInt
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    first: bool = False
    last: bool = False


class StageBackwardRequest(_Request):
    """A pipeline stage's backward of micro-batch ``micro``; gradients accumulate.

    ``grad_output`` is the gradient of the stage's output (``None`` on the last stage, which
    backpropagates its loss). Returns the gradient of the stage's input (``None`` on the first)."""

    cmd: Literal["stage_backward"] = "stage_backward"
    micro: NonNegativeInt
    grad_output: Any = None


class StageStepRequest(_Request):
    """End a pipeline global batch: one step of each node's optimizer, then zeroed gradients.

    Returns the number of parameters stepped."""

    cmd: Literal["stage_step"] = "stage_step"
    node_ids: Annotated[list[str], Field(min_length=1)]


class CompositeForwardRequest(_Request):
    """Forward ``x`` through a chain of nodes, optionally with explicit states by node id."""

    cmd: Literal["composite_forward"] = "composite_forward"
    node_ids: Annotated[list[str], Field(min_length=1)]
    x: Any
    states: dict[str, Any] | None = None


class GetStateRequest(_Request):
    """Read the states of some nodes (``None``: all of them), as they are now."""

    cmd: Literal["get_state"] = "get_state"
    node_ids: list[str] | None = None


class SetStateRequest(_Request):
    """Load states (what ``get_state`` returned, or an aggregate of it) into the nodes."""

    cmd: Literal["set_state"] = "set_state"
    states: dict[str, Any]


class GetOptimizerStateRequest(_Request):
    """Read the persistent optimizers of some differentiable nodes: node → the optimizer's
    ``state_dict()`` (moments, step counts, hyperparameters), ``None`` before its first step."""

    cmd: Literal["get_optimizer_state"] = "get_optimizer_state"
    node_ids: Annotated[list[str], Field(min_length=1)]


class SetOptimizerStateRequest(_Request):
    """Give nodes fresh optimizers loaded with what ``get_optimizer_state`` returned elsewhere:
    a replacement replica resumes with the survivors' momentum and moments."""

    cmd: Literal["set_optimizer_state"] = "set_optimizer_state"
    states: dict[str, Any]


class GetGradientsRequest(_Request):
    """Read the gradients the last backward left on the parameters: node → name → tensor."""

    cmd: Literal["get_gradients"] = "get_gradients"
    node_ids: list[str] | None = None


class ApplyGradientsRequest(_Request):
    """Write gradients onto the parameters and step each node's persistent optimizer."""

    cmd: Literal["apply_gradients"] = "apply_gradients"
    gradients: dict[str, dict[str, Any]]


class PingRequest(_Request):
    """Do nothing and answer: liveness and round-trip time."""

    cmd: Literal["ping"] = "ping"


class ShutdownRequest(_Request):
    """Answer, then exit with status 0."""

    cmd: Literal["shutdown"] = "shutdown"


DaemonRequest = Annotated[
    LoadRequest
    | FitRequest
    | ForwardRequest
    | CompositeFitRequest
    | BatchedFitRequest
    | CompositeForwardRequest
    | GetStateRequest
    | SetStateRequest
    | GetOptimizerStateRequest
    | SetOptimizerStateRequest
    | GetGradientsRequest
    | ApplyGradientsRequest
    | StageRequest
    | GradientsRequest
    | StageForwardRequest
    | StageBackwardRequest
    | StageStepRequest
    | PingRequest
    | ShutdownRequest,
    Field(discriminator="cmd"),
]
"""Any request the daemon accepts, told apart by ``cmd``."""


def _numbered(raw: Any) -> Any:
    """A request read off the pipe must carry its id: an absent one is given as ``None``, which
    the strict ``id`` field refuses (a request built in code is numbered when it is sent)."""
    if isinstance(raw, dict) and "id" not in raw:
        return {**raw, "id": None}
    return raw


request_adapter: TypeAdapter[DaemonRequest] = TypeAdapter(
    Annotated[DaemonRequest, BeforeValidator(_numbered)]
)
"""Validates a request as the daemon receives it (numbered)."""


def command_fields(request: BaseModel) -> dict[str, Any]:
    """A request as it travels before it is numbered (a coordinator's ``Call.request``): the
    fields its sender set and its ``cmd``, no ``id``. Shallow, as :func:`request_fields`."""
    names = (request.model_fields_set | {"cmd"}) - {"id"}
    return {name: getattr(request, name) for name in type(request).model_fields if name in names}


def request_fields(request: BaseModel) -> dict[str, Any]:
    """A request model as the plain dict that goes on the wire.

    Shallow on purpose: ``model_dump`` would rebuild every dict and list under the ``Any`` fields,
    and the values there are tensors the codec sends as they are.
    """
    return {name: getattr(request, name) for name in type(request).model_fields}


# --------------------------------------------------------------------------------------------
# Replies


class OkReply(BaseModel):
    """The command ran; ``result`` is what it returned.

    ``fit``, ``composite_fit`` and ``batched_fit`` return the engine's ``FitResult`` as a dict
    (``output``, ``states``, ``loss``, ``rows``, ``epoch_losses``); ``load`` the node ids;
    ``set_state``, ``set_optimizer_state``, ``ping`` and ``shutdown`` ``None``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int
    ok: Literal[True]
    result: Any = None


class ErrorReply(BaseModel):
    """The command did not run, or raised; ``error`` says what and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int
    ok: Literal[False]
    error: ErrorInfo


DaemonReply = Annotated[OkReply | ErrorReply, Field(discriminator="ok")]
"""Any reply of the daemon, told apart by ``ok``."""

reply_adapter: TypeAdapter[DaemonReply] = TypeAdapter(DaemonReply)


# --------------------------------------------------------------------------------------------
# Framing (no I/O: the caller reads into / writes from the buffers these hand out)


def allocate_paged(nbytes: int) -> memoryview:
    """A frame buffer for a reader on an event loop: cheap in steady state, no long stalls.

    Frames up to :data:`HEAP_FRAME_BYTES` get a ``bytearray``: glibc serves blocks up to its
    largest mmap threshold (32 MiB on 64-bit) from its heap once such a block has been freed, so
    a frame of the size of the previous one lands in memory already faulted in. Reading a
    23 MB gradient frame from a pipe measured 3 ms of CPU so, 17 ms into fresh pages: the
    data-parallel steady state, one such frame per step. Larger frames get an anonymous
    ``mmap``, whose pages are faulted in as the bytes arrive, 4 KiB at a time: ``bytearray(n)``
    would zero-fill all of them first (~40 ms for 100 MB of fresh memory, at once) and numpy's
    allocator asks for transparent huge pages, whose allocation can stall for milliseconds
    (compaction) in the middle of one read.
    """
    return memoryview(bytearray(nbytes) if nbytes <= HEAP_FRAME_BYTES else mmap.mmap(-1, nbytes))


def allocate_fast(nbytes: int) -> memoryview:
    """A frame buffer for a reader that only blocks itself: uninitialised, huge pages allowed.

    About twice the throughput of :func:`allocate_paged` for 100 MB frames, at the price of
    occasional multi-millisecond page faults — fine for the daemon, not for an event loop.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class SharedRegion:
    """One direction's shared memory between the agent and its daemon: a memfd both map.

    The supervisor creates one per direction (:meth:`create`) and hands the daemon their file
    descriptors. The region only grows (sealed against shrinking, so the other process cannot
    make our mapping fault), to the largest frame sent so far, rounded up to a MiB; its pages
    stay allocated for the next frame. :attr:`frames` and :attr:`nbytes` count what went through.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.frames = 0
        self.nbytes = 0
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, name: str) -> SharedRegion | None:
        """A new, empty region; ``None`` where there are no sealable memfds (not Linux)."""
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        except (AttributeError, OSError):
            os.close(fd)
            return None
        return cls(fd)

    def _mapping(self, nbytes: int, grow: bool) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            if not grow:
                raise FrameError(
                    f"a frame of {nbytes} bytes in shared memory, which holds {size} bytes"
                )
            size = -(-nbytes // (1 << 20)) * (1 << 20)
            os.ftruncate(self.fd, size)
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, size)
        return self._map

    def write(self, views: Iterable[memoryview]) -> int:
        """Copy a frame (its parts, in order) to the start of the region; return its length."""
        views = list(views)
        total = sum(v.nbytes for v in views)
        region = self._mapping(total, grow=True)
        position = 0
        for view in views:
            region[position : position + view.nbytes] = view
            position += view.nbytes
        self.frames += 1
        self.nbytes += total
        return total

    def read(self, nbytes: int, allocate: Callable[[int], memoryview]) -> memoryview:
        """Copy the ``nbytes``-long frame at the start of the region into a new buffer.

        Raises:
            FrameError: the region is shorter than ``nbytes``.
        """
        region = self._mapping(nbytes, grow=False)
        frame = allocate(nbytes)
        with memoryview(region) as whole, whole[:nbytes] as source:
            frame[:] = source
        self.frames += 1
        self.nbytes += nbytes
        return frame

    def close(self) -> None:
        """Unmap and close (the daemon's side stays valid until it exits)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FrameReader:
    """Cuts a byte stream into length-prefixed frames, each read straight into its own buffer.

    Usage: read up to ``len(reader.buffer())`` bytes into ``reader.buffer()``, then call
    ``reader.advance(n)``; it returns the frame once its last byte arrived. The frame is a
    writable memoryview over a buffer of its own, which then belongs to the caller (the reader
    starts a new one), so arrays and tensors decoded over it stay valid and are zero-copy.

    Args:
        max_frame: the largest frame accepted.
        allocate: makes the writable, byte-format buffer of a frame of the given size (see
            :func:`allocate_paged`, the default, and :func:`allocate_fast`).
        shared: the region the other side writes large frames into (see the module docstring);
            ``None``: every frame comes down the pipe.
    """

    def __init__(
        self,
        max_frame: int = MAX_FRAME_BYTES,
        allocate: Callable[[int], memoryview] = allocate_paged,
        shared: SharedRegion | None = None,
    ) -> None:
        self._max_frame = max_frame
        self._allocate = allocate
        self._shared = shared
        self._prefix = bytearray(LENGTH.size)
        self._frame: memoryview | None = None  # None while reading the length prefix
        self._filled = 0

    def buffer(self) -> memoryview:
        """Where the next bytes of the stream go (never empty while a frame is incomplete)."""
        if self._frame is None:
            return memoryview(self._prefix)[self._filled :]
        return self._frame[self._filled :]

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame (or of its prefix) has been read: EOF now is a truncation."""
        return self._filled > 0 or self._frame is not None

    def advance(self, nbytes: int) -> memoryview | None:
        """Account for ``nbytes`` written into :meth:`buffer`; return the frame they completed.

        Raises:
            FrameError: the length prefix exceeds ``max_frame``, or no buffer that large can be
                had; either way the stream cannot be followed any further.
        """
        self._filled += nbytes
        if self._frame is None:
            if self._filled < LENGTH.size:
                return None
            (length,) = LENGTH.unpack(self._prefix)
            if length & SHARED_FLAG and self._shared is not None:
                return self._take_shared(length ^ SHARED_FLAG)
            if length > self._max_frame:
                raise FrameError(f"frame length {length} exceeds the limit of {self._max_frame}")
            try:
                self._frame = self._allocate(length)
            except (MemoryError, OSError) as exc:
                raise FrameError(f"cannot allocate a frame of {length} bytes: {exc}") from exc
            self._filled = 0
            if length > 0:
                return None
        elif self._filled < self._frame.nbytes:
            return None
        frame, self._frame, self._filled = self._frame, None, 0
        return frame

    def _take_shared(self, length: int) -> memoryview:
        assert self._shared is not None
        if length > self._max_frame:
            raise FrameError(f"frame length {length} exceeds the limit of {self._max_frame}")
        self._filled = 0
        try:
            return self._shared.read(length, self._allocate)
        except (MemoryError, OSError, ValueError) as exc:
            raise FrameError(
                f"cannot take a frame of {length} bytes from shared memory: {exc}"
            ) from exc


class FrameWriter:
    """The bytes of length-prefixed frames still to be written, as a queue of memoryviews.

    Usage: ``writer.add(parts)`` with the codec's ``encode(obj)`` parts, then write
    ``writer.buffers()`` (e.g. with ``os.writev``) and report the count with ``advance(n)`` until
    ``writer.done``. Nothing is copied: partial writes only re-slice the views. With ``shared``,
    a frame of :data:`SHARED_MIN_BYTES` to :data:`SHARED_MAX_BYTES` is copied into that region at
    once and only its flagged length is queued.
    """

    def __init__(
        self,
        parts: Iterable[bytes | bytearray | memoryview] = (),
        shared: SharedRegion | None = None,
    ) -> None:
        self._views: deque[memoryview] = deque()
        self._shared = shared
        if parts:
            self.add(parts)

    def add(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        """Queue one frame made of ``parts`` (their concatenation is the frame)."""
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        total = sum(v.nbytes for v in views)
        if self._shared is not None and SHARED_MIN_BYTES <= total <= SHARED_MAX_BYTES:
            try:
                self._shared.write(views)
            except (OSError, ValueError):
                pass  # no memory for the region: this frame goes down the pipe instead
            else:
                self._views.append(memoryview(LENGTH.pack(total | SHARED_FLAG)))
                return
        self._views.append(memoryview(LENGTH.pack(total)))
        self._views.extend(views)

    @property
    def done(self) -> bool:
        """True once every queued byte was reported written."""
        return not self._views

    def buffers(self, limit: int = 64) -> list[memoryview]:
        """The next views to write, at most ``limit`` of them (stay under ``IOV_MAX``)."""
        return [self._views[i] for i in range(min(limit, len(self._views)))]

    def advance(self, nbytes: int) -> None:
        """Drop ``nbytes`` from the front of the queue: they were written."""
        while nbytes:
            head = self._views[0]
            if nbytes < head.nbytes:
                self._views[0] = head[nbytes:]
                return
            nbytes -= head.nbytes
            self._views.popleft()
