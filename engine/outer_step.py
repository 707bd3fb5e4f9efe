"""DiLoCo's outer step on a replica (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", Algorithm 1).

Between two synchronisations every replica trains alone: its inner steps take its own slice of
each global batch with the filter's own optimizer, and nothing crosses the network. At a
synchronisation the replicas all-reduce their *pseudo-gradients* Δ = θ_global − θ_local (averaged
over the group, in buckets), and each takes the same outer step on the global weights it keeps —
SGD with momentum, Nesterov's by default (``torch.optim.SGD``, whose update with Δ as the
gradient is the paper's outer optimiser); they travel in fp32 or compressed
(:class:`engine.compression.CompressedMean`) — and starts its next inner steps from them. Every
replica holds the same global weights and outer momentum, so none of it travels.

With ``sync_every=1``, an outer SGD of ``lr=1`` and no momentum, one synchronisation averages the
replicas' weights after one step each: with an inner SGD that is DataParallel's step, since each
replica's loss is weighted by its share of the global batch (:mod:`engine.replica`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from engine.compression import CompressedMean
from protocol.daemon import OuterStepSpec
from protocol.rules.traffic import buckets

__all__ = ["OuterStep"]


class OuterStep:
    """The global weights of ``params`` and their outer optimizer, over the default process
    group (module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        spec: OuterStepSpec,
        compression: str | None = None,
    ) -> None:
        self.spec = spec
        self.pseudo_gradients = CompressedMean(compression)
        self.params = list(params)
        self.global_params = [p.detach().clone() for p in self.params]
        nesterov = spec.nesterov and spec.momentum > 0  # Nesterov's step needs a momentum
        self.optimizer = torch.optim.SGD(
            self.global_params, lr=spec.lr, momentum=spec.momentum, nesterov=nesterov
        )

    def sync(self, inner: Sequence[torch.optim.Optimizer]) -> None:
        """Average the pseudo-gradients over the group, step the global weights, and set the
        local weights to them; drop the ``inner`` optimizers' state when the spec says so.

        Raises:
            RuntimeError: the group broke (torch.distributed's own error).
        """
        with torch.no_grad():
            deltas = [g - p.detach() for g, p in zip(self.global_params, self.params, strict=True)]
            sizes = [d.numel() * d.element_size() for d in deltas]
            for k, run in enumerate(buckets(sizes)):  # (protocol.rules.traffic counts them so)
                bucket = [deltas[j] for j in run]
                flat = torch.cat([d.reshape(-1) for d in bucket])
                self.pseudo_gradients.mean(flat, k)
                offset = 0
                for d in bucket:
                    d.copy_(flat[offset : offset + d.numel()].view_as(d))
                    offset += d.numel()
            for g, delta in zip(self.global_params, deltas, strict=True):
                g.grad = delta
            self.optimizer.step()
            for g, p in zip(self.global_params, self.params, strict=True):
                p.copy_(g)
                g.grad = None
        if self.spec.inner_state == "reset":
            for optimizer in inner:
                optimizer.state = defaultdict(dict)
