"""Federated strategies' options: FedAvg, FedProx and the server optimizers (Reddi et al.
2021) applied to each round's average; see :mod:`protocol.options.strategies`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from protocol.options.aggregators import check_round_size
from protocol.options.base import CheckpointOptions, Dialect, NamedOptions, Say, named
from protocol.options.client_config import check_client_config
from protocol.options.privacy import check_privacy
from protocol.options.secure_aggregation import check_secagg

__all__ = [
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "FedAdagradOptions",
    "FedAdamOptions",
    "FedAvgMOptions",
    "FedAvgOptions",
    "FedProxOptions",
    "FedYogiOptions",
    "PlainAveragingOptions",
    "QFedAvgOptions",
    "ServerOptions",
    "server_options",
]


# -- server optimizers (Reddi et al. 2021) ------------------------------------------------------


class _ServerOptions(NamedOptions):
    """A server optimizer's hyperparameters; ``name`` selects it on the wire."""

    def hyperparameters(self) -> dict[str, float]:
        return self.parameters()

    @classmethod
    def _decay(cls, say: Say, fields: dict[str, Any], key: str) -> None:
        value = cls._given(fields, key)
        number = say.real(key, value, f"{key} must be a finite number, got {value!r}")
        if not 0 <= number < 1:
            raise say.no(
                f"{key} must be in [0, 1), not {value!r}", f"{key} must be in [0, 1), got {value!r}"
            )


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


class _MomentOptions(_ServerOptions):
    """What the adaptive server optimizers share (Reddi et al. 2021, Algorithm 2): ``lr`` > 0,
    ``beta1`` in [0, 1), and where they take them ``beta2`` in [0, 1) and ``tau`` > 0."""

    lr: float = 0.01
    beta1: float = 0.9

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._positive(say, fields, "lr")
        cls._decay(say, fields, "beta1")
        if "beta2" in cls.model_fields:
            cls._decay(say, fields, "beta2")
        cls._positive(say, fields, "tau")
        return fields


class FedAdagradOptions(_MomentOptions):
    """Adagrad on the server: no ``beta2`` (v_t = v_{t−1} + Δ_t²)."""

    wire_name = "fedadagrad"
    sdk_name = "FedAdagrad"

    name: Literal["fedadagrad"] = "fedadagrad"
    tau: float = 1e-3


class AdaptiveOptions(_MomentOptions):
    """Adam-like server optimizers (Reddi et al. 2021, Algorithm 2)."""

    beta2: float = 0.99
    tau: float = 1e-3


class FedAdamOptions(AdaptiveOptions):
    wire_name = "fedadam"
    sdk_name = "FedAdam"

    name: Literal["fedadam"] = "fedadam"


class FedYogiOptions(AdaptiveOptions):
    wire_name = "fedyogi"
    sdk_name = "FedYogi"

    name: Literal["fedyogi"] = "fedyogi"


ServerOptions = (
    PlainAveragingOptions | FedAvgMOptions | FedAdagradOptions | FedAdamOptions | FedYogiOptions
)

SERVER_OPTIMIZERS: dict[str, type[_ServerOptions]] = {
    cls.wire_name: cls
    for cls in (
        PlainAveragingOptions,
        FedAvgMOptions,
        FedAdagradOptions,
        FedAdamOptions,
        FedYogiOptions,
    )
}
"""The server optimizers' options by the name a client gives."""


def server_options(
    name: str, hyperparameters: Mapping[str, Any], dialect: Dialect
) -> ServerOptions:
    """The server optimizer ``name`` with ``hyperparameters``, checked.

    Raises:
        ValueError: an unknown name, an option it does not take, or a value out of range.
    """
    options: ServerOptions = named(
        SERVER_OPTIMIZERS, "server optimizer", name, hyperparameters, dialect
    )  # type: ignore[assignment]
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
    aggregator: dict[str, Any] | None = None  # a robust rule: {"name": ..., parameter: value}
    client_config: list[dict[str, Any]] | None = None  # one dict per round
    clients_per_worker: int = 1
    privacy: dict[str, Any] | None = None  # {"name": ..., parameter: value}
    secure_aggregation: dict[str, Any] | None = None  # {"name": "secagg", parameter: value}
    seed: int = 0
    device: str | None = None
    evaluate_fraction: float = 0.0

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        rounds = say.positive_int("rounds", fields.get("rounds"))
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
                    "server must be FedAvgM(...), FedAdagrad(...), FedAdam(...), FedYogi(...) or "
                    "None, "
                    f"not {server!r}",
                    f"server must be an object with a name (one of {sorted(SERVER_OPTIMIZERS)}) "
                    f"and its options, not {server!r}",
                )
            hyperparameters = {k: v for k, v in server.items() if k != "name"}
            try:
                server_options(server["name"], hyperparameters, say.dialect)
            except ValueError as exc:
                raise say.no(f"server: {exc}") from None
        per_worker = say.positive_int("clients_per_worker", fields.get("clients_per_worker", 1))
        aggregator = fields.get("aggregator")
        if aggregator is not None:
            counted = f"min_workers is {min_workers}: raise it"
            if per_worker > 1:
                counted = (
                    f"min_workers {min_workers} × clients_per_worker {per_worker}: raise either"
                )
            check_round_size(say, aggregator, min_workers * per_worker, counted)
        privacy = fields.get("privacy")
        if privacy is not None:
            if aggregator is not None:
                raise say.no(
                    "privacy and a robust aggregator do not go together: DP-FedAvg's noise is "
                    "sized for the sum of clipped updates"
                )
            check_privacy(say, privacy, min_workers * per_worker)
        secure = fields.get("secure_aggregation")
        if secure is not None:
            if aggregator is not None or privacy is not None:
                raise say.no(
                    "secure_aggregation gives the coordinator the sum alone: a robust aggregator "
                    "or privacy, which need each client's model, cannot go with it"
                )
            check_secagg(say, secure, min_workers * per_worker)
        config = fields.get("client_config")
        if config is not None:
            try:
                check_client_config(config, rounds)
            except ValueError as exc:
                raise say.no(str(exc)) from None
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
        if self.clients_per_worker == 1:
            unset.add("clients_per_worker")
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


class QFedAvgOptions(FedAvgOptions):
    """FedAvg with q-FedAvg's server update (Li et al. 2020): ``q`` >= 0, ``lipschitz`` L > 0;
    its own server step, so no ``server`` and no ``aggregator``."""

    wire_name = "qfedavg"
    sdk_name = "QFedAvg"

    q: float
    lipschitz: float

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        q = fields.get("q")
        if say.real("q", q) < 0:
            raise say.no(f"q must be >= 0, not {q!r}")
        lipschitz = fields.get("lipschitz")
        if say.real("lipschitz", lipschitz) <= 0:
            raise say.no(f"lipschitz must be > 0 (the paper takes 1/lr), not {lipschitz!r}")
        for key in ("server", "aggregator", "privacy", "secure_aggregation"):
            if fields.get(key) is not None:
                raise say.no(
                    f"{key} must be None: q-FedAvg's server update is its own, not {fields[key]!r}"
                )
        return super()._check(fields, say)

    def to_wire(self) -> dict[str, Any]:
        options = super().to_wire()
        return {"q": options.pop("q"), "lipschitz": options.pop("lipschitz"), **options}
