"""The agent ↔ filter-daemon link's messages.

The worker agent drives one filter daemon (``python -m worker.daemon``) per job through the
daemon's stdin/stdout; the frames that carry these messages, and the shared memory large ones
take, are the worker's business (``worker.daemon.pipe``, ``worker.daemon.shared_memory``).

A request is one of the command models below (``cmd`` names it, ``id`` is chosen by the agent); the
daemon answers every request, in order, with an :class:`OkReply` or an :class:`ErrorReply` carrying
the same ``id`` (``-1`` when the request was too broken to read one). Strictly one request at a
time: the daemon is a single thread running user code.

Fields that carry data (``x``, ``y``, states, gradients, results) are typed ``Any`` so that pydantic
never walks a tensor: the codec already decoded them, zero-copy, and validating them would copy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

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
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from protocol.compressed_trees import is_compressed
from protocol.errors import ErrorInfo
from protocol.filter_buffers import FilterBuffer
from protocol.options.compression import Compression, TreeCompression


def _plain_or_compressed(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A compressed tree as it is (:func:`protocol.compressed_trees.decode` checks it where it
    is used); anything else validated as a plain tree."""
    return value if is_compressed(value) else handler(value)


GradientTree = Annotated[dict[str, dict[str, Any]], WrapValidator(_plain_or_compressed)]
"""Node id → parameter name → tensor, or such a tree compressed
(:mod:`protocol.compressed_trees`)."""

__all__ = [
    "ApplyGradientsRequest",
    "BatchedFitRequest",
    "CompositeFitRequest",
    "CompositeForwardRequest",
    "DaemonReply",
    "DaemonRequest",
    "DataSource",
    "DdpSpec",
    "DiLoCoAloneSpec",
    "DiLoCoGroupSpec",
    "DistEvaluateRequest",
    "DistJoinRequest",
    "DistLeaveRequest",
    "DistLoadShardsRequest",
    "DistOuterStateRequest",
    "DistOuterUpdateRequest",
    "DistPiecesRequest",
    "DistPlanRequest",
    "DistProbeRequest",
    "DistPseudoGradientsRequest",
    "DistShardFileRequest",
    "DistStoreRequest",
    "DistTrainRequest",
    "ErrorReply",
    "EvaluateRequest",
    "FitRequest",
    "ForwardRequest",
    "GetGradientsRequest",
    "GetOptimizerStateRequest",
    "GetStateRequest",
    "GradientsRequest",
    "LoadRequest",
    "OkReply",
    "OuterStepSpec",
    "PingRequest",
    "PipePlanRequest",
    "PipeTrainRequest",
    "ReplicaModeSpec",
    "ReplicaPlace",
    "ScheduleRequest",
    "SecAggRequest",
    "SetOptimizerStateRequest",
    "SetStateRequest",
    "ShardedSpec",
    "Sharding",
    "ShutdownRequest",
    "SnapshotWay",
    "StageBackwardRequest",
    "StageForwardRequest",
    "StageNormRequest",
    "StageRequest",
    "StageStepRequest",
    "reply_adapter",
    "request_adapter",
    "request_fields",
]

# --------------------------------------------------------------------------------------------
# Requests


Sharding = Literal["none", "full", "gradients"]
"""What DataParallel's replicas shard with FSDP2 (``none``: nothing; ``full``: parameters,
gradients and optimizer state; ``gradients``: those, the parameters kept gathered from forward
to backward); :data:`protocol.options.strategies.SHARDINGS` lists them."""


class _Request(BaseModel):
    """Fields every command has. Unknown fields are refused, so a typo is an error, not a no-op.

    ``cmd`` defaults to the command's own name (a sender writes ``GetStateRequest(node_ids=...)``);
    ``id`` is the numbering sender's (the agent's supervisor), 0 until it numbers the request;
    one read off the pipe (:data:`request_adapter`) must have it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: StrictInt = 0  # strict: the id echoed in the reply is exactly the one that was sent


class LoadRequest(_Request):
    """Replace the loaded filters: node id → a filter's bytes (:mod:`protocol.filters`), in
    graph order, each as it travels (:mod:`protocol.filter_buffers`)."""

    cmd: Literal["load"] = "load"
    filters: dict[str, FilterBuffer]


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
    ``reset_optimizer`` trains with fresh optimizers instead of the kept ones; ``lr`` sets their
    learning rate; ``start`` holds states to set before training (saving a ``set_state``);
    ``start_loss`` asks for the loss before training (q-FedAvg's F_k(w_t)); ``clip_norm``
    clips the TorchFilters' update to that L2 norm (client-side DP clipping). The learning-rate
    schedules span this call's epochs, or ``schedule_epochs`` of which ``schedule_before`` were
    trained before it (a federated run's earlier rounds)."""

    cmd: Literal["batched_fit"] = "batched_fit"
    node_ids: Annotated[list[str], Field(min_length=1)]
    batch_size: PositiveInt | None = None
    epochs: NonNegativeInt | None = None
    prox_mu: NonNegativeFloat = 0.0
    reset_optimizer: bool = False
    schedule_before: NonNegativeInt = 0
    schedule_epochs: PositiveInt | None = None
    validation: str | None = None  # staged validation data, evaluated at each epoch's end
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    start: dict[str, Any] | None = None  # states set first: a virtual client's w_t
    start_loss: bool = False
    clip_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    return_output: bool = True  # False: the chain's output on the data stays on the worker
    return_states: bool = True  # False: the caller reads them later (get_state), when it can


class StageRequest(_Request):
    """Keep data under ``name`` for later commands: sent inline (``x``, ``y``), or a dataset of
    the worker's own (``dataset``: a name the agent was given with ``--data NAME=PATH``), opened
    by the job's pickled ``loader`` when one is given (:mod:`engine.data.dataset_rows`)."""

    cmd: Literal["stage"] = "stage"
    name: str
    x: Any = None
    y: Any = None
    dataset: str | None = None
    loader: StrictBytes | None = None
    labels: bool = False  # stage the dataset's y as the rows: a pipeline's last stage
    split: str | None = None  # the dataset's split of that name (validation: "val")


class GradientsRequest(DataSource):
    """A data-parallel replica's half of a step: forward, loss and backward over the rows (plain
    filters apply the state they hold), then the gradients of the chain's torch nodes.

    ``seed`` seeds torch's generator for the forward (dropout masks: per replica and step);
    ``buffers`` (replica 0's, node → name → tensor) are set before it, DDP's
    ``broadcast_buffers``; ``return_buffers``: the reply carries this replica's after it."""

    cmd: Literal["gradients"] = "gradients"
    node_ids: Annotated[list[str], Field(min_length=1)]
    apply: GradientTree | None = None  # the previous step's mean, applied first
    apply_ends_epoch: bool = False  # that step was its epoch's last (epoch-wise schedulers)
    read_next: list[int] | None = None  # the rows of ``data`` the next step will ask for
    seed: int | None = None
    buffers: dict[str, dict[str, Any]] | None = None
    return_buffers: bool = False
    # The gradients travel back compressed (protocol.compressed_trees, with error feedback).
    compression: TreeCompression | None = None


class EvaluateRequest(DataSource):
    """Evaluate the chain as it stands on the data (``x``, ``y``, or staged): forward through
    ``node_ids`` up to the last TorchFilter, its loss and metrics. Returns ``{"val_loss",
    <metric>..., "rows"}``."""

    cmd: Literal["evaluate"] = "evaluate"
    node_ids: Annotated[list[str], Field(min_length=1)]


class ScheduleRequest(_Request):
    """The horizon of the run's learning-rate schedules, for a daemon that is told each step
    rather than running the loop (a data-parallel replica, a pipeline stage): optimizer steps
    per epoch, epochs, and the step the run stops after when ``max_steps`` comes first. Sent
    before any optimizer is made or loaded."""

    cmd: Literal["schedule"] = "schedule"
    steps_per_epoch: NonNegativeInt
    epochs: NonNegativeInt
    max_steps: PositiveInt | None = None


Secret = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", repr=False)]
"""A rendezvous's secret: 32 bytes in hex, made by the coordinator for each store."""


class DistStoreRequest(_Request):
    """Open the rendezvous of a torch collective here (replica 0): a store on a free port of
    ``address`` (the address the other members dial, where it is one of this machine's; else
    every interface) that only connections proving ``secret`` may use
    (:mod:`engine.rendezvous_store`), kept until ``dist_leave``. Returns ``{"port": int}``."""

    cmd: Literal["dist_store"] = "dist_store"
    timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    secret: Secret
    address: str = ""


class DistProbeRequest(_Request):
    """Whether this daemon can open a TCP connection to ``host:port`` within ``timeout``
    seconds. Returns ``{"reachable": bool, "error": str | None}``."""

    cmd: Literal["dist_probe"] = "dist_probe"
    host: str
    port: Annotated[int, Field(gt=0, lt=65536)]
    timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)]


class DistJoinRequest(_Request):
    """Join a process group as ``rank`` of ``world`` through the store at ``host:port`` (keys
    under ``prefix``, one per formation of the group); ``backend`` is NCCL only when every member
    trains on CUDA. ``timeout`` bounds the join and every collective after it. Returns
    ``{"backend": str}``."""

    cmd: Literal["dist_join"] = "dist_join"
    host: str
    port: Annotated[int, Field(gt=0, lt=65536)]
    secret: Secret  # what the store asks every member to prove
    prefix: str
    backend: Literal["gloo", "nccl"] = "gloo"
    rank: NonNegativeInt
    world: PositiveInt
    timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)]

    @model_validator(mode="after")
    def _rank_in_world(self) -> Self:
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")
        return self


class _Steps(_Request):
    """Steps ``[start, stop)`` of a plan a group's members walk."""

    start: NonNegativeInt
    stop: NonNegativeInt

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.stop < self.start:
            raise ValueError(f"stop {self.stop} is before start {self.start}")
        return self


class _BatchPlan(_Request):
    r"""The global batches of a run, as every member computes them: ``rows`` rows, ``epochs``,
    ``batch_size`` (default: all rows), in order or ``shuffle``\ d with ``seed``; the first
    ``max_steps`` of them when it is given."""

    rows: NonNegativeInt
    epochs: NonNegativeInt
    batch_size: PositiveInt | None = None
    shuffle: bool = False
    seed: int = 0
    max_steps: PositiveInt | None = None


class OuterStepSpec(BaseModel):
    """DiLoCo's outer optimisation, as a replica runs it (Douillard et al. 2023, Algorithm 1):
    after every ``sync_every`` inner steps counted over the run, after its last, and after each
    step of ``also`` (:func:`protocol.rules.fragments.fragment_syncs`), the replicas average their
    pseudo-gradients (global weights − local weights) and take one step of SGD on the global
    weights (``lr``, ``momentum``, Nesterov when ``nesterov``); the inner optimizer's state is
    kept across synchronisations, or dropped at each (``reset``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sync_every: PositiveInt
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    momentum: Annotated[float, Field(ge=0, lt=1)]
    nesterov: bool
    inner_state: Literal["keep", "reset"] = "keep"
    also: list[PositiveInt] = Field(default_factory=list)  # steps (from 1) a sync also follows
    # Streaming DiLoCo (protocol.rules.fragments): the model in fragments synchronised at
    # staggered steps, each exchange landing ``overlap`` steps after it starts, the local
    # weights then mixed with the global ones (α·local + (1 − α)·global)
    fragments: PositiveInt = 1
    overlap: NonNegativeInt = 0
    mixing: Annotated[float, Field(ge=0, lt=1)] = 0.0

    def streams(self) -> bool:
        """Whether this is Streaming DiLoCo (fragments, an overlap or mixing): the replicas
        hold the global model whole only after the blocking synchronisations."""
        return self.fragments > 1 or self.overlap > 0 or self.mixing > 0


class ReplicaPlace(BaseModel):
    """A replica's place among a run's replicas where its group does not say it: ``rank`` of
    ``world`` (it has no group, or its group was formed anew with fewer or other members)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: NonNegativeInt
    world: PositiveInt


class _ModeSpec(BaseModel):
    """What every replica mode says of the plan: by default, that the group gives the
    replica its place and that no outer step is taken. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def given_place(self) -> ReplicaPlace | None:
        """The replica's place among the replicas, where the coordinator gives it rather than
        the group."""
        return None

    def outer_step(self) -> OuterStepSpec | None:
        """DiLoCo's outer step, for a mode that takes one."""
        return None


class DdpSpec(_ModeSpec):
    """DataParallel on the torch group: the run wrapped in ``DistributedDataParallel``, every
    step's gradients all-reduced during its backward; ``sync_batchnorm``: BatchNorm layers as
    ``torch.nn.SyncBatchNorm`` (CUDA)."""

    kind: Literal["ddp"] = "ddp"
    sync_batchnorm: bool = False


class DiLoCoGroupSpec(_ModeSpec):
    """DiLoCo over the torch group: inner steps on the replica's own slices (DDP's wrapper, no
    all-reduce), and at each synchronisation the ``outer`` step the replicas take together.

    ``regroup``: the group formed again (replicas dropped or joined at a sync); the replica's
    place is then the one given (not its rank in the group), its local weights stay as they are
    (no broadcast), and its global weights, outer momentum and a synchronisation its group broke
    in carry over from the group before (a joiner's global weights are its weights, its outer
    momentum what ``dist_outer_state`` gives it)."""

    kind: Literal["diloco_group"] = "diloco_group"
    outer: OuterStepSpec
    sync_batchnorm: bool = False
    regroup: ReplicaPlace | None = None

    def given_place(self) -> ReplicaPlace | None:
        return self.regroup

    def outer_step(self) -> OuterStepSpec:
        return self.outer


class DiLoCoAloneSpec(_ModeSpec):
    """DiLoCo through the coordinator: a replica with no group, at ``place`` among the
    replicas, training its slices between synchronisations; the coordinator takes the
    ``outer`` step (its ``sync_every``, ``also`` and ``inner_state`` say where, and whether the
    inner optimizer's state is dropped there)."""

    kind: Literal["diloco_alone"] = "diloco_alone"
    outer: OuterStepSpec
    place: ReplicaPlace

    def given_place(self) -> ReplicaPlace:
        return self.place

    def outer_step(self) -> OuterStepSpec:
        return self.outer


class ShardedSpec(_ModeSpec):
    """DataParallel with FSDP2 on the torch group: what the replicas shard (``sharding``:
    ``"full"`` or ``"gradients"``), and the module classes (qualified names) sharded as one unit
    each (``shard_units``; ``None``: each TorchFilter module's children)."""

    kind: Literal["sharded"] = "sharded"
    sharding: Literal["full", "gradients"]
    shard_units: list[Annotated[str, Field(min_length=1, max_length=500)]] | None = None


ReplicaModeSpec = Annotated[
    DdpSpec | DiLoCoGroupSpec | DiLoCoAloneSpec | ShardedSpec, Field(discriminator="kind")
]
"""How a data-parallel replica trains, chosen once with its plan (:class:`DistPlanRequest`) and
told apart by ``kind``: each mode holds only what it uses."""


class DistPlanRequest(_BatchPlan):
    """A data-parallel replica's plan, once joined: train ``node_ids`` on its slice of every
    global batch, the slices cut over the replicas' places; ``held`` are the global row ids
    staged here under ``data`` (sorted). With ``sizes`` the replicas train on their own datasets
    instead (``WorkerData``): ``sizes`` are their rows in the order of their worker ids, this
    replica the one at ``position``, the steps those of
    :func:`protocol.rules.batching.replica_batches` (``rows`` and ``held`` are not used).
    ``mode``: DDP, DiLoCo over the group or through the coordinator, or FSDP2's shards
    (:data:`ReplicaModeSpec`)."""

    cmd: Literal["dist_plan"] = "dist_plan"
    node_ids: Annotated[list[str], Field(min_length=1)]
    data: str
    held: list[int]
    sizes: list[NonNegativeInt] | None = None
    position: NonNegativeInt = 0
    mode: ReplicaModeSpec
    compression: Compression | None = None  # the gradients as "fp16", "bf16" or "powersgd:RANK"


class PipePlanRequest(_BatchPlan):
    """A pipeline stage's plan, once joined (its rank is its place in the pipeline): every
    global batch cut in ``micro_batches`` micro-batches, run through ``node_ids`` in the order of
    ``actions`` (``[kind, micro]``, kind ``"F"`` or ``"B"``: this stage's part of the schedule).
    The first stage reads its rows staged under ``data``; the last its labels, staged as ``x``
    under ``labels``."""

    cmd: Literal["pipe_plan"] = "pipe_plan"
    node_ids: Annotated[list[str], Field(min_length=1)]
    micro_batches: PositiveInt
    clip_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    actions: list[tuple[Literal["F", "B"], NonNegativeInt]]
    data: str | None = None
    labels: str | None = None


class PipeTrainRequest(_Steps):
    """Train global batches ``[start, stop)`` of the pipeline plan: this stage's actions of
    each, activations and their gradients sent to the neighbouring stages' daemons, then one
    optimizer step. Returns ``{"losses": [[...]], "rows": [[...]]}``: per batch, per
    micro-batch (the last stage's; empty lists elsewhere). With ``snapshot`` the reply also
    carries, under ``"snapshot"``, what a checkpoint saves of the stage as the chunk ends:
    ``{"states", "optimizers"}`` of its nodes (its TorchFilters' optimizers), as ``get_state``
    and ``get_optimizer_state`` give them."""

    cmd: Literal["pipe_train"] = "pipe_train"
    snapshot: bool = False


SnapshotWay = Literal["in_reply", "kept_whole", "kept_inner"]
"""What a replica gives of a checkpoint due after its chunk (:class:`DistTrainRequest`'s
``snapshot``): in the chunk's reply; or as one file for its worker to keep (a DiLoCo replica's,
on the torch group), all of it or its inner optimizer state alone."""


class DistTrainRequest(_Steps):
    """Train global steps ``[start, stop)`` of the data-parallel plan: per step this replica's
    slice, forward, loss and backward, gradients all-reduced (weighted by rows) during the
    backward, one optimizer step. Returns ``{"losses": [...], "rows": [...]}``: this replica's,
    per step. With ``snapshot`` the reply also carries, under ``"snapshot"``, what a
    checkpoint saves of the replica as the chunk ends. ``"in_reply"``: ``{"states",
    "optimizers"}`` as ``get_state`` and ``get_optimizer_state`` give them, or, sharded (every
    replica at once), ``"shards"``: the files torch.distributed.checkpoint wrote of its shards
    (name → bytes), ``"rest"``: what every replica holds alike, and the plain filters' states
    under ``"plain"`` — read in the chunk's own reply, while the next chunk trains, not by a
    request queued behind it.

    ``"kept_whole"`` or ``"kept_inner"`` (a DiLoCo replica's, on the torch group): the snapshot
    comes as one file for its worker to keep, ``{"shards": {SNAPSHOT_FILE: frame}}``
    (:data:`protocol.files.shard_files.SNAPSHOT_FILE`; the :mod:`protocol.codec` frame of what the
    reply would have held), which the coordinator reads while the next chunk trains:
    ``"kept_whole"``, its states, inner optimizer state and outer momentum; ``"kept_inner"``,
    its inner optimizer state only (the global model and the outer momentum being alike on every
    replica, one replica's suffice)."""

    cmd: Literal["dist_train"] = "dist_train"
    snapshot: SnapshotWay | None = None


class DistEvaluateRequest(DataSource):
    """Evaluate a sharded replica's model as it stands on the data (``rows`` of the staged
    validation data, or all of its own split), with its shards where they lie: every replica
    of the group at once, each unit's weights gathered for its forward and dropped after it,
    every replica forwarding as many batches (one with fewer, or none, of its own repeats one
    it holds, or reads a training row, counted for nothing). Returns ``{"val_loss",
    <metric>..., "rows"}`` of this replica's rows (``rows``: 0 with none), which the
    coordinator weights by rows."""

    cmd: Literal["dist_evaluate"] = "dist_evaluate"
    node_ids: Annotated[list[str], Field(min_length=1)]


class DistPiecesRequest(_Request):
    """A sharded replica's shards of its model, read where they lie (no collective) for the
    job's result, as one file for its agent to keep (``{"files": {"pieces": pieces}}``, kept
    as the pieces' codec frame: :mod:`protocol.files.shard_pieces`): ``{"states": ...}`` by node, as
    ``get_state`` gives them but with each sharded tensor as this replica's rows of it (dim 0,
    in rank order), and ``"split"``: the key paths of those tensors. No optimizer state."""

    cmd: Literal["dist_pieces"] = "dist_pieces"


class DistShardFileRequest(_Request):
    """A piece of one file of a sharded checkpoint (a ``dist_train`` snapshot's ``shards``),
    ``data`` at ``offset``, for this replica to keep until ``dist_load_shards``: its own
    shards, and the ``.metadata``, each sent in pieces in order (the one at ``0`` starts the
    file afresh, each next one goes on where the file ends)."""

    cmd: Literal["dist_shard_file"] = "dist_shard_file"
    name: Annotated[str, Field(min_length=1, max_length=255)]
    data: StrictBytes
    offset: NonNegativeInt = 0


class DistLoadShardsRequest(_Request):
    """Load the sharded checkpoint whose files ``dist_shard_file`` gave into this replica's
    shards, every replica at once (a collective), after ``dist_plan``; ``rest``: the snapshot's
    ``rest``, what every replica holds alike (buffers, step counts, schedulers)."""

    cmd: Literal["dist_load_shards"] = "dist_load_shards"
    rest: dict[str, Any]


class DistPseudoGradientsRequest(_Request):
    """A replica ``alone`` at a synchronisation of DiLoCo through the coordinator: its
    pseudo-gradients (the weights of its last synchronisation minus its weights now) as
    ``compression`` has them travel (:mod:`protocol.compressed_trees`, int8 with error
    feedback)."""

    cmd: Literal["dist_pseudo_gradients"] = "dist_pseudo_gradients"
    compression: TreeCompression


class DistOuterUpdateRequest(_Request):
    """A replica ``alone`` takes the coordinator's outer step: ``update`` (a compressed tree)
    added to the weights of its last synchronisation, which its weights become."""

    cmd: Literal["dist_outer_update"] = "dist_outer_update"
    update: dict[str, Any]


class DistOuterStateRequest(_Request):
    """DiLoCo's outer optimizer on a replica of a torch group: with ``momentum`` absent, what
    it holds (``{"momentum": node → name → tensor}``, torch SGD's momentum buffers of the
    global weights; empty before the first synchronisation or without momentum); with it,
    those buffers set (a replica joining at a synchronisation, a run resumed)."""

    cmd: Literal["dist_outer_state"] = "dist_outer_state"
    momentum: dict[str, dict[str, Any]] | None = None


class DistLeaveRequest(_Request):
    """Leave the process group (and close the store, on replica 0); nothing to leave is fine."""

    cmd: Literal["dist_leave"] = "dist_leave"


class StageForwardRequest(DataSource):
    """A pipeline stage's forward of micro-batch ``micro`` (ModelParallel, GPipe).

    Plain filters apply their held state, the differentiable run goes forward in training mode
    and what its backward needs is kept under ``micro``. ``first``: the input needs no gradient;
    ``last``: labels are required and the loss, times ``scale`` (the micro-batch's share of the
    global batch's rows), is kept. Returns the activation, or ``{"loss", "rows"}`` when ``last``.
    A last stage on its worker's own data takes ``y`` as rows ``label_rows`` of the labels it
    staged under ``labels``.
    """

    cmd: Literal["stage_forward"] = "stage_forward"
    node_ids: Annotated[list[str], Field(min_length=1)]
    micro: NonNegativeInt
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    first: bool = False
    last: bool = False
    labels: str | None = None
    label_rows: list[int] | None = None

    @model_validator(mode="after")
    def _labels_by_name(self) -> Self:
        if (self.labels is None) != (self.label_rows is None):
            raise ValueError("labels and label_rows come together")
        if self.labels is not None and not self.last:
            raise ValueError("staged labels are the last stage's y: give them with last")
        if self.labels is not None and self.y is not None:
            raise ValueError("staged labels are the last stage's y: give them or y, not both")
        return self


class StageBackwardRequest(_Request):
    """A pipeline stage's backward of micro-batch ``micro``; gradients accumulate.

    ``grad_output`` is the gradient of the stage's output (``None`` on the last stage, which
    backpropagates its loss). Returns the gradient of the stage's input (``None`` on the first)."""

    cmd: Literal["stage_backward"] = "stage_backward"
    micro: NonNegativeInt
    grad_output: Any = None


class StageNormRequest(_Request):
    """The sum of the squared norms of the gradients a pipeline stage's micro-batches left:
    its part of the norm the whole pipeline's gradient is clipped by. Returns a float."""

    cmd: Literal["stage_norm"] = "stage_norm"
    node_ids: Annotated[list[str], Field(min_length=1)]


class StageStepRequest(_Request):
    """End a pipeline global batch: the gradients times ``coefficient`` (the pipeline's
    clipping), one step of each node's optimizer and scheduler (an epoch-wise one at
    ``epoch_end``), then zeroed gradients.

    Returns the number of parameters stepped."""

    cmd: Literal["stage_step"] = "stage_step"
    node_ids: Annotated[list[str], Field(min_length=1)]
    epoch_end: bool = False
    coefficient: Annotated[float, Field(ge=0, le=1)] | None = None


class CompositeForwardRequest(_Request):
    """Forward ``x`` through a chain of nodes, optionally with explicit states by node id."""

    cmd: Literal["composite_forward"] = "composite_forward"
    node_ids: Annotated[list[str], Field(min_length=1)]
    x: Any
    states: dict[str, Any] | None = None


class GetStateRequest(_Request):
    """Read the states of some nodes (``None``: all of them), as they are now; with ``digests``,
    only each differentiable node's tensors' SHA-256 (name → hex, over dtype, shape and bytes):
    what the replicas of a data-parallel run compare at its end, instead of sending it whole."""

    cmd: Literal["get_state"] = "get_state"
    node_ids: list[str] | None = None
    digests: bool = False


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
    gradients: GradientTree
    epoch_end: bool = False  # the step ends an epoch (epoch-wise schedulers step after it)
    buffers: dict[str, dict[str, Any]] | None = None  # replica 0's, set after the step


class SecAggRequest(_Request):
    """One step of secure aggregation for the virtual client ``client`` in ``round``
    (``worker.daemon.secagg_client``): ``keys`` (its two public keys), ``share`` (its secrets'
    shares, sealed for each of its ``peers``: label → [encryption key, mask key]), ``mask``
    (its trained model, ``weight`` times the float entries named in ``layout``, quantized and
    masked, after opening the ``sealed`` shares its peers sent it), ``unmask`` (the shares it
    holds of the ``survivors``' self-masks and of the ``dropped``' mask keys)."""

    cmd: Literal["secagg"] = "secagg"
    step: Literal["keys", "share", "mask", "unmask"]
    round: NonNegativeInt
    client: str
    peers: dict[str, list[StrictBytes]] | None = None
    threshold: PositiveInt | None = None
    sealed: dict[str, StrictBytes] | None = None
    layout: list[list[str]] | None = None
    weight: PositiveInt | None = None
    scale_bits: Annotated[int, Field(ge=1, le=52)] = 24
    bound: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    survivors: list[str] | None = None
    dropped: list[str] | None = None


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
    | ScheduleRequest
    | EvaluateRequest
    | DistStoreRequest
    | DistProbeRequest
    | DistJoinRequest
    | DistPlanRequest
    | DistTrainRequest
    | DistEvaluateRequest
    | DistPiecesRequest
    | DistShardFileRequest
    | DistLoadShardsRequest
    | DistPseudoGradientsRequest
    | DistOuterUpdateRequest
    | DistOuterStateRequest
    | PipePlanRequest
    | PipeTrainRequest
    | DistLeaveRequest
    | StageForwardRequest
    | StageBackwardRequest
    | StageNormRequest
    | StageStepRequest
    | SecAggRequest
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
    fields = type(request).model_fields
    return {name: _plain(getattr(request, name)) for name in fields if name in names}


def request_fields(request: BaseModel) -> dict[str, Any]:
    """A request model as the plain dict that goes on the wire.

    Shallow on purpose: ``model_dump`` would rebuild every dict and list under the ``Any`` fields,
    and the values there are tensors the codec sends as they are. A field that is a model itself
    (a replica's mode, with its :class:`OuterStepSpec`) is dumped.
    """
    return {name: _plain(getattr(request, name)) for name in type(request).model_fields}


def _plain(value: Any) -> Any:
    """A field's value as the codec takes it: a nested model as its dict."""
    return value.model_dump() if isinstance(value, BaseModel) else value


# --------------------------------------------------------------------------------------------
# Replies


class OkReply(BaseModel):
    """The command ran; ``result`` is what it returned.

    ``fit``, ``composite_fit`` and ``batched_fit`` return the engine's ``FitResult`` as a dict
    (``output``, ``states``, ``loss``, ``rows``, ``epoch_losses``, ``history``); ``load`` the
    node ids; ``set_state``, ``set_optimizer_state``, ``ping`` and ``shutdown`` ``None``.
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
