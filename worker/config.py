"""The worker agent's settings: one dataclass, built by :mod:`worker.cli` and passed whole.

:class:`AgentConfig` checks what it can at construction (a ``ValueError`` then, which the CLI
turns into a usage error, rather than at :meth:`~worker.agent.Agent.run`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from engine.devices import resolve_device
from protocol.asyncio.channel import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES
from protocol.chunking import DEFAULT_STALL_SECONDS
from protocol.messages import Capabilities
from worker.confinement.environment import refused_names
from worker.confinement.limits import JobLimits
from worker.confinement.sandbox import NO_SANDBOX, Sandbox
from worker.daemon.allocator import GLIBC, Allocator

__all__ = ["AgentConfig", "split_host_port", "worker_url"]


@dataclass(frozen=True)
class AgentConfig:
    """What a worker agent connects to, announces and allows.

    Args:
        url: the coordinator, ``ws://HOST:PORT`` (``/worker`` is appended when there is no path).
        worker_id: the id to ask for; ``None`` lets the coordinator choose. Either way the id of
            the last welcome is asked for again on every reconnection.
        tags: what jobs can select this worker by.
        threads: torch threads per daemon when ``open_job`` names none (default: all cores).
        token: sent as ``Authorization: Bearer <token>`` on the WebSocket upgrade.
        heartbeat_interval_override: heartbeat period instead of the welcome's.
        reconnect: ``False``: :meth:`~worker.agent.Agent.run` returns when the first connection
            ends.
        capabilities: what the hello reports (default: :func:`~worker.capabilities.detect`).
        open_timeout: seconds for the TCP connect, the upgrade, and the hello/welcome exchange.
        ping_interval: seconds between WebSocket pings (``websockets``' own keepalive, a second
            line of defence behind the heartbeats); ``None`` disables them.
        ping_timeout: seconds a ping may go unanswered before the connection is dropped.
        close_timeout: seconds each closing step may take (closing handshake, daemon shutdown,
            in-flight replies).
        startup_timeout: seconds a daemon may take to start and load a job's filters.
        call_timeout: seconds a ``call`` without its own ``timeout`` may take.
        python: the interpreter that runs the daemons.
        spare: keep daemons started ahead of the next jobs (``open_job`` then only loads the
            filters: importing torch in a new daemon takes seconds); the oldest also answers
            ``probe``.
        spares: how many (``None``: one where daemons are forked, two where each starts anew in
            its sandbox: :attr:`worker.supervision.pool.DaemonPool.depth`).
        slots: how many one-slot jobs it runs at once, each in its own daemon and cgroup
            (``--slots``; the coordinator gives each its part of the threads).
        fork_server: fork each daemon from a process that imported torch once
            (:mod:`worker.daemon.fork_server`): a daemon starts in milliseconds and shares that
            memory; on a CPU worker (a CUDA context does not survive a fork), else each starts anew.
        fork_server_share: a folder where the agents one user starts on this machine share one
            fork server's imports (``--fork-server-share``; a local cluster's workers): the
            agent forks its daemons from a sibling of the server listening there for its
            daemons' environment (its datasets aside: each fork is told them), or starts that
            server, which outlives the agent for the agents started there later
            (:mod:`worker.daemon.fork_server`).
        fork_server_linger: how long a server this agent starts in ``fork_server_share``
            waits, serving no agent, for the next (``--fork-server-linger``; ``None``: a
            minute, :data:`~worker.daemon.fork_server.LINGER_SECONDS`).
        datasets: local datasets by name (``--data NAME=PATH``), announced in the hello and
            readable by the job daemons (only what the job's filters return leaves this machine).
        peer_listen: ``HOST:PORT`` to serve ``/peer`` on, where other workers deliver pipeline
            tensors directly (port 0: any free port). The hello announces it as
            ``ws://HOST:PORT``, with ``127.0.0.1`` for a wildcard host (``0.0.0.0``/``::``/empty):
            a wildcard is not an address a peer can dial, and loopback is what tests use — pass
            the machine's reachable address to span machines. ``None``: no direct links; every
            tensor for this worker is relayed by the coordinator.
        peer_advertise: the ``HOST:PORT`` other workers dial instead (behind NAT, in Docker).
        ca_file: for ``wss://``, the certificate(s) to trust (a coordinator's own CA, and the
            peers' when they serve TLS); ``None``: the system's.
        peer_tls_cert: with ``peer_tls_key``, the certificate chain (PEM) ``/peer`` serves
            ``wss://`` with; the hello then announces ``wss://HOST:PORT``. ``None``: peer links
            run in clear (authenticated by the job's peer secret, not encrypted).
        peer_tls_key: the private key of ``peer_tls_cert`` (PEM).
        identity_key: this agent's identity key (``--identity-file``, see
            :mod:`worker.identity`): presented with ``worker_id``, which the coordinator binds
            to it at the first registration; ``None``: the id is not bound.
        daemon_env: names of more variables of the agent's environment its daemons get
            (``--daemon-env``), beyond :mod:`worker.confinement.environment`'s allow-list; the
            tokens never.
        max_job_memory: resident bytes a job's daemon, with what it forked, may hold
            (``--max-job-memory``); ``None``: any.
        max_job_procs: processes a job's daemon may run, itself included (``--max-job-procs``);
            ``None``: any.
        job_cgroups: give each job's daemon a cgroup v2 of its own where the agent may make one
            (``--job-cgroups auto``; :mod:`worker.confinement.cgroup`); ``False``: a process group
            only.
        sandbox: what each job's daemon runs inside (``--sandbox``, chosen by
            :func:`worker.confinement.sandbox.choose`); the default runs it as the agent's user.
        daemon_malloc: the ``malloc`` each daemon runs with (``--daemon-malloc``, chosen by
            :func:`worker.daemon.allocator.choose`: tcmalloc where installed); the default is
            the C library's own.
        stall_timeout: seconds a chunked message from the coordinator or a peer may wait for its
            next chunk before it is dropped and its memory freed.
        max_message_bytes: largest message accepted from the coordinator or a peer (and the
            bytes of chunked messages in progress on all peer links together).
        max_inflight: requests handled at once per connection.
        device: where the daemons train: ``auto`` (the first CUDA device, else ``cpu``),
            ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; resolved at construction, so the field
            holds the concrete device (``"cpu"``, ``"cuda:0"``...).

    Raises:
        ValueError: a URL that is not a coordinator's, a ``peer_listen`` that is not
            ``HOST:PORT``, a limit that is not positive, or a device that is not one or is not
            on this machine (naming those it has).
    """

    url: str
    worker_id: str | None = None
    tags: Sequence[str] = ()
    threads: int | None = None
    token: str | None = None
    heartbeat_interval_override: float | None = None
    reconnect: bool = True
    capabilities: Capabilities | None = None
    open_timeout: float = 10.0
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    close_timeout: float = 5.0
    startup_timeout: float = 60.0
    call_timeout: float = 3600.0
    python: str = sys.executable
    spare: bool = True
    spares: int | None = None
    slots: int = 1
    fork_server: bool = True
    fork_server_share: Path | None = None
    fork_server_linger: float | None = None
    datasets: Mapping[str, Path] = field(default_factory=dict)
    peer_listen: str | None = None
    peer_advertise: str | None = None
    ca_file: str | None = None
    peer_tls_cert: str | None = None
    peer_tls_key: str | None = None
    daemon_env: Sequence[str] = ()
    identity_key: str | None = None
    stall_timeout: float = DEFAULT_STALL_SECONDS
    max_job_memory: int | None = None
    max_job_procs: int | None = None
    job_cgroups: bool = True
    sandbox: Sandbox = NO_SANDBOX
    daemon_malloc: Allocator = GLIBC
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    device: str = "auto"

    def __post_init__(self) -> None:
        worker_url(self.url)
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.max_message_bytes < 1 or self.max_inflight < 1:
            raise ValueError("max_message_bytes and max_inflight must be positive")
        if self.peer_listen is not None:
            split_host_port(self.peer_listen)
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError("peer TLS needs both a certificate and its key")
        JobLimits(self.max_job_memory, self.max_job_procs)  # positive, or refused here
        if refused := refused_names(self.daemon_env):
            raise ValueError(f"no filter daemon is given {', '.join(refused)}: it holds a token")

    @property
    def endpoint(self) -> str:
        """The coordinator's ``/worker`` URL (see :func:`worker_url`)."""
        return worker_url(self.url)


def worker_url(url: str) -> str:
    """The agents' endpoint of a coordinator URL: ``ws://h:p`` → ``ws://h:p/worker``.

    A URL with a path is used as it is; one without a scheme gets ``ws://``.

    Raises:
        ValueError: not a ``ws://`` or ``wss://`` URL with a host.
    """
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a coordinator URL: {url!r} (expected ws://HOST:PORT or wss://...)")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/worker")
    return urlunsplit(parts)


def split_host_port(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) → ``(host, port)``.

    Raises:
        ValueError: no port, or one that is not a number in 0..65535.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {listen!r}")
    return host.strip("[]"), int(port)
