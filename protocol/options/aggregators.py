"""FedAvg's ``aggregator`` options: the Byzantine-robust rules that may replace a round's
weighted mean (``coordinator.strategies.federated.robust``), and how many clients each needs.

A rule travels as ``{"name": ..., parameter: value}``; :func:`aggregator_options` checks one.
:func:`check_round_size` refuses, when a job is submitted, a rule its rounds cannot have
enough clients for: a round goes on with as few as ``min_workers`` answers (times
``clients_per_worker``), so that is the n each rule must hold with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from protocol.options.base import Dialect, NamedOptions, Say, check_named, from_spec

__all__ = [
    "AGGREGATORS",
    "AggregatorOptions",
    "BulyanOptions",
    "FedMedianOptions",
    "KrumOptions",
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


class _RuleOptions(NamedOptions):
    """A robust rule's parameters; ``name`` selects it on the wire."""

    def least_clients(self) -> int:
        """The fewest clients a round needs for the rule to hold."""
        return 1

    def needs(self) -> str:
        """Why :meth:`least_clients` is what it is, for a refusal."""
        return ""


class FedMedianOptions(_RuleOptions):
    """The coordinate-wise median (Yin et al. 2018)."""

    wire_name = "fedmedian"
    sdk_name = "FedMedian"

    name: Literal["fedmedian"] = "fedmedian"


class TrimmedMeanOptions(_RuleOptions):
    """The coordinate-wise β-trimmed mean (Yin et al. 2018): ``beta`` in [0, 1/2)."""

    wire_name = "trimmed_mean"
    sdk_name = "TrimmedMean"

    name: Literal["trimmed_mean"] = "trimmed_mean"
    beta: float

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        beta = cls._given(fields, "beta")
        if not 0 <= say.real("beta", beta) < 0.5:
            raise say.no(f"beta must be in [0, 0.5), not {beta!r}")
        return fields


class KrumOptions(_RuleOptions):
    """Krum, Multi-Krum with ``keep`` > 1 (Blanchard et al. 2017): ``byzantine`` f >= 0,
    ``keep`` m >= 1."""

    wire_name = "krum"
    sdk_name = "Krum"

    name: Literal["krum"] = "krum"
    byzantine: int
    keep: int = 1

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._count(say, fields, "byzantine", 0)
        cls._count(say, fields, "keep", 1)
        return fields

    def least_clients(self) -> int:
        return krum_least_clients(self.byzantine, self.keep)

    def needs(self) -> str:
        f, m = self.byzantine, self.keep
        return f"n > 2f + 2 = {2 * f + 2}" + (f" and n >= keep + f = {m + f}" if m > 1 else "")


class BulyanOptions(_RuleOptions):
    """Bulyan over Krum (El Mhamdi et al. 2018): ``byzantine`` f >= 0."""

    wire_name = "bulyan"
    sdk_name = "Bulyan"

    name: Literal["bulyan"] = "bulyan"
    byzantine: int

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._count(say, fields, "byzantine", 0)
        return fields

    def least_clients(self) -> int:
        return bulyan_least_clients(self.byzantine)

    def needs(self) -> str:
        return f"n >= 4f + 3 = {self.least_clients()}"


AggregatorOptions = FedMedianOptions | TrimmedMeanOptions | KrumOptions | BulyanOptions

AGGREGATORS: dict[str, type[_RuleOptions]] = {
    cls.wire_name: cls for cls in (FedMedianOptions, TrimmedMeanOptions, KrumOptions, BulyanOptions)
}
"""The robust rules' options by the name a client gives."""


def aggregator_options(spec: Mapping[str, Any], dialect: Dialect) -> AggregatorOptions:
    """The robust rule ``{"name": ..., parameter: value}`` asks for, checked.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    options: AggregatorOptions = from_spec(AGGREGATORS, "aggregator", spec, dialect)  # type: ignore[assignment]
    return options


FORMS = "FedMedian(), TrimmedMean(beta), Krum(byzantine, keep), Bulyan(byzantine)"
"""The SDK's robust rules, as a refusal lists them."""


def check_round_size(say: Say, spec: object, clients: int, counted: str) -> None:
    """Refuse an ``aggregator`` spec that is not a rule, or whose rule a round of ``clients``
    clients (the fewest a round may have: ``counted`` says how that is counted, and what to
    raise) cannot hold."""
    rule: AggregatorOptions = check_named(say, AGGREGATORS, "aggregator", "aggregator", FORMS, spec)  # type: ignore[assignment]
    least = rule.least_clients()
    if clients < least:
        given = ", ".join(f"{k}={v!r}" for k, v in rule.parameters().items())
        raise say.no(
            f"aggregator {rule.sdk_name}({given}) needs {rule.needs()}: at least {least} "
            f"clients in every round, and a round may go on with {clients} ({counted})"
        )
