"""The coordinator's settings: one dataclass, built by :mod:`coordinator.cli` and passed whole.

:class:`CoordinatorConfig` checks what it can at construction (a ``ValueError`` then, which the
CLI turns into a usage error, rather than at :meth:`~coordinator.server.app.Coordinator.start`),
and loads the TLS certificate it names. Every default of ``somatize-coordinator``'s flags is
defined here once.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from coordinator.jobs.manager import ADMIN_POLICY, DEFAULT_OWNER, DEFAULT_PREEMPT_GRACE
from coordinator.jobs.retention import Retention
from coordinator.scheduling.plan import DEFAULT_SHARE_WAIT
from coordinator.scheduling.shares import DEFAULT_HALF_LIFE, DEFAULT_POLICY, ClientPolicy
from coordinator.server.clients import ClientTokens
from coordinator.server.pending import MAX_PENDING_PER_ADDRESS, MAX_PENDING_SOCKETS
from protocol.asyncio.channel import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES
from protocol.asyncio.websocket import server_tls
from protocol.chunking import DEFAULT_STALL_SECONDS

__all__ = [
    "CALL_TIMEOUT",
    "GRACE",
    "HANDSHAKE_TIMEOUT",
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT",
    "MAX_PENDING_CONNECTIONS",
    "MAX_PENDING_PER_ADDRESS",
    "MAX_PENDING_SOCKETS",
    "REASSEMBLY_BUDGET",
    "SERVER",
    "CoordinatorConfig",
    "is_loopback",
]

SERVER = "somatize-coordinator/0.1.0"
"""The server's name and version: in its welcome, its HTTP ``Server`` header and its status."""

HEARTBEAT_INTERVAL = 2.0
"""Default seconds between an agent's heartbeats (told to agents in the welcome)."""
HEARTBEAT_TIMEOUT = 10.0
"""Default seconds of silence after which a worker is lost."""
CALL_TIMEOUT = 3600.0
"""Default seconds one command of a job may take on a worker."""
GRACE = 10.0
"""Default seconds running jobs get to finish when the coordinator stops."""
REASSEMBLY_BUDGET = 4 << 30
"""Default bytes of chunked messages in progress on all connections together (4 GiB)."""
HANDSHAKE_TIMEOUT = 10.0
"""Default seconds a new connection has, from its TCP accept, for the upgrade and its hello."""
MAX_PENDING_CONNECTIONS = 64
"""Default number of upgrades with a valid token but no hello yet beyond which upgrades get
``503``."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """Where a coordinator listens, what it keeps, whom it lets in and what it allows.

    Args:
        host, port: where to listen (port 0: any free port, see
            :attr:`~coordinator.server.app.Coordinator.port`).
        state_dir: the job store's directory (its checkpoints and live jobs' files too).
        heartbeat_interval: seconds between an agent's heartbeats (told to agents).
        heartbeat_timeout: seconds of silence after which a worker is lost.
        call_timeout: seconds one command of a job may take on a worker.
        job_threads: torch threads of each job's daemon (``None``: the agent's default).
        grace: seconds running jobs get to finish when the coordinator stops.
        max_message_bytes: largest (reassembled) message accepted from a peer.
        max_inflight: requests handled at once per connection (one more: ``busy``).
        max_pending_connections: upgrades with a valid token but no hello yet beyond which an
            upgrade gets ``503`` (sockets without a valid upgrade are not counted).
        max_pending_per_address: sockets from one IP address without a hello yet (token or
            not) beyond which a new one from it is closed at its accept.
        max_pending_sockets: sockets without a hello yet in all, whatever their addresses
            (never more than a quarter of the open-files limit), beyond which a new one takes
            the place of the oldest that showed no valid token, or is closed at its accept.
        handshake_timeout: seconds from the TCP accept to the hello, upgrade included.
        worker_token, client_token: the bearer tokens ``/worker`` and ``/client`` connections
            must present (``Authorization: Bearer ...``), checked in constant time on the HTTP
            upgrade, before any message is read. ``None``: that path is open (loopback only,
            unless ``insecure``). A worker token cannot submit jobs.
        client_tokens: named client tokens (``--client-tokens-file``), beside ``client_token``
            (which is the ``client`` admin's): a client sees and cancels only its own jobs
            unless it is an admin.
        insecure: allow listening beyond loopback without a worker token and a client token,
            and client tokens without a worker token.
        tls_cert, tls_key: serve ``wss://`` (and ``https://`` health, metrics and status) with
            this certificate chain and its private key (PEM files), loaded at construction
            into :attr:`tls`.
        public_status: serve ``/``, ``/api/status`` and ``/metrics`` without the client token
            (for a scraper on a trusted network). ``/healthz`` is always open.
        max_queued_jobs: jobs one client may have queued or running at once (``None``: any).
        forget_workers: worker ids whose identity key is dropped at start (their next keyed
            hello enrols again).
        enrolled: the only worker ids that may register (``--enroll ID[=FINGERPRINT]``), by id:
            the fingerprint of the identity key each must prove (bound at start), or ``None``:
            its key is bound at its first registration; an enrolled id never registers without
            a key. Empty: any id may (the first hello of an id with a key binds it).
        max_reassembly_bytes: the bytes received of chunked messages in progress on all
            workers' connections together — three quarters for the replies the coordinator
            awaits, a quarter for what they send unasked, each worker id a share of both —
            and as many on all clients' (each at least ``max_message_bytes``); a chunk beyond
            it ends its message ``busy`` ("retry later"): a few peers cannot pin the
            coordinator's memory, clients cannot take the room of workers' replies, nor
            workers sending unasked (:mod:`coordinator.server.reassembly_shares`).
        max_client_reassembly_bytes: the part of the clients' that one client may hold
            (``None``: a third, at least ``max_message_bytes``; the clients' pool holds three
            such shares at least).
        stall_timeout: seconds a chunked message may wait for its next chunk before it is
            dropped and its memory freed.
        preempt_grace: seconds a preempted job has to save a checkpoint at its next safe point
            before its run is stopped anyway (:mod:`coordinator.scheduling`).
        share_wait: seconds a job of a client under its fair share waits before it preempts a
            job of a client over its share.
        usage_half_life: seconds after which a client's past use of worker-time counts half.
        scheduler: ``"fair"`` (fair shares, priorities, reservations, preemption) or
            ``"fifo"`` (first come, first placed: what the coordinator did before them).
        require_sandbox: refuse a worker whose hello says it runs job code without a sandbox
            (``--sandbox none``, or an agent that does not say): every job's code runs
            sandboxed (``--require-sandbox``).

    Raises:
        ValueError: listening beyond loopback without both tokens, or client tokens without a
            worker token (unless ``insecure``), a worker token that is also a client's, half a
            TLS pair or one that does not load, a heartbeat timeout not longer than the
            interval, or a limit that is not positive.
    """

    host: str
    port: int
    state_dir: Path
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    call_timeout: float = CALL_TIMEOUT
    job_threads: int | None = None
    grace: float = GRACE
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_pending_connections: int = MAX_PENDING_CONNECTIONS
    max_pending_per_address: int = MAX_PENDING_PER_ADDRESS
    max_pending_sockets: int = MAX_PENDING_SOCKETS
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    worker_token: str | None = field(default=None, repr=False)
    client_token: str | None = field(default=None, repr=False)
    client_tokens: ClientTokens | None = field(default=None, repr=False)
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    public_status: bool = False
    max_queued_jobs: int | None = None
    forget_workers: Sequence[str] = ()
    enrolled: Mapping[str, str | None] = field(default_factory=dict)
    max_reassembly_bytes: int = REASSEMBLY_BUDGET
    max_client_reassembly_bytes: int | None = None
    stall_timeout: float = DEFAULT_STALL_SECONDS
    require_sandbox: bool = False
    preempt_grace: float = DEFAULT_PREEMPT_GRACE
    share_wait: float = DEFAULT_SHARE_WAIT
    usage_half_life: float = DEFAULT_HALF_LIFE
    scheduler: str = "fair"
    retention: Retention = field(default_factory=Retention)
    tls: ssl.SSLContext | None = field(default=None, init=False, repr=False)
    """The TLS context of ``tls_cert`` and ``tls_key`` (``None``: plain ``ws://``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        object.__setattr__(self, "forget_workers", tuple(self.forget_workers))
        object.__setattr__(self, "enrolled", dict(self.enrolled))
        self._check_tokens()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is not None and self.tls_key is not None:
            try:
                object.__setattr__(self, "tls", server_tls(self.tls_cert, self.tls_key))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot load the TLS certificate: {exc}") from exc
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("the heartbeat timeout must be longer than the heartbeat interval")
        if min(self.max_message_bytes, self.max_inflight, self.max_pending_connections) < 1:
            raise ValueError("message, in-flight and pending-connection limits must be positive")
        if min(self.max_pending_per_address, self.max_pending_sockets) < 1:
            raise ValueError("pending-connection limits must be positive")
        if self.handshake_timeout <= 0:
            raise ValueError("the handshake timeout must be positive")
        if min(self.max_reassembly_bytes, self.max_client_reassembly_bytes or 1) < 1:
            raise ValueError("reassembly limits must be positive")

    def _check_tokens(self) -> None:
        """Refuse a coordinator anyone on the network could run code through, and a worker
        token that could submit jobs."""
        any_client_token = self.client_token is not None or self.client_tokens is not None
        guarded = self.worker_token and any_client_token
        if not is_loopback(self.host) and not self.insecure and not guarded:
            raise ValueError(
                f"refusing to listen on {self.host} without tokens: a client can run code on "
                "every worker. Give --worker-token-file and --client-token-file (or "
                "SOMATIZE_WORKER_TOKEN and SOMATIZE_TOKEN), or --insecure to accept the risk."
            )
        if any_client_token and not self.worker_token and not self.insecure:
            raise ValueError(
                "client tokens without a worker token: any process that reaches the coordinator "
                "could register as a worker and be sent the clients' filters and data. Give "
                "--worker-token-file (or SOMATIZE_WORKER_TOKEN) too, or --insecure to accept "
                "the risk."
            )
        worker = self.worker_token
        if worker is not None and (
            worker == self.client_token or (self.client_tokens and self.client_tokens.holds(worker))
        ):
            raise ValueError(
                "the worker and client tokens must differ (a worker token must not be able to "
                "submit jobs)"
            )

    @cached_property
    def clients(self) -> ClientTokens | None:
        """Every client token: ``client_token`` (the ``client`` admin's) and ``client_tokens``;
        ``None`` when there is none (everyone is the ``client`` admin)."""
        if self.client_token is None:
            return self.client_tokens
        single = ClientTokens.single(self.client_token)
        return single if self.client_tokens is None else single.merged(self.client_tokens)

    def policy(self, client: str) -> ClientPolicy:
        """What ``client`` is owed of the workers (its line of the clients file; the
        ``client`` admin, and everyone without client tokens, an equal share and no ceiling)."""
        found = self._policies.get(client)
        if found is not None:
            return found
        return ADMIN_POLICY if client == DEFAULT_OWNER else DEFAULT_POLICY

    @cached_property
    def _policies(self) -> dict[str, ClientPolicy]:
        return {} if self.clients is None else self.clients.policies()

    @property
    def scheme(self) -> str:
        """``wss`` with TLS, else ``ws``."""
        return "ws" if self.tls is None else "wss"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): reachable from this machine
    only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
