"""The coordinator's plain HTTP endpoints, on the same port as its WebSockets.

* ``GET /healthz`` — ``ok`` while the coordinator serves (always open); ``503`` with the reason
  while its job store cannot be written (a full disk, a damaged file);
* ``GET /metrics`` — Prometheus text; ``GET /`` — a live status page polling ``GET /api/status``
  (workers and jobs as JSON) and, for its job view, ``GET /api/jobs/ID`` (and ``.../cancel``:
  :mod:`coordinator.server.status_api`). With a client token these need it (``Authorization:
  Bearer``, or HTTP Basic with the token as password, so a browser can log in) unless
  ``public_status`` (a cancel always does);
* an upgrade to ``/worker`` or ``/client`` is checked here before any message is read: its bearer
  token (in constant time) first, then ``503`` beyond ``max_pending_connections`` upgrades with
  a valid token still waiting for their hello (sockets without one lock nobody out).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import http
import logging
import math
from typing import TYPE_CHECKING, Any

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from coordinator.server.clients import EVERYONE, ClientIdentity
from coordinator.server.status_api import CANCEL_HEADER, job_view, parse_job_path
from coordinator.server.status_page import CSP, PAGE

if TYPE_CHECKING:
    from coordinator.server.app import Coordinator

__all__ = ["authorized", "process_request"]

log = logging.getLogger(__name__)

REALM = "somatize"
"""The HTTP Basic realm a browser is asked to log in to (any user name, the client token)."""


async def process_request(
    server: Coordinator, connection: ServerConnection, request: Request
) -> Response | None:
    """Answer a plain HTTP request, or check an upgrade to ``/worker`` or ``/client`` (``None``:
    go on with the WebSocket handshake); ``websockets``' ``process_request`` hook."""
    path = request.path.split("?", 1)[0]
    if path == "/healthz":
        failure = server.store.write_failure if server.store is not None else None
        if failure is not None:
            unhealthy = f"the job store cannot be written: {failure}\n"
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, unhealthy)
        return connection.respond(http.HTTPStatus.OK, "ok\n")
    if path in ("/", "/api/status", "/metrics"):
        client = EVERYONE if server.public_status else identified(server, request, basic=True)
        if client is None:
            return _unauthorized(connection, path)
        if path == "/":
            return _page(connection)
        if path == "/api/status":
            return _json(connection, await server.status(client))
        return await _metrics(server, connection)
    if (job := parse_job_path(path)) is not None:
        return await _job(server, connection, request, *job)
    if path == "/client":
        client = identified(server, request)
        if client is None:
            log.info("refused %s on %s: missing or wrong token", connection.remote_address, path)
            return connection.respond(
                http.HTTPStatus.UNAUTHORIZED, f"{path} needs a valid bearer token\n"
            )
        server.clients[connection] = client
    if path in ("/worker", "/client"):
        if path == "/worker" and not authorized(request, server.tokens[path]):
            log.info("refused %s on %s: missing or wrong token", connection.remote_address, path)
            return connection.respond(
                http.HTTPStatus.UNAUTHORIZED, f"{path} needs a valid bearer token\n"
            )
        if not server.admit(connection):  # the token first: no token, no lockout
            return _busy(server, connection)
        return None  # go on with the WebSocket handshake
    return connection.respond(http.HTTPStatus.NOT_FOUND, f"no such path {path!r}\n")


async def _job(
    server: Coordinator,
    connection: ServerConnection,
    request: Request,
    job_id: str,
    cancel: bool,
) -> Response:
    """A job view of the status page, or its cancel (:mod:`coordinator.server.status_api`)."""
    client = identified(server, request, basic=True)
    if client is None and not (server.public_status and not cancel):
        return _unauthorized(connection, request.path)
    if cancel and request.headers.get(CANCEL_HEADER[0]) != CANCEL_HEADER[1]:
        return connection.respond(
            http.HTTPStatus.FORBIDDEN, f"a cancel carries '{': '.join(CANCEL_HEADER)}'\n"
        )
    status, body = await job_view(server, client or EVERYONE, job_id, cancel)
    return _json(connection, body, status)


async def _metrics(server: Coordinator, connection: ServerConnection) -> Response:
    assert server.jobs is not None
    counts = await server.jobs.counts()
    workers = {str(k): v for k, v in server.registry.counts().items()}
    jobs = {str(k): v for k, v in counts.items()}
    text = server.metrics.render(
        workers,
        jobs,
        server.channels,
        server.pending_connections,
        server.pending.refused_at_accept,
    )
    return _respond(connection, "text/plain; version=0.0.4; charset=utf-8", text)


def _busy(server: Coordinator, connection: ServerConnection) -> Response:
    """``503`` for an upgrade beyond ``max_pending_connections``, before any message."""
    server.metrics.refused_upgrades += 1
    log.warning(
        "refused %s: %d upgrades are waiting for their hello (limit %d)",
        connection.remote_address,
        server.max_pending_connections,
        server.max_pending_connections,
    )
    response = connection.respond(
        http.HTTPStatus.SERVICE_UNAVAILABLE,
        f"too many connections waiting for their hello (the limit is "
        f"{server.max_pending_connections}); retry in a few seconds\n",
    )
    response.headers["Retry-After"] = str(math.ceil(server.handshake_timeout))
    return response


def authorized(request: Request, token: str | None, *, basic: bool = False) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (see :func:`offered`),
    compared in constant time. ``token`` ``None``: anyone is."""
    if token is None:
        return True
    given = offered(request, basic=basic)
    return given is not None and hmac.compare_digest(token.encode(), given)


def identified(
    server: Coordinator, request: Request, *, basic: bool = False
) -> ClientIdentity | None:
    """The client whose token the request carries (:func:`offered`); ``None``: nobody's.
    Without client tokens everyone is :data:`~coordinator.server.clients.EVERYONE`."""
    if server.client_tokens is None:
        return EVERYONE
    given = offered(request, basic=basic)
    return None if given is None else server.client_tokens.identify(given)


def offered(request: Request, *, basic: bool = False) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` — or, with ``basic``, the password of
    HTTP Basic credentials (RFC 7617; the user name is not looked at); ``None`` without one,
    or with several ``Authorization`` headers (which would be meant is anyone's guess)."""
    values = request.headers.get_all("Authorization")
    if len(values) != 1:
        return None
    scheme, _, given = values[0].partition(" ")
    token = given.strip().encode()
    if scheme.lower() == "basic" and basic:
        try:
            return base64.b64decode(token, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return None
    return token if scheme.lower() == "bearer" else None


def _unauthorized(connection: ServerConnection, path: str) -> Response:
    """``401`` that makes a browser ask for the client token (as the password)."""
    log.info("refused %s on %s: missing or wrong token", connection.remote_address, path)
    response = connection.respond(
        http.HTTPStatus.UNAUTHORIZED,
        f"{path} needs the client token: 'Authorization: Bearer TOKEN', or any user name and "
        "the token as password\n",
    )
    response.headers["WWW-Authenticate"] = f'Basic realm="{REALM}", charset="UTF-8"'
    return response


def _respond(
    connection: ServerConnection,
    content_type: str,
    body: str,
    status: http.HTTPStatus = http.HTTPStatus.OK,
) -> Response:
    """``body`` as ``content_type`` (``200`` unless told), that no cache keeps (a status goes
    stale in a second)."""
    response = connection.respond(status, body)
    del response.headers["Content-Type"]  # respond() says text/plain; a second one would clash
    response.headers["Content-Type"] = content_type
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _page(connection: ServerConnection) -> Response:
    """The status page, allowed to load nothing from anywhere else and to sit in no frame."""
    response = _respond(connection, "text/html; charset=utf-8", PAGE)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    return response


def _json(
    connection: ServerConnection, value: Any, status: http.HTTPStatus = http.HTTPStatus.OK
) -> Response:
    return _respond(connection, "application/json", orjson.dumps(value).decode(), status)
