"""What a worker presents on a peer link, so that a stage cannot speak for another.

The coordinator draws one secret per job and never sends it. Each of the job's workers gets its
own *link key*, ``HMAC(secret, worker id)`` (:func:`link_key`, in ``OpenJob``); a worker that
dials a peer presents the *credential* ``HMAC(peer's link key, its own id)`` (:func:`credential`,
which the coordinator computes and sends in ``Links`` for each peer it dials). The receiver
computes the same from its own key and the id the hello claims, and compares in constant time.

A worker holds its own key and the credentials for the peers it dials: it can prove it is
itself to them, and nothing else — not another worker to a third (it would need that third's
key), not itself to a worker of another job. No I/O.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["credential", "link_key", "matches"]


def link_key(job_secret: str, worker_id: str) -> str:
    """Worker ``worker_id``'s link key in the job whose secret is ``job_secret``."""
    return hmac.new(job_secret.encode(), worker_id.encode(), hashlib.sha256).hexdigest()


def credential(receiver_key: str, sender_id: str) -> str:
    """What worker ``sender_id`` presents to the worker whose link key is ``receiver_key``."""
    return hmac.new(receiver_key.encode(), sender_id.encode(), hashlib.sha256).hexdigest()


def matches(own_key: str | None, sender_id: str, presented: str) -> bool:
    """Whether ``presented`` is ``sender_id``'s credential to the worker holding ``own_key``
    (``None``: a job that takes no peer link here), compared in constant time."""
    expected = "" if own_key is None else credential(own_key, sender_id)
    return hmac.compare_digest(presented.encode(), expected.encode()) and bool(expected)
