"""Secure aggregation's building blocks, shared by its clients (the workers' daemons) and its
server (the coordinator): Bonawitz et al. 2017, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning", over the sparse graph of SecAgg+ (Bell et al. 2020,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead").

Every primitive is a library's: X25519 key agreement, HKDF-SHA256, the ChaCha20 stream as the
PRG and ChaCha20-Poly1305 for the shares in transit come from ``cryptography``; Shamir's secret
sharing (over GF(2^128), a 32-byte secret as two 16-byte halves) from ``pycryptodome``.

Inputs are vectors of reals, sent as fixed-point integers mod 2^64 (:func:`quantize`): each
value v becomes round(v · 2^f) in two's complement, f = ``scale_bits``. A client's rounding
error is at most 2^−(f+1) per coordinate, so a sum over m clients is within m · 2^−(f+1) of the
real sum; the sum must stay within ±2^(63−f) (each client checks its own share of that range).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

__all__ = [
    "Share",
    "agree",
    "combine",
    "dequantize",
    "neighbours",
    "new_key",
    "open_sealed",
    "prg",
    "private_bytes",
    "public_bytes",
    "quantize",
    "seal",
    "split",
]

Words: TypeAlias = np.ndarray[Any, np.dtype[np.uint64]]
Share: TypeAlias = tuple[int, bytes]
"""One Shamir share of a 32-byte secret: its index (1, 2, ...) and 32 bytes."""

_ZERO_NONCE = bytes(16)


def new_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def private_key(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def agree(key: X25519PrivateKey, peer: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: X25519 between ``key`` and the ``peer`` public key,
    through HKDF-SHA256 with ``info`` (what the key is for)."""
    secret = key.exchange(X25519PublicKey.from_public_bytes(peer))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def prg(seed: bytes, size: int) -> Words:
    """``size`` pseudo-random words mod 2^64 from a 32-byte ``seed``: the ChaCha20 keystream."""
    stream = Cipher(algorithms.ChaCha20(seed, _ZERO_NONCE), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * size)), dtype="<u8").astype(np.uint64)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``plaintext`` encrypted and authenticated (ChaCha20-Poly1305, a random nonce in front)."""
    nonce = np.random.default_rng().bytes(12)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """What :func:`seal` sealed.

    Raises:
        ValueError: the blob was not sealed with ``key`` and ``aad``, or was altered.
    """
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:12], blob[12:], aad)
    except InvalidTag:
        raise ValueError("a sealed share does not open: wrong key, or altered") from None


def split(secret: bytes, shares: int, threshold: int) -> list[Share]:
    """``secret`` (32 bytes) in ``shares`` Shamir shares, any ``threshold`` of which rebuild it."""
    low = Shamir.split(threshold, shares, secret[:16])
    high = Shamir.split(threshold, shares, secret[16:])
    return [(i, a + b) for (i, a), (_, b) in zip(low, high, strict=True)]


def combine(shares: Sequence[Share]) -> bytes:
    """The secret of ``shares`` (exactly the threshold's number of them)."""
    low = Shamir.combine([(i, s[:16]) for i, s in shares])
    high = Shamir.combine([(i, s[16:]) for i, s in shares])
    return bytes(low + high)


def quantize(values: np.ndarray[Any, Any], scale_bits: int) -> Words:
    """round(v · 2^f) mod 2^64 for each value (two's complement)."""
    scaled = np.rint(np.asarray(values, dtype=np.float64) * float(2**scale_bits))
    return scaled.astype(np.int64).view(np.uint64)


def dequantize(words: Words, scale_bits: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The reals a sum of :func:`quantize`'d vectors stands for."""
    return np.asarray(words, dtype=np.uint64).view(np.int64).astype(np.float64) / float(
        2**scale_bits
    )


def neighbours(labels: Sequence[str], k: int, seed: int) -> dict[str, list[str]]:
    """SecAgg+'s communication graph (Bell et al. 2020): the clients in a random order on a
    ring (``default_rng(seed)``), each joined to the ⌈k/2⌉ before and after it; every pair
    when k >= n − 1 (Bonawitz et al.'s complete graph). Each list is in label order."""
    n = len(labels)
    if k >= n - 1:
        return {u: sorted(v for v in labels if v != u) for u in labels}
    order = [labels[i] for i in np.random.default_rng(seed).permutation(n).tolist()]
    half = (k + 1) // 2
    out: dict[str, set[str]] = {u: set() for u in labels}
    for p, u in enumerate(order):
        for step in range(1, half + 1):
            v = order[(p + step) % n]
            out[u].add(v)
            out[v].add(u)
    return {u: sorted(vs) for u, vs in out.items()}


def mask_sign(u: str, v: str) -> int:
    """+1 when ``u`` adds the pair's mask, −1 when it takes it away (u < v adds)."""
    return 1 if u < v else -1
