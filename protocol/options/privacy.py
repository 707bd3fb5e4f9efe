"""FedAvg's ``privacy``: user-level differential privacy by clipping each client's update and
adding Gaussian noise to their sum (``coordinator.strategies.federated.privacy`` runs it), each
round's event saying the privacy spent so far (ε at ``delta``, from ``dp_accounting``'s RDP
accountant)::

    sz.FedAvg(rounds=100, fraction=0.1, privacy=sz.FixedClipping(clip_norm=1.0,
                                                                  noise_multiplier=1.1))

* ``fixed_clipping`` — McMahan et al. 2018, "Learning Differentially Private Recurrent
  Language Models" (DP-FedAvg): every update clipped to ``clip_norm`` S, by the server
  (``side="server"``) or by each client before it sends it (``side="client"``), and
  N(0, (z S)²) added to their sum, z the ``noise_multiplier``.
* ``adaptive_clipping`` — Andrew et al. 2021, "Differentially Private Learning with Adaptive
  Clipping": the server clips to a norm C that follows the ``target_quantile`` γ of the update
  norms, from ``initial_clip``, at ``clip_lr`` η_C, the count of unclipped updates noised with
  ``count_stddev`` σ_b (default m/20, m the clients a round selects).

A private job trains TorchFilters only (plain filters' states would be averaged in the clear:
refused at submit) and takes no robust aggregator; a server optimizer steps on the noised mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from protocol.options.base import (
    AboveZero,
    Caller,
    NamedOptions,
    Rule,
    above_zero,
    from_spec,
    real_in,
)

__all__ = [
    "FORMS",
    "PRIVACY",
    "AdaptiveClippingOptions",
    "FixedClippingOptions",
    "PrivacyMechanismOptions",
    "PrivacyOptions",
    "check_privacy",
    "privacy_options",
]

Side = Literal["server", "client"]
SIDES: tuple[str, ...] = get_args(Side)


def _side(key: str, side: object) -> str:
    if side not in SIDES:
        raise ValueError(f"{key} must be 'server' or 'client', not {side!r}")
    return side


Noise = Annotated[float, Rule(above_zero, zero=True)]
"""A noise multiplier or standard deviation: a finite number >= 0."""


class PrivacyMechanismOptions(NamedOptions):
    """A privacy mechanism: its noise multiplier z and the δ at which ε is reported."""

    noise_multiplier: Noise
    delta: Annotated[float, Rule(real_in, "(0, 1)")] = 1e-5


class FixedClippingOptions(PrivacyMechanismOptions):
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

    name = "fixed_clipping"
    sdk_name = "FixedClipping"

    clip_norm: AboveZero
    side: Annotated[Side, Rule(_side)] = "server"


class AdaptiveClippingOptions(PrivacyMechanismOptions):
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

    name = "adaptive_clipping"
    sdk_name = "AdaptiveClipping"

    initial_clip: AboveZero = 0.1
    target_quantile: Annotated[float, Rule(real_in, "[0, 1]")] = 0.5
    clip_lr: AboveZero = 0.2
    count_stddev: Noise | None = None

    def count_noise(self, clients: int) -> float:
        """σ_b for a round of ``clients`` selected clients: as given, or m/20 (Andrew et al.'s
        recommendation); 0 when there is no noise at all."""
        if self.noise_multiplier == 0:
            return 0.0
        return self.count_stddev if self.count_stddev is not None else clients / 20

    def update_noise(self, clients: int) -> float:
        """z_Δ, the update's share of the noise: (z^−2 − (2σ_b)^−2)^−1/2 (Andrew et al. 2021,
        Theorem 1), so that the update and the count together spend what z alone would.

        Raises:
            ValueError: z >= 2σ_b: the count's noise alone would spend more than z allows.
        """
        z = self.noise_multiplier
        if z == 0:
            return 0.0
        sigma_b = self.count_noise(clients)
        if z >= 2 * sigma_b:
            raise ValueError(
                f"noise_multiplier {z:g} needs count_stddev > {z / 2:g}, and a round of "
                f"{clients} clients has {sigma_b:g}"
                + (" (m/20)" if self.count_stddev is None else "")
            )
        return float((z**-2 - (2 * sigma_b) ** -2) ** -0.5)


PrivacyOptions = FixedClippingOptions | AdaptiveClippingOptions

PRIVACY: dict[str, type[PrivacyMechanismOptions]] = {
    cls.name: cls for cls in (FixedClippingOptions, AdaptiveClippingOptions)
}
"""The privacy mechanisms' options by the name a client gives."""

FORMS = "FixedClipping(...), AdaptiveClipping(...)"
"""The SDK's privacy mechanisms, as a refusal lists them."""


def privacy_options(
    spec: Mapping[str, Any], caller: Caller = Caller.WIRE
) -> PrivacyMechanismOptions:
    """The mechanism ``{"name": ..., parameter: value}`` asks for, checked.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    return from_spec(PRIVACY, "privacy", spec, caller)


def check_privacy(mechanism: PrivacyMechanismOptions, clients: int) -> None:
    """Refuse an adaptive mechanism whose count noise a round of ``clients`` clients (the
    fewest a round selects) leaves too small."""
    if isinstance(mechanism, AdaptiveClippingOptions):
        try:
            mechanism.update_noise(clients)
        except ValueError as exc:
            raise ValueError(f"privacy: {exc}") from None
