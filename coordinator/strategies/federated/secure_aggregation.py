"""The server side of secure aggregation: a FedAvg round in which the coordinator learns the
sum of the selected clients' weighted models, never one client's (Bonawitz et al. 2017,
"Practical Secure Aggregation for Privacy-Preserving Machine Learning", Figure 4; over the
sparse graph of SecAgg+, Bell et al. 2020). The clients' side is ``worker.daemon.secagg_client``;
the primitives are :mod:`protocol.security.secagg`'s.

:class:`SecureRound` holds one round's state and makes each step's requests; the strategy runs
them (:func:`each_client`), in this order::

    keys    every selected client advertises two public keys          U1: those that did
    share   each shares its secrets with its neighbours, sealed        U2 ⊆ U1
    mask    each trains, then sends y_u = x_u + masks mod 2^64        U3 ⊆ U2: their Σ y_u
    unmask  the survivors send shares: b_v of each v in U3, s_v of each v in U2 \\ U3

and :meth:`SecureRound.result` rebuilds each b_v and each dropped s_v (Shamir, from the
threshold's number of shares), takes the self-masks and the dropped clients' pairwise masks off
Σ y_u, and is left with Σ_{u∈U3} x_u: Σ n_u w_u and Σ n_u, the row-weighted mean of the
survivors' models to within the quantization error (see :mod:`protocol.security.secagg`). A dropped
client whose neighbours cannot rebuild its key, or a survivor whose self-mask they cannot,
fails the round. Each client's example count n_u is known to the coordinator (its training's
reply), its model is not.

The coordinator is taken to be honest but curious, as in Bonawitz et al.'s semi-honest setting:
it follows the protocol and tries to learn from what it sees. Against a coordinator that lies
about who dropped out (their round 4', ConsistencyCheck, and signed keys) there is no defence
here beyond each client's refusal to give both shares of one peer.

Only the TorchFilters' float entries are aggregated: their integer entries (BatchNorm's
``num_batches_tracked``) stay w_t's, and a job with plain filters is refused at submit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.aggregate import Tree, leaf_kind, like
from coordinator.strategies.base import concurrently
from coordinator.strategies.federated.cohort import Cohort, DroppedWorker, reasons
from coordinator.strategies.federated.collection import Collection
from protocol.daemon import SecAggRequest
from protocol.errors import ErrorCode
from protocol.options.secure_aggregation import SecAggOptions
from protocol.security import secagg


@dataclass
class SecureRound:
    """One round of secure aggregation over the clients ``labels`` (see the module)."""

    round: int
    labels: list[str]
    options: SecAggOptions
    start: Mapping[str, Any]  # w_t of the TorchFilters: the layout and the result's types
    graph: dict[str, list[str]] = field(default_factory=dict)
    keys: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # U1: c_pk, s_pk
    shared: set[str] = field(default_factory=set)  # U2
    sealed_to: dict[str, dict[str, bytes]] = field(default_factory=dict)  # receiver → sender
    total: np.ndarray[Any, np.dtype[np.uint64]] | None = None
    masked: set[str] = field(default_factory=set)  # U3
    b_shares: dict[str, list[secagg.Share]] = field(default_factory=dict)
    s_shares: dict[str, list[secagg.Share]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.graph = secagg.neighbours(sorted(self.labels), self.options.neighbours, self.round)
        self.layout = [
            [node, key]
            for node, state in self.start.items()
            for key, value in state.items()
            if leaf_kind(value) == "float"
        ]

    def threshold(self, u: str) -> int:
        """t_u: of u's shares (one per neighbour, one its own), how many rebuild its secrets."""
        return max(1, math.ceil(self.options.threshold * (len(self.graph[u]) + 1)))

    # -- the steps' requests and what is taken from their replies -------------------------------

    def keys_request(self, u: str) -> SecAggRequest:
        return SecAggRequest(step="keys", round=self.round, client=u)

    def took_keys(self, u: str, reply: Mapping[str, Any]) -> None:
        self.keys[u] = (bytes(reply["c"]), bytes(reply["s"]))

    def share_request(self, u: str) -> SecAggRequest:
        peers = {v: list(self.keys[v]) for v in self.graph[u] if v in self.keys}
        return SecAggRequest(
            step="share", round=self.round, client=u, peers=peers, threshold=self.threshold(u)
        )

    def took_shares(self, u: str, reply: Mapping[str, Any]) -> None:
        for v, blob in reply["sealed"].items():
            self.sealed_to.setdefault(v, {})[u] = bytes(blob)
        self.shared.add(u)

    def mask_request(self, u: str, rows: int) -> SecAggRequest:
        sealed = {v: blob for v, blob in self.sealed_to.get(u, {}).items() if v in self.shared}
        # Every client's values within ±2^(63−f)/|U2|: no sum of them wraps around.
        bound = 2.0 ** (63 - self.options.scale_bits) / max(1, len(self.shared))
        return SecAggRequest(
            step="mask",
            round=self.round,
            client=u,
            sealed=sealed,
            layout=self.layout,
            weight=rows,
            scale_bits=self.options.scale_bits,
            bound=bound,
        )

    def took_masked(self, u: str, masked: Any) -> None:
        words = np.asarray(masked, dtype=np.uint64)
        if self.total is None:
            self.total = words.copy()
        else:
            self.total += words  # mod 2^64
        self.masked.add(u)

    def unmask_request(self, u: str) -> SecAggRequest:
        near = {*self.graph[u], u}
        return SecAggRequest(
            step="unmask",
            round=self.round,
            client=u,
            survivors=sorted(near & self.masked),
            dropped=sorted((near & self.shared) - self.masked),
        )

    def took_unmask(self, u: str, reply: Mapping[str, Any]) -> None:
        for v, (index, share) in reply["b"].items():
            self.b_shares.setdefault(v, []).append((int(index), bytes(share)))
        for v, (index, share) in reply["s"].items():
            self.s_shares.setdefault(v, []).append((int(index), bytes(share)))

    # -- the sum --------------------------------------------------------------------------------

    def unmasked(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """Σ_{u∈U3} x_u mod 2^64: Σ y_u less the survivors' self-masks and the pairwise masks
        the survivors shared with the clients that dropped after sharing.

        Raises:
            StrategyFailed: a secret its holders cannot rebuild (too few shares).
        """
        if self.total is None:
            raise self._failed("no client sent its masked model")
        total = self.total.copy()
        size = total.size
        for v in sorted(self.masked):
            total -= secagg.prg(secagg.combine(self._shares(self.b_shares, v, "self-mask")), size)
        for v in sorted(self.shared - self.masked):
            s_v = secagg.private_key(secagg.combine(self._shares(self.s_shares, v, "mask key")))
            for u in sorted(set(self.graph[v]) & self.masked):
                seed = secagg.agree(s_v, self.keys[u][1], b"secagg mask")
                if secagg.mask_sign(u, v) > 0:  # u added it: take it off
                    total -= secagg.prg(seed, size)
                else:
                    total += secagg.prg(seed, size)
        return total

    def result(self) -> Tree:
        """The survivors' row-weighted mean model, on w_t's structure and types."""
        values = secagg.dequantize(self.unmasked(), self.options.scale_bits)
        weights = values[-1]
        mean = values[:-1] / weights
        out = {node: dict(state) for node, state in self.start.items()}
        offset = 0
        for node, key in self.layout:
            template = out[node][key]
            n = int(np.prod(np.shape(template), dtype=np.int64))
            out[node][key] = like(template, mean[offset : offset + n].reshape(np.shape(template)))
            offset += n
        return out

    def _shares(
        self, shares: dict[str, list[secagg.Share]], v: str, what: str
    ) -> list[secagg.Share]:
        got, t = shares.get(v, []), self.threshold(v)
        if len(got) < t:
            raise self._failed(
                f"the {what} of client {v!r} needs {t} shares and its neighbours sent {len(got)}"
            )
        return sorted(got)[:t]

    def _failed(self, message: str) -> StrategyFailed:
        return StrategyFailed(
            ErrorCode.NOT_ENOUGH_WORKERS,
            f"round {self.round}: secure aggregation: {message}",
            round=self.round,
        )


async def each_client(
    ctx: StrategyContext,
    cohort: Cohort,
    clients: Sequence[int],
    request: Callable[[str], SecAggRequest],
    took: Callable[[str, Any], None],
) -> list[DroppedWorker]:
    """One step for each of ``clients`` (a worker's own in turn, the workers at once); who
    failed it (a worker gone takes its remaining clients with it)."""

    turns: dict[int, list[int]] = {}
    for c in clients:
        turns.setdefault(cohort.worker_of(c), []).append(c)

    async def on_worker(i: int, mine: list[int]) -> list[DroppedWorker]:
        out = []
        for c in mine:
            label = cohort.label(c)
            try:
                took(label, await ctx.call(i, request(label)))
            except WorkerCallError as exc:
                dropped = cohort.drop(i, exc)
                out.append(DroppedWorker(label, dropped.code, dropped.message))
                if i in cohort.lost or i in cohort.stale:
                    break
        return out

    groups = await concurrently(*(on_worker(i, mine) for i, mine in turns.items()))
    return [d for group in groups for d in group]


@dataclass
class SecureSum(Collection):
    """Secure aggregation as a round's collection: keys and shares before the clients train
    (Bonawitz et al. 2017, rounds 0 and 1), each client's masked model after (round 2), the
    survivors' shares and the sum at the end (round 3, Unmasking); w_t is ``start``'s states
    and what the sum leaves alone (the TorchFilters' integer entries, plain filters')."""

    secure: SecureRound
    start: Mapping[str, Any]

    async def before_training(
        self, ctx: StrategyContext, cohort: Cohort, selected: Sequence[int]
    ) -> list[DroppedWorker]:
        secure = self.secure
        dropped = await each_client(ctx, cohort, selected, secure.keys_request, secure.took_keys)
        keyed = [c for c in selected if cohort.label(c) in secure.keys]
        dropped += await each_client(ctx, cohort, keyed, secure.share_request, secure.took_shares)
        return dropped

    def trains(self, label: str) -> bool:
        return label in self.secure.shared  # else dropped out before training: counted there

    async def collect(
        self, ctx: StrategyContext, i: int, label: str, fit: Mapping[str, Any], nodes: list[str]
    ) -> None:
        # Its masked model, never the model itself.
        masked = await ctx.call(i, self.secure.mask_request(label, fit["rows"]))
        self.secure.took_masked(label, masked["masked"])

    async def aggregate(
        self, ctx: StrategyContext, cohort: Cohort, selected: Sequence[int]
    ) -> tuple[Tree, dict[str, Any]]:
        """The survivors' shares, and from them the mean of their models; the survivors that
        failed it (their models are in the sum all the same)."""
        secure = self.secure
        survivors = [c for c in selected if cohort.label(c) in secure.masked]
        late = await each_client(ctx, cohort, survivors, secure.unmask_request, secure.took_unmask)
        model = secure.result()
        summary: dict[str, Any] = {"summed": len(secure.masked)}
        if late:
            summary["unmask_failed"] = reasons(late)
        return {**self.start, **model}, {"secure_aggregation": summary}
