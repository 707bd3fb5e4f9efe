"""The devices a job may ask for, and which workers fit: shared by the SDK, the coordinator's
placement and its strategies."""

from __future__ import annotations

import re

__all__ = ["DEVICES", "device_fits", "is_device"]

DEVICES = ("cpu", "cuda", "cuda:N", "mps")
"""The devices a job may ask for: ``"cuda"`` is any CUDA device, ``"cuda:N"`` the N-th one."""

_CUDA_INDEX = re.compile(r"cuda:(0|[1-9][0-9]*)")


def is_device(value: object) -> bool:
    """Whether ``value`` is one of the :data:`DEVICES` forms."""
    return isinstance(value, str) and (
        value in ("cpu", "cuda", "mps") or _CUDA_INDEX.fullmatch(value) is not None
    )


def device_fits(wanted: str | None, device: str) -> bool:
    """Whether a worker training on ``device`` fits a job asking for ``wanted`` (``None``: any
    device; ``"cuda"``: any ``"cuda:N"``; otherwise the same device)."""
    if wanted is None or device == wanted:
        return True
    return wanted == "cuda" and _CUDA_INDEX.fullmatch(device) is not None
