"""User-level differential privacy for FedAvg and FedProx
(``coordinator.strategies.federated.privacy``): each client's update clipped, Gaussian noise on
their sum, and each round's event saying the privacy spent so far (ε at ``delta``, from
``dp_accounting``'s RDP accountant)::

    sz.FedAvg(rounds=100, fraction=0.1, privacy=sz.FixedClipping(clip_norm=1.0,
                                                                  noise_multiplier=1.1))

A private job trains TorchFilters only (plain filters' states would be averaged in the clear:
refused at submit) and takes no robust aggregator; a server optimizer steps on the noised mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.options import privacy as po
from protocol.options.secure_aggregation import SECAGG
from somatize.components import Component

__all__ = ["AdaptiveClipping", "FixedClipping", "PrivacyMechanism", "SecAgg"]


@dataclass(frozen=True)
class PrivacyMechanism(Component):
    """Base of the privacy mechanisms."""

    registry = po.PRIVACY
    kind = "privacy"


@dataclass(frozen=True)
class FixedClipping(PrivacyMechanism):
    """DP-FedAvg (McMahan et al. 2018): every update clipped to ``clip_norm`` S and
    N(0, (z S)²) added to their sum, z = ``noise_multiplier``. With ``side="client"`` each
    client clips its own update before sending it (the server never holds an unclipped one);
    ``"server"`` clips on the coordinator. Use when the update norms are known well enough to
    pick S.

    Args:
        clip_norm: S (> 0).
        noise_multiplier: z (>= 0; 0: clipping only, no privacy).
        side: ``"server"`` or ``"client"``.
        delta: the δ at which ε is reported.
    """

    clip_norm: float
    noise_multiplier: float
    side: str = "server"
    delta: float = 1e-5

    name: ClassVar[str] = "fixed_clipping"


@dataclass(frozen=True)
class AdaptiveClipping(PrivacyMechanism):
    """DP-FedAvg clipping at a quantile of the update norms (Andrew et al. 2021): the server's
    clip C follows ``target_quantile`` γ (C ← C·exp(−η_C (b̃ − γ)), b̃ the noised share of
    unclipped updates), so that no S has to be tuned. Use when the update norms are unknown or
    change as training goes.

    Args:
        noise_multiplier: z (>= 0), split between the update and the count.
        initial_clip: C_0 (> 0).
        target_quantile: γ in [0, 1].
        clip_lr: η_C (> 0).
        count_stddev: σ_b (default: m/20, m the clients a round selects).
        delta: the δ at which ε is reported.
    """

    noise_multiplier: float
    initial_clip: float = 0.1
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_stddev: float | None = None
    delta: float = 1e-5

    name: ClassVar[str] = "adaptive_clipping"


@dataclass(frozen=True)
class SecAgg(Component):
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

    neighbours: int = 16
    threshold: float = 2 / 3
    scale_bits: int = 24

    name: ClassVar[str] = "secagg"
    registry = SECAGG
    kind = "secure aggregation"
