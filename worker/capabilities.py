"""What this machine offers a job: the :class:`~protocol.messages.Capabilities` of the hello.

The coordinator places jobs by these numbers and shows them to people, so they describe what the
agent may actually use: the CPUs of its affinity mask (a container or ``taskset`` limit, not the
host's count), the physical memory, and the versions a pickled filter depends on.

torch is only imported when an NVIDIA driver is present: the agent itself never runs torch, and
importing it costs about a second and a few hundred MB that a CPU-only worker would pay for
nothing (``torch.cuda`` would find no device there anyway).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform

from engine.devices import describe_device, has_nvidia_driver
from protocol.messages import Capabilities

__all__ = ["detect", "memory_bytes"]

log = logging.getLogger(__name__)


def detect(device: str = "cpu") -> Capabilities:
    """Describe this machine and the resolved ``device`` its daemons train on (blocking: may
    import torch; call it in an executor from a loop)."""
    name, memory = describe_device(device)
    return Capabilities(
        cpus=_cpus(),
        memory_bytes=memory_bytes(),
        torch=_version("torch"),
        cuda_devices=_cuda_devices(),
        python=platform.python_version(),
        cloudpickle=_version("cloudpickle"),
        platform=platform.platform(),
        device=device,
        device_name=name,
        device_memory_bytes=memory,
    )


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the platform cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # a platform without these names
        return 0


def _version(distribution: str) -> str:
    """The installed version, read from package metadata so nothing gets imported."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _cuda_devices() -> list[str]:
    """Names of the visible CUDA devices (``["NVIDIA A100-SXM4-40GB", ...]``), ``[]`` if none."""
    if not has_nvidia_driver():
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a broken driver must not keep the worker from registering
        log.warning("cannot list CUDA devices: %s", exc)
        return []
