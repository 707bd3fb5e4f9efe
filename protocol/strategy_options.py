"""Strategy options: what a job may ask of each strategy, checked once for both sides.

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
for any CUDA device (:func:`protocol.devices.device_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from protocol.devices import DEVICES, device_fits, is_device
from protocol.wording import listed

__all__ = [
    "DEVICES",
    "SCHEDULES",
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "DataParallelOptions",
    "Dialect",
    "FedAdamOptions",
    "FedAvgMOptions",
    "FedAvgOptions",
    "FedProxOptions",
    "FedYogiOptions",
    "LocalOptions",
    "ModelParallelOptions",
    "PartitionOptions",
    "PlainAveragingOptions",
    "ServerOptions",
    "StrategyOptions",
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


class Dialect(StrEnum):
    """Who is asking, and so how a refusal is worded."""

    SDK = "sdk"  # Python arguments of a somatize class
    WIRE = "wire"  # JSON options of a StrategySpec


@dataclass(frozen=True)
class _Say:
    """Words a refusal for ``owner`` in ``dialect``."""

    owner: str
    dialect: Dialect

    def no(self, sdk: str, wire: str | None = None) -> ValueError:
        text = sdk if self.dialect is Dialect.SDK or wire is None else wire
        return ValueError(f"{self.owner}: {text}")

    # -- the checks every strategy shares ------------------------------------------------------

    def selector(self, key: str, value: object) -> str | None:
        """A worker id or tag: a non-empty string, or unset."""
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise self.no(
                f"{key} must be a non-empty string or None, not {value!r}",
                f"{key} must be a non-empty string, not {value!r}",
            )
        return value

    def device(self, key: str, value: object) -> str | None:
        """A device a job may ask for (:data:`DEVICES`), or unset."""
        if value is not None and not is_device(value):
            forms = "'cpu', 'cuda' (any CUDA device), 'cuda:N' or 'mps'"
            raise self.no(
                f"{key} must be None (any device), {forms}, not {value!r}",
                f"{key} must be one of {forms}, not {value!r}",
            )
        return value if isinstance(value, str) else None

    def positive_int(self, key: str, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.no(f"{key} must be a positive integer, not {value!r}")
        return value

    def real(self, key: str, value: object, wire: str | None = None) -> float:
        """``value`` as a float, if it is a finite real number (not a bool)."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.no(f"{key} must be a finite number, not {value!r}", wire)
        return float(value)


def _say(cls: type[StrategyOptions], info: ValidationInfo) -> _Say:
    dialect = Dialect((info.context or {}).get("dialect", Dialect.WIRE))
    return _Say(cls.sdk_name if dialect is Dialect.SDK else cls.wire_name, dialect)


def _fields(data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"options must be an object, not {data!r}")
    return dict(data)


class StrategyOptions(BaseModel):
    """Options of one strategy: the schema, the rules (``_check``) and the wire form."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The strategy's name on the wire, and its SDK class's name.
    wire_name: ClassVar[str]
    sdk_name: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _validate(cls, data: Any, info: ValidationInfo) -> dict[str, Any]:
        return cls._check(_fields(data), _say(cls, info))

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        """``fields`` checked, in the order a person would fix them; the first fault raised."""
        return fields

    def to_wire(self) -> dict[str, Any]:
        """The options as a client sends them (JSON values; unset options left out)."""
        return self.model_dump(exclude_none=True)


T = TypeVar("T", bound=StrategyOptions)


def parse(cls: type[T], data: Mapping[str, Any], dialect: Dialect) -> T:
    """``data`` as ``cls``, or the one :class:`ValueError` saying what is wrong.

    On the wire an option the strategy does not take is refused, naming what it takes.
    """
    if dialect is Dialect.WIRE and isinstance(data, Mapping):
        allowed = set(cls.model_fields)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"strategy {cls.wire_name!r} takes no option {unknown}; it takes {sorted(allowed)}"
            )
    try:
        return cls.model_validate(data, context={"dialect": dialect})
    except ValidationError as exc:
        raise ValueError(_message(exc)) from None


def _message(exc: ValidationError) -> str:
    """The message of the first check that refused (not pydantic's report around it)."""
    first = exc.errors()[0]
    error = (first.get("ctx") or {}).get("error")
    return str(error) if error is not None else str(exc)


# -- single-worker and data-parallel ------------------------------------------------------------


class LocalOptions(StrategyOptions):
    """The whole graph on one worker, pinned by id or by tag (not both) or neither."""

    wire_name = "local"
    sdk_name = "Local"

    worker: str | None = None
    tag: str | None = None
    device: str | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        worker = say.selector("worker", fields.get("worker"))
        tag = say.selector("tag", fields.get("tag"))
        if worker is not None and tag is not None:
            raise say.no(
                "pin a Local job to a worker or to a tag, not both "
                f"(worker={worker!r}, tag={tag!r})"
            )
        say.device("device", fields.get("device"))
        return fields


def _check_collective_timeout(fields: dict[str, Any], say: _Say) -> None:
    limit = fields.get("collective_timeout", DEFAULT_COLLECTIVE_TIMEOUT)
    wire = f"collective_timeout must be a positive number of seconds, not {limit!r}"
    if say.real("collective_timeout", limit, wire) <= 0:
        raise say.no(f"collective_timeout must be > 0, not {limit!r}", wire)


class DataParallelOptions(StrategyOptions):
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

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        say.positive_int("workers", fields.get("workers"))
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
        return options


class WorkerDataOptions(StrategyOptions):
    """A job's input that stays on the workers: the name of each one's own dataset."""

    wire_name = "worker_data"
    sdk_name = "WorkerData"

    name: str | None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        say.selector("name", fields.get("name"))
        return fields


# -- server optimizers (Reddi et al. 2021) ------------------------------------------------------


class _ServerOptions(StrategyOptions):
    """A server optimizer's hyperparameters; ``name`` selects it on the wire."""

    name: str

    def hyperparameters(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if k != "name"}

    @classmethod
    def _range(cls, say: _Say, key: str, value: object, rule: str, ok: bool) -> None:
        if not ok:
            raise say.no(
                f"{key} must be {rule}, not {value!r}", f"{key} must be {rule}, got {value!r}"
            )

    @classmethod
    def _positive(cls, say: _Say, fields: dict[str, Any], key: str) -> None:
        value = fields.get(key, cls.model_fields[key].default)
        number = say.real(key, value, f"{key} must be a finite number, got {value!r}")
        cls._range(say, key, value, "> 0", number > 0)

    @classmethod
    def _decay(cls, say: _Say, fields: dict[str, Any], key: str) -> None:
        value = fields.get(key, cls.model_fields[key].default)
        number = say.real(key, value, f"{key} must be a finite number, got {value!r}")
        cls._range(say, key, value, "in [0, 1)", 0 <= number < 1)


class PlainAveragingOptions(_ServerOptions):
    """No server optimizer: the round's average is the next global model."""

    wire_name = "fedavg"
    sdk_name = "FedAvg"

    name: Literal["fedavg"] = "fedavg"


class FedAvgMOptions(_ServerOptions):
    """Server momentum (Hsu et al. 2019): ``lr`` > 0, ``momentum`` in [0, 1)."""

    wire_name = "fedavgm"
    sdk_name = "FedAvgM"

    name: Literal["fedavgm"] = "fedavgm"
    lr: float = 1.0
    momentum: float = 0.9

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        cls._positive(say, fields, "lr")
        cls._decay(say, fields, "momentum")
        return fields


class AdaptiveOptions(_ServerOptions):
    """Adam-like server optimizers (Reddi et al. 2021, Algorithm 2)."""

    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        cls._positive(say, fields, "lr")
        cls._decay(say, fields, "beta1")
        cls._decay(say, fields, "beta2")
        cls._positive(say, fields, "tau")
        return fields


class FedAdamOptions(AdaptiveOptions):
    wire_name = "fedadam"
    sdk_name = "FedAdam"

    name: Literal["fedadam"] = "fedadam"


class FedYogiOptions(AdaptiveOptions):
    wire_name = "fedyogi"
    sdk_name = "FedYogi"

    name: Literal["fedyogi"] = "fedyogi"


ServerOptions = PlainAveragingOptions | FedAvgMOptions | FedAdamOptions | FedYogiOptions

SERVER_OPTIMIZERS: dict[str, type[_ServerOptions]] = {
    cls.wire_name: cls
    for cls in (PlainAveragingOptions, FedAvgMOptions, FedAdamOptions, FedYogiOptions)
}
"""The server optimizers' options by the name a client gives."""


def server_options(
    name: str, hyperparameters: Mapping[str, Any], dialect: Dialect
) -> ServerOptions:
    """The server optimizer ``name`` with ``hyperparameters``, checked.

    Raises:
        ValueError: an unknown name, an option it does not take, or a value out of range.
    """
    try:
        cls = SERVER_OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown server optimizer {name!r}; expected one of {sorted(SERVER_OPTIMIZERS)}"
        ) from None
    allowed = [key for key in cls.model_fields if key != "name"]
    unknown = sorted(str(key) for key in hyperparameters if key not in allowed)
    if unknown:
        takes = f"takes options {allowed}" if allowed else "takes no options"
        raise ValueError(f"server optimizer {name!r} {takes}; got unknown {unknown}")
    fields = {"name": name, **hyperparameters}
    try:
        options: ServerOptions = cls.model_validate(fields, context={"dialect": dialect})  # type: ignore[assignment]
    except ValidationError as exc:
        raise ValueError(_message(exc)) from None
    return options


# -- federated (McMahan et al. 2017; Li et al. 2020) --------------------------------------------


class FedAvgOptions(StrategyOptions):
    """Rounds of local training, averaged by rows; see ``somatize.FedAvg`` for each option."""

    wire_name = "fedavg"
    sdk_name = "FedAvg"

    rounds: int
    local_epochs: int = 1
    fraction: float = 1.0
    min_workers: int = 1
    workers: int | None = None
    tag: str | None = None
    server: dict[str, Any] | None = None  # {"name": ..., hyperparameter: value, ...}
    seed: int = 0
    device: str | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        say.positive_int("rounds", fields.get("rounds"))
        say.positive_int("local_epochs", fields.get("local_epochs", 1))
        min_workers = say.positive_int("min_workers", fields.get("min_workers", 1))
        fraction = fields.get("fraction", 1.0)
        wire = f"fraction must be a number in (0, 1], not {fraction!r}"
        if not 0 < say.real("fraction", fraction, wire) <= 1:
            raise say.no(f"fraction must be in (0, 1], not {fraction!r}", wire)
        workers = fields.get("workers")
        if workers is not None and say.positive_int("workers", workers) < min_workers:
            raise say.no(f"workers ({workers}) must be at least min_workers ({min_workers})")
        say.selector("tag", fields.get("tag"))
        server = fields.get("server")
        if server is not None:
            if not isinstance(server, Mapping) or not isinstance(server.get("name"), str):
                raise say.no(
                    "server must be FedAvgM(...), FedAdam(...), FedYogi(...) or None, "
                    f"not {server!r}",
                    f"server must be an object with a name (one of {sorted(SERVER_OPTIMIZERS)}) "
                    f"and its options, not {server!r}",
                )
            hyperparameters = {k: v for k, v in server.items() if k != "name"}
            try:
                server_options(server["name"], hyperparameters, say.dialect)
            except ValueError as exc:
                raise say.no(f"server: {exc}") from None
        seed = fields.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise say.no(f"seed must be a non-negative integer, not {seed!r}")
        say.device("device", fields.get("device"))
        return fields

    def server_optimizer(self) -> ServerOptions:
        """The server optimizer asked for (plain averaging when none is)."""
        spec = self.server or {"name": PlainAveragingOptions.wire_name}
        hyperparameters = {k: v for k, v in spec.items() if k != "name"}
        return server_options(spec["name"], hyperparameters, Dialect.WIRE)


class FedProxOptions(FedAvgOptions):
    """FedAvg with the proximal term μ/2 ‖w − w_t‖² on every local batch; ``mu`` > 0."""

    wire_name = "fedprox"
    sdk_name = "FedProx"

    mu: float

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        mu = fields.get("mu")
        wire = f"mu must be a finite number > 0, not {mu!r} (mu = 0 is FedAvg)"
        if say.real("mu", mu, wire) <= 0:
            raise say.no(f"mu must be > 0, not {mu!r}", wire)
        return super()._check(fields, say)

    def to_wire(self) -> dict[str, Any]:
        options = super().to_wire()
        return {"mu": options.pop("mu"), **options}


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
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
        return _check_partition(fields, say, "partition")

    def to_wire(self) -> dict[str, Any]:
        pinned = {"worker": self.worker} if self.worker is not None else {"tag": self.tag}
        on = {"device": self.device} if self.device is not None else {}
        return {"node_ids": list(self.node_ids), **pinned, **on}


def _check_partition(fields: dict[str, Any], say: _Say, label: str) -> dict[str, Any]:
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


class ModelParallelOptions(StrategyOptions):
    """The graph's partitions, in graph order; micro-batches per global batch; the schedule;
    the device of the partitions that name none."""

    wire_name = "model_parallel"
    sdk_name = "ModelParallel"

    partitions: tuple[PartitionOptions, ...]
    micro_batches: int = 1
    schedule: str = "gpipe"
    device: str | None = None
    transport: str = "auto"
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT

    @classmethod
    def _check(cls, fields: dict[str, Any], say: _Say) -> dict[str, Any]:
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
        return options

    def device_of(self, partition: int) -> str | None:
        """Where partition ``partition`` runs: its own device, else the pipeline's."""
        own = self.partitions[partition].device
        return own if own is not None else self.device
