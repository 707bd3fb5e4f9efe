"""Federated strategies' options: FedAvg, FedProx and q-FedAvg, defined once (see
:mod:`protocol.options.strategies`); the parts they take by name are defined beside them:
:mod:`~protocol.options.server_optimizers`, :mod:`~protocol.options.aggregators`,
:mod:`~protocol.options.privacy`, :mod:`~protocol.options.secure_aggregation`, and the per-round
:mod:`~protocol.options.client_config`."""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import SerializeAsAny, ValidationInfo, field_validator, model_validator

from protocol.options import aggregators, privacy, secure_aggregation, server_optimizers
from protocol.options.aggregators import RobustRuleOptions, check_round_size
from protocol.options.base import (
    CheckpointOptions,
    DeviceName,
    Part,
    PositiveInt,
    Rule,
    Selector,
    finite_positive,
    integer,
    number_in,
    real,
)
from protocol.options.client_config import check_client_config
from protocol.options.privacy import PrivacyMechanismOptions, check_privacy
from protocol.options.secure_aggregation import SecAggOptions, check_secagg
from protocol.options.server_optimizers import (
    SERVER_OPTIMIZERS,
    PlainAveragingOptions,
    ServerOptimizerOptions,
)

__all__ = ["FedAvgOptions", "FedProxOptions", "QFedAvgOptions"]

# The parts FedAvg takes by name: a model of their registry, or on the wire its spec (Part).
ServerPart = Annotated[
    SerializeAsAny[ServerOptimizerOptions] | None,
    Part(SERVER_OPTIMIZERS, "server optimizer", server_optimizers.FORMS),
]
AggregatorPart = Annotated[
    SerializeAsAny[RobustRuleOptions] | None,
    Part(aggregators.AGGREGATORS, "aggregator", aggregators.FORMS),
]
PrivacyPart = Annotated[
    SerializeAsAny[PrivacyMechanismOptions] | None,
    Part(privacy.PRIVACY, "privacy", privacy.FORMS),
]
SecAggPart = Annotated[
    SecAggOptions | None,
    Part(secure_aggregation.SECAGG, "secure aggregation", secure_aggregation.FORMS),
]


def _seed(key: str, seed: object) -> int:
    if not integer(seed) or seed < 0:  # type: ignore[operator]
        raise ValueError(f"{key} must be a non-negative integer, not {seed!r}")
    return seed  # type: ignore[return-value]


class FedAvgOptions(CheckpointOptions):
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
        server: a server optimizer (``FedAvgM``, ``FedAdagrad``, ``FedAdam``, ``FedYogi``:
            :mod:`protocol.options.server_optimizers`); default: plain averaging.
        aggregator: a Byzantine-robust rule in place of the weighted mean (``FedMedian``,
            ``TrimmedMean``, ``Krum``, ``Bulyan``: :mod:`protocol.options.aggregators`);
            default: the mean. ``min_workers`` must be enough for it (Krum: > 2f + 2,
            Bulyan: >= 4f + 3).
        client_config: what each round's clients train with, one dict per round: ``lr``
            (their optimizers' learning rate), ``local_epochs``, ``batch_size``
            (:mod:`protocol.options.client_config`). The SDK takes a function of the round
            (1, 2, ...), e.g. ``lambda r: {"lr": 0.1 * 0.9 ** r}``, called for every round when
            the strategy is built (the coordinator runs no client code).
        clients_per_worker: K, the virtual clients each worker trains in turn, client j on the
            j-th of K contiguous partitions of its rows (its shard, or its own dataset), each
            from w_t with a fresh optimizer: the same as K workers holding one partition each,
            so that a round of 1,000 clients runs on 2 workers. Selection (``fraction``) is
            over all clients, and a round needs ``min_workers`` × K answers.
        privacy: user-level differential privacy (``FixedClipping``, ``AdaptiveClipping``:
            :mod:`protocol.options.privacy`): clipped updates, Gaussian noise on their sum, ε
            spent in each round's event. TorchFilters only; no ``aggregator`` with it.
        secure_aggregation: ``SecAgg`` (:mod:`protocol.options.secure_aggregation`): the
            coordinator learns only the sum of each round's client models (TorchFilters only;
            no ``aggregator`` or ``privacy`` with it).
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

    name = "fedavg"
    sdk_name = "FedAvg"

    rounds: PositiveInt
    local_epochs: PositiveInt = 1
    fraction: Annotated[float, Rule(number_in, "(0, 1]")] = 1.0
    min_workers: PositiveInt = 1
    workers: PositiveInt | None = None
    tag: Selector = None
    server: ServerPart = None
    aggregator: AggregatorPart = None
    client_config: list[dict[str, Any]] | None = None  # one dict per round (_one_per_round)
    clients_per_worker: PositiveInt = 1
    privacy: PrivacyPart = None
    secure_aggregation: SecAggPart = None
    seed: Annotated[int, Rule(_seed)] = 0
    device: DeviceName = None
    evaluate_fraction: Annotated[float, Rule(number_in, "[0, 1]")] = 0.0
    inherited_after = "evaluate_fraction"

    @field_validator("client_config", mode="before")
    @classmethod
    def _one_per_round(cls, config: object, info: ValidationInfo) -> object:
        """``client_config``: one checked dict per round (its words count ``rounds``, declared,
        and so checked, before it: where it was refused, that refusal comes first)."""
        rounds = info.data.get("rounds")
        if config is not None and rounds is not None:
            check_client_config(config, rounds)
        return config

    @model_validator(mode="after")
    def _rounds_hold_their_parts(self) -> Self:
        """Enough workers for ``min_workers``; a round's fewest clients enough for the robust
        aggregator or the privacy mechanism; privacy, secure aggregation and a robust
        aggregator one at a time."""
        min_workers, per_worker = self.min_workers, self.clients_per_worker
        if self.workers is not None and self.workers < min_workers:
            raise ValueError(
                f"workers ({self.workers}) must be at least min_workers ({min_workers})"
            )
        least = self.min_clients  # the fewest clients a round may go on with
        aggregator, mechanism = self.aggregator, self.privacy
        if aggregator is not None:
            counted = f"min_workers is {min_workers}: raise it"
            if per_worker > 1:
                counted = (
                    f"min_workers {min_workers} × clients_per_worker {per_worker}: raise either"
                )
            check_round_size(aggregator, least, counted)
        if mechanism is not None:
            if aggregator is not None:
                raise ValueError(
                    "privacy and a robust aggregator do not go together: DP-FedAvg's noise is "
                    "sized for the sum of clipped updates"
                )
            check_privacy(mechanism, least)
        if self.secure_aggregation is not None:
            if aggregator is not None or mechanism is not None:
                raise ValueError(
                    "secure_aggregation gives the coordinator the sum alone: a robust aggregator "
                    "or privacy, which need each client's model, cannot go with it"
                )
            check_secagg(min_workers, per_worker)
        return self

    def server_optimizer(self) -> ServerOptimizerOptions:
        """The server optimizer asked for (plain averaging when none is)."""
        return self.server if self.server is not None else PlainAveragingOptions()

    @property
    def min_clients(self) -> int:
        """The fewest clients a round needs answers from: ``min_workers`` workers' worth."""
        return self.min_workers * self.clients_per_worker

    def config_of(self, r: int) -> dict[str, Any]:
        """Round ``r``'s client config (``{}``: the strategy's and the filters' own)."""
        return self.client_config[r - 1] if self.client_config else {}

    def epochs_through(self, r: int) -> int:
        """The local epochs a client trains in rounds 1 to ``r``: what its learning-rate
        schedules have stepped through by the end of round ``r``."""
        rounds = range(1, r + 1)
        return sum(self.config_of(t).get("local_epochs", self.local_epochs) for t in rounds)


class FedProxOptions(FedAvgOptions):
    """FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg
    whose workers add the proximal term μ/2 ‖w − w_t‖² to every local batch's loss, w_t being
    the round's global model, which keeps local models near it on heterogeneous data.

    Args:
        mu: μ (> 0; with μ = 0 this is FedAvg).
        rounds, local_epochs, fraction, min_workers, workers, tag, server, aggregator,
            client_config, clients_per_worker, privacy, secure_aggregation, seed, device,
            evaluate_fraction, checkpoint_every, keep_checkpoints, max_restarts,
            restart_timeout: as :class:`FedAvgOptions`.

    Raises:
        ValueError: an argument out of range or of the wrong type.
    """

    name = "fedprox"
    sdk_name = "FedProx"

    mu: Annotated[float, Rule(finite_positive, "mu = 0 is FedAvg")]
    inherited_after = "mu"


def _q(key: str, value: object) -> float:
    q = real(key, value)
    if q < 0:
        raise ValueError(f"{key} must be >= 0, not {value!r}")
    return q


def _lipschitz(key: str, value: object) -> float:
    lipschitz = real(key, value)
    if lipschitz <= 0:
        raise ValueError(f"{key} must be > 0 (the paper takes 1/lr), not {value!r}")
    return lipschitz


class QFedAvgOptions(FedAvgOptions):
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
            restart_timeout: as :class:`FedAvgOptions`.
    """

    name = "qfedavg"
    sdk_name = "QFedAvg"

    q: Annotated[float, Rule(_q)]
    lipschitz: Annotated[float, Rule(_lipschitz)]

    @field_validator("server", "aggregator", "privacy", "secure_aggregation", mode="before")
    @classmethod
    def _its_own_update(cls, value: object, info: ValidationInfo) -> object:
        """FedAvg's parts, none of which q-FedAvg takes (run before their own rule)."""
        if value is not None:
            raise ValueError(
                f"{info.field_name} must be None: q-FedAvg's server update is its own, "
                f"not {value!r}"
            )
        return value
