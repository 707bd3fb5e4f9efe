"""The client side of secure aggregation, run in a worker's filter daemon for each of its
virtual clients (Bonawitz et al. 2017, Figure 4, rounds 0–3; over SecAgg+'s neighbours, Bell
et al. 2020). The coordinator only relays; what it sees of a client is its public keys, shares
sealed for other clients, and its masked input.

* ``keys`` (AdvertiseKeys): two X25519 key pairs, c (to seal shares) and s (to derive masks).
* ``share`` (ShareKeys): a self-mask seed b_u; s_u's private key and b_u split in Shamir shares,
  one per peer (and one kept), each sealed for its peer under agree(c_u, c_v).
* ``mask`` (MaskedInputCollection): the shares the peers sent opened and kept; the input
  x_u = quantize(weight · the trained float entries of ``layout``, then weight itself) and
  y_u = x_u + PRG(b_u) + Σ_v ±PRG(agree(s_u, s_v)) mod 2^64 over the peers that shared with u.
* ``unmask`` (Unmasking): the kept shares of b_v for each survivor v and of s_v for each
  dropped v — never both for one client (that would unmask it) — then the round is forgotten.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from engine.errors import EngineError
from engine.nodes import Nodes
from protocol.daemon import SecAggRequest
from protocol.errors import ErrorCode
from protocol.security import secagg


@dataclass
class _Client:
    """One virtual client's secrets for one round."""

    round: int
    c: X25519PrivateKey = field(default_factory=secagg.new_key)
    s: X25519PrivateKey = field(default_factory=secagg.new_key)
    peers: dict[str, list[bytes]] = field(default_factory=dict)  # v → [c_pk, s_pk]
    b: bytes = b""
    own: dict[str, secagg.Share] = field(default_factory=dict)  # "s"/"b" → its own shares
    held: dict[str, tuple[secagg.Share, secagg.Share]] = field(default_factory=dict)  # v → (s, b)
    threshold: int = 0


class SecAggClients:
    """The secure-aggregation state of the virtual clients a daemon trains."""

    def __init__(self) -> None:
        self.clients: dict[str, _Client] = {}

    def handle(self, req: SecAggRequest, nodes: Nodes) -> dict[str, Any]:
        """One step for ``req.client``, whose trained model is ``nodes``' states.

        Raises:
            EngineError: a step out of order, or a request that would break the protocol.
        """
        if req.step == "keys":
            client = self.clients[req.client] = _Client(req.round)
            return {"c": secagg.public_bytes(client.c), "s": secagg.public_bytes(client.s)}
        client = self._client(req)
        if req.step == "share":
            return {"sealed": self._share(req, client)}
        if req.step == "mask":
            return {"masked": self._mask(req, client, nodes)}
        del self.clients[req.client]
        return self._unmask(req, client)

    def _client(self, req: SecAggRequest) -> _Client:
        client = self.clients.get(req.client)
        if client is None or client.round != req.round:
            raise _refused(f"{req.step} for client {req.client!r} in round {req.round} before keys")
        return client

    def _share(self, req: SecAggRequest, client: _Client) -> dict[str, bytes]:
        peers, t = req.peers or {}, req.threshold
        if t is None or req.client in peers or not peers or t > len(peers) + 1:
            raise _refused("share needs the peers' keys (not the client's own) and a threshold")
        client.peers, client.threshold = dict(peers), t
        client.b = os.urandom(32)
        holders = sorted([*peers, req.client])  # share i + 1 goes to holders[i]
        s_shares = secagg.split(secagg.private_bytes(client.s), len(holders), t)
        b_shares = secagg.split(client.b, len(holders), t)
        sealed = {}
        for holder, s_share, b_share in zip(holders, s_shares, b_shares, strict=True):
            if holder == req.client:
                client.own = {"s": s_share, "b": b_share}
                continue
            key = secagg.agree(client.c, peers[holder][0], b"secagg share")
            sealed[holder] = secagg.seal(
                key, _pack(s_share, b_share), _aad(req, req.client, holder)
            )
        return sealed

    def _mask(self, req: SecAggRequest, client: _Client, nodes: Nodes) -> Any:
        if req.layout is None or req.weight is None or req.bound is None:
            raise _refused("mask needs the layout, the weight and the bound")
        for v, blob in (req.sealed or {}).items():
            if v not in client.peers:
                raise _refused(f"a share from {v!r}, which is not a peer of {req.client!r}")
            key = secagg.agree(client.c, client.peers[v][0], b"secagg share")
            try:
                client.held[v] = _unpack(secagg.open_sealed(key, blob, _aad(req, v, req.client)))
            except ValueError as exc:
                raise _refused(f"the share from {v!r}: {exc}") from None
        if len(client.held) + 1 < client.threshold:
            raise _refused(
                f"{len(client.held)} peers shared with {req.client!r}: fewer than the threshold"
            )
        states = nodes.get_state(sorted({node for node, _ in req.layout}))
        entries = [states[node][key].double().reshape(-1).numpy() for node, key in req.layout]
        values = np.concatenate([req.weight * np.concatenate(entries), [float(req.weight)]])
        peak = float(np.abs(values).max())
        if peak > req.bound:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"client {req.client!r}: a value of {peak:g} is outside the range ±{req.bound:g} "
                "secure aggregation can sum without overflow (raise scale_bits' headroom: "
                "lower scale_bits)",
            )
        masked = secagg.quantize(values, req.scale_bits)
        masked += secagg.prg(client.b, masked.size)
        for v in client.held:  # pairwise masks with every peer that shared: they cancel in Σ
            seed = secagg.agree(client.s, client.peers[v][1], b"secagg mask")
            pairwise = secagg.prg(seed, masked.size)
            if secagg.mask_sign(req.client, v) > 0:
                masked += pairwise
            else:
                masked -= pairwise
        return masked

    def _unmask(self, req: SecAggRequest, client: _Client) -> dict[str, Any]:
        survivors, dropped = set(req.survivors or ()), set(req.dropped or ())
        if survivors & dropped:
            raise _refused(f"asked for both shares of {sorted(survivors & dropped)}: refused")
        if len(survivors) < client.threshold:
            raise _refused(f"{len(survivors)} survivors: fewer than the threshold")
        b = {v: list(client.held[v][1]) for v in survivors if v in client.held}
        s = {v: list(client.held[v][0]) for v in dropped if v in client.held}
        if req.client in survivors:
            b[req.client] = list(client.own["b"])
        return {"b": b, "s": s}


def _pack(s_share: secagg.Share, b_share: secagg.Share) -> bytes:
    return s_share[0].to_bytes(4, "big") + s_share[1] + b_share[0].to_bytes(4, "big") + b_share[1]


def _unpack(blob: bytes) -> tuple[secagg.Share, secagg.Share]:
    return (int.from_bytes(blob[:4], "big"), blob[4:36]), (
        int.from_bytes(blob[36:40], "big"),
        blob[40:72],
    )


def _aad(req: SecAggRequest, sender: str, receiver: str) -> bytes:
    """What a sealed share is bound to: the round, who sent it, to whom."""
    return f"{req.round}|{sender}|{receiver}".encode()


def _refused(message: str) -> EngineError:
    return EngineError(ErrorCode.BAD_REQUEST, f"secure aggregation: {message}")
