"""The binary frame codec: one frame format for every link (agent ↔ daemon pipes, WebSockets).

A frame is a small JSON header followed by raw buffers, so tensors cross the wire as their own
bytes: no JSON number lists, no base64, no pickle. Byte by byte::

    offset 0        u32, little-endian: H, the length of the header in bytes
    offset 4        H bytes of UTF-8 JSON (written by orjson):
                        {"v": 1, "bufs": [n0, n1, ...], "body": <tree>}
    offset 4 + H    zero bytes up to o0, the first multiple of 64 at or after 4 + H
    o0              buffer 0: n0 raw bytes
    o0 + n0         zero bytes up to o1, the first multiple of 64 at or after o0 + n0
    o1              buffer 1: n1 raw bytes
    ...             and so on; the frame ends exactly at the end of the last buffer
                    (or right after the header when there are no buffers).

Offsets count from the first byte of the frame, so a frame received into a 64-byte-aligned
allocation gives aligned arrays. The decoder recomputes every offset from ``bufs`` and refuses a
frame whose length is not exactly the expected end, whose padding is not zero, or whose buffers
are not each referenced exactly once by the body.

``body`` is the encoded value. JSON null, booleans, strings, finite floats, 64-bit integers,
arrays and objects stand for themselves (an array is a Python ``list``, an object a ``dict`` whose
keys are all ``str`` and none starts with ``$``). Everything else is a *tagged* object, recognised
by a key starting with ``$``:

======================================================  =========================================
``{"$tuple": [v, ...]}``                                a tuple
``{"$dict": [[k, v], ...]}``                            a dict with a non-str key or a ``$`` key
``{"$int": "-1f"}``                                     an int outside [-2**63, 2**64 - 1], in hex
``{"$float": "nan" | "inf" | "-inf"}``                  a non-finite float
``{"$bytes": i}``                                       bytes: the raw contents of buffer ``i``
``{"$buf": i, "dtype": d, "shape": [..], "lib": l}``    an array: buffer ``i`` holds its C-order
                                                        little-endian elements; ``l`` is ``"np"``
                                                        (numpy array), ``"np_scalar"`` (numpy
                                                        scalar, shape ``[]``) or ``"torch"``
======================================================  =========================================

dtype names are numpy's: ``bool``, ``int8`` … ``int64``, ``uint8`` … ``uint64``, ``float16``,
``float32``, ``float64``, ``complex64``, ``complex128``, plus ``bfloat16`` for torch only.
Non-contiguous arrays are made contiguous and big-endian ones little-endian on encode.
A :class:`Joined` (bytes made of several buffers) is written as one ``uint8`` array of their
bytes one after another, without joining them first, and comes back as that array.

Anything else is refused with :class:`~protocol.errors.FrameError` naming its type and where it
sits: sets, Python ``complex``, arbitrary objects; numpy object, structured, string, datetime and
``longdouble`` dtypes and masked arrays; sparse, quantized, nested and meta tensors and torch
dtypes outside the list (``complex32``, float8 …).

What comes back:

- the same type, dtype, shape and bits for every supported value; ``bytearray`` and
  ``memoryview`` come back as ``bytes``; subclasses of ``str``/``int``/``float``/``dict``/
  ``list``/``tuple`` (enums, named tuples, ``OrderedDict``, ``torch.Size``) come back as the base
  type; ndarray subclasses come back as ``np.ndarray`` and ``nn.Parameter`` as a plain tensor.
- torch tensors come back on the CPU with ``requires_grad=False`` (CUDA tensors are copied to
  the CPU on encode, tensors that require grad are detached).
- numpy arrays are views over the frame: read-only over ``bytes``, writable over a
  ``bytearray``. torch has no read-only tensors, so torch tensors are views over the frame only
  when the frame is writable; over ``bytes`` each tensor's bytes are copied (a tensor aliasing an
  immutable ``bytes`` object could be changed in place by an optimizer). Receivers that want
  zero-copy tensors read frames into a ``bytearray``, and must not reuse that bytearray while
  the decoded arrays are alive.

:func:`encode` does not copy buffers either: its memoryviews point into the caller's arrays
(after making them contiguous and little-endian where needed), so an array must not be changed
until its frame has been written out.

torch is imported lazily: a value can only hold a tensor once its owner imported torch, so the
encoder looks for tensors only then, and the decoder imports torch at the first ``"torch"``
buffer it meets. A process that never handles a tensor (a coordinator relaying numpy states, a
tool reading frames) never pays torch's import time and memory (~230 MiB). The dtypes and the
array specs are :mod:`protocol.arrays`'.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable
from typing import Any, Final, TypeAlias

import numpy as np
import orjson

from protocol.arrays import (
    NP_DTYPES,
    Outline,
    RelayedTensor,
    array_from,
    loaded_torch,
    ndarray_spec,
    preview,
    tensor_spec,
)
from protocol.errors import FrameError, Located

__all__ = [
    "ALIGNMENT",
    "FRAME_VERSION",
    "Joined",
    "Part",
    "decode",
    "encode",
    "encode_frame",
    "frame_nbytes",
]

FRAME_VERSION: Final = 1
"""The ``v`` of the header; a frame with another version is refused."""

ALIGNMENT: Final = 64
"""Every buffer starts at a multiple of this many bytes from the start of the frame."""

Part: TypeAlias = bytes | memoryview
"""One piece of an encoded frame; the frame is ``b"".join(parts)``."""

# orjson writes ints in this range natively (and reads them back as ints); others go as "$int".
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
# orjson refuses to write JSON nested 254 deep; refusing deeper input early keeps both sides
# well inside Python's recursion limit.
_MAX_DEPTH: Final = 254
_MAX_HEADER: Final = 2**32 - 1
_PREFIX: Final = struct.Struct("<I")
_ZEROS: Final = bytes(ALIGNMENT)
_HEX_INT: Final = re.compile(r"-?[0-9a-f]+")
_NON_FINITE: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

_SMALL_HEADER: Final = 4096
"""Headers up to this size are checked for the plain fast path of :func:`decode`."""

_BUF_KEYS: Final = frozenset({"$buf", "dtype", "shape", "lib"})
_HEADER_KEYS: Final = frozenset({"v", "bufs", "body"})


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _type_name(obj: object) -> str:
    cls = type(obj)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


# --------------------------------------------------------------------------------------- encode


class Joined:
    """Bytes made of ``parts`` one after another, which travel as one ``uint8`` array (decoded
    as that array) and are never joined in this process: the frame's parts are theirs. A
    sender that would otherwise join a cut of large buffers (a replica's rows of a model:
    :func:`protocol.filters.split_rows`) sends them so, and the parts must not change until
    the frame is written out.
    """

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        """The bytes joined (a copy: for a receiver in this very process)."""
        return b"".join(self.parts)


class _Encoder:
    """Turns a value into a JSON-able tree, collecting the raw buffers it refers to (a
    :class:`Joined`'s parts together as one)."""

    def __init__(self) -> None:
        self.buffers: list[memoryview | Joined] = []

    def add(self, buffer: memoryview | Joined) -> int:
        self.buffers.append(buffer)
        return len(self.buffers) - 1

    def walk(self, obj: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise Located(f"value nested more than {_MAX_DEPTH} deep (or cyclic)")
        cls = type(obj)
        if cls is str or cls is bool or obj is None:
            return obj
        if cls is int:
            return obj if _INT_MIN <= obj <= _INT_MAX else {"$int": format(obj, "x")}
        if cls is float:
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if cls is dict:
            return self.walk_dict(obj, depth)
        if cls is list:
            return self.walk_items(obj, depth)
        if cls is tuple:
            return {"$tuple": self.walk_items(obj, depth)}
        if cls is bytes or cls is bytearray:
            return {"$bytes": self.add(memoryview(obj))}
        return self.walk_other(obj, depth)

    def walk_items(self, items: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        out: list[Any] = []
        for index, item in enumerate(items):
            try:
                out.append(self.walk(item, depth + 1))
            except Located as e:
                e.path.append(f"[{index}]")
                raise
        return out

    def walk_dict(self, obj: dict[Any, Any], depth: int) -> Any:
        key: Any = None
        try:
            if all(type(k) is str and not k.startswith("$") for k in obj):
                plain: dict[str, Any] = {}
                for key, value in obj.items():
                    plain[key] = self.walk(value, depth + 1)
                return plain
            pairs: list[list[Any]] = []
            for key, value in obj.items():
                pairs.append([self.walk(key, depth + 2), self.walk(value, depth + 2)])
            return {"$dict": pairs}
        except Located as e:
            e.path.append(f"[{key!r}]")
            raise

    def walk_other(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, RelayedTensor):
            shape = list(obj.shape)
            return {"$buf": self.add(obj.data), "dtype": obj.dtype, "shape": shape, "lib": "torch"}
        torch = loaded_torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            return tensor_spec(obj, self.add)
        if isinstance(obj, np.generic):
            if obj.dtype.name in NP_DTYPES:
                spec = ndarray_spec(np.asarray(obj), self.add)
                spec["lib"] = "np_scalar"
                return spec
            if not isinstance(obj, str | bytes):  # np.str_ / np.bytes_ go on as str / bytes
                raise Located(f"unsupported numpy scalar dtype {obj.dtype.name!r}")
        if isinstance(obj, np.ndarray):
            if isinstance(obj, np.ma.MaskedArray):
                raise Located("unsupported type numpy.ma.MaskedArray (the mask would be lost)")
            return ndarray_spec(np.asarray(obj), self.add)
        if isinstance(obj, Joined):
            return {"$buf": self.add(obj), "dtype": "uint8", "shape": [obj.nbytes], "lib": "np"}
        if isinstance(obj, memoryview):
            try:
                flat = obj.cast("B") if obj.c_contiguous else memoryview(obj.tobytes())
            except ValueError as e:  # a released memoryview
                raise Located(f"unreadable memoryview: {e}") from None
            return {"$bytes": self.add(flat)}
        # Subclasses of the builtins travel as their base type.
        if isinstance(obj, bool):  # pragma: no cover - bool cannot be subclassed
            return bool(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, int):
            return self.walk(int.__int__(obj), depth)
        if isinstance(obj, float):
            return self.walk(float.__float__(obj), depth)
        if isinstance(obj, bytes | bytearray):
            return {"$bytes": self.add(memoryview(obj).cast("B"))}
        if isinstance(obj, dict):
            return self.walk_dict(obj, depth)
        if isinstance(obj, list):
            return self.walk_items(obj, depth)
        if isinstance(obj, tuple):
            return {"$tuple": self.walk_items(obj, depth)}
        raise Located(f"unsupported type {_type_name(obj)}")


def _plain_tree(obj: Any, depth: int) -> bool:
    """Whether ``obj`` is its own body: only ``str``, ``bool``, ``None``, 64-bit ``int``, finite
    ``float``, ``list`` and ``dict`` with ``str`` keys not starting with ``$`` (exact types),
    not too deep. Then orjson writes it as it is and the walk that builds a tagged copy is
    skipped: most messages (hellos, pings, heartbeats, replies without tensors) are such."""
    cls = type(obj)
    if cls is str or cls is bool or obj is None:
        return True
    if cls is int:
        return bool(_INT_MIN <= obj <= _INT_MAX)
    if cls is float:
        return math.isfinite(obj)
    if depth >= _MAX_DEPTH:
        return False
    if cls is dict:
        for key, value in obj.items():
            if type(key) is not str or key.startswith("$") or not _plain_tree(value, depth + 1):
                return False
        return True
    if cls is list:
        return all(_plain_tree(item, depth + 1) for item in obj)
    return False


def encode(obj: Any) -> list[Part]:
    """Encode ``obj`` as the parts of one frame, without copying its buffers.

    Args:
        obj: a tree of the supported values (see the module docstring).

    Returns:
        The header (with its length prefix and padding), then each buffer and its padding;
        ``b"".join(parts)`` is the frame. Buffers are memoryviews into the caller's arrays,
        tensors and bytes: write them out before changing those.

    Raises:
        FrameError: ``obj`` holds a value the codec does not carry; the message names its type
            and where it is.
    """
    encoder = _Encoder()
    try:
        body = obj if _plain_tree(obj, 0) else encoder.walk(obj, 0)
    except Located as e:
        raise FrameError(f"cannot encode {e.where()}: {e.message}") from None
    buffers = encoder.buffers
    try:
        header = orjson.dumps(
            {"v": FRAME_VERSION, "bufs": [b.nbytes for b in buffers], "body": body}
        )
    except orjson.JSONEncodeError as e:
        raise FrameError(f"cannot encode the header: {e}") from None
    if len(header) > _MAX_HEADER:
        raise FrameError(f"header of {len(header)} bytes does not fit the u32 length prefix")
    end = _PREFIX.size + len(header)
    first = _PREFIX.pack(len(header)) + header
    if not buffers:
        return [first]
    parts: list[Part] = [first + _ZEROS[: _align(end) - end]]
    end = _align(end)
    for i, buffer in enumerate(buffers):
        if i:
            pad = _align(end) - end
            if pad:
                parts.append(_ZEROS[:pad])
            end += pad
        if isinstance(buffer, Joined):
            parts.extend(p for p in buffer.parts if p.nbytes)
        elif buffer.nbytes:
            parts.append(buffer)
        end += buffer.nbytes
    return parts


def encode_frame(obj: Any) -> bytes:
    """Encode ``obj`` as one contiguous frame (``b"".join(encode(obj))``: copies the buffers)."""
    return b"".join(encode(obj))


def frame_nbytes(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """Total length in bytes of the frame made of ``parts``."""
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


# --------------------------------------------------------------------------------------- decode


class _Decoder:
    """Rebuilds a value from the header tree, viewing arrays over the frame's buffers."""

    def __init__(
        self,
        frame: memoryview,
        offsets: list[int],
        lengths: list[int],
        outline: bool,
        relay: bool = False,
    ) -> None:
        self.frame = frame
        self.offsets = offsets
        self.lengths = lengths
        self.outline = outline
        self.relay = relay
        self.used = [False] * len(lengths)

    def walk(self, node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise Located(f"header nested more than {_MAX_DEPTH} deep")
        cls = type(node)
        if cls is list:
            return self.walk_items(node, depth)
        if cls is dict:
            if any(key.startswith("$") for key in node):
                return self.tagged(node, depth)
            out: dict[str, Any] = {}
            key = ""
            try:
                for key, value in node.items():
                    out[key] = self.walk(value, depth + 1)
            except Located as e:
                e.path.append(f"[{key!r}]")
                raise
            return out
        # orjson yields only str, int, float (finite), bool and None besides list and dict.
        return node

    def walk_items(self, items: list[Any], depth: int) -> list[Any]:
        out: list[Any] = []
        for index, item in enumerate(items):
            try:
                out.append(self.walk(item, depth + 1))
            except Located as e:
                e.path.append(f"[{index}]")
                raise
        return out

    def tagged(self, node: dict[str, Any], depth: int) -> Any:
        keys = node.keys()
        if len(node) == 1:
            ((tag, value),) = node.items()
            if tag == "$tuple" and type(value) is list:
                return tuple(self.walk_items(value, depth + 1))
            if tag == "$dict" and type(value) is list:
                return self.dict_pairs(value, depth)
            if tag == "$int" and type(value) is str and _HEX_INT.fullmatch(value):
                return int(value, 16)
            if tag == "$float" and type(value) is str and value in _NON_FINITE:
                return _NON_FINITE[value]
            if tag == "$bytes":
                index = self.claim(value)
                offset, length = self.offsets[index], self.lengths[index]
                if self.outline:
                    return Outline("bytes", "uint8", (length,))
                return bytes(self.frame[offset : offset + length])
        elif keys == _BUF_KEYS:
            return self.array(node)
        raise Located(f"malformed tagged value {preview(node)}")

    def dict_pairs(self, pairs: list[Any], depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        index = 0
        try:
            for index, pair in enumerate(pairs):
                if type(pair) is not list or len(pair) != 2:
                    raise Located(f"dict item is not a [key, value] pair: {preview(pair)}")
                key = self.walk(pair[0], depth + 3)
                value = self.walk(pair[1], depth + 3)
                try:
                    out[key] = value
                except TypeError:
                    raise Located(f"unhashable dict key of type {_type_name(key)}") from None
                if len(out) != index + 1:
                    raise Located(f"duplicate dict key {key!r}")
        except Located as e:
            e.path.append(f"[$dict {index}]")
            raise
        return out

    def claim(self, index: Any) -> int:
        if type(index) is not int or not 0 <= index < len(self.lengths):
            raise Located(f"buffer index {preview(index)} is not one of the {len(self.lengths)}")
        if self.used[index]:
            raise Located(f"buffer {index} is referenced twice")
        self.used[index] = True
        return index

    def array(self, spec: dict[str, Any]) -> Any:
        index = self.claim(spec["$buf"])
        return array_from(
            self.frame,
            index,
            spec,
            self.offsets[index],
            self.lengths[index],
            outline=self.outline,
            relay=self.relay,
        )


def _frame_view(frame: bytes | bytearray | memoryview) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        raise FrameError(
            f"cannot decode a {_type_name(frame)}: expected bytes, bytearray or memoryview"
        ) from None
    if not view.c_contiguous:
        raise FrameError("frame is a non-contiguous memoryview")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _buffer_layout(frame: memoryview, start: int, lengths: Any) -> list[int]:
    """Offsets of the buffers, after checking the frame holds exactly them and zero padding."""
    if type(lengths) is not list or not all(type(n) is int and n >= 0 for n in lengths):
        raise FrameError(f"header 'bufs' is not a list of byte counts: {preview(lengths)}")
    offsets: list[int] = []
    end = start
    for length in lengths:
        offset = _align(end)
        offsets.append(offset)
        end = offset + length
    size = frame.nbytes
    if end > size:
        raise FrameError(
            f"frame truncated: header declares {len(lengths)} buffers totalling "
            f"{sum(lengths)} bytes (ending at byte {end} with alignment padding), "
            f"frame has {size - start} bytes after the header"
        )
    if end < size:
        raise FrameError(
            f"frame has {size - end} trailing bytes after the end of its last buffer (byte {end})"
        )
    gap_start = start
    for index, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if frame[gap_start:offset] != _ZEROS[: offset - gap_start]:
            raise FrameError(
                f"padding before buffer {index} (bytes {gap_start}..{offset}) is not zero"
            )
        gap_start = offset + length
    return offsets


def _plain(header: bytes) -> bool:
    """Whether a header's body needs no walk: no ``"$`` anywhere (so no tagged value and no
    escaped key), and fewer openers than the depth limit (so nothing nested too deep). Small
    messages (hellos, pings, replies without tensors) are decoded by orjson alone."""
    return b'"$' not in header and header.count(b"[") + header.count(b"{") <= _MAX_DEPTH


def decode(
    frame: bytes | bytearray | memoryview, *, outline: bool = False, relay: bool = False
) -> Any:
    """Decode one frame, viewing its arrays over ``frame`` without copying them.

    Args:
        frame: exactly one frame. numpy arrays come back as views over it (read-only over
            ``bytes``); torch tensors are views when ``frame`` is writable (a ``bytearray``)
            and copies otherwise. Do not reuse a writable frame while its values are alive.
        outline: give each array and bytes as its :class:`~protocol.arrays.Outline` (what it
            holds, checked against its buffer), none of their bytes read: the shape of a
            frame too large to hold, over a memory map, say (and no torch imported for it).
        relay: give each torch tensor as its :class:`~protocol.arrays.RelayedTensor`, which
            :func:`encode` writes back as the tensor: what a process that passes tensors on
            without computing on them reads (no torch imported for it).

    Returns:
        The encoded value.

    Raises:
        FrameError: the frame is truncated, malformed, has trailing bytes or carries an
            unsupported value; the message says what and where. No other exception escapes,
            whatever the input bytes.
    """
    view = _frame_view(frame)
    size = view.nbytes
    if size < _PREFIX.size:
        raise FrameError(f"frame truncated: {size} bytes, the header length alone needs 4")
    (header_len,) = _PREFIX.unpack_from(view, 0)
    start = _PREFIX.size + header_len
    if start > size:
        raise FrameError(
            f"frame truncated: header length is {header_len} bytes, frame has {size - 4} "
            "bytes after the length prefix"
        )
    raw: bytes | memoryview = view[_PREFIX.size : start]
    if header_len <= _SMALL_HEADER:
        raw = view[_PREFIX.size : start].tobytes()  # cheap, and bytes can be searched
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise FrameError(f"header is not valid JSON: {e}") from None
    if type(header) is not dict or header.keys() != _HEADER_KEYS:
        raise FrameError(f"header is not an object with keys v, bufs, body: {preview(header)}")
    if header["v"] != FRAME_VERSION or type(header["v"]) is not int:
        raise FrameError(
            f"unsupported frame version {preview(header['v'])} (this codec reads {FRAME_VERSION})"
        )
    if start == size and header["bufs"] == [] and isinstance(raw, bytes) and _plain(raw):
        return header["body"]  # orjson's tree is the value: nothing tagged, nothing too deep
    lengths = header["bufs"]
    offsets = _buffer_layout(view, start, lengths)
    decoder = _Decoder(view, offsets, lengths, outline, relay)
    try:
        value = decoder.walk(header["body"], 0)
    except Located as e:
        raise FrameError(f"bad value at {e.where()}: {e.message}") from None
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        # Belt and braces: the checks above should leave numpy and torch nothing to refuse.
        raise FrameError(f"malformed frame: {type(e).__name__}: {e}") from None
    if not all(decoder.used):
        unused = [i for i, used in enumerate(decoder.used) if not used]
        raise FrameError(f"buffers {unused} are not referenced by the body")
    return value
