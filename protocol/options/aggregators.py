"""FedAvg's ``aggregator``: the Byzantine-robust rules that may replace a round's weighted mean
when a few clients may send anything (``coordinator.strategies.federated.robust`` runs them),
and how many clients each needs::

    sz.FedAvg(rounds=20, min_workers=7, aggregator=sz.Krum(byzantine=1, keep=3))

Each rule weighs the clients equally (as its paper does) and is applied to the TorchFilters'
weights; a server optimizer, if any, then steps on its result in place of the mean. In Python a
rule is its model; on the wire ``{"name": ..., parameter: value}`` (:func:`aggregator_options`).
:func:`check_round_size` refuses, when a job is submitted, a rule its rounds cannot have enough
clients for: a round goes on with as few as ``min_workers`` answers (times
``clients_per_worker``), so that is the n each rule must hold with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from protocol.options.base import Caller, NamedOptions, Rule, count, from_spec, real_in

__all__ = [
    "AGGREGATORS",
    "FORMS",
    "AggregatorOptions",
    "BulyanOptions",
    "FedMedianOptions",
    "KrumOptions",
    "RobustRuleOptions",
    "TrimmedMeanOptions",
    "aggregator_options",
    "bulyan_least_clients",
    "check_round_size",
    "krum_least_clients",
]


def krum_least_clients(byzantine: int, keep: int) -> int:
    """Krum needs n > 2f + 2 (Blanchard et al. 2017), and Multi-Krum's m <= n − f kept
    vectors (so that at least one is kept where f are bad)."""
    return max(2 * byzantine + 3, keep + byzantine)


def bulyan_least_clients(byzantine: int) -> int:
    """Bulyan needs n >= 4f + 3 (El Mhamdi et al. 2018)."""
    return 4 * byzantine + 3


class RobustRuleOptions(NamedOptions):
    """A Byzantine-robust rule in place of a round's weighted mean: its parameters, and the
    fewest clients a round needs for it to hold."""

    def least_clients(self) -> int:
        """The fewest clients a round needs for the rule to hold."""
        return 1

    def needs(self) -> str:
        """Why :meth:`least_clients` is what it is, for a refusal."""
        return ""


class FedMedianOptions(RobustRuleOptions):
    """The coordinate-wise median of the clients' models (Yin et al. 2018): robust to any
    minority of bad clients, at some cost in accuracy on honest, varied data."""

    name = "fedmedian"
    sdk_name = "FedMedian"


class TrimmedMeanOptions(RobustRuleOptions):
    """The coordinate-wise β-trimmed mean (Yin et al. 2018): each coordinate's ⌊β n⌋ largest
    and ⌊β n⌋ smallest values dropped, the rest averaged.

    Args:
        beta: β, in [0, 0.5).
    """

    name = "trimmed_mean"
    sdk_name = "TrimmedMean"

    beta: Annotated[float, Rule(real_in, "[0, 0.5)")]


class KrumOptions(RobustRuleOptions):
    """Krum (Blanchard et al. 2017): the client model closest to its n − f − 2 nearest
    neighbours; with ``keep`` = m > 1, Multi-Krum, the mean of the m best. Needs n > 2f + 2.

    Args:
        byzantine: f, how many bad clients to withstand (>= 0).
        keep: m, how many models are averaged (1: Krum).
    """

    name = "krum"
    sdk_name = "Krum"

    byzantine: Annotated[int, Rule(count, 0)]
    keep: Annotated[int, Rule(count, 1)] = 1

    def least_clients(self) -> int:
        return krum_least_clients(self.byzantine, self.keep)

    def needs(self) -> str:
        f, m = self.byzantine, self.keep
        return f"n > 2f + 2 = {2 * f + 2}" + (f" and n >= keep + f = {m + f}" if m > 1 else "")


class BulyanOptions(RobustRuleOptions):
    """Bulyan (El Mhamdi et al. 2018): θ = n − 2f models chosen by Krum one after the other,
    then, coordinate by coordinate, the mean of the θ − 2f values closest to their median.
    Needs n >= 4f + 3.

    Args:
        byzantine: f, how many bad clients to withstand (>= 0).
    """

    name = "bulyan"
    sdk_name = "Bulyan"

    byzantine: Annotated[int, Rule(count, 0)]

    def least_clients(self) -> int:
        return bulyan_least_clients(self.byzantine)

    def needs(self) -> str:
        return f"n >= 4f + 3 = {self.least_clients()}"


AggregatorOptions = FedMedianOptions | TrimmedMeanOptions | KrumOptions | BulyanOptions

AGGREGATORS: dict[str, type[RobustRuleOptions]] = {
    cls.name: cls for cls in (FedMedianOptions, TrimmedMeanOptions, KrumOptions, BulyanOptions)
}
"""The robust rules' options by the name a client gives."""

FORMS = "FedMedian(), TrimmedMean(beta), Krum(byzantine, keep), Bulyan(byzantine)"
"""The SDK's robust rules, as a refusal lists them."""


def aggregator_options(spec: Mapping[str, Any], caller: Caller = Caller.WIRE) -> RobustRuleOptions:
    """The robust rule ``{"name": ..., parameter: value}`` asks for, checked.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    return from_spec(AGGREGATORS, "aggregator", spec, caller)


def check_round_size(rule: RobustRuleOptions, clients: int, counted: str) -> None:
    """Refuse a rule that a round of ``clients`` clients (the fewest a round may have:
    ``counted`` says how that is counted, and what to raise) cannot hold."""
    least = rule.least_clients()
    if clients < least:
        given = ", ".join(f"{k}={v!r}" for k, v in rule.parameters().items())
        raise ValueError(
            f"aggregator {rule.sdk_name}({given}) needs {rule.needs()}: at least {least} "
            f"clients in every round, and a round may go on with {clients} ({counted})"
        )
