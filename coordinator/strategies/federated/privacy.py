"""User-level differential privacy for FedAvg: clipped client updates, Gaussian noise on their
sum, and the privacy spent so far.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models",
Algorithm 1, with every client weighing 1 and the fixed denominator)::

    Δ_k ← ClientUpdate(k, θ_t) − θ_t, clipped: Δ_k · min(1, S / ‖Δ_k‖)
    Δ̃   ← (Σ_k Δ_k + N(0, σ² I)) / m,    σ = z S
    θ_{t+1} ← θ_t + Δ̃                     (then the server optimizer, if any)

with m the clients the round selected (those that dropped out add nothing, the denominator
stays), z the noise multiplier and S the clipping norm. The clipping is the server's, or each
client's before it sends its model (``batched_fit`` with ``clip_norm``; the server clips again,
a no-op for an honest client). With adaptive clipping (Andrew et al. 2021, "Differentially
Private Learning with Adaptive Clipping", Algorithm 1) S is C_t, and each round also counts
the unclipped updates, noised::

    b̃  ← (Σ_k 1[‖Δ_k‖ <= C_t] + N(0, σ_b²)) / m
    C_{t+1} ← C_t · exp(−η_C (b̃ − γ))

the update then noised with z_Δ = (z^−2 − (2σ_b)^−2)^−1/2 in place of z, so that update and
count together spend what z alone would (their Theorem 1).

Δ is taken over the TorchFilters' float leaves
(:class:`~coordinator.strategies.federated.flat.Flat`): a job with plain filters, whose states are
averaged in the clear, is refused at submit. The noise comes from ``numpy.random.default_rng()``
seeded by the operating system. The privacy spent after each round is ε at the given δ from
``dp_accounting``'s RDP accountant (Mironov 2017), each round a Gaussian mechanism of multiplier z,
sampled with q = m / K (K the clients it was drawn from): the accountant treats the round's uniform
draw of m of K as Poisson sampling at that rate, the usual approximation (McMahan et al. sample
Poisson).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import Accumulator, Tree
from coordinator.strategies.federated.flat import Flat, Vector
from coordinator.strategies.federated.round_fold import RoundFold
from protocol.options import privacy as po

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
"""The RDP orders the accountant tries (as opacus' and TensorFlow Privacy's accountants)."""


class DPFold(RoundFold):
    """One round of DP-FedAvg's aggregation (see the module docstring).

    Args:
        start: θ_t, the states the round's clients started from.
        nodes: the TorchFilters.
        clip: the clipping norm this round (S, or C_t).
        update_noise: z (or z_Δ): the sum gets N(0, (z · clip)²) per coordinate.
        count_noise: σ_b, the noise on the count of unclipped updates (adaptive only).
        selected: m, the clients the round selected: the denominator.
        rng: where the noise comes from.
    """

    def __init__(
        self,
        start: Tree,
        nodes: Sequence[str],
        clip: float,
        *,
        update_noise: float,
        count_noise: float,
        selected: int,
        rng: np.random.Generator,
    ) -> None:
        self.start = start
        self.nodes = list(nodes)
        self.clip = clip
        self.update_noise = update_noise
        self.count_noise = count_noise
        self.selected = selected
        self.rng = rng
        self.flat: Flat | None = None
        self.theta: Vector | None = None
        self.total: Vector | None = None
        self.unclipped = 0
        self.noised_fraction: float | None = None  # b̃, once the result is taken
        self.checks = Accumulator()  # the trees agree (keys, shapes, integer leaves)

    def add(self, label: str, fit: Mapping[str, Any], states: Tree) -> None:
        model = {n: states[n] for n in self.nodes}
        flat = self.flat or Flat(model)
        theta = self.theta if self.theta is not None else flat.vector(self._start_model())
        delta = flat.vector(model) - theta
        self.checks.add(label, 1, model)
        self.flat, self.theta = flat, theta
        norm = float(np.linalg.norm(delta))
        if norm <= self.clip:
            self.unclipped += 1
        else:
            delta *= self.clip / norm
        self.total = delta if self.total is None else self.total + delta

    def _start_model(self) -> Tree:
        return {n: self.start[n] for n in self.nodes}

    def result(self) -> tuple[Tree, dict[str, Any]]:
        # b̃ ← (Σ b_k + N(0, σ_b²)) / m, for the next round's clip (adaptive clipping).
        count_noise = self.rng.normal(0.0, self.count_noise) if self.count_noise else 0.0
        self.noised_fraction = (self.unclipped + count_noise) / self.selected
        if self.flat is None or self.theta is None or self.total is None:
            return self.checks.result(), {}
        sigma = self.update_noise * self.clip
        noise = self.rng.normal(0.0, sigma, self.total.shape) if sigma else 0.0
        theta = self.theta + (self.total + noise) / self.selected
        model = self.flat.tree(theta, self.checks.result())
        return model, {}


def load_accountant() -> None:
    """Import ``dp_accounting`` (seconds, the first time; only a private job pays for it): best
    off the event loop, where a submitted job is vetted."""
    import dp_accounting  # noqa: F401


class Privacy:
    """What DP-FedAvg keeps across rounds: the clipping norm (it moves with adaptive clipping)
    and the accountant; :meth:`fold` makes a round's aggregation, :meth:`spent` closes it."""

    def __init__(
        self, options: po.PrivacyMechanismOptions, rng: np.random.Generator | None = None
    ) -> None:
        self.options = options
        self.rng = rng if rng is not None else np.random.default_rng()
        self.adaptive = isinstance(self.options, po.AdaptiveClippingOptions)
        if isinstance(options, po.AdaptiveClippingOptions):
            self.clip = options.initial_clip
        elif isinstance(options, po.FixedClippingOptions):
            self.clip = options.clip_norm
        else:
            raise TypeError(f"no privacy mechanism {type(options).__name__}")
        self.rates: list[float] = []  # each round's sampling rate q = m / K
        load_accountant()  # once, as the job starts: never inside a round

    @property
    def client_clip(self) -> float | None:
        """The norm each client clips its own update to (client-side clipping), else None."""
        options = self.options
        if isinstance(options, po.FixedClippingOptions) and options.side == "client":
            return options.clip_norm
        return None

    def fold(self, start: Tree, nodes: Sequence[str], selected: int) -> DPFold:
        """Round t's aggregation over ``selected`` (m) clients."""
        options = self.options
        if isinstance(options, po.AdaptiveClippingOptions):
            update_noise = options.update_noise(selected)
            count_noise = options.count_noise(selected)
        else:
            update_noise, count_noise = options.noise_multiplier, 0.0
        return DPFold(
            start,
            nodes,
            self.clip,
            update_noise=update_noise,
            count_noise=count_noise,
            selected=selected,
            rng=self.rng,
        )

    def spent(self, fold: DPFold, selected: int, population: int) -> dict[str, Any]:
        """Close a round: the next clip (adaptive), the round's sampling rate into the
        accountant; what the round's event says (ε at δ so far, the clip used)."""
        used = self.clip
        options = self.options
        if isinstance(options, po.AdaptiveClippingOptions) and fold.noised_fraction is not None:
            # C_{t+1} ← C_t · exp(−η_C (b̃ − γ)), the geometric update.
            self.clip = used * math.exp(
                -options.clip_lr * (fold.noised_fraction - options.target_quantile)
            )
        self.rates.append(selected / population)
        return {
            "privacy": {
                "epsilon": self.epsilon(),
                "delta": options.delta,
                "noise_multiplier": options.noise_multiplier,
                "clip": used,
            }
        }

    def epsilon(self) -> float:
        """ε at δ after the rounds so far (``inf`` without noise)."""
        z = self.options.noise_multiplier
        if z == 0:
            return math.inf
        import dp_accounting  # only a private job pays for the import
        from dp_accounting.rdp import RdpAccountant

        accountant = RdpAccountant(orders=ORDERS)
        for q in self.rates:
            accountant.compose(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
            )
        return float(accountant.get_epsilon(self.options.delta))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the clip and the rounds' sampling rates."""
        return {"clip": self.clip, "rates": list(self.rates)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clip = float(state["clip"])
        self.rates = [float(q) for q in state["rates"]]
