"""FedAvg's ``privacy`` options: user-level differential privacy by clipping each client's
update and adding Gaussian noise to their sum (``coordinator.strategies.federated.privacy``).

* ``fixed_clipping`` — McMahan et al. 2018, "Learning Differentially Private Recurrent
  Language Models" (DP-FedAvg): every update clipped to ``clip_norm`` S, by the server
  (``side="server"``) or by each client before it sends it (``side="client"``), and
  N(0, (z S)²) added to their sum, z the ``noise_multiplier``.
* ``adaptive_clipping`` — Andrew et al. 2021, "Differentially Private Learning with Adaptive
  Clipping": the server clips to a norm C that follows the ``target_quantile`` γ of the update
  norms, from ``initial_clip``, at ``clip_lr`` η_C, the count of unclipped updates noised with
  ``count_stddev`` σ_b (default m/20, m the clients a round selects).

``delta`` is the δ at which each round's event reports the ε spent so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from protocol.options.base import Dialect, NamedOptions, Say, check_named, from_spec

__all__ = [
    "PRIVACY",
    "AdaptiveClippingOptions",
    "FixedClippingOptions",
    "PrivacyOptions",
    "check_privacy",
    "privacy_options",
]

SIDES = ("server", "client")


class _PrivacyOptions(NamedOptions):
    """A privacy mechanism's parameters; ``name`` selects it on the wire."""

    noise_multiplier: float
    delta: float = 1e-5

    @classmethod
    def _check_common(cls, fields: dict[str, Any], say: Say) -> None:
        cls._positive(say, fields, "noise_multiplier", zero=True)
        delta = cls._given(fields, "delta")
        if not 0 < say.real("delta", delta) < 1:
            raise say.no(f"delta must be in (0, 1), not {delta!r}")


class FixedClippingOptions(_PrivacyOptions):
    """DP-FedAvg with a fixed clipping norm (McMahan et al. 2018)."""

    wire_name = "fixed_clipping"
    sdk_name = "FixedClipping"

    name: Literal["fixed_clipping"] = "fixed_clipping"
    clip_norm: float
    side: Literal["server", "client"] = "server"

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._positive(say, fields, "clip_norm")
        cls._check_common(fields, say)
        side = fields.get("side", "server")
        if side not in SIDES:
            raise say.no(f"side must be 'server' or 'client', not {side!r}")
        return fields


class AdaptiveClippingOptions(_PrivacyOptions):
    """DP-FedAvg clipping at a quantile of the update norms (Andrew et al. 2021)."""

    wire_name = "adaptive_clipping"
    sdk_name = "AdaptiveClipping"

    name: Literal["adaptive_clipping"] = "adaptive_clipping"
    initial_clip: float = 0.1
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_stddev: float | None = None

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        cls._positive(say, fields, "initial_clip")
        quantile = cls._given(fields, "target_quantile")
        if not 0 <= say.real("target_quantile", quantile) <= 1:
            raise say.no(f"target_quantile must be in [0, 1], not {quantile!r}")
        cls._positive(say, fields, "clip_lr")
        if fields.get("count_stddev") is not None:
            cls._positive(say, fields, "count_stddev", zero=True)
        cls._check_common(fields, say)
        return fields

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

PRIVACY: dict[str, type[_PrivacyOptions]] = {
    cls.wire_name: cls for cls in (FixedClippingOptions, AdaptiveClippingOptions)
}
"""The privacy mechanisms' options by the name a client gives."""


def privacy_options(spec: Mapping[str, Any], dialect: Dialect) -> PrivacyOptions:
    """The mechanism ``{"name": ..., parameter: value}`` asks for, checked.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    options: PrivacyOptions = from_spec(PRIVACY, "privacy", spec, dialect)  # type: ignore[assignment]
    return options


def check_privacy(say: Say, spec: object, clients: int) -> None:
    """Refuse a ``privacy`` spec that is not a mechanism, or an adaptive one whose count noise
    a round of ``clients`` clients (the fewest a round selects) leaves too small."""
    forms = "FixedClipping(...), AdaptiveClipping(...)"
    options = check_named(say, PRIVACY, "privacy", "privacy", forms, spec)
    if isinstance(options, AdaptiveClippingOptions):
        try:
            options.update_noise(clients)
        except ValueError as exc:
            raise say.no(f"privacy: {exc}") from None
