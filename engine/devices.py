"""The device a worker's daemons train on: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

:func:`resolve_device` turns what ``--device`` was given into a concrete device (``"cpu"``,
``"cuda:0"``, ``"mps"``) or refuses it naming the devices that exist. torch is imported only
where a device other than the CPU may exist (an NVIDIA driver, macOS): the agent itself never
runs torch, and a CPU-only worker would pay for the import for nothing.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

__all__ = [
    "DEVICE_CHOICES",
    "available_devices",
    "describe_device",
    "has_nvidia_driver",
    "resolve_device",
]

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"

_NVIDIA_DRIVER = (Path("/proc/driver/nvidia"), Path("/dev/nvidia0"), Path("/dev/nvidiactl"))
_SPEC = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def has_nvidia_driver() -> bool:
    """Whether an NVIDIA driver is present: where CUDA may be, and torch is worth importing."""
    return any(path.exists() for path in _NVIDIA_DRIVER)


def _cuda_count() -> int:
    if not has_nvidia_driver():
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _has_mps() -> bool:
    if platform.system() != "Darwin":
        return False
    import torch

    return bool(torch.backends.mps.is_available())


def available_devices() -> list[str]:
    """The devices of this machine: ``["cpu", "cuda:0", ..., "mps"]``."""
    found = ["cpu", *(f"cuda:{i}" for i in range(_cuda_count()))]
    return [*found, "mps"] if _has_mps() else found


def resolve_device(spec: str) -> str:
    """The concrete device ``spec`` names on this machine.

    ``auto`` is the first CUDA device if there is one, else ``cpu``; ``cuda`` is ``cuda:0``.

    Raises:
        ValueError: ``spec`` is not one of :data:`DEVICE_CHOICES`, or names a device this
            machine does not have (the message lists those it has).
    """
    text = spec.strip().lower() if isinstance(spec, str) else spec
    if not isinstance(text, str) or not _SPEC.match(text):
        raise ValueError(f"not a device: {spec!r} (expected {DEVICE_CHOICES})")
    if text == "cpu":
        return "cpu"
    available = available_devices()
    if text == "auto":
        return "cuda:0" if "cuda:0" in available else "cpu"
    wanted = "cuda:0" if text == "cuda" else text
    if wanted not in available:
        raise ValueError(f"device {spec!r} is not on this machine; it has {', '.join(available)}")
    return wanted


def describe_device(device: str) -> tuple[str, int]:
    """``(name, total memory in bytes)`` of a resolved device; ``("", 0)`` for the CPU and
    for ``mps`` (whose memory is the machine's)."""
    if not device.startswith("cuda"):
        return "", 0
    import torch

    index = int(device.partition(":")[2] or 0)
    return torch.cuda.get_device_name(index), int(
        torch.cuda.get_device_properties(index).total_memory
    )
