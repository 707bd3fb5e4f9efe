"""Federated strategies' options: FedAvg, FedProx and the server optimizers (Reddi et al.
2021) applied to each round's average; see :mod:`protocol.strategy_options`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationError

from protocol.options_base import CheckpointOptions, Dialect, Say, StrategyOptions, message_of

__all__ = [
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "FedAdamOptions",
    "FedAvgMOptions",
    "FedAvgOptions",
    "FedProxOptions",
    "FedYogiOptions",
    "PlainAveragingOptions",
    "ServerOptions",
    "server_options",
]


# -- server optimizers (Reddi et al. 2021) ------------------------------------------------------


class _ServerOptions(StrategyOptions):
    """A server optimizer's hyperparameters; ``name`` selects it on the wire."""

    name: str

    def hyperparameters(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if k != "name"}

    @classmethod
    def _range(cls, say: Say, key: str, value: object, rule: str, ok: bool) -> None:
        if not ok:
            raise say.no(
                f"{key} must be {rule}, not {value!r}", f"{key} must be {rule}, got {value!r}"
            )

    @classmethod
    def _positive(cls, say: Say, fields: dict[str, Any], key: str) -> None:
        value = fields.get(key, cls.model_fields[key].default)
        number = say.real(key, value, f"{key} must be a finite number, got {value!r}")
        cls._range(say, key, value, "> 0", number > 0)

    @classmethod
    def _decay(cls, say: Say, fields: dict[str, Any], key: str) -> None:
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
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
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
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
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
        raise ValueError(message_of(exc)) from None
    return options


# -- federated (McMahan et al. 2017; Li et al. 2020) --------------------------------------------


class FedAvgOptions(CheckpointOptions):
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
    evaluate_fraction: float = 0.0

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        say.positive_int("rounds", fields.get("rounds"))
        share = fields.get("evaluate_fraction", 0.0)
        wire = f"evaluate_fraction must be a number in [0, 1], not {share!r}"
        if not 0 <= say.real("evaluate_fraction", share, wire) <= 1:
            raise say.no(f"evaluate_fraction must be in [0, 1], not {share!r}", wire)
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
        cls._check_checkpoints(fields, say)
        return fields

    def to_wire(self) -> dict[str, Any]:
        unset = {"checkpoint_every", "keep_checkpoints", "max_restarts", "restart_timeout"}
        if not self.evaluate_fraction:
            unset.add("evaluate_fraction")
        return self.model_dump(exclude_none=True, exclude=unset) | self._checkpoints_wire()

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
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        mu = fields.get("mu")
        wire = f"mu must be a finite number > 0, not {mu!r} (mu = 0 is FedAvg)"
        if say.real("mu", mu, wire) <= 0:
            raise say.no(f"mu must be > 0, not {mu!r}", wire)
        return super()._check(fields, say)

    def to_wire(self) -> dict[str, Any]:
        options = super().to_wire()
        return {"mu": options.pop("mu"), **options}
