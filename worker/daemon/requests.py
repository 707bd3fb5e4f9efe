"""Daemon commands as typed models on the worker side: a dict in, its request model out.

The agent receives a job's daemon commands as plain dicts (a ``Call``'s ``request``) and the
daemon reads them as decoded frames; both turn them into one of :mod:`protocol.daemon`'s request
models here, so an invalid command is refused with the same ``BAD_REQUEST`` wherever it is found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from protocol.daemon import DaemonRequest, request_adapter
from protocol.errors import ErrorCode, ErrorInfo, RequestRefused

__all__ = ["bad_request", "parse_command", "parse_request"]


def parse_request(raw: Any) -> DaemonRequest:
    """The request model of ``raw`` (a decoded request frame: ``cmd``, ``id`` and its fields).

    Raises:
        RequestRefused: ``raw`` is not a valid command; its ``info`` (``BAD_REQUEST``) names
            the offending field (``cmd`` for an unknown or missing command).
    """
    try:
        return request_adapter.validate_python(raw)
    except ValidationError as exc:
        raise RequestRefused(bad_request(exc)) from exc


def parse_command(command: Mapping[str, Any]) -> DaemonRequest:
    """The request model of a command given without an id (``{"cmd": "fit", ...}``).

    Its ``id`` is a placeholder: the supervisor numbers each request it sends.

    Raises:
        RequestRefused: as :func:`parse_request`.
    """
    return parse_request({**command, "id": 0})


def bad_request(exc: ValidationError) -> ErrorInfo:
    """``BAD_REQUEST`` naming the offending field (``cmd`` for an unknown or missing command)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    listed = []
    for err in errors:
        loc = [str(part) for part in err["loc"]]
        kind = err["type"]
        # A discriminated union puts the tag first in the location: ('fit', 'node_id').
        field = ".".join(loc[1:]) if len(loc) > 1 else "cmd" if kind.startswith("union_tag") else ""
        listed.append({"field": field, "message": err["msg"], "type": kind})
    first = listed[0] if listed else {"field": "", "message": str(exc)}
    if first["field"]:
        message = f"invalid request: {first['field']}: {first['message']}"
    else:
        message = f"invalid request: {first['message']}"
    if len(listed) > 1:
        message += f" (and {len(listed) - 1} more)"
    return ErrorInfo(
        code=ErrorCode.BAD_REQUEST,
        message=message,
        detail={"field": first["field"], "errors": listed},
    )
