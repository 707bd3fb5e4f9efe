"""The coordinator's plain HTTP endpoints, on the same port as its WebSockets.

* ``GET /healthz`` — ``ok`` while the coordinator serves (always open); ``503`` with the reason
  while its job store cannot be written (a full disk, a damaged file);
* ``GET /metrics`` — Prometheus text; ``GET /`` — a live status page polling ``GET /api/status``
  (workers and jobs as JSON) and, for its job view, ``GET /api/jobs/ID`` (and ``.../cancel``):
  :mod:`coordinator.server.status`. With a client token these need it (``Authorization:
  Bearer``, or HTTP Basic with the token as password, so a browser can log in) unless
  ``public_status`` (a cancel always does);
* an upgrade to ``/worker`` or ``/client`` is checked here before any message is read: its bearer
  token (in constant time) first, then ``503`` beyond ``max_pending_connections`` upgrades with
  a valid token still waiting for their hello (sockets without one lock nobody out). A
  ``/worker`` upgrade's answer then carries the challenge its hello signs: that, and the rest
  of a worker's session, is :mod:`coordinator.server.worker_sessions`.

:class:`HttpEndpoints` takes what it reads: the settings, the workers, the jobs, the counters,
the pending connections, the clients by connection and the open channels.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import http
import logging
import math
from collections.abc import Set
from typing import Any

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from coordinator.jobs.manager import JobManager
from coordinator.server.clients import EVERYONE, ClientIdentity, ConnectedClients
from coordinator.server.config import CoordinatorConfig
from coordinator.server.metrics import Metrics
from coordinator.server.pending import PendingConnections
from coordinator.server.status import (
    CANCEL_HEADER,
    CSP,
    PAGE,
    job_view,
    parse_job_path,
    status_snapshot,
)
from coordinator.workers.registry import Registry
from protocol.asyncio.channel import Channel

__all__ = ["HttpEndpoints", "authorized", "offered"]

log = logging.getLogger(__name__)

REALM = "somatize"
"""The HTTP Basic realm a browser is asked to log in to (any user name, the client token)."""


class HttpEndpoints:
    """The coordinator's plain HTTP side and its upgrade checks (the module docstring).

    Args:
        config: the coordinator's settings (tokens, ``public_status``, the pending limit).
        registry: the workers (``/metrics``, ``/api/status``).
        jobs: the jobs (``/metrics``, ``/api/status``, ``/api/jobs/...``; its store for
            ``/healthz``).
        metrics: the counters ``/metrics`` renders (and refused upgrades are counted in).
        pending: the connections without a hello yet (an upgrade is admitted there).
        clients: who each ``/client`` connection is, filled in at its upgrade.
        channels: every open connection's channel (``/metrics``).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        registry: Registry,
        jobs: JobManager,
        metrics: Metrics,
        pending: PendingConnections,
        clients: ConnectedClients,
        channels: Set[Channel],
    ) -> None:
        self.config = config
        self.registry = registry
        self.jobs = jobs
        self.metrics = metrics
        self.pending = pending
        self.clients = clients
        self.channels = channels
        self._worker_token = config.worker_token
        self._client_tokens = config.clients

    async def process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        """Answer a plain HTTP request, or check an upgrade to ``/worker`` or ``/client``
        (``None``: go on with the WebSocket handshake); ``websockets``' ``process_request``
        hook."""
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            failure = self.jobs.store.write_failure
            if failure is not None:
                unhealthy = f"the job store cannot be written: {failure}\n"
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, unhealthy)
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        if path in ("/", "/api/status", "/metrics"):
            public = self.config.public_status
            client = EVERYONE if public else self.identified(request, basic=True)
            if client is None:
                return _unauthorized(connection, path)
            if path == "/":
                return _page(connection)
            if path == "/api/status":
                return _json(connection, await status_snapshot(self.registry, self.jobs, client))
            return await self._metrics(connection)
        if (job := parse_job_path(path)) is not None:
            return await self._job(connection, request, *job)
        if path == "/client":
            client = self.identified(request)
            if client is None:
                log.info(
                    "refused %s on %s: missing or wrong token", connection.remote_address, path
                )
                return connection.respond(
                    http.HTTPStatus.UNAUTHORIZED, f"{path} needs a valid bearer token\n"
                )
            self.clients[connection] = client
        if path in ("/worker", "/client"):
            if path == "/worker" and not authorized(request, self._worker_token):
                log.info(
                    "refused %s on %s: missing or wrong token", connection.remote_address, path
                )
                return connection.respond(
                    http.HTTPStatus.UNAUTHORIZED, f"{path} needs a valid bearer token\n"
                )
            if not self.pending.admit(connection):  # the token first: no token, no lockout
                return self._busy(connection)
            return None  # go on with the WebSocket handshake
        return connection.respond(http.HTTPStatus.NOT_FOUND, f"no such path {path!r}\n")

    def identified(self, request: Request, *, basic: bool = False) -> ClientIdentity | None:
        """The client whose token the request carries (:func:`offered`); ``None``: nobody's.
        Without client tokens everyone is :data:`~coordinator.server.clients.EVERYONE`."""
        if self._client_tokens is None:
            return EVERYONE
        given = offered(request, basic=basic)
        return None if given is None else self._client_tokens.identify(given)

    async def _job(
        self, connection: ServerConnection, request: Request, job_id: str, cancel: bool
    ) -> Response:
        """A job view of the status page, or its cancel (:func:`~coordinator.server.status.
        job_view`)."""
        client = self.identified(request, basic=True)
        if client is None and not (self.config.public_status and not cancel):
            return _unauthorized(connection, request.path)
        if cancel and request.headers.get(CANCEL_HEADER[0]) != CANCEL_HEADER[1]:
            return connection.respond(
                http.HTTPStatus.FORBIDDEN, f"a cancel carries '{': '.join(CANCEL_HEADER)}'\n"
            )
        status, body = await job_view(self.jobs, client or EVERYONE, job_id, cancel)
        return _json(connection, body, status)

    async def _metrics(self, connection: ServerConnection) -> Response:
        counts = await self.jobs.counts()
        workers = {str(k): v for k, v in self.registry.counts().items()}
        jobs = {str(k): v for k, v in counts.items()}
        text = self.metrics.render(
            workers,
            jobs,
            self.channels,
            len(self.pending),
            self.pending.refused_at_accept,
            self.pending.displaced,
        )
        return _respond(connection, "text/plain; version=0.0.4; charset=utf-8", text)

    def _busy(self, connection: ServerConnection) -> Response:
        """``503`` for an upgrade beyond ``max_pending_connections``, before any message."""
        limit = self.config.max_pending_connections
        self.metrics.refused_upgrades += 1
        log.warning(
            "refused %s: %d upgrades are waiting for their hello (limit %d)",
            connection.remote_address,
            limit,
            limit,
        )
        response = connection.respond(
            http.HTTPStatus.SERVICE_UNAVAILABLE,
            f"too many connections waiting for their hello (the limit is "
            f"{limit}); retry in a few seconds\n",
        )
        response.headers["Retry-After"] = str(math.ceil(self.config.handshake_timeout))
        return response


def authorized(request: Request, token: str | None, *, basic: bool = False) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (see :func:`offered`),
    compared in constant time. ``token`` ``None``: anyone is."""
    if token is None:
        return True
    given = offered(request, basic=basic)
    return given is not None and hmac.compare_digest(token.encode(), given)


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
