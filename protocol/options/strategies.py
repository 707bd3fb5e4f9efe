"""Strategy options: what a job may ask of each strategy, checked once for both sides (the
federated ones in :mod:`protocol.options.federated`, the machinery in
:mod:`protocol.options.base`; all of them importable from here).

The SDK (``somatize.strategies``) builds these models from its arguments, the coordinator
(``coordinator.strategies``) from the JSON options of a
:class:`~protocol.messages.StrategySpec`; both go through :func:`parse`, which raises a
:class:`ValueError` naming the bad option. A model's :meth:`~StrategyOptions.to_wire` is the
options dict a client sends (unset options left out).

The rules are written once; their words follow the caller (:class:`Dialect`): the SDK names the
Python class and argument (``FedAvg: rounds must be ...``, ``True or False``), the wire names
the strategy and option as they travel (``fedavg: rounds must be ...``, ``a boolean``).

Every strategy (and each pipeline partition) takes ``device``: ``None`` for any worker, else a
worker's training device as it announces it (``"cpu"``, ``"cuda:N"``, ``"mps"``) or ``"cuda"``
for any CUDA device (:func:`protocol.options.devices.device_fits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.options.base import (
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_RESTART_TIMEOUT,
    CheckpointOptions,
    Dialect,
    RestartOptions,
    Say,
    StrategyOptions,
    T,
    parse,
)
from protocol.options.devices import DEVICES, device_fits, is_device
from protocol.options.federated import (
    SERVER_OPTIMIZERS,
    AdaptiveOptions,
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedAvgOptions,
    FedProxOptions,
    FedYogiOptions,
    PlainAveragingOptions,
    QFedAvgOptions,
    ServerOptions,
    server_options,
)
from protocol.wording import listed

__all__ = [
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_RESTART_TIMEOUT",
    "DEVICES",
    "SCHEDULES",
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "CheckpointOptions",
    "DataParallelOptions",
    "Dialect",
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
    "ServerOptions",
    "StrategyOptions",
    "T",
    "WorkerDataOptions",
    "device_fits",
    "is_device",
    "parse",
    "server_options",
]

SCHEDULES = ("1f1b", "gpipe")
"""The pipeline schedules ModelParallel runs."""

DEFAULT_COLLECTIVE_TIMEOUT = 60.0
"""Seconds a torch collective (joining the group, one all-reduce) may take before it fails:
never torch's 30-minute default."""

COLLECTIVES = ("auto", "torch", "coordinator")
"""How DataParallel reduces gradients: torch.distributed between the replicas (``torch``),
through the coordinator (``coordinator``), or the first when every replica can reach the
rendezvous (``auto``)."""

TRANSPORTS = ("auto", "torch", "websocket")
"""How ModelParallel's stages pass activations: torch.distributed point-to-point between their
daemons (``torch``), calls from the coordinator over the WebSocket peer links (``websocket``),
or the first when every stage can reach the rendezvous (``auto``)."""

DEFAULT_ELASTIC_TIMEOUT = 60.0
"""Seconds an elastic DataParallel job waits for a replacement worker unless told otherwise."""


# -- single-worker and data-parallel ------------------------------------------------------------


class LocalOptions(RestartOptions):
    """The whole graph on one worker, pinned by id or by tag (not both) or neither; restarted
    from the start (it keeps no checkpoints) up to ``max_restarts`` times after a fault."""

    wire_name = "local"
    sdk_name = "Local"

    worker: str | None = None
    tag: str | None = None
    device: str | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        worker = say.selector("worker", fields.get("worker"))
        tag = say.selector("tag", fields.get("tag"))
        if worker is not None and tag is not None:
            raise say.no(
                "pin a Local job to a worker or to a tag, not both "
                f"(worker={worker!r}, tag={tag!r})"
            )
        say.device("device", fields.get("device"))
        cls._check_restarts(fields, say)
        return fields

    def to_wire(self) -> dict[str, Any]:
        pinned = {k: v for k, v in (("worker", self.worker), ("tag", self.tag)) if v is not None}
        on = {"device": self.device} if self.device is not None else {}
        return pinned | on | self._restarts_wire()


def _check_collective_timeout(fields: dict[str, Any], say: Say) -> None:
    limit = fields.get("collective_timeout", DEFAULT_COLLECTIVE_TIMEOUT)
    wire = f"collective_timeout must be a positive number of seconds, not {limit!r}"
    if say.real("collective_timeout", limit, wire) <= 0:
        raise say.no(f"collective_timeout must be > 0, not {limit!r}", wire)


class DataParallelOptions(CheckpointOptions):
    """``workers`` replicas in lockstep; ``elastic``: a lost one replaced within the timeout."""

    wire_name = "data_parallel"
    sdk_name = "DataParallel"

    workers: int
    tag: str | None = None
    elastic: bool = False
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT
    device: str | None = None
    collective: str = "auto"
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    sync_batchnorm: bool = False

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        say.positive_int("workers", fields.get("workers"))
        _check_sync_batchnorm(fields, say)
        collective = fields.get("collective", "auto")
        if collective not in COLLECTIVES:
            raise say.no(
                f"collective must be one of {', '.join(map(repr, COLLECTIVES))}, not {collective!r}"
            )
        _check_collective_timeout(fields, say)
        say.selector("tag", fields.get("tag"))
        say.device("device", fields.get("device"))
        elastic = fields.get("elastic", False)
        if not isinstance(elastic, bool):
            raise say.no(
                f"elastic must be True or False, not {elastic!r}",
                f"elastic must be a boolean, not {elastic!r}",
            )
        timeout = fields.get("elastic_timeout", DEFAULT_ELASTIC_TIMEOUT)
        wire = f"elastic_timeout must be a positive number of seconds, not {timeout!r}"
        if say.real("elastic_timeout", timeout, wire) <= 0:
            raise say.no(f"elastic_timeout must be > 0, not {timeout!r}", wire)
        cls._check_checkpoints(fields, say)
        return fields

    def to_wire(self) -> dict[str, Any]:
        options: dict[str, Any] = {"workers": self.workers}
        if self.tag is not None:
            options["tag"] = self.tag
        if self.elastic:
            options |= {"elastic": True, "elastic_timeout": self.elastic_timeout}
        if self.device is not None:
            options["device"] = self.device
        if self.collective != "auto":
            options["collective"] = self.collective
        if self.collective_timeout != DEFAULT_COLLECTIVE_TIMEOUT:
            options["collective_timeout"] = self.collective_timeout
        if self.sync_batchnorm:
            options["sync_batchnorm"] = True
        return options | self._checkpoints_wire()


def _check_sync_batchnorm(fields: dict[str, Any], say: Say) -> None:
    """``sync_batchnorm``: a bool; torch's SyncBatchNorm runs on CUDA over a torch group only."""
    sync = fields.get("sync_batchnorm", False)
    if not isinstance(sync, bool):
        raise say.no(f"sync_batchnorm must be True or False, not {sync!r}")
    device = fields.get("device")
    if sync and not (isinstance(device, str) and device.startswith("cuda")):
        raise say.no(
            "sync_batchnorm=True needs device='cuda' (or 'cuda:N'): torch.nn.SyncBatchNorm "
            f"normalises over a group of CUDA workers; device is {device!r}"
        )
    if sync and fields.get("collective") == "coordinator":
        raise say.no(
            "sync_batchnorm=True needs the torch collective (collective='auto' or 'torch'), "
            "not 'coordinator'"
        )


class WorkerDataOptions(StrategyOptions):
    """A job's input that stays on the workers: the name of each one's own dataset."""

    wire_name = "worker_data"
    sdk_name = "WorkerData"

    name: str | None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        say.selector("name", fields.get("name"))
        return fields


# -- pipelines (GPipe, 1F1B) --------------------------------------------------------------------


class PartitionOptions(StrategyOptions):
    """One pipeline stage: a run of node ids, pinned to a worker id or a tag (exactly one), on
    ``device`` (unset: ModelParallel's ``device``)."""

    wire_name = "partition"
    sdk_name = "Partition"

    node_ids: tuple[str, ...]
    worker: str | None = None
    tag: str | None = None
    device: str | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        return _check_partition(fields, say, "partition")

    def to_wire(self) -> dict[str, Any]:
        pinned = {"worker": self.worker} if self.worker is not None else {"tag": self.tag}
        on = {"device": self.device} if self.device is not None else {}
        return {"node_ids": list(self.node_ids), **pinned, **on}


def _check_partition(fields: dict[str, Any], say: Say, label: str) -> dict[str, Any]:
    ids = fields.get("node_ids")
    if (
        not isinstance(ids, list | tuple)
        or not ids
        or not all(isinstance(n, str) and n for n in ids)
    ):
        shown = listed(ids) if isinstance(ids, list | tuple) else repr(ids)
        raise say.no(f"{label}: node_ids must be one or more node ids, not {shown}")
    worker = say.selector("worker", fields.get("worker"))
    tag = say.selector("tag", fields.get("tag"))
    if (worker is None) == (tag is None):
        raise say.no(
            f"{label} {listed(ids)} must be pinned to a worker id or a tag, exactly one "
            f"(worker={worker!r}, tag={tag!r})"
        )
    say.device(f"{label}: device", fields.get("device"))
    return {**fields, "node_ids": tuple(ids)}


class ModelParallelOptions(CheckpointOptions):
    """The graph's partitions, in graph order; micro-batches per global batch; the schedule;
    the device of the partitions that name none; ``spares`` more workers (tagged ``spare_tag``,
    or any) held by the job to take a lost stage's place."""

    wire_name = "model_parallel"
    sdk_name = "ModelParallel"

    partitions: tuple[PartitionOptions, ...]
    micro_batches: int = 1
    schedule: str = "gpipe"
    device: str | None = None
    transport: str = "auto"
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    spares: int = 0
    spare_tag: str | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        raw = fields.get("partitions")
        if not isinstance(raw, list | tuple) or not raw:
            raise say.no("partitions must be a non-empty list")
        partitions = []
        for p, item in enumerate(raw):
            part = item.model_dump() if isinstance(item, PartitionOptions) else item
            if not isinstance(part, Mapping):
                raise say.no(f"partition {p} must be a mapping")
            partitions.append(_check_partition(dict(part), say, f"partition {p}"))
        say.positive_int("micro_batches", fields.get("micro_batches", 1))
        schedule = fields.get("schedule", "gpipe")
        if schedule not in SCHEDULES:
            raise say.no(f"schedule must be one of {sorted(SCHEDULES)}, not {schedule!r}")
        say.device("device", fields.get("device"))
        transport = fields.get("transport", "auto")
        if transport not in TRANSPORTS:
            raise say.no(
                f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, not {transport!r}"
            )
        _check_collective_timeout(fields, say)
        spares = fields.get("spares", 0)
        if not isinstance(spares, int) or isinstance(spares, bool) or spares < 0:
            raise say.no(f"spares must be an integer >= 0, not {spares!r}")
        if say.selector("spare_tag", fields.get("spare_tag")) is not None and not spares:
            raise say.no("spare_tag names the spares' tag: give spares=N (N >= 1) too")
        cls._check_checkpoints(fields, say)
        return {**fields, "partitions": partitions}

    def to_wire(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "partitions": [p.to_wire() for p in self.partitions],
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
        }
        if self.device is not None:
            options["device"] = self.device
        if self.transport != "auto":
            options["transport"] = self.transport
        if self.collective_timeout != DEFAULT_COLLECTIVE_TIMEOUT:
            options["collective_timeout"] = self.collective_timeout
        if self.spares:
            options["spares"] = self.spares
        if self.spare_tag is not None:
            options["spare_tag"] = self.spare_tag
        return options | self._checkpoints_wire()

    def device_of(self, partition: int) -> str | None:
        """Where partition ``partition`` runs: its own device, else the pipeline's."""
        own = self.partitions[partition].device
        return own if own is not None else self.device
