"""Frames taken apart and built by hand, for the codec's tests (from the documented layout)."""

from __future__ import annotations

import struct
from typing import Any

import orjson
from hypothesis import HealthCheck, settings

from protocol.codec import ALIGNMENT, decode, encode
from protocol.errors import FrameError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NP_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
TORCH_DTYPES = [*NP_DTYPES, "bfloat16"]


def split(frame: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """The header and buffers of a frame, read by hand from the documented layout."""
    (n,) = struct.unpack_from("<I", frame)
    header = orjson.loads(frame[4 : 4 + n])
    buffers, end = [], 4 + n
    for length in header["bufs"]:
        start = -(-end // ALIGNMENT) * ALIGNMENT
        buffers.append(frame[start : start + length])
        end = start + length
    return header, buffers


def build(header: Any, buffers: list[bytes]) -> bytes:
    """A frame laid out by hand from the documented layout (zero padding, 64-byte offsets)."""
    raw = orjson.dumps(header)
    out = bytearray(struct.pack("<I", len(raw)) + raw)
    for buffer in buffers:
        out += bytes(-len(out) % ALIGNMENT) + buffer
    return bytes(out)


def decode_or_frame_error(frame: bytes | bytearray) -> None:
    """Garbage may decode (then the value must encode again) or raise FrameError, nothing else."""
    try:
        value = decode(frame)
    except FrameError:
        return
    encode(value)
