"""``somatize-coordinator``: run the coordinator daemon.

The flags become one :class:`~coordinator.server.config.CoordinatorConfig` (:func:`config_from`),
checked at its construction (what it refuses is a usage error here), and the
:class:`~coordinator.server.app.Coordinator` runs on it until the first SIGTERM or SIGINT drains
it (a second one exits at once).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from coordinator.jobs.manager import DEFAULT_PREEMPT_GRACE
from coordinator.jobs.retention import Retention
from coordinator.scheduling.plan import DEFAULT_SHARE_WAIT
from coordinator.scheduling.shares import DEFAULT_HALF_LIFE
from coordinator.server.app import Coordinator
from coordinator.server.clients import ClientTokens
from coordinator.server.collector import tend
from coordinator.server.config import (
    CALL_TIMEOUT,
    GRACE,
    HANDSHAKE_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    MAX_PENDING_CONNECTIONS,
    MAX_PENDING_PER_ADDRESS,
    MAX_PENDING_SOCKETS,
    REASSEMBLY_BUDGET,
    CoordinatorConfig,
)
from protocol.asyncio.channel import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES
from protocol.asyncio.loop import loop_factory
from protocol.asyncio.memory import keep_freed_memory
from protocol.asyncio.open_files import raise_open_files_limit
from protocol.chunking import DEFAULT_STALL_SECONDS
from protocol.security.token_file import token_file_problem
from protocol.text.log_lines import log_to
from protocol.text.quantities import byte_count, seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize-coordinator",
        description="Coordinate worker agents and run training jobs submitted by clients.",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:8765",
        help="address to listen on (default 127.0.0.1:8765; port 0 picks a free one)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        type=Path,
        default=Path(os.environ.get("SOMATIZE_STATE_DIR", "~/.local/state/somatize")).expanduser(),
        help="where the job store lives (default ~/.local/state/somatize)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL, metavar="S")
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT, metavar="S")
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=CALL_TIMEOUT,
        metavar="S",
        help="seconds one command of a job may take on a worker",
    )
    parser.add_argument(
        "--job-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads of each job daemon on the workers (default: the worker's own)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=GRACE,
        metavar="S",
        help="seconds running jobs get to finish on shutdown",
    )
    _security_options(parser)
    _limit_options(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _security_options(parser: argparse.ArgumentParser) -> None:
    """Tokens, TLS, and who may see the status page."""
    parser.add_argument(
        "--client-tokens-file",
        metavar="FILE",
        help="named client tokens, a line 'NAME TOKEN [admin] [share=W] [max_workers=N] "
        "[max_priority=P]' each (chmod 600): a client sees and cancels only its own jobs "
        "unless it is an admin; share weighs its fair share of the workers (default 1), "
        "max_workers caps what its jobs hold, max_priority what priority they may ask "
        "(default 0; an admin's: none)",
    )
    parser.add_argument(
        "--scheduler",
        choices=("fair", "fifo"),
        default="fair",
        help="fair (default): jobs go by priority, then each client's fair share, then age; "
        "a job of several workers reserves them as they free; running jobs may be preempted "
        "(docs/scheduling.md). fifo: first come, first placed, nothing preempted",
    )
    parser.add_argument(
        "--retain-age",
        type=seconds,
        metavar="SECONDS",
        help="remove ended jobs (record, events, result, checkpoints) this long after they "
        "ended (a number of seconds, or 30d, 12h, 90m); checked every minute",
    )
    parser.add_argument(
        "--retain-jobs",
        type=int,
        metavar="N",
        help="keep only the N newest ended jobs",
    )
    parser.add_argument(
        "--retain-bytes",
        type=byte_count,
        metavar="SIZE",
        help="remove the oldest ended jobs until the rest hold at most SIZE (bytes, or 500M, 20G)",
    )
    parser.add_argument(
        "--preempt-grace",
        type=_positive_float,
        default=DEFAULT_PREEMPT_GRACE,
        metavar="SECONDS",
        help="seconds a preempted job has to checkpoint at its next safe point before it is "
        f"stopped anyway and requeued (default {DEFAULT_PREEMPT_GRACE:g})",
    )
    parser.add_argument(
        "--share-wait",
        type=_positive_float,
        default=DEFAULT_SHARE_WAIT,
        metavar="SECONDS",
        help="seconds a job of a client under its fair share waits before it preempts a job "
        f"of a client over its share (default {DEFAULT_SHARE_WAIT:g}; a higher priority "
        "preempts at once)",
    )
    parser.add_argument(
        "--usage-half-life",
        type=_positive_float,
        default=DEFAULT_HALF_LIFE,
        metavar="SECONDS",
        help="seconds after which a client's past use of worker-time counts half in its fair "
        f"share (default {DEFAULT_HALF_LIFE:g})",
    )
    parser.add_argument(
        "--max-queued-jobs",
        type=_positive_int,
        metavar="N",
        help="jobs one client may have queued or running at once; one more is refused busy "
        "(default: no limit)",
    )
    parser.add_argument(
        "--enroll",
        action="append",
        type=_enrolment,
        default=[],
        metavar="ID[=FINGERPRINT]",
        help="enrol worker ID (repeatable): once any is given, only these ids may register, "
        "each with its identity key (never without one): the key of FINGERPRINT (what "
        "somatize-worker --id ID --fingerprint prints), or, with ID alone, the key it first "
        "registers with (trust on first use: the first caller claims it); without --enroll "
        "any worker-token holder may register a new id",
    )
    parser.add_argument(
        "--require-sandbox",
        action="store_true",
        help="refuse workers that run job code without a sandbox (somatize-worker --sandbox "
        "none): every job's code then runs under bubblewrap or a uid of its own",
    )
    parser.add_argument(
        "--forget-worker",
        action="append",
        default=[],
        metavar="ID",
        help="drop worker ID's identity key at startup (repeatable): its next registration "
        "enrols again, e.g. a rebuilt machine that lost its --identity-file",
    )
    parser.add_argument(
        "--worker-token-file",
        metavar="FILE",
        help="the token workers must present (default: $SOMATIZE_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--client-token-file",
        metavar="FILE",
        help="the token clients must present, also asked for by the status page and /metrics "
        "(default: $SOMATIZE_TOKEN)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve wss:// with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--public-status",
        action="store_true",
        help="serve the status page (/), /api/status and /metrics without the client token, "
        "e.g. to a Prometheus scraper on a trusted network (default: with a client token they "
        "need it, as a bearer token or as the password of HTTP Basic; /healthz is always open)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without tokens: anyone who reaches the port can "
        "run code on every worker",
    )


def _limit_options(parser: argparse.ArgumentParser) -> None:
    """What one message, one connection and the not-yet-greeted connections may take."""
    parser.add_argument(
        "--max-message-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help="largest message accepted, reassembled from its chunks; a larger one is refused "
        f"with a too_large error before it is buffered (default {DEFAULT_MAX_MESSAGE_BYTES}: "
        "2 GiB)",
    )
    parser.add_argument(
        "--max-inflight",
        type=_positive_int,
        default=DEFAULT_MAX_INFLIGHT,
        metavar="N",
        help="requests handled at once per connection; one more gets a busy error "
        f"(default {DEFAULT_MAX_INFLIGHT})",
    )
    parser.add_argument(
        "--max-reassembly-bytes",
        type=_positive_int,
        default=REASSEMBLY_BUDGET,
        metavar="N",
        help="bytes received of chunked messages in progress on all workers' connections "
        "together (three quarters kept for the replies the coordinator awaits, each worker id "
        "a share of both parts), and as many on all clients'; a chunk beyond it ends its "
        f"message with busy, retry later (default {REASSEMBLY_BUDGET}: 4 GiB)",
    )
    parser.add_argument(
        "--max-client-reassembly-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="bytes of chunked messages in progress one client may hold over all its "
        "connections, so that one client cannot keep another's messages out (default: a third "
        "of --max-reassembly-bytes, at least --max-message-bytes; the clients' pool holds "
        "three such shares at least: two clients cannot fill it for a third)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_SECONDS,
        metavar="SECONDS",
        help="a chunked message that gets no chunk for this long is dropped and its memory "
        f"freed (default {DEFAULT_STALL_SECONDS:g})",
    )
    parser.add_argument(
        "--max-pending-connections",
        type=_positive_int,
        default=MAX_PENDING_CONNECTIONS,
        metavar="N",
        help="upgrades with a valid token that have not sent their hello yet, beyond which new "
        f"upgrades get HTTP 503 (default {MAX_PENDING_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-pending-per-address",
        type=_positive_int,
        default=MAX_PENDING_PER_ADDRESS,
        metavar="N",
        help="sockets from one IP address that have not sent their hello yet (with a token or "
        "not), beyond which a new one from that address is closed at its accept "
        f"(default {MAX_PENDING_PER_ADDRESS})",
    )
    parser.add_argument(
        "--max-pending-sockets",
        type=_positive_int,
        default=MAX_PENDING_SOCKETS,
        metavar="N",
        help="sockets that have not sent their hello yet in all, whatever their addresses, "
        "beyond which a new one takes the place of the oldest without a valid token, or is "
        "closed at its accept; never more than a quarter of the open-files limit "
        f"(default {MAX_PENDING_SOCKETS})",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=_positive_float,
        default=HANDSHAKE_TIMEOUT,
        metavar="S",
        help="seconds a new connection has for the upgrade and its hello "
        f"(default {HANDSHAKE_TIMEOUT:g})",
    )


def _enrolment(text: str) -> tuple[str, str | None]:
    """``ID`` or ``ID=FINGERPRINT`` (the SHA-256 of the worker's public key, in hex)."""
    worker_id, has, fingerprint = text.partition("=")
    if not worker_id:
        raise argparse.ArgumentTypeError(f"a worker id to enrol, not {text!r}")
    if not has:
        return worker_id, None
    if not re.fullmatch(r"[0-9a-f]{64}", fingerprint):
        raise argparse.ArgumentTypeError(
            f"{worker_id}'s fingerprint must be the 64 hex digits somatize-worker --id "
            f"{worker_id} --fingerprint prints, not {fingerprint!r}"
        )
    return worker_id, fingerprint


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"somatize-coordinator: --listen takes HOST:PORT, not {listen!r}")
    return host.strip("[]"), int(port)


def _token(path: str | None, variable: str) -> str | None:
    if path is None:
        return os.environ.get(variable) or None
    return _secret_file(path).strip()


def _secret_file(path: str) -> str:
    """What a token file holds, once it is found readable by its owner only, and not empty."""
    try:
        with open(path, encoding="utf-8") as f:
            mode, text = os.fstat(f.fileno()).st_mode, f.read()
    except OSError as exc:
        raise SystemExit(f"somatize-coordinator: cannot read the token file {path}: {exc}") from exc
    problem = token_file_problem(path, mode, text)
    if problem is not None:
        raise SystemExit(f"somatize-coordinator: {problem}")
    return text


def config_from(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's settings from its flags (and the token variables of the environment).

    Raises:
        SystemExit: a flag, a token file or a setting that is refused, saying why.
    """
    host, port = _split(args.listen)
    worker_token = _token(args.worker_token_file, "SOMATIZE_WORKER_TOKEN")
    client_token = _token(args.client_token_file, "SOMATIZE_TOKEN")
    client_tokens = None
    if args.client_tokens_file is not None:
        try:
            client_tokens = ClientTokens.parse(
                _secret_file(args.client_tokens_file), args.client_tokens_file
            )
        except ValueError as exc:
            raise SystemExit(f"somatize-coordinator: {exc}") from exc
    try:
        return CoordinatorConfig(
            host,
            port,
            args.state_dir,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            call_timeout=args.call_timeout,
            job_threads=args.job_threads,
            grace=args.grace,
            max_message_bytes=args.max_message_bytes,
            max_inflight=args.max_inflight,
            max_pending_connections=args.max_pending_connections,
            max_pending_per_address=args.max_pending_per_address,
            max_pending_sockets=args.max_pending_sockets,
            handshake_timeout=args.handshake_timeout,
            worker_token=worker_token,
            client_token=client_token,
            client_tokens=client_tokens,
            insecure=args.insecure,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            public_status=args.public_status,
            max_queued_jobs=args.max_queued_jobs,
            forget_workers=args.forget_worker,
            enrolled=dict(args.enroll),
            max_reassembly_bytes=args.max_reassembly_bytes,
            max_client_reassembly_bytes=args.max_client_reassembly_bytes,
            stall_timeout=args.stall_timeout,
            require_sandbox=args.require_sandbox,
            preempt_grace=args.preempt_grace,
            share_wait=args.share_wait,
            usage_half_life=args.usage_half_life,
            scheduler=args.scheduler,
            retention=Retention(args.retain_age, args.retain_jobs, args.retain_bytes),
        )
    except ValueError as exc:
        raise SystemExit(f"somatize-coordinator: {exc}") from exc


async def _main(config: CoordinatorConfig) -> None:
    coordinator = Coordinator(config)
    await coordinator.start()
    # What start-up made lives as long as the process: out of the cyclic collector's way, so a
    # full collection with thousands of connections open does not walk it too (a pause of the
    # loop that every heartbeat would wait behind); and so is, each second, what is alive then
    # (coordinator.server.collector).
    gc.collect()
    gc.freeze()
    collector = asyncio.ensure_future(tend())
    print(
        f"somatize-coordinator listening on {config.scheme}://{config.host}:{coordinator.port}",
        flush=True,
    )
    loop = asyncio.get_running_loop()
    stopping: list[Any] = []

    def on_signal() -> None:
        if stopping:  # the second signal: no more waiting
            os._exit(1)
        stopping.append(asyncio.ensure_future(coordinator.stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await coordinator.serve_forever()
    finally:
        collector.cancel()


def _one_maths_thread() -> None:
    """Run the coordinator's tensor maths (gradient and state averages, server optimizers) on
    one intra-op thread.

    They are memory-bound passes on the event loop's thread, no faster on more cores; and an
    OpenMP pool spin-waits between operations on cores that co-located workers need (measured:
    18 % of all the CPU time of a DataParallel(2) step with the workers on the same 2 cores).

    The coordinator imports torch only when a job needs it (its idle memory is a fifth without):
    the thread count is set through the environment torch reads when it is imported.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:  # imported already (by an embedding program): set it directly
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = config_from(args)
    keep_freed_memory()
    raise_open_files_limit()
    _one_maths_thread()
    log_to(sys.stderr, args.log_level.upper())  # one line per record, whatever it quotes
    # websockets logs every connection at INFO; ours already says what matters, once.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_main(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
