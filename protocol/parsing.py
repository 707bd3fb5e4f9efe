"""One frame to one validated message and back, with the error reply for a bad one: no I/O.

:func:`parse` turns the bytes of a frame into a :mod:`protocol.messages` model or raises
:class:`~protocol.errors.BadMessage` carrying the ``error`` reply to send (naming the field that
failed, bounded whatever the peer sent). :func:`peek_ids` reads the ids of a message from its
first bytes, so that a refused message can still be answered.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from protocol import PROTOCOL_VERSION
from protocol.codec import decode, encode
from protocol.errors import BadMessage, ErrorCode, ErrorInfo, FrameError, VersionMismatch
from protocol.messages import message_adapter

__all__ = [
    "check_version",
    "dump",
    "encode_small",
    "message_id",
    "parse",
    "peek_ids",
    "preview",
    "validation_info",
]

FRAME_PREFIX = struct.Struct("<I")
"""A frame's first four bytes: its header length."""
HEAD_SCAN_BYTES = 1 << 20
"""Bytes of a header searched for the message's ids when the header is not whole."""
_LEADING_IDS = re.compile(rb'"body":\{"v":\d{1,9},"id":(\d{1,19}),"reply_to":(null|\d{1,19})[,}]')
MAX_REPORTED_ERRORS = 20
"""Validation errors listed in an error reply's detail (the count of the rest follows)."""


def dump(message: BaseModel) -> dict[str, Any]:
    """A message as the dict the codec encodes (tensors are passed through, not copied)."""
    return message.model_dump()


def encode_small(message: BaseModel) -> bytes:
    """Encode a message known to fit one WebSocket message."""
    return b"".join(encode(dump(message)))


def peek_ids(data: memoryview) -> tuple[int | None, int | None]:
    """``id`` and ``reply_to`` of the message whose frame starts with ``data`` (a chunk of a
    refused message: whom to tell). From the whole header when ``data`` holds it; else from
    the header's start, where :func:`dump` puts them (the body's first fields), so that a
    message whose header alone exceeds a chunk (a graph of 50,000 nodes) is answered too."""
    if len(data) < FRAME_PREFIX.size:
        return None, None
    (length,) = FRAME_PREFIX.unpack_from(data)
    if FRAME_PREFIX.size + length > len(data):
        return _leading_ids(bytes(data[FRAME_PREFIX.size : FRAME_PREFIX.size + HEAD_SCAN_BYTES]))
    try:
        header = orjson.loads(data[FRAME_PREFIX.size : FRAME_PREFIX.size + length])
    except orjson.JSONDecodeError:
        return None, None
    body = header.get("body") if isinstance(header, dict) else None
    if not isinstance(body, dict):
        return None, None
    return message_id(body.get("id")), message_id(body.get("reply_to"))


def _leading_ids(head: bytes) -> tuple[int | None, int | None]:
    """The ids of a body that starts ``{"v":N,"id":N,"reply_to":N|null`` (as every message
    from :func:`dump` does) somewhere in ``head``, the first bytes of a header."""
    found = _LEADING_IDS.search(head)
    if found is None:
        return None, None
    reply_to = found.group(2)
    return int(found.group(1)), None if reply_to == b"null" else int(reply_to)


def message_id(value: Any) -> int | None:
    """``value`` when it can be a message id (an int that is not a bool), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse(payload: bytes | bytearray | memoryview, relay: bool = False) -> Any:
    """Decode and validate one frame into a message (with ``relay``, its tensors as
    :class:`~protocol.arrays.RelayedTensor`: see :func:`~protocol.codec.decode`).

    Raises:
        BadMessage: with the error reply to send (``reply_to`` when the id could be read).
    """
    try:
        raw = decode(payload, relay=relay)
    except FrameError as exc:
        raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
    reply_to = message_id(raw.get("id")) if isinstance(raw, dict) else None
    try:
        return message_adapter.validate_python(raw)
    except ValidationError as exc:
        raise BadMessage(validation_info(exc, raw), reply_to) from exc


def validation_info(exc: ValidationError, raw: Any) -> ErrorInfo:
    """The ``bad_request`` error reply for a message that failed validation: the first failing
    field in the message, up to :data:`MAX_REPORTED_ERRORS` of them in the detail."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    kind = raw.get("kind") if isinstance(raw, dict) else None
    name = kind if isinstance(kind, str) else None  # a peer's kind may be anything
    loc = list(first["loc"])
    if loc and name is not None and loc[0] == name:  # the union's tag leads the location
        loc = loc[1:]
    where = preview(".".join(str(p) for p in loc))
    if first.get("type") == "union_tag_invalid":
        message = f"unknown message kind {preview(kind)}"
    elif first.get("type") == "union_tag_not_found":
        message = "message has no 'kind'"
    else:
        message = f"invalid {name[:60] if name else 'message'}: field {where}: {first['msg']}"
    # Bounded, whatever the message: an error reply never echoes a peer's megabytes back.
    detail: dict[str, Any] = {
        "errors": [
            {"loc": [preview(str(p)) for p in e["loc"][:8]], "msg": e["msg"][:200]}
            for e in errors[:MAX_REPORTED_ERRORS]
        ]
    }
    if len(errors) > MAX_REPORTED_ERRORS:
        detail["more"] = len(errors) - MAX_REPORTED_ERRORS
    return ErrorInfo(code=ErrorCode.BAD_REQUEST, message=message, detail=detail)


def preview(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (it goes into an error message)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_version(payload: bytes | bytearray | memoryview) -> None:
    """Refuse a hello from another protocol version, before reading anything else of it.

    Raises:
        VersionMismatch: the frame's ``v`` is not :data:`~protocol.PROTOCOL_VERSION`.
    """
    try:
        raw = decode(payload)
    except FrameError:
        return  # parse() reports it
    version = raw.get("v") if isinstance(raw, dict) else None
    # An int that is not a bool: ``v`` may be anything a peer sent (an array, whose ``!=`` is
    # an array too).
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: peer speaks {preview(version)}, this side speaks "
            f"{PROTOCOL_VERSION}"
        )
