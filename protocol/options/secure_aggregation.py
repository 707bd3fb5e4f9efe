"""FedAvg's ``secure_aggregation`` (``coordinator.strategies.federated.secure_aggregation``):
the coordinator learns only the sum of a round's client models (Bonawitz et al. 2017; SecAgg+,
Bell et al. 2020)::

    sz.FedAvg(rounds=10, min_workers=3, secure_aggregation=sz.SecAgg())

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
from typing import Annotated, Any

from protocol.options.base import Caller, NamedOptions, Rule, count, from_spec, integer, real_in

__all__ = ["FORMS", "SECAGG", "SecAggOptions", "check_secagg", "secagg_options"]


def _scale_bits(key: str, f: object) -> int:
    if not integer(f) or not 8 <= f <= 40:  # type: ignore[operator]
        raise ValueError(f"{key} must be an integer in [8, 40], not {f!r}")
    return f  # type: ignore[return-value]


class SecAggOptions(NamedOptions):
    """Secure aggregation (Bonawitz et al. 2017; SecAgg+, Bell et al. 2020): the coordinator
    learns the sum of a round's client models, never one of them. Each client masks its model
    (weighted by its rows) with pairwise masks that cancel in the sum and a self-mask whose seed
    its neighbours hold in Shamir shares, so a client that drops out after sharing is unmasked
    by the others. Values travel as fixed point mod 2^64: the mean is off by at most
    2^−(scale_bits+1) per coordinate. Use when the coordinator must not see any one client's
    model (it still sees their row counts); TorchFilters only, no aggregator, no privacy.

    Args:
        neighbours: k, the clients each one shares secrets and masks with (a round of at most
            k + 1 clients: all of them).
        threshold: the share of a client's k + 1 shares that rebuilds its secrets, in (0.5, 1]:
            the round survives as long as that many of its neighbours are left.
        scale_bits: f, the fixed point, in [8, 40].
    """

    name = "secagg"
    sdk_name = "SecAgg"

    neighbours: Annotated[int, Rule(count, 2)] = 16
    threshold: Annotated[float, Rule(real_in, "(0.5, 1]")] = 2 / 3
    scale_bits: Annotated[int, Rule(_scale_bits)] = 24


SECAGG = {SecAggOptions.name: SecAggOptions}

FORMS = "SecAgg(...)"
"""The SDK's secure aggregation, as a refusal names it."""


def secagg_options(spec: Mapping[str, Any], caller: Caller = Caller.WIRE) -> SecAggOptions:
    """The secure aggregation ``{"name": "secagg", ...}`` asks for, checked.

    Raises:
        ValueError: a parameter it does not take, or a value out of range.
    """
    return from_spec(SECAGG, "secure aggregation", spec, caller)


def check_secagg(workers: int, clients_per_worker: int = 1) -> None:
    """Refuse rounds that may have a single worker's clients only: the sum of one worker's
    virtual clients is still that worker's update (its data), whatever their number."""
    if workers < 2:
        raise ValueError(
            "secure_aggregation needs the clients of at least 2 workers in every round (the "
            f"sum of one worker's is its update), and a round may go on with {workers}"
            + (f" worker's {clients_per_worker} clients" if clients_per_worker > 1 else "")
            + ": raise min_workers"
        )
