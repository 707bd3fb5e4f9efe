"""The messages between coordinator, worker agents and clients.

Every WebSocket message is one binary frame of :mod:`protocol.codec` whose body is a message
dict: ``{"v": 1, "kind": ..., "id": ..., "reply_to": ..., ...}``. Tensors ride inside the body and
travel as raw buffers. ``kind`` selects one model of the union below (one class per kind); a
message that fails validation is answered with an :class:`Error` naming the field, and the
connection stays up. ``v`` is checked once, on the first message of a connection (the hello): a
different version is refused with both versions named.

Conversation shapes:

* worker agent → coordinator: :class:`WorkerHello` → :class:`Welcome`; then :class:`Heartbeat`
  every ``heartbeat_interval``; the coordinator sends :class:`OpenJob`, :class:`Call`,
  :class:`CloseJob`, :class:`ReadKept`, :class:`DropKept` (each answered by :class:`Ack`,
  :class:`Result` or :class:`Error`) and :class:`Shutdown` when it goes away.
* client → coordinator: :class:`ClientHello` → :class:`Welcome`; then :class:`Submit` (→
  :class:`Result` ``{"job_id"}``), :class:`Watch` (→ a stream of :class:`JobEvent` ending with
  the job's terminal event, then :class:`Ack`), :class:`GetResult` (→ :class:`Result` with the
  states; a sharded run's as its replicas' pieces, which the client joins),
  :class:`GetCheckpoint` (→ :class:`Result` with one checkpoint's position and states),
  :class:`Cancel` (→ :class:`Ack`), :class:`GetJob`, :class:`ListJobs`, :class:`GetQueue`
  and :class:`Status` (→ :class:`Result`), :class:`Ping` (→ :class:`Result`, through a
  worker's daemon when it names one).
* a frame too large for one WebSocket message (:data:`CHUNK_BYTES`) travels as consecutive
  chunk messages (raw bytes with a fixed header, see :mod:`protocol.chunking`); other messages,
  heartbeats included, may go in between.

A :class:`Call` carries one filter-daemon command (:mod:`protocol.daemon`, without its ``id``):
the strategies' vocabulary (fit, get/set state, get/apply gradients, ...) is the daemon's, and
the agent forwards it to the job's daemon unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SerializerFunctionWrapHandler,
    StrictBytes,
    StrictInt,
    TypeAdapter,
    model_serializer,
    model_validator,
)

from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorInfo
from protocol.filter_buffers import FilterBuffer
from protocol.options.training import TrainingOptions

CHUNK_BYTES = 1 << 20
"""Frames larger than this travel as chunk messages of this size: ``websockets`` moves
~1 MB messages several times faster than one huge one, and heartbeats can pass in between."""


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration a receiver waits or schedules by: finite and not negative (a NaN or an infinity
would reach ``asyncio.timeout``)."""
Interval = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A period: finite and positive."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: StrictInt = PROTOCOL_VERSION
    id: StrictInt = 0
    reply_to: StrictInt | None = None


# -- handshake and liveness --------------------------------------------------------------------


class Capabilities(BaseModel):
    """What a worker has: what placement can match on and what a person wants to see."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int
    memory_bytes: int
    torch: str
    cuda_devices: list[str] = Field(default_factory=list)
    device: str = "cpu"  # where this worker's daemons train: "cpu", "cuda:N" or "mps"
    device_name: str = ""  # e.g. "NVIDIA H200"; empty for the CPU
    device_memory_bytes: int = Field(default=0, ge=0)  # the device's own memory (0: the CPU's)
    python: str
    cloudpickle: str
    platform: str = ""
    sandbox: str = ""  # what a job's code runs inside there: "bwrap", "uid", "none" (or unsaid)
    network: bool = True  # whether a job's code there shares the machine's network
    slots: int = Field(default=1, ge=1)  # jobs (of one slot each) it runs at once


SandboxRequirement = Literal["any", "required"]
"""What a job asks of its workers' sandbox (``Submit.sandbox``)."""
SANDBOX_REQUIREMENTS: tuple[str, ...] = get_args(SandboxRequirement)

SANDBOXES = ("bwrap", "uid")
"""The sandboxes a job that asks for one (``sandbox="required"``) may be placed in."""


def sandboxed(capabilities: Capabilities) -> bool:
    """Whether a worker runs job code in a sandbox (:data:`SANDBOXES`)."""
    return capabilities.sandbox in SANDBOXES


class ArrayShape(BaseModel):
    """One array of a worker's dataset: its shape (rows first) and numpy dtype name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[Annotated[int, Field(ge=0)]]
    dtype: str


class DatasetSummary(BaseModel):
    """What a worker's dataset holds (``--data NAME=PATH``), never its content: the kind of
    path (``npz``, ``npy``: a directory of ``x.npy``/``y.npy``, ``shards``; ``path``: anything
    else, which only a job's ``loader`` can open, its rows ``None`` until then), its rows, the
    shapes and dtypes of ``x`` and ``y`` (``None``: no labels), and how many shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int | None = Field(ge=0)
    kind: Literal["npz", "npy", "shards", "path"] = "npz"
    x: ArrayShape | None = None
    y: ArrayShape | None = None
    shards: int = Field(default=1, ge=1)


WorkerName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")
]
"""A worker id or tag: 1 to 128 characters, none of them a control character (an id shows up
in logs, terminals and the status page as it is)."""


class WorkerHello(_Message):
    """First message of an agent: who it is (an id it keeps across reconnects) and what it has."""

    kind: Literal["worker_hello"] = "worker_hello"
    worker_id: WorkerName | None = None
    tags: list[WorkerName] = Field(default_factory=list)
    capabilities: Capabilities
    peer_address: str | None = None
    datasets: dict[str, DatasetSummary] = Field(default_factory=dict)  # its own, by name
    public_key: str | None = None
    """With an id its operator chose, the agent's public identity key
    (:mod:`protocol.security.identity_proof`): the first such hello enrols the id; a later hello for
    an enrolled id is refused unless it proves the same key."""
    proof: str | None = None
    """The agent's signature of its connection's challenge and its id, by that key."""


class ClientHello(_Message):
    """First message of a client."""

    kind: Literal["client_hello"] = "client_hello"
    name: str | None = None


class Welcome(_Message):
    """The coordinator's answer to a hello: the id to use and the heartbeat contract."""

    kind: Literal["welcome"] = "welcome"
    worker_id: str | None = None
    heartbeat_interval: Interval
    heartbeat_timeout: Interval
    server: str


class Heartbeat(_Message):
    """An agent is alive; sent every ``heartbeat_interval`` even while its daemon computes."""

    kind: Literal["heartbeat"] = "heartbeat"
    sent_at: float
    job_id: str | None = None


class Shutdown(_Message):
    """The coordinator is going away (the agent reconnects with backoff)."""

    kind: Literal["shutdown"] = "shutdown"
    reason: str


# -- replies -----------------------------------------------------------------------------------


class Ack(_Message):
    """A request that returns nothing succeeded."""

    kind: Literal["ack"] = "ack"


class Result(_Message):
    """A request succeeded with a value."""

    kind: Literal["result"] = "result"
    result: Any = None


class Error(_Message):
    """A request failed: ``error.code`` says how, ``error.message`` what and where."""

    kind: Literal["error"] = "error"
    error: ErrorInfo


# -- coordinator → agent -----------------------------------------------------------------------


class OpenJob(_Message):
    """Start a filter daemon for ``job_id`` and load the job's filters into it (each as it
    travels: :mod:`protocol.filter_buffers`)."""

    kind: Literal["open_job"] = "open_job"
    job_id: str
    filters: dict[str, FilterBuffer]
    threads: int | None = None
    peer_secret: str | None = None
    """This worker's link key in the job (:func:`protocol.security.peer_credentials.link_key`): a
    peer link for the job is accepted only from a worker that presents its credential made from it
    (``None``: none is)."""


class PeerRoute(BaseModel):
    """Where a command's result goes instead of back to the coordinator: the mailbox ``key`` of
    worker ``worker`` (over the direct peer link, or relayed by the coordinator)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: str
    key: str


class Call(_Message):
    """One filter-daemon command (:mod:`protocol.daemon`, without ``id``) for ``job_id``.

    Pipeline stages pass tensors to each other, not through the coordinator: ``input_from``
    names a mailbox key whose delivered value becomes ``request[input_field]`` (the agent waits
    for it), and ``output_to`` sends the command's result to another worker's mailbox instead of
    replying with it (the reply is then ``{"delivered": bytes sent}``).

    ``seq`` orders a job's calls on the worker: the calls carrying one run strictly in ``seq``
    order (0, 1, 2, … per job), each starting when the one before has finished on the daemon. A
    pipeline stage's whole schedule can so be sent at once and run back to back, with no round
    trip to the coordinator between two micro-batches. After a sequenced call fails, the later
    ones fail at once.

    ``keep`` names, by the keys that lead to it, a part of the result that holds files
    (``{name: bytes}``, a sharded checkpoint's, say): the agent writes them to its own disk and
    replies with ``{"kept": id, "files": {name: size}}`` in their place, and the coordinator
    reads them a piece at a time (:class:`ReadKept`) while the job goes on, then drops them
    (:class:`DropKept`; they go with the job too). So no reply of a replica ever brings the
    coordinator a file whole.
    """

    kind: Literal["call"] = "call"
    job_id: str
    request: dict[str, Any]
    timeout: Seconds | None = None
    input_from: str | None = None
    input_field: str = "x"
    output_to: PeerRoute | None = None
    seq: int | None = Field(default=None, ge=0)
    keep: list[str] | None = Field(default=None, min_length=1)


MAX_READ_BYTES = 64 << 20
"""The most bytes one read of a file in pieces asks for (:class:`ReadKept` of an agent,
:class:`GetResult` and :class:`GetCheckpoint` of a coordinator): what the one answering reads
into its memory at once."""


class ReadKept(_Message):
    """Bytes ``[offset, offset + length)`` of file ``name`` that a call of ``job_id`` left on
    the worker (:attr:`Call.keep`), under the id ``kept`` its reply gave (→ :class:`Result`
    with the bytes: fewer only where the file ends)."""

    kind: Literal["read_kept"] = "read_kept"
    job_id: str
    kept: str
    name: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0, le=MAX_READ_BYTES)


class DropKept(_Message):
    """The files a call of ``job_id`` left on the worker under ``kept`` are read: remove them
    (an unknown id is already gone)."""

    kind: Literal["drop_kept"] = "drop_kept"
    job_id: str
    kept: str


class Links(_Message):
    """The peers a worker exchanges tensors with for ``job_id``: worker id → its peer address
    (``ws://HOST:PORT``), or ``None`` when it has none (then the coordinator relays).

    ``expects`` says what each peer may deliver here: worker id → the prefix of the mailbox
    keys it sends (``"act/"`` from the stage before, ``"grad/"`` from the one after). A delivery
    from any other worker, or to any other key, is refused.
    """

    kind: Literal["links"] = "links"
    job_id: str
    peers: dict[str, str | None]
    expects: dict[str, str] = Field(default_factory=dict)
    credentials: dict[str, str] = Field(default_factory=dict)
    """Peer id → what this worker presents to it when it dials it
    (:func:`protocol.security.peer_credentials.credential`)."""


class Deliver(_Message):
    """A tensor for worker ``to``'s mailbox: ``payload`` is an encoded frame, opaque on the way
    (a relaying coordinator forwards it without decoding the tensors)."""

    kind: Literal["deliver"] = "deliver"
    job_id: str
    to: str
    key: str
    payload: StrictBytes
    sender: str | None = None
    """Who sent it, as the receiver knows: set by the coordinator when it relays (from the
    connection it came on) and by the receiving agent on a direct link (from the hello)."""


class PeerHello(_Message):
    """First message on a peer link: which worker dials, for which job, and its credential to
    the receiver (:attr:`Links.credentials`), which the receiver checks against the id claimed,
    in constant time (:mod:`protocol.security.peer_credentials`). A link serves that one job."""

    kind: Literal["peer_hello"] = "peer_hello"
    worker_id: str
    job_id: str
    secret: str


class Probe(_Message):
    """Ping the worker's warm filter daemon: the no-op round trip through every hop."""

    kind: Literal["probe"] = "probe"


class CloseJob(_Message):
    """Stop ``job_id``'s daemon (also how a running command is cancelled)."""

    kind: Literal["close_job"] = "close_job"
    job_id: str


# -- client → coordinator ----------------------------------------------------------------------


class NodeInfo(BaseModel):
    """What the coordinator may know of a node without unpickling it: whether it trains by
    gradient descent, and then how (``training``: its TorchFilter's :class:`TrainingOptions`).

    On the wire the training options are keys of the node's object beside the others, as they
    always were (``{"differentiable": true, "epochs": 2, "batch_size": 32, ...}``); they are
    gathered into ``training`` when it is read, and a plain filter has none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    differentiable: bool = False
    training: TrainingOptions | None = None
    # Its loss needs labels y (not a model that computes its own, loss="model", nor a step=
    # function); it has a step= function (which trains it alone: no TorchFilter beside it).
    labels: bool = True
    step: bool = False
    # What makes replicas of it differ from one process training it (DataParallel's notes):
    buffers: bool = False  # the module holds buffers (replica 0's are broadcast each step)
    normalization: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=64
    )  # classes that normalise with batch statistics (BatchNorm1d...)
    randomness: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=64
    )  # classes that draw random numbers in training (Dropout...)
    # The trainable parameters' shapes: the bytes a step exchanges (protocol.rules.traffic).
    parameter_shapes: list[Annotated[list[NonNegativeInt], Field(max_length=16)]] = Field(
        default_factory=list, max_length=1 << 16
    )

    @model_validator(mode="before")
    @classmethod
    def _gather_training(cls, data: Any) -> Any:
        """The training options as the wire has them, keys beside the others, in ``training``
        (a differentiable node's defaults where it gives none)."""
        if not isinstance(data, Mapping) or "training" in data:
            return data
        keys = TrainingOptions.model_fields.keys()
        rest = {k: v for k, v in data.items() if k not in keys}
        given = {k: v for k, v in data.items() if k in keys}
        return rest | {"training": given if data.get("differentiable") else None}

    @model_serializer(mode="wrap")
    def _training_as_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The node as the wire has it: the training options as keys beside the others."""
        data: dict[str, Any] = handler(self)
        training = data.pop("training", None) or {}
        return data | training


MAX_GRAPH_NODES = 4096
"""Most nodes one job's graph may have: a bigger submit is ``bad_request`` from its validation,
before any check whose cost grows with the graph (a 50,000-node submit is refused like any)."""

NodeId = Annotated[str, Field(min_length=1, max_length=256)]
"""A graph node's id: 1 to 256 characters."""


class GraphSpec(BaseModel):
    """A graph as the coordinator sees it: node ids in order, opaque pickled filters, and what
    the client declares of each node (the coordinator never unpickles a filter); at most
    :data:`MAX_GRAPH_NODES` nodes. A filter's bytes come as ``bytes`` or, from the SDK, as a
    ``uint8`` array (:mod:`protocol.filter_buffers`): a view over the frame they came in, not
    a copy out of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_ids: Annotated[list[NodeId], Field(min_length=1, max_length=MAX_GRAPH_NODES)]
    filters: Annotated[dict[NodeId, FilterBuffer], Field(max_length=MAX_GRAPH_NODES)]
    nodes: Annotated[dict[NodeId, NodeInfo], Field(max_length=MAX_GRAPH_NODES)] = Field(
        default_factory=dict
    )


class StrategySpec(BaseModel):
    """A strategy by name with its options (see :mod:`coordinator.strategies`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class Submit(_Message):
    """Queue a job: train ``graph`` on ``x``/``y`` with ``strategy``."""

    kind: Literal["submit"] = "submit"
    graph: GraphSpec
    x: Any = None
    y: Any = None
    dataset: str | None = None  # instead of x/y: each worker's own dataset of that name
    loader: StrictBytes | None = None  # with dataset: pickled code the workers open it with
    strategy: StrategySpec
    x_val: Any = None  # validation data, evaluated at the end of every epoch (round)
    y_val: Any = None
    val_split: str | None = None  # instead of x_val/y_val: each worker's split of its dataset
    resume_from: str | None = None  # a job whose newest checkpoint this one starts from
    # None: a worker id, tag, dataset or device no registered worker has is refused at once;
    # seconds: the job waits that long for its workers, whatever it asks, then fails.
    wait_for_workers: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # for the job list
    file: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # its job file
    # "required": placed only on workers that run job code sandboxed (bwrap or uid)
    sandbox: SandboxRequirement = "any"
    # among the jobs that can start, the higher goes first; at most the client's ceiling
    priority: int = Field(default=0, ge=-1000, le=1000)
    # False: never preempted to make room for another job (counted against the client's quota)
    preemptible: bool = True
    # seconds it may run, then it fails (time_limit); a declared one lets it backfill
    time_limit: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    slots: int = Field(default=1, ge=1, le=1024)  # of each of its workers


class Watch(_Message):
    """Stream the events of ``job_id`` after ``after_seq`` until the job ends."""

    kind: Literal["watch"] = "watch"
    job_id: str
    after_seq: int = 0


class JobEvent(_Message):
    """One event of a job: queued, placed, progress, succeeded, failed, cancelled..."""

    kind: Literal["job_event"] = "job_event"
    job_id: str
    seq: int
    time: float
    event: str
    data: dict[str, Any] = Field(default_factory=dict)


class GetResult(_Message):
    """The trained states of a finished job (``wait`` seconds for it to finish, at most):
    ``states`` by node; or, for a sharded run, ``pieces``: how many ``replicas`` hold them,
    the plain filters' states (``plain``), the nodes (``node_ids``) and the bytes of each
    replica's file of pieces (``sizes``). The client then asks for each replica's pieces
    (``replica``: its rows of every parameter, :mod:`protocol.files.shard_pieces`), one at a time,
    and joins them: ``length`` bytes of its file from ``offset`` at a time (→ ``{"replica",
    "offset", "data"}``, fewer bytes only where it ends; the file is one codec frame), or
    without ``offset`` whole, decoded, in one message (→ ``{"replica", "pieces"}``)."""

    kind: Literal["get_result"] = "get_result"
    job_id: str
    wait: Seconds = 0.0
    replica: NonNegativeInt | None = None
    offset: NonNegativeInt | None = None
    length: int = Field(default=MAX_READ_BYTES, gt=0, le=MAX_READ_BYTES)


class GetCheckpoint(_Message):
    """One of a job's checkpoints: its position and its nodes' states (``seq``: its number;
    ``None``: the newest). A sharded run's holds, for ``states``, ``shards``: the names of
    its files (``names``: each replica's shards as torch.distributed.checkpoint wrote them;
    ``files``: each one's ``bytes`` and ``sha256``), what every replica holds alike
    (``rest``) and the plain filters' states (``plain``); the client then asks for each
    ``file`` of checkpoint ``seq`` in turn, ``length`` bytes from ``offset`` at a time (→
    ``{"file", "offset", "data"}``, fewer bytes only where it ends; without ``offset``:
    whole, checked against its digest, → ``{"file", "data"}``), and joins them."""

    kind: Literal["get_checkpoint"] = "get_checkpoint"
    job_id: str
    seq: Annotated[int, Field(ge=1)] | None = None
    file: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    offset: NonNegativeInt | None = None
    length: int = Field(default=MAX_READ_BYTES, gt=0, le=MAX_READ_BYTES)


class Cancel(_Message):
    """Cancel a queued or running job."""

    kind: Literal["cancel"] = "cancel"
    job_id: str


class GetJob(_Message):
    """One job's record."""

    kind: Literal["get_job"] = "get_job"
    job_id: str


MAX_LISTED = 1000
"""The most job records one list answer holds."""


class ListJobs(_Message):
    """The newest jobs (at most 1,000: an answer stays bounded), as records listed compactly
    (their history but its last row; a job's own record has it all)."""

    kind: Literal["list_jobs"] = "list_jobs"
    limit: Annotated[int, Field(ge=0, le=MAX_LISTED)] = 50


class GetQueue(_Message):
    """Every job running or queued that the client may see, in the order they go, each queued
    one with where it stands and why it waits (``wait``); for an admin, every client's share,
    what it holds and has held lately (``clients``)."""

    kind: Literal["get_queue"] = "get_queue"


class PruneJobs(_Message):
    """Remove ended jobs — record, events, result, checkpoints — from the coordinator: those
    that ended more than ``older_than`` seconds ago, all but the ``keep`` newest, as many of
    the oldest as leave ``max_bytes``, and those of ``job_ids``; the client's own (an admin's:
    anyone's). Returns what was removed (``dry_run``: would be): ``{"jobs", "bytes",
    "kept"}`` (``kept``: ids asked for that are not an ended job of the client's)."""

    kind: Literal["prune_jobs"] = "prune_jobs"
    older_than: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    keep: NonNegativeInt | None = None
    max_bytes: NonNegativeInt | None = None
    job_ids: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=10_000
    )
    dry_run: bool = False


class Status(_Message):
    """Workers and jobs at a glance."""

    kind: Literal["status"] = "status"


class Ping(_Message):
    """A no-op: answered by the coordinator, or (``worker_id``) by that worker's daemon."""

    kind: Literal["ping"] = "ping"
    worker_id: str | None = None


# -- transport ---------------------------------------------------------------------------------


Message = Annotated[
    WorkerHello
    | ClientHello
    | Welcome
    | Heartbeat
    | Shutdown
    | Ack
    | Result
    | Error
    | OpenJob
    | Call
    | Links
    | Deliver
    | PeerHello
    | Probe
    | CloseJob
    | ReadKept
    | DropKept
    | Submit
    | Watch
    | JobEvent
    | GetResult
    | GetCheckpoint
    | Cancel
    | GetJob
    | ListJobs
    | GetQueue
    | PruneJobs
    | Status
    | Ping,
    Field(discriminator="kind"),
]
message_adapter: TypeAdapter[Message] = TypeAdapter(Message)

REPLY_KINDS = frozenset({"ack", "result", "error"})
