"""How a job is spread over workers: the strategies' configuration objects.

A strategy here is only configuration: it is checked when it is built, by the options models the
coordinator checks it with (:mod:`protocol.options.strategies`; a bad argument is a
:class:`ValueError` naming it), and travels to the coordinator as a
:class:`~protocol.messages.StrategySpec` (a name and JSON options). The strategies themselves run
on the coordinator (:mod:`coordinator.strategies`)::

    client.submit(graph, x, y, strategy=sz.Local(tag="gpu"))

Every strategy takes ``device``: run only on workers training on it (``"cpu"``, ``"cuda"`` for
any CUDA device, ``"cuda:N"``, ``"mps"``; default ``None``: any worker). A job asking for a
device no worker has is refused when it is submitted, naming the devices there are::

    client.submit(graph, x, y, strategy=sz.DataParallel(2, device="cuda"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from protocol.messages import StrategySpec
from protocol.options import strategies as so
from protocol.options.client_config import client_configs
from somatize.aggregators import Aggregator
from somatize.privacy import PrivacyMechanism, SecAgg
from somatize.server_optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
)

__all__ = [
    "DataParallel",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "Local",
    "ModelParallel",
    "Partition",
    "QFedAvg",
    "ServerOptimizer",
    "Strategy",
    "WorkerData",
]


class Strategy(ABC):
    """Base of the strategies: a name the coordinator knows and the options it takes."""

    #: The strategy's name on the wire.
    name: ClassVar[str]

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The options sent to the coordinator (JSON values; unset options left out)."""

    def spec(self) -> StrategySpec:
        """This strategy as it travels in a :class:`~protocol.messages.Submit`."""
        return StrategySpec(name=self.name, options=self.options())


def _arguments(instance: object) -> dict[str, Any]:
    """A dataclass's arguments by name."""
    return {f.name: getattr(instance, f.name) for f in fields(instance)}  # type: ignore[arg-type]


def _checked(model: type[so.T], instance: object, **values: Any) -> so.T:
    """``instance``'s arguments (and ``values`` in their place) checked by ``model``."""
    return so.parse(model, _arguments(instance) | values, so.Dialect.SDK)


@dataclass(frozen=True)
class Local(Strategy):
    """The whole graph on one worker with all the data, trained as ``graph.fit`` would.

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

    worker: str | None = None
    tag: str | None = None
    device: str | None = None
    max_restarts: int = 0
    restart_timeout: float = 60.0

    name: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        _checked(so.LocalOptions, self)

    def options(self) -> dict[str, Any]:
        return _checked(so.LocalOptions, self).to_wire()


@dataclass(frozen=True)
class DataParallel(Strategy):
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

    Raises:
        ValueError: ``workers`` is not a positive integer, ``tag`` not a non-empty string,
            ``elastic`` not a bool, ``sync_batchnorm`` without ``device="cuda"`` or with
            ``collective="coordinator"``, ``elastic_timeout`` or ``collective_timeout`` not a
            positive number, ``device`` not one of the device forms, ``collective`` not one
            of the three, ``checkpoint_every`` not ``None`` or an integer >= 0,
            ``keep_checkpoints`` not a positive integer, ``max_restarts`` not an integer >= 0
            or ``restart_timeout`` not a positive number.
    """

    workers: int
    tag: str | None = None
    elastic: bool = False
    elastic_timeout: float = 60.0
    device: str | None = None
    collective: str = "auto"
    collective_timeout: float = 60.0
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_restarts: int = 0
    restart_timeout: float = 60.0
    sync_batchnorm: bool = False

    name: ClassVar[str] = "data_parallel"

    def __post_init__(self) -> None:
        _checked(so.DataParallelOptions, self)

    def options(self) -> dict[str, Any]:
        return _checked(so.DataParallelOptions, self).to_wire()


@dataclass(frozen=True)
class WorkerData:
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
    """

    name: str
    loader: Callable[[Path], Any] | None = None
    split: str | None = None

    def __post_init__(self) -> None:
        so.parse(so.WorkerDataOptions, {"name": self.name}, so.Dialect.SDK)
        if self.split is not None and (
            not isinstance(self.split, str) or not self.split.isidentifier()
        ):
            raise ValueError(f"WorkerData: a split is a name like 'val', not {self.split!r}")
        if self.loader is not None and not callable(self.loader):
            raise TypeError(
                f"WorkerData: loader must be a function of the dataset's path, not "
                f"{type(self.loader).__name__}"
            )


# -- federated ----------------------------------------------------------------------------------


def _federated(model: type[so.T], s: FedAvg | FedProx) -> so.T:  # QFedAvg is a FedAvg
    """The options of a FedAvg or FedProx, checked; the server optimizer must be an SDK one."""
    if s.server is not None and not isinstance(s.server, ServerOptimizer):
        raise ValueError(
            f"{type(s).__name__}: server must be FedAvgM(...), FedAdagrad(...), FedAdam(...), "
            f"FedYogi(...) or None, not {s.server!r}"
        )
    server = s.server.options() if s.server is not None else None
    if s.aggregator is not None and not isinstance(s.aggregator, Aggregator):
        raise ValueError(
            f"{type(s).__name__}: aggregator must be FedMedian(), TrimmedMean(beta), "
            f"Krum(byzantine, keep), Bulyan(byzantine) or None, not {s.aggregator!r}"
        )
    aggregator = s.aggregator.options() if s.aggregator is not None else None
    if s.privacy is not None and not isinstance(s.privacy, PrivacyMechanism):
        raise ValueError(
            f"{type(s).__name__}: privacy must be FixedClipping(...), AdaptiveClipping(...) or "
            f"None, not {s.privacy!r}"
        )
    privacy = s.privacy.options() if s.privacy is not None else None
    secure = s.secure_aggregation
    if secure is not None and not isinstance(secure, SecAgg):
        raise ValueError(
            f"{type(s).__name__}: secure_aggregation must be SecAgg(...) or None, not {secure!r}"
        )
    config = None
    if s.client_config is not None:
        try:
            config = client_configs(s.client_config, s.rounds)
        except ValueError as exc:
            raise ValueError(f"{type(s).__name__}: {exc}") from None
    return _checked(
        model,
        s,
        server=server,
        aggregator=aggregator,
        client_config=config,
        privacy=privacy,
        secure_aggregation=secure.options() if secure is not None else None,
    )


@dataclass(frozen=True)
class FedAvg(Strategy):
    """Federated averaging (McMahan et al. 2017, Algorithm 1): rounds of local training.

    Each round the coordinator selects max(``min_workers``, ⌈``fraction`` · K⌉) of the K
    workers (a draw seeded with ``seed`` + round), sends them the global model, each trains
    ``local_epochs`` epochs on its data with a fresh optimizer (its TorchFilters' own optimizer,
    ``lr`` and ``batch_size``), and the new global model is their average weighted by rows,
    stepped through ``server`` if one is given. The data is the workers' own
    (``sz.WorkerData(name)``) or the rows sent, split in contiguous shards. Workers that fail in
    a round are dropped from it and named in its event; the round fails when fewer than
    ``min_workers`` answered. Plain filters are fitted by each worker on its own data and their
    states averaged by rows.

    Args:
        rounds: communication rounds.
        local_epochs: epochs of local training per round.
        fraction: C, the share of the workers selected each round, in (0, 1].
        min_workers: the least number of workers a round needs answers from.
        workers: how many workers to reserve (default: every idle matching worker when the job
            starts, at least ``min_workers``).
        tag: only workers with this tag.
        server: a server optimizer (:class:`FedAvgM`, :class:`FedAdagrad`, :class:`FedAdam`,
            :class:`FedYogi`);
            default: plain averaging.
        aggregator: a Byzantine-robust rule in place of the weighted mean
            (:class:`~somatize.aggregators.FedMedian`, ``TrimmedMean``, ``Krum``, ``Bulyan``);
            default: the mean. ``min_workers`` must be enough for it (Krum: > 2f + 2,
            Bulyan: >= 4f + 3).
        client_config: a function of the round (1, 2, ...) returning what that round's
            clients train with: ``lr`` (their optimizers' learning rate), ``local_epochs``,
            ``batch_size``; e.g. ``lambda r: {"lr": 0.1 * 0.9 ** r}``. It is called for every
            round when the strategy is built (the coordinator runs no client code).
        clients_per_worker: K, the virtual clients each worker trains in turn, client j on the
            j-th of K contiguous partitions of its rows (its shard, or its own dataset), each
            from w_t with a fresh optimizer: the same as K workers holding one partition each,
            so that a round of 1,000 clients runs on 2 workers. Selection (``fraction``) is
            over all clients, and a round needs ``min_workers`` × K answers.
        privacy: user-level differential privacy (:class:`~somatize.privacy.FixedClipping`,
            ``AdaptiveClipping``): clipped updates, Gaussian noise on their sum, ε spent in
            each round's event. TorchFilters only; no ``aggregator`` with it.
        secure_aggregation: :class:`~somatize.privacy.SecAgg`: the coordinator learns only
            the sum of each round's client models (TorchFilters only; no ``aggregator`` or
            ``privacy`` with it).
        seed: seeds the selection of workers.
        device: only workers training on this device (default: any).
        evaluate_fraction: federated evaluation (Flower's ``evaluate``): each round this share
            of the workers (at least one) evaluates the new global model on its own
            validation data — the split named by ``validation=sz.WorkerData(name,
            split=...)`` of the job, else ``"val"``: its dataset's ``x_val``/``y_val`` — and
            the round's ``val_loss`` and metrics are their figures weighted by rows; the
            round's event also names each worker's. ``0`` (default): none. The job must
            train on ``WorkerData``.
        checkpoint_every: save a checkpoint (the global model, the server optimizer's moments
            and the round) every this many rounds; ``None`` (default): every round; ``0``:
            never. A restarted coordinator resumes the job from its last one.
        keep_checkpoints: how many checkpoints of the job are kept (default 2).
        max_restarts: how many times the job, when a worker is lost or a daemon crashes
            beyond what ``min_workers`` allows, goes back to its last checkpoint (round) and
            goes on from there instead of failing (default 0).
        restart_timeout: seconds each restart waits for workers (default 60).

    Raises:
        ValueError: an argument out of range or of the wrong type.
    """

    rounds: int
    local_epochs: int = 1
    fraction: float = 1.0
    min_workers: int = 1
    workers: int | None = None
    tag: str | None = None
    server: ServerOptimizer | None = None
    aggregator: Aggregator | None = None
    client_config: Callable[[int], dict[str, Any]] | None = None
    clients_per_worker: int = 1
    privacy: PrivacyMechanism | None = None
    secure_aggregation: SecAgg | None = None
    seed: int = 0
    device: str | None = None
    evaluate_fraction: float = 0.0
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_restarts: int = 0
    restart_timeout: float = 60.0

    name: ClassVar[str] = "fedavg"

    def __post_init__(self) -> None:
        _federated(so.FedAvgOptions, self)

    def options(self) -> dict[str, Any]:
        return _federated(so.FedAvgOptions, self).to_wire()


@dataclass(frozen=True)
class FedProx(Strategy):
    """FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg
    whose workers add the proximal term μ/2 ‖w − w_t‖² to every local batch's loss, w_t being
    the round's global model, which keeps local models near it on heterogeneous data.

    Args:
        mu: μ (> 0; with μ = 0 this is :class:`FedAvg`).
        rounds, local_epochs, fraction, min_workers, workers, tag, server, aggregator,
            client_config, clients_per_worker, privacy, secure_aggregation, seed, device,
            evaluate_fraction, checkpoint_every, keep_checkpoints, max_restarts,
            restart_timeout: as :class:`FedAvg`.

    Raises:
        ValueError: an argument out of range or of the wrong type.
    """

    mu: float
    rounds: int
    local_epochs: int = 1
    fraction: float = 1.0
    min_workers: int = 1
    workers: int | None = None
    tag: str | None = None
    server: ServerOptimizer | None = None
    aggregator: Aggregator | None = None
    client_config: Callable[[int], dict[str, Any]] | None = None
    clients_per_worker: int = 1
    privacy: PrivacyMechanism | None = None
    secure_aggregation: SecAgg | None = None
    seed: int = 0
    device: str | None = None
    evaluate_fraction: float = 0.0
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_restarts: int = 0
    restart_timeout: float = 60.0

    name: ClassVar[str] = "fedprox"

    def __post_init__(self) -> None:
        _federated(so.FedProxOptions, self)

    def options(self) -> dict[str, Any]:
        return _federated(so.FedProxOptions, self).to_wire()


@dataclass(frozen=True, kw_only=True)
class QFedAvg(FedAvg):
    """q-FedAvg (Li et al. 2020, "Fair Resource Allocation in Federated Learning"): FedAvg's
    rounds, and a server update that weighs each client by its loss at the round's model to the
    power q, so that the clients the model fits worst pull hardest (q = 0: the unweighted mean
    of the clients' models). For a model that must serve every client fairly, not only on
    average. Each client also reports its loss before training. Takes no ``server`` and no
    ``aggregator`` (its update is its own)::

        sz.QFedAvg(rounds=20, q=1.0, lipschitz=1 / lr)

    Args:
        q: q >= 0.
        lipschitz: L > 0, the Lipschitz constant of the loss's gradient; the paper takes 1/η,
            η the TorchFilters' learning rate.
        rounds, local_epochs, fraction, min_workers, workers, tag, seed, device,
            evaluate_fraction, checkpoint_every, keep_checkpoints, max_restarts,
            restart_timeout: as :class:`FedAvg`.
    """

    q: float
    lipschitz: float

    name: ClassVar[str] = "qfedavg"

    def __post_init__(self) -> None:
        _federated(so.QFedAvgOptions, self)

    def options(self) -> dict[str, Any]:
        return _federated(so.QFedAvgOptions, self).to_wire()


@dataclass(frozen=True)
class Partition:
    """One pipeline stage: a contiguous run of node ids, pinned to a worker by id or by tag,
    on a worker training on ``device`` (default: the ModelParallel's ``device``)."""

    node_ids: tuple[str, ...] | list[str]
    worker: str | None = None
    tag: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        checked = _checked(so.PartitionOptions, self)
        object.__setattr__(self, "node_ids", checked.node_ids)

    def option(self) -> dict[str, Any]:
        """This stage as ModelParallel sends it."""
        return _checked(so.PartitionOptions, self).to_wire()


@dataclass(frozen=True)
class ModelParallel(Strategy):
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
        partitions: the stages, in graph order; together they hold every node exactly once.
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

    partitions: tuple[Partition, ...] | list[Partition]
    micro_batches: int = 1
    schedule: str = "gpipe"
    device: str | None = None
    transport: str = "auto"
    collective_timeout: float = 60.0
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_restarts: int = 0
    restart_timeout: float = 60.0
    spares: int = 0
    spare_tag: str | None = None

    name: ClassVar[str] = "model_parallel"

    def __post_init__(self) -> None:
        parts = list(self.partitions)
        if not parts or not all(isinstance(p, Partition) for p in parts):
            raise ValueError("partitions must be a non-empty list of somatize.Partition")
        object.__setattr__(self, "partitions", tuple(parts))
        self.options()

    def options(self) -> dict[str, Any]:
        partitions = [p.option() for p in self.partitions]
        return _checked(so.ModelParallelOptions, self, partitions=partitions).to_wire()
