"""A worker's proof of its identity key: the signature of one connection's challenge and its
id, checked by Ed25519 (RFC 8032) through ``cryptography``; the key never in the hello."""

from __future__ import annotations

import base64

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.security.identity_proof import challenge, fingerprint, prove, public_key, verified

SECRET = "an agent's identity secret"


def test_a_proof_holds_for_its_challenge_and_id_only():
    issued = challenge()
    proof = prove(SECRET, issued, "w1")
    public = public_key(SECRET)
    assert verified(public, proof, issued, "w1")
    assert not verified(public, proof, challenge(), "w1")  # another connection's
    assert not verified(public, proof, issued, "w2")  # another id
    assert not verified(public_key("another secret"), proof, issued, "w1")
    tampered = base64.urlsafe_b64encode(bytes(64)).decode()
    assert not verified(public, tampered, issued, "w1")
    assert not verified("not base64!", proof, issued, "w1")


def test_the_hello_carries_a_public_key_and_a_signature_never_the_secret():
    public, proof = public_key(SECRET), prove(SECRET, "c", "w1")
    raw = base64.urlsafe_b64decode(public)
    assert len(raw) == 32 and len(base64.urlsafe_b64decode(proof)) == 64  # RFC 8032 sizes
    assert SECRET not in public + proof
    # The signature verifies with the standard Ed25519 verifier over the documented message.
    Ed25519PublicKey.from_public_bytes(raw).verify(
        base64.urlsafe_b64decode(proof), b"somatize worker hello\nw1\nc"
    )
    assert public_key(SECRET) == public  # derived, not drawn: the identity file is the key
    assert fingerprint(public) != public and len(fingerprint(public)) == 64
