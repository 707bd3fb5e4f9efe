"""How a worker proves it holds its identity key without sending it.

The agent's identity file holds a secret (:mod:`worker.identity`); an Ed25519 key pair is
derived from it (``cryptography``). The coordinator answers each ``/worker`` upgrade with a
fresh challenge in the :data:`CHALLENGE_HEADER` response header; the agent's hello carries its
public key and its signature of the challenge and its worker id (:func:`prove`). The coordinator
checks the signature (:func:`verified`) and binds the id to the public key at its first
registration; a later hello for the id must prove the same key. The secret never leaves the
agent, and a proof is good for one connection only. No I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

__all__ = ["CHALLENGE_HEADER", "challenge", "fingerprint", "prove", "public_key", "verified"]

CHALLENGE_HEADER = "X-Somatize-Challenge"
"""The ``/worker`` upgrade's response header that carries the coordinator's challenge."""


def challenge() -> str:
    """A fresh challenge for one connection."""
    return secrets.token_urlsafe(32)


def _signing_key(secret: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(secret.encode()).digest())


def _signed(challenge_text: str, worker_id: str) -> bytes:
    return f"somatize worker hello\n{worker_id}\n{challenge_text}".encode()


def public_key(secret: str) -> str:
    """The public key derived from the identity ``secret`` (URL-safe base64)."""
    raw = _signing_key(secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).decode()


def prove(secret: str, challenge_text: str, worker_id: str) -> str:
    """The signature, by the key derived from ``secret``, of ``challenge_text`` for
    ``worker_id`` (URL-safe base64)."""
    signature = _signing_key(secret).sign(_signed(challenge_text, worker_id))
    return base64.urlsafe_b64encode(signature).decode()


def verified(public: str, proof: str, challenge_text: str, worker_id: str) -> bool:
    """Whether ``proof`` is ``public``'s signature of ``challenge_text`` for ``worker_id``."""
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(public))
        key.verify(base64.urlsafe_b64decode(proof), _signed(challenge_text, worker_id))
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True


def fingerprint(public: str) -> str:
    """What the coordinator's store keeps of a worker's public key (its SHA-256)."""
    return hashlib.sha256(public.encode()).hexdigest()
