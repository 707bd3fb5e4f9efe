"""Strategy options: what a job may ask of each strategy, defined once for the SDK, the wire and
the coordinator (the federated ones in :mod:`protocol.options.federated`, the machinery in
:mod:`protocol.options.base`; all of them importable from here).

The SDK's classes (``somatize.Local``, ``somatize.DataParallel``...) are these models, built from
Python arguments; the coordinator (``coordinator.strategies``) parses the JSON options of a
:class:`~protocol.messages.StrategySpec` into the same model (:func:`parse`) and takes it whole.
A model's :meth:`~protocol.options.base.Options.to_wire` is the options dict a client sends
(options at their defaults left out). Each rule is worded once; a refusal names the SDK class
(``FedAvg: rounds must be ...``) or the strategy as it travels (``fedavg: rounds must be ...``).

Every strategy (and each pipeline partition) takes ``device``: ``None`` for any worker, else a
worker's training device as it announces it (``"cpu"``, ``"cuda:N"``, ``"mps"``) or ``"cuda"``
for any CUDA device (:func:`protocol.options.devices.device_fits`)::

    client.submit(graph, x, y, strategy=sz.DataParallel(2, device="cuda"))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

from pydantic import (
    BeforeValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocol.daemon import OuterStepSpec, Sharding
from protocol.options.base import (
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_RESTART_TIMEOUT,
    Boolean,
    Caller,
    CheckpointOptions,
    DeviceName,
    Form,
    Options,
    PositiveInt,
    RestartOptions,
    Rule,
    Seconds,
    Selector,
    StrategyOptions,
    T,
    count,
    device,
    finite_positive,
    form_of,
    integer,
    number_in,
    one_of,
    parse,
    prefixed,
)
from protocol.options.compression import Compression
from protocol.options.devices import DEVICES, device_fits, is_device
from protocol.options.federated import FedAvgOptions, FedProxOptions, QFedAvgOptions
from protocol.options.refusals import refused
from protocol.options.server_optimizers import (
    SERVER_OPTIMIZERS,
    AdaptiveOptions,
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
    PlainAveragingOptions,
    ServerOptimizerOptions,
    ServerOptions,
    server_options,
)
from protocol.text.wording import listed

__all__ = [
    "COLLECTIVES",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_ELASTIC_TIMEOUT",
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_RESTART_TIMEOUT",
    "DEVICES",
    "INNER_STATES",
    "SCHEDULES",
    "SERVER_OPTIMIZERS",
    "SHARDINGS",
    "TRANSPORTS",
    "AdaptiveOptions",
    "Caller",
    "CheckpointOptions",
    "DataParallelOptions",
    "DiLoCoOptions",
    "FedAdagradOptions",
    "FedAdamOptions",
    "FedAvgMOptions",
    "FedAvgOptions",
    "FedProxOptions",
    "FedYogiOptions",
    "LocalOptions",
    "ModelParallelOptions",
    "PartitionOptions",
    "PlainAveragingOptions",
    "QFedAvgOptions",
    "RestartOptions",
    "ServerOptimizerOptions",
    "ServerOptions",
    "Sharding",
    "StrategyOptions",
    "T",
    "WorkerDataOptions",
    "device_fits",
    "is_device",
    "parse",
    "server_options",
]

PipelineSchedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
"""The pipeline schedules ModelParallel runs."""

Collective = Literal["auto", "torch", "coordinator"]
COLLECTIVES: tuple[str, ...] = get_args(Collective)
"""How DataParallel reduces gradients: torch.distributed between the replicas (``torch``),
through the coordinator (``coordinator``), or the first when every replica can reach the
rendezvous (``auto``)."""

SHARDINGS: tuple[str, ...] = get_args(Sharding)
"""What DataParallel's replicas shard (FSDP2 on the torch collective): nothing (``none``: each
holds the whole model, as DDP), parameters, gradients and optimizer state (``full``: as
``fully_shard(reshard_after_forward=True)``), or gradients and optimizer state with the
parameters kept gathered from forward to backward (``gradients``: ``reshard_after_forward=
False``, ZeRO-2-like)."""

Transport = Literal["auto", "torch", "websocket"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
"""How ModelParallel's stages pass activations: torch.distributed point-to-point between their
daemons (``torch``), calls from the coordinator over the WebSocket peer links (``websocket``),
or the first when every stage can reach the rendezvous (``auto``)."""

DEFAULT_COLLECTIVE_TIMEOUT = 60.0
"""Seconds a torch collective (joining the group, one all-reduce) may take before it fails:
never torch's 30-minute default."""

DEFAULT_ELASTIC_TIMEOUT = 60.0
"""Seconds an elastic DataParallel job waits for a replacement worker unless told otherwise."""


# -- single-worker and data-parallel ------------------------------------------------------------


class LocalOptions(RestartOptions):
    """The whole graph on one worker with all the data, trained as ``graph.fit`` would::

        client.submit(graph, x, y, strategy=sz.Local(tag="gpu"))

    Args:
        worker: run on the worker with this id (default: any idle worker).
        tag: run on a worker that has this tag (default: any idle worker).
        device: run on a worker training on this device (default: any).
        max_restarts: how many times the job, when its worker is lost or its daemon crashes,
            is queued again and trains from the start (a Local job keeps no checkpoints: its
            one call trains the whole graph) instead of failing (default 0).
        restart_timeout: seconds a restart waits for a worker.

    Raises:
        ValueError: ``worker`` or ``tag`` is not a non-empty string, or both are given;
            ``device`` is not one of the device forms; ``max_restarts`` not an integer >= 0 or
            ``restart_timeout`` not a positive number.
    """

    name = "local"
    sdk_name = "Local"

    worker: Selector = None
    tag: Selector = None
    device: DeviceName = None
    inherited_after = "device"

    @model_validator(mode="after")
    def _pinned_once(self) -> Self:
        if self.worker is not None and self.tag is not None:
            raise ValueError(
                "pin a Local job to a worker or to a tag, not both "
                f"(worker={self.worker!r}, tag={self.tag!r})"
            )
        return self


# (the rules of DataParallel's own options, declared before it: its fields name them)


def _on_cuda(device: str | None) -> bool:
    return device is not None and device.startswith("cuda")


def _shard_units(key: str, units: object) -> tuple[str, ...] | None:
    """Module classes or their qualified names, made names (:func:`_qualified_name`)."""
    if units is None:
        return None
    if isinstance(units, (str, type)) or not isinstance(units, (list, tuple)) or not units:
        raise ValueError(
            f"{key} must be a non-empty list of module classes or their qualified names, "
            f"not {units!r}"
        )
    return tuple(_qualified_name(unit) for unit in units)


def _qualified_name(unit: object) -> str:
    """``module.QualName`` of a module class, or a name given as such.

    Raises:
        ValueError: ``unit`` is neither a class of ``torch.nn.Module`` nor a dotted name.
    """
    if isinstance(unit, type):
        if not any(k.__module__ == "torch.nn.modules.module" for k in unit.__mro__):
            raise ValueError(f"shard_units takes torch.nn.Module classes, not {unit!r}")
        return f"{unit.__module__}.{unit.__qualname__}"
    if isinstance(unit, str) and "." in unit.strip(".") and unit.isascii():
        return unit
    raise ValueError(
        "shard_units takes module classes or their qualified names (such as "
        f"'torch.nn.TransformerEncoderLayer'), not {unit!r}"
    )


class DataParallelOptions(CheckpointOptions):
    """Synchronous data-parallel SGD over ``workers`` replicas (gradient all-reduce).

    Each global batch — exactly the batch ``graph.fit`` takes, by the last TorchFilter's
    ``batch_size``, ``shuffle`` and ``seed`` — is split across the replicas with its labels; the
    coordinator averages their gradients weighted by slice size and every replica takes the same
    step with its own persistent optimizer. With a mean-reduced loss and no randomness in the
    model, the result equals ``graph.fit``. Plain filters before the first TorchFilter are fitted
    per shard and their states averaged by rows.

    A replica whose worker is lost fails the job at once (``worker_lost``, naming the worker),
    unless ``elastic``: then the step in flight is abandoned, the job waits up to
    ``elastic_timeout`` seconds for a replacement (an idle worker that matches, or the lost one
    reconnecting; a crashed daemon is restarted on its own worker), copies a surviving
    replica's weights and optimizer state (momentum, moments, step counts) onto it and resumes
    from the step that failed — so the result is still the one ``graph.fit`` gives. The job's
    events say what happened (``worker_lost``, ``worker_replaced``, ``worker_restored``). No
    replacement in time fails it with ``not_enough_workers``; every replica lost at once leaves
    nothing to copy and fails it with ``worker_lost``.

    How gradients are reduced (``collective``): ``"torch"`` — the replicas join one
    torch.distributed process group (gloo; NCCL when every replica is on CUDA) through a
    rendezvous the coordinator sets up on replica 0, and each runs the training loop itself,
    its gradients all-reduced by ``DistributedDataParallel`` during the backward; the
    coordinator then only sees progress. ``"coordinator"`` — every step's gradients go through
    the coordinator (the one path for workers that cannot reach each other, behind NAT).
    ``"auto"`` (default) — ``torch`` when every replica can open a connection to the rendezvous,
    checked at job start, else ``coordinator``; the ``placed`` event says which and why. Either
    gives the same result. A collective waits at most ``collective_timeout`` seconds.

    Args:
        workers: how many replicas (workers) to train on.
        tag: only workers with this tag (default: any idle workers).
        elastic: replace a lost replica and go on instead of failing.
        elastic_timeout: seconds an elastic job waits for a replacement worker.
        device: only workers training on this device (default: any).
        collective: ``"auto"``, ``"torch"`` or ``"coordinator"`` (above).
        collective_timeout: seconds joining the group or one collective may take.
        checkpoint_every: save a checkpoint (every replica's model and optimizer state, and
            the step) every this many steps; ``None`` (default): at the end of every epoch or
            after 60 s of training, whichever comes first; ``0``: never. A coordinator that
            dies and comes back on the same ``--state-dir`` resumes the job from its last one.
        keep_checkpoints: how many checkpoints of the job are kept (default 2).
        max_restarts: how many times the job, when a replica's worker is lost, its daemon
            crashes or the collective breaks, goes back to its last checkpoint and trains on
            from there instead of failing (default 0; ``elastic`` recovers without going back,
            on the step that failed). Each restart waits up to ``restart_timeout`` seconds for
            workers; the job's events say ``restarting`` and then ``resumed``.
        restart_timeout: seconds a restart waits for workers before the job fails with the
            error that stopped it.
        sync_batchnorm: BatchNorm layers normalise with the global batch's statistics
            (``torch.nn.SyncBatchNorm``; CUDA workers on the torch collective). Without it each
            replica normalises its slice with its own, and the running statistics follow
            DistributedDataParallel's ``broadcast_buffers``: replica 0's, broadcast to every
            replica each step. A model with BatchNorm or Dropout does not equal ``graph.fit``
            exactly; the job says why when it is submitted (:attr:`Job.notes`) and in its
            ``placed`` event. Dropout masks are drawn per replica from a generator seeded by
            the filter's seed, the replica and the step: a rerun gives the same result.
        compression: what the gradients travel as. On the torch collective, through torch's
            own DDP communication hooks: ``None`` (default, fp32), ``"fp16"`` or ``"bf16"``
            (each bucket cast before its all-reduce and back after: a relative error of at most
            2⁻¹¹ and 2⁻⁸ per value; ``"bf16"`` on CUDA workers, over NCCL), or
            ``"powersgd:RANK"`` (Vogels et al. 2019: each matrix's gradient sent as a
            rank-RANK factorisation, with error feedback and warm start; the first two steps
            all-reduce uncompressed), or ``"int8"`` (each replica's bucket quantised to 8 bits
            in chunks of 4,096 values, every value within max|chunk| / 254, all-gathered, with
            error feedback). Through the coordinator, ``"fp16"``, ``"bf16"`` (on any device)
            and ``"int8"`` compress both legs of the star: each replica's gradients and the
            mean sent back, int8 with error feedback on both (``"powersgd:RANK"`` is refused
            there). The result is then close to ``graph.fit``'s, not equal. DiLoCo takes
            ``"fp16"``, ``"bf16"`` and ``"int8"`` for its pseudo-gradients and outer updates.
        sharding: ``"none"`` (default): every replica holds the whole model, its gradients
            and its optimizer state. ``"full"``: each replica holds a 1/N shard of each
            (torch's FSDP2, ``fully_shard``), gathering a unit's parameters for its forward and
            again for its backward; ``"gradients"``: parameters stay gathered from forward to
            backward (more memory, one all-gather less). On the torch collective only, with a
            mean-reduced loss it equals ``graph.fit`` as unsharded DataParallel does. Where the
            coordinator reads the model (a checkpoint, a validation, the result) the replicas
            gather it whole first.
        shard_units: the module classes (or their qualified names, ``"torch.nn.
            TransformerEncoderLayer"``) each sharded as one unit; default: each TorchFilter's
            module's children.

    Raises:
        ValueError: ``workers`` is not a positive integer, ``tag`` not a non-empty string,
            ``elastic`` not a bool, ``sync_batchnorm`` without ``device="cuda"`` or with
            ``collective="coordinator"``, ``elastic_timeout`` or ``collective_timeout`` not a
            positive number, ``device`` not one of the device forms, ``collective`` not one
            of the three, ``checkpoint_every`` not ``None`` or an integer >= 0,
            ``keep_checkpoints`` not a positive integer, ``max_restarts`` not an integer >= 0
            or ``restart_timeout`` not a positive number.
    """

    name = "data_parallel"
    sdk_name = "DataParallel"

    workers: PositiveInt
    tag: Selector = None
    elastic: Boolean = False
    elastic_timeout: Seconds = DEFAULT_ELASTIC_TIMEOUT
    device: DeviceName = None
    collective: Annotated[Collective, Rule(one_of, COLLECTIVES)] = "auto"
    collective_timeout: Seconds = DEFAULT_COLLECTIVE_TIMEOUT
    inherited_after = "collective_timeout"
    sync_batchnorm: Boolean = False
    compression: Compression | None = None  # (its type parses it, refusing in its words)
    sharding: Annotated[Sharding, Rule(one_of, SHARDINGS)] = "none"
    shard_units: Annotated[tuple[str, ...] | None, Rule(_shard_units)] = None

    @model_validator(mode="after")
    def _sync_batchnorm_on_cuda_over_torch(self) -> Self:
        """torch's SyncBatchNorm runs on CUDA over a torch group only."""
        if not self.sync_batchnorm:
            return self
        if not _on_cuda(self.device):
            raise ValueError(
                "sync_batchnorm=True needs device='cuda' (or 'cuda:N'): torch.nn.SyncBatchNorm "
                f"normalises over a group of CUDA workers; device is {self.device!r}"
            )
        if self.collective == "coordinator":
            raise ValueError(
                "sync_batchnorm=True needs the torch collective (collective='auto' or 'torch'), "
                "not 'coordinator'"
            )
        return self

    @model_validator(mode="after")
    def _compression_fits_the_collective(self) -> Self:
        """bf16 on the torch collective over CUDA only, PowerSGD on the torch collective only."""
        compression, collective = self.compression, self.collective
        if compression is None:
            return self
        if compression.kind == "bf16" and not _on_cuda(self.device) and collective != "coordinator":
            raise ValueError(
                "compression='bf16' needs device='cuda' (or 'cuda:N') on the torch collective: "
                f"torch's bf16 hook runs on NCCL; device is {self.device!r} ('fp16' runs "
                "everywhere, and 'bf16' with collective='coordinator')"
            )
        if not compression.travels_as_tree and collective == "coordinator":
            raise ValueError(
                f"compression={compression!r} runs on the torch collective (collective='auto' or "
                "'torch'); through the coordinator gradients travel as 'fp16', 'bf16' or 'int8'"
            )
        return self

    @model_validator(mode="after")
    def _sharding_on_torch_alone(self) -> Self:
        """``shard_units`` for a sharded model only; sharding on the torch collective, not
        ``elastic``, compressed or with SyncBatchNorm."""
        sharding = self.sharding
        if sharding == "none":
            if self.shard_units is not None:
                raise ValueError("shard_units is for sharding='full' or 'gradients'")
            return self
        refused = [
            (
                self.collective == "coordinator",
                "collective='coordinator' (FSDP2 runs on "
                "the torch collective: collective='auto' or 'torch')",
            ),
            (self.elastic, "elastic=True (a replacement would need every replica's shard)"),
            (
                self.compression is not None,
                "compression (FSDP2 reduce-scatters the gradients as they are)",
            ),
            (self.sync_batchnorm, "sync_batchnorm=True"),
        ]
        for cannot, what in refused:
            if cannot:
                raise ValueError(f"sharding={sharding!r} does not go with {what}")
        return self


InnerState = Literal["keep", "reset"]
INNER_STATES: tuple[str, ...] = get_args(InnerState)
"""What DiLoCo does with each replica's inner optimizer at a synchronisation."""


class DiLoCoOptions(DataParallelOptions):
    """DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models"): data parallelism that talks every ``sync_every`` steps instead of every
    step, for workers on slow links.

    Each replica takes its slice of every global batch, as in ``DataParallel``, but steps on
    its own slice's gradient with the TorchFilter's own optimizer (the *inner* optimizer, kept
    across synchronisations: AdamW in the paper) and sends nothing. After every ``sync_every``
    steps counted over the run (as the paper and torchft count H: an epoch's end does not
    restart the count) and after the run's last, the replicas average their pseudo-gradients
    (global weights − local weights, one bucketed all-reduce) and take one *outer* step of SGD
    on the global weights — ``outer_lr``, ``outer_momentum``, Nesterov's momentum by default —
    from which the next inner steps start. They also synchronise where the global model is
    read: where the job validates (each epoch's end, and ``validate_every``), and at each
    epoch's end when ``sync_at_epoch_end``. A step's progress is the replicas' inner losses,
    weighted by rows; validation and the result see the global model.

    Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
    communication"): with ``fragments`` F the model's parameters, end to end, are cut into F
    runs of equal numbers of values (:mod:`protocol.rules.fragments`), each synchronised every
    ``sync_every`` steps at its own offset (fragment p after steps ≡ p·H/F mod H), so a
    synchronisation moves 1/F of the model; with ``overlap`` τ a fragment's exchange runs
    while the next τ inner steps train and lands after them, the local weights then set to
    ``mixing`` α·local + (1 − α)·global. Validation evaluates the global model as the
    fragments' last synchronisations left it, without synchronising; at the run's end every
    fragment synchronises at once, nothing in flight and nothing mixed: every replica then
    holds the global model. With F = 1, τ = 0, α = 0 it is DiLoCo. It runs on the torch
    collective (refused through the coordinator) and does not take elastic, checkpoints or
    max_restarts (the model is never whole on every replica while exchanges are in flight);
    ``overlap`` needs a model without buffers (DDP broadcasts them before each forward).

    With ``sync_every=1``, ``outer_lr=1``, ``outer_momentum=0`` and an inner SGD this is
    ``DataParallel`` (each replica's loss is weighted by its share of the global batch, so the
    average of the replicas' steps is the global batch's).

    How the replicas synchronise (``collective``): ``"torch"`` — over their torch.distributed
    group, each taking the outer step itself; ``"coordinator"`` — through the coordinator, for
    workers that cannot reach each other (behind NAT): it reads every replica's weights at a
    synchronisation, takes the outer step and sets them all to the result; ``"auto"``
    (default) — ``torch`` when the replicas' group forms, checked at job start, else
    ``coordinator``. Either gives the same result.

    What must outlive a replica — the global model, the outer momentum, every replica's inner
    optimizer state — is kept by the replicas on the torch collective and by the coordinator
    through it; either path is ``elastic``, saves checkpoints (``checkpoint_every`` not 0;
    DiLoCo's default is 0) and restarts (``max_restarts``). An elastic model with buffers (DDP
    broadcasts them at every inner step) trains through the coordinator (``auto`` picks it).
    ``elastic``: a replica whose worker is lost during a round is dropped from that round's
    average and the others go on without waiting (on the torch group they form it again
    without it to synchronise); after that synchronisation an idle worker takes its place,
    set to the global model, a survivor's inner optimizer state and the outer momentum (the
    job's events ``worker_dropped`` and ``worker_joined`` say who). A checkpoint is taken after a
    synchronisation (the first at or after every ``checkpoint_every`` steps; ``None``: at each
    epoch's end or after 60 s); a job resumed from one trains on exactly as it would have.
    ``compression`` (``"fp16"``, ``"bf16"``, ``"int8"``) is what the pseudo-gradients travel as
    (and, through the coordinator, the outer update sent back); int8 keeps what quantisation
    leaves out and sends it with the next synchronisation (error feedback). A resumed run's or
    a new replica's int8 residual starts empty.

    Args:
        workers: how many replicas (workers) to train on.
        sync_every: the inner steps between two synchronisations (H, >= 1).
        outer_lr: the outer SGD's learning rate (> 0; 0.7 in the paper).
        outer_momentum: the outer SGD's momentum, in [0, 1) (0.9 in the paper).
        nesterov: Nesterov's momentum for the outer step (default ``True``, as the paper).
        inner_state: ``"keep"`` (default) the inner optimizer's state across synchronisations,
            or ``"reset"`` it at each.
        sync_at_epoch_end: also synchronise at each epoch's end (default ``False``: only
            where the job validates there), as this project did before H was counted over the
            run.
        fragments: Streaming DiLoCo's fragments F (1 to ``sync_every``; default 1).
        overlap: the inner steps τ a fragment's exchange overlaps (0 to ``sync_every`` − 1;
            default 0).
        mixing: α in [0, 1): what the local weights keep of themselves when an exchange
            lands (default 0: they become the global weights).
        (the rest as ``DataParallel``.)

    Raises:
        ValueError: as ``DataParallel``; ``sync_every`` not a positive integer, ``outer_lr``
            not a positive number, ``outer_momentum`` not in [0, 1), ``nesterov`` not a bool,
            ``inner_state`` not ``"keep"`` or ``"reset"``, or one of the options not yet taken.
    """

    name = "diloco"
    sdk_name = "DiLoCo"

    sync_every: PositiveInt = 50
    outer_lr: Annotated[float, Rule(finite_positive)] = 0.7
    outer_momentum: Annotated[float, Rule(number_in, "[0, 1)")] = 0.9
    nesterov: Boolean = True
    inner_state: Annotated[InnerState, Rule(one_of, INNER_STATES)] = "keep"
    sync_at_epoch_end: Boolean = False
    fragments: PositiveInt = 1
    overlap: int = 0  # (its rule names sync_every: _overlap_within_sync_every)
    mixing: Annotated[float, Rule(number_in, "[0, 1)")] = 0.0
    # (checkpoint_every: 0, never, unless asked: its replicas synchronise to save one)
    defaults: ClassVar[Mapping[str, Any]] = {"checkpoint_every": 0}

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_within_sync_every(cls, overlap: object, info: ValidationInfo) -> object:
        """``overlap``: a whole number of steps below ``sync_every`` (declared, and so checked,
        before it: where it was refused, that refusal comes first)."""
        every = info.data.get("sync_every")
        if every is None:
            return overlap
        if not integer(overlap) or not 0 <= overlap < every:  # type: ignore[operator]
            raise ValueError(
                f"overlap must be a whole number of steps from 0 to sync_every - 1 "
                f"({every - 1}), not {overlap!r}"
            )
        return overlap

    @model_validator(mode="after")
    def _streams_on_torch_and_keeps_nothing(self) -> Self:
        """Each fragment at its own step of ``sync_every``; Streaming DiLoCo on the torch
        collective and keeping nothing of a replica; whole models, compressed as trees."""
        every, fragments = self.sync_every, self.fragments
        if fragments > every:
            raise ValueError(
                f"fragments must be at most sync_every ({every}): each synchronises at its own "
                f"step of the {every}, not {fragments}"
            )
        streaming = self.streaming()
        if streaming and self.collective == "coordinator":
            raise ValueError(
                f"Streaming DiLoCo ({streaming}) runs on the torch collective; "
                "collective='coordinator' cannot stream: use 'auto' or 'torch'"
            )
        if self.sharding != "none":
            raise ValueError(
                "DiLoCo's replicas each keep a whole model between synchronisations: sharding "
                "is for DataParallel"
            )
        compression = self.compression
        if compression is not None and not compression.travels_as_tree:
            raise ValueError(
                f"compression={compression!r} factorises DataParallel's gradients; DiLoCo's "
                "pseudo-gradients travel as 'fp16', 'bf16' or 'int8'"
            )
        keeps = self.keeps_state()
        if keeps and streaming:
            raise ValueError(
                f"Streaming DiLoCo ({streaming}) keeps fragments' exchanges in flight between "
                f"synchronisations, where the model is never whole on every replica: it does "
                f"not take {keeps}; use DiLoCo (fragments=1, overlap=0, mixing=0)"
            )
        return self

    def streaming(self) -> str:
        """What makes this run Streaming DiLoCo ("" for nothing)."""
        asked = {
            f"fragments={self.fragments}": self.fragments != 1,
            f"overlap={self.overlap}": self.overlap != 0,
            f"mixing={self.mixing}": self.mixing != 0,
        }
        return ", ".join(option for option, on in asked.items() if on)

    def keeps_state(self) -> str:
        """What of these options asks the run to outlive a replica (``elastic``, checkpoints,
        ``max_restarts``), in words; ``""`` for none."""
        asked = {
            "elastic=True": self.elastic,
            "checkpoints": self.checkpoint_every != 0,
            "max_restarts": bool(self.max_restarts),
        }
        return ", ".join(option for option, on in asked.items() if on)

    def outer_step(self, also: Sequence[int] = ()) -> OuterStepSpec:
        """The outer step as a replica runs it, synchronising also after the steps ``also``
        (where the model is read)."""
        return OuterStepSpec(
            sync_every=self.sync_every,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.nesterov,
            inner_state=self.inner_state,
            also=list(also),
            fragments=self.fragments,
            overlap=self.overlap,
            mixing=self.mixing,
        )


def _loader(key: str, loader: object) -> Any:
    """A function of the dataset's path, or unset (a ``TypeError``: a bug of the caller's)."""
    if loader is not None and not callable(loader):
        raise TypeError(
            f"{key} must be a function of the dataset's path, not {type(loader).__name__}"
        )
    return loader


def _split(key: str, split: object) -> str | None:
    """The name of a split of the dataset (``"val"``), or unset."""
    if split is not None and (not isinstance(split, str) or not split.isidentifier()):
        raise ValueError(f"a {key} is a name like 'val', not {split!r}")
    return split


class WorkerDataOptions(Options):
    """A job's input that stays on the workers: each trains on its own dataset called ``name``
    (``somatize-worker --data NAME=PATH``: an ``.npz``, a directory of ``x.npy``/``y.npy`` or of
    shards), with FedAvg/FedProx, DataParallel (each replica on its own rows) or Local::

        client.submit(graph, sz.WorkerData("clinic"), strategy=sz.FedAvg(rounds=10))
        client.submit(graph, sz.WorkerData("shards"), strategy=sz.DataParallel(4))

    ``loader``: the job's own code for any other format. ``loader(path)`` runs in each
    worker's filter daemon on the path that worker serves as ``name`` (a client never names a
    path) and returns a ``torch.utils.data.Dataset`` of ``(x, y)`` pairs; the rows each step
    needs are read from it then. It is pickled with the job (``cloudpickle``), like a filter.

    ``split``: as a job's ``validation=``, each worker's split of that name of the dataset it
    trains on (default ``"val"``): an ``.npz``'s ``x_val``/``y_val``, a directory's
    ``x_val.npy``/``y_val.npy``, or a dataset in its directory ``val/``::

        client.submit(graph, sz.WorkerData("clinic"), strategy=sz.FedAvg(rounds=10),
                      validation=sz.WorkerData("clinic", split="val"))

    The wire carries the name (``Submit.dataset``), the pickled loader and the split
    (``Submit.val_split``) as the job's own fields.
    """

    wire_name = "worker_data"
    sdk_name = "WorkerData"

    name: Selector
    loader: Annotated[Any, Rule(_loader)] = None  # (pickled by the client)
    split: Annotated[str | None, Rule(_split)] = None


# -- pipelines (GPipe, 1F1B) --------------------------------------------------------------------


_PLACE = "place"
"""The validation context's key for where a partition is in its pipeline (``partition 1``)."""


def _place(info: ValidationInfo) -> str:
    return str((info.context or {}).get(_PLACE, "partition"))


class _Placed(Rule):
    """A partition's rule whose refusal names the partition by its place in the pipeline
    (``partition 1: device must be ...``), ``partition`` where it stands alone."""

    def key(self, info: ValidationInfo) -> str:
        return f"{_place(info)}: {info.field_name}"


def _node_ids(key: str, ids: object) -> tuple[str, ...]:
    """One or more node ids (non-empty strings), as a tuple."""
    if (
        not isinstance(ids, list | tuple)
        or not ids
        or not all(isinstance(n, str) and n for n in ids)
    ):
        shown = listed(ids) if isinstance(ids, list | tuple) else repr(ids)
        raise ValueError(f"{key} must be one or more node ids, not {shown}")
    return tuple(ids)


_StageDevice = Annotated[str | None, _Placed(device)]
"""A partition's device (:func:`~protocol.options.base.device`), refused naming the partition.
(An alias: in the class body ``device`` is the field's default.)"""


class PartitionOptions(Options):
    """One pipeline stage: a contiguous run of node ids, pinned to a worker by id or by tag
    (exactly one), on a worker training on ``device`` (default: the ModelParallel's
    ``device``)."""

    wire_name = "partition"
    sdk_name = "Partition"

    node_ids: Annotated[tuple[str, ...], _Placed(_node_ids)]
    worker: Selector = None
    tag: Selector = None
    device: _StageDevice = None

    @model_validator(mode="after")
    def _pinned_once(self, info: ValidationInfo) -> Self:
        if (self.worker is None) == (self.tag is None):
            raise ValueError(
                f"{_place(info)} {listed(self.node_ids)} must be pinned to a worker id or a "
                f"tag, exactly one (worker={self.worker!r}, tag={self.tag!r})"
            )
        return self


def _partition(p: int, item: object, form: Form) -> PartitionOptions:
    """Partition ``p`` as given: a :class:`PartitionOptions`, or on the wire its object."""
    place = f"partition {p}"
    if isinstance(item, PartitionOptions):
        return item
    if not isinstance(item, Mapping) or form is not Form.WIRE:
        raise ValueError(
            f"{place} must be a Partition(...) (on the wire: an object with node_ids and a "
            f"worker or a tag), not {item!r}"
        )
    try:
        return PartitionOptions.model_validate(item, context={_PLACE: place})
    except ValidationError as exc:
        refusal = refused(exc, PartitionOptions)
        if exc.errors()[0]["type"] != "value_error":  # pydantic's words: name the partition
            refusal = prefixed(place, refusal)
        raise refusal from None


def _partitions(raw: object, info: ValidationInfo) -> tuple[PartitionOptions, ...]:
    """The stages as given: one or more partitions (:func:`_partition`)."""
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(f"partitions must be a non-empty list of partitions, not {raw!r}")
    return tuple(_partition(p, item, form_of(info)) for p, item in enumerate(raw))


def _schedule(key: str, schedule: object) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"{key} must be one of {sorted(SCHEDULES)}, not {schedule!r}")
    return schedule


class ModelParallelOptions(CheckpointOptions):
    """Pipeline-parallel training: the graph split in ``partitions``, each on its own worker.

    Every global batch (the batch ``graph.fit`` would take) is cut into ``micro_batches`` that
    flow stage to stage; the last stage computes the loss; gradients flow back; each stage steps
    its optimizer once per global batch (GPipe). The result equals ``graph.fit``.

    How activations travel (``transport``): ``"torch"`` — the stages join one torch.distributed
    group and each runs its part of the schedule itself, sending activations and their gradients
    straight to its neighbours' daemons (point-to-point, as ``torch.distributed.pipelining``
    does); the coordinator sees one call per stage per chunk of global batches.
    ``"websocket"`` — every micro-batch's action is a call from the coordinator, the tensors
    going over the agents' peer links (or relayed by the coordinator). ``"auto"`` (default) —
    ``torch`` when every stage can reach the rendezvous on the first, else ``websocket``; a
    ``linked`` progress event says which and why.

    A lost stage fails the job at once, unless the job holds ``spares``: then the lost stage's
    partition moves to a spare worker, every stage goes back to the last checkpoint (the start,
    before the first) and training goes on from there — the result is still the undisturbed
    run's. The events say ``worker_lost``, ``worker_replaced`` (which stage, which worker) and
    ``resumed``. With no spare left, ``max_restarts`` still applies.

    Args:
        partitions: the stages (``Partition``), in graph order; together they hold every node
            exactly once.
        micro_batches: micro-batches per global batch.
        schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``.
        device: the device of every partition that names none (default: any).
        transport: ``"auto"``, ``"torch"`` or ``"websocket"`` (above).
        collective_timeout: seconds joining the group or one send/receive may take.
        checkpoint_every: save a checkpoint (every stage's model and optimizer state, and the
            global batch) every this many global batches; ``None`` (default): at the end of
            every epoch or after 60 s of training, whichever comes first; ``0``: never.
        keep_checkpoints: how many checkpoints of the job are kept (default 2).
        max_restarts: how many times the job, when a stage's worker is lost (and no spare is
            left), its daemon crashes or the group breaks, goes back to its last checkpoint on
            the workers there are (default 0), waiting up to ``restart_timeout`` seconds.
        restart_timeout: seconds a restart waits for workers.
        spares: workers the job holds besides its stages, idle, each ready to take a lost
            stage's place (default 0).
        spare_tag: only workers with this tag are spares (default: any worker).
    """

    name = "model_parallel"
    sdk_name = "ModelParallel"

    partitions: Annotated[tuple[PartitionOptions, ...], BeforeValidator(_partitions)]
    micro_batches: PositiveInt = 1
    schedule: Annotated[PipelineSchedule, Rule(_schedule)] = "gpipe"
    device: DeviceName = None
    transport: Annotated[Transport, Rule(one_of, TRANSPORTS)] = "auto"
    collective_timeout: Seconds = DEFAULT_COLLECTIVE_TIMEOUT
    inherited_after = "collective_timeout"
    spares: Annotated[int, Rule(count, 0)] = 0
    spare_tag: Selector = None

    @model_validator(mode="after")
    def _spare_tag_with_spares(self) -> Self:
        if self.spare_tag is not None and not self.spares:
            raise ValueError("spare_tag names the spares' tag: give spares=N (N >= 1) too")
        return self

    def device_of(self, partition: int) -> str | None:
        """Where partition ``partition`` runs: its own device, else the pipeline's."""
        own = self.partitions[partition].device
        return own if own is not None else self.device
