"""FedAvg's ``secure_aggregation`` options
(``coordinator.strategies.federated.secure_aggregation``): the coordinator learns only the sum of a
round's client models (Bonawitz et al. 2017; SecAgg+, Bell et al. 2020).

* ``neighbours`` k — the clients each one shares its secrets and pairwise masks with (SecAgg+'s
  sparse graph; every other client, Bonawitz et al.'s complete graph, when the round has at
  most k + 1): the cost per client grows with k, not with the round's size.
* ``threshold`` — the share of a client's k + 1 Shamir shares that rebuilds its secrets, in
  (1/2, 1]: a round survives a client's dropping out as long as that many of its neighbours
  are left; more than half, so that no two disjoint groups can rebuild both of its secrets.
* ``scale_bits`` f — the fixed point of the quantization: each value is sent as
  round(v · 2^f) mod 2^64, the mean off by at most 2^−(f+1) per coordinate (each client's
  rounding error, averaged), the weighted sums limited to ±2^(63−f).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from protocol.options.base import Dialect, NamedOptions, Say, check_named, from_spec

__all__ = ["SECAGG", "SecAggOptions", "check_secagg", "secagg_options"]


class SecAggOptions(NamedOptions):
    """Secure aggregation's parameters; see the module docstring."""

    wire_name = "secagg"
    sdk_name = "SecAgg"

    name: Literal["secagg"] = "secagg"
    neighbours: int = 16
    threshold: float = 2 / 3
    scale_bits: int = 24

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._count(say, fields, "neighbours", 2)
        t = cls._given(fields, "threshold")
        if not 0.5 < say.real("threshold", t) <= 1:
            raise say.no(f"threshold must be in (0.5, 1], not {t!r}")
        f = cls._given(fields, "scale_bits")
        if not isinstance(f, int) or isinstance(f, bool) or not 8 <= f <= 40:
            raise say.no(f"scale_bits must be an integer in [8, 40], not {f!r}")
        return fields


SECAGG = {"secagg": SecAggOptions}


def secagg_options(spec: Mapping[str, Any], dialect: Dialect) -> SecAggOptions:
    """The secure aggregation ``{"name": "secagg", ...}`` asks for, checked.

    Raises:
        ValueError: a parameter it does not take, or a value out of range.
    """
    return from_spec(SECAGG, "secure aggregation", spec, dialect)


def check_secagg(say: Say, spec: object, clients: int) -> None:
    """Refuse a ``secure_aggregation`` spec that is not one, or rounds that may have a single
    client (whose sum is its model)."""
    check_named(say, SECAGG, "secure_aggregation", "secure aggregation", "SecAgg(...)", spec)
    if clients < 2:
        raise say.no(
            "secure_aggregation needs at least 2 clients in every round (the sum of one is its "
            f"model), and a round may go on with {clients}: raise min_workers"
        )
