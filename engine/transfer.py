"""Moving tensors between the engine's device and the CPU, and running under a precision.

The engine keeps modules on its device for a whole job and converts only at its boundary:
whatever leaves it (states, gradients, optimizer state, outputs, activations) is a CPU tensor for
the codec, whatever comes in is moved to the device once. On the CPU every move is a no-op (the
same tensor comes back), so a CPU engine works on the very tensors it was given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.errors import EngineError
from protocol.errors import ErrorCode

__all__ = [
    "PRECISIONS",
    "autocast",
    "cpu_tensor",
    "engine_device",
    "scaler_for",
    "tensors_to",
    "to_cpu",
    "to_device",
]

PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
"""``TorchFilter(precision=...)`` → the autocast dtype (``None``: no autocast)."""


def engine_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device`.

    Raises:
        EngineError: ``BAD_REQUEST`` for a string torch does not read as a device.
    """
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EngineError(
            ErrorCode.BAD_REQUEST, f"not a device: {device!r} (cpu, cuda, cuda:N or mps)"
        ) from exc


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there already).

    A plain copy: pinning a batch first would cost a page-locked allocation and one more host
    copy per call, more than an asynchronous transfer of one batch saves.
    """
    if tensor.device == device:
        return tensor
    return tensor.to(device)


def cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU (itself when it is there already)."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (through mappings, lists and tuples;
    anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (through mappings, lists and tuples) on the CPU."""
    return map_tensors(cpu_tensor, value)


def tensors_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (through mappings, lists and tuples) on ``device``."""
    return map_tensors(lambda tensor: to_device(tensor, device), value)


def precision_of(f: Any) -> str:
    """A differentiable filter's precision (``"fp32"`` for one that names none)."""
    return str(getattr(f, "precision", "fp32"))


def autocast(f: Any, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast region of filter ``f`` on ``device``: none for fp32, else
    ``torch.autocast(device.type, dtype)`` (weights stay fp32, ops run in the lower precision)."""
    dtype = PRECISIONS.get(precision_of(f))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def scaler_for(f: Any, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for an fp16 filter (fp16 gradients underflow without one), else None."""
    if precision_of(f) != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
