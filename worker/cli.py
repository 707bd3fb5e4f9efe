"""The ``somatize-worker`` command line: a worker agent, until a signal stops it.

::

    somatize-worker --connect ws://HOST:PORT [--id NAME] [--tag T ...] [--threads N]
                    [--token-file FILE] [--peer-listen HOST:PORT] [--log-level LEVEL]
                    [--max-message-bytes N] [--max-inflight N]
                    [--device auto|cpu|cuda|cuda:N|mps]

Lifecycle: startup → serve → shutdown. The first SIGTERM or SIGINT stops accepting work, closes
the filter daemons (a call still running is answered with an error) and the connection, and exits
with status 0. A second one kills the daemons and exits at once, with status 1, for when the
orderly way hangs. The loop is uvloop's when uvloop can be imported, plain asyncio's otherwise.

The token comes from ``--token-file`` or else the ``SOMATIZE_WORKER_TOKEN`` environment variable
(never from the command line, where ``ps`` would show it to every user of the machine).

Exit status: 0 stopped by a signal; 1 refused by the coordinator (another protocol version, a
wrong token: retrying cannot help) or forced out by a second signal; 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from engine.data.datasets import parse_data_option
from protocol.asyncio.channel import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES
from protocol.asyncio.loop import loop_factory
from protocol.asyncio.memory import keep_freed_memory
from protocol.security.identity_proof import fingerprint, public_key
from protocol.security.token_file import token_file_problem
from protocol.text.log_lines import log_to
from protocol.text.quantities import byte_count, seconds
from worker.agent import Agent
from worker.capabilities import memory_bytes
from worker.config import AgentConfig
from worker.confinement.sandbox import LEVELS, Sandbox, choose
from worker.daemon.allocator import LEVELS as MALLOC_LEVELS
from worker.daemon.allocator import Allocator
from worker.daemon.allocator import choose as choose_allocator
from worker.daemon.fork_server import LINGER_SECONDS
from worker.errors import RegistrationRefused, UntrustedCoordinator
from worker.identity import default_identity_file, load_or_create_key

__all__ = ["main"]

log = logging.getLogger("worker.cli")

SPARE_MEMORY_FLOOR = 4 << 30
"""Under this much memory ``--spare-daemon auto`` keeps no daemon started ahead: each holds
~300 MB, a large share of a small machine's memory for a job's start a few seconds sooner."""


def _spare(choice: str, memory: int) -> bool:
    """Whether the agent keeps daemons started ahead: as asked, or (``auto``) where the
    machine's ``memory`` (bytes; 0: unknown) is not under :data:`SPARE_MEMORY_FLOOR`."""
    if choice != "auto":
        return choice == "on"
    if 0 < memory < SPARE_MEMORY_FLOOR:
        log.info(
            "no spare filter daemon: this machine has %.1f GiB (under %d GiB); "
            "--spare-daemon on keeps one",
            memory / (1 << 30),
            SPARE_MEMORY_FLOOR >> 30,
        )
        return False
    return True


TOKEN_ENV = "SOMATIZE_WORKER_TOKEN"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize-worker",
        description="Connect to a somatize coordinator and run the filters of its jobs.",
    )
    parser.add_argument(
        "--connect", metavar="URL", help="the coordinator, ws://HOST:PORT (required)"
    )
    parser.add_argument("--id", help="this worker's id (default: the coordinator chooses one)")
    parser.add_argument(
        "--tag", action="append", default=[], help="a tag jobs can select (repeatable)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per filter daemon, when a job names none (default: all cores)",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a local dataset jobs can train on by name: an .npz with x (and y), a directory "
        "of x.npy (and y.npy), opened memory-mapped, or a directory of such shards and .npz "
        "files, in name order; repeatable",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding the worker token (default: ${TOKEN_ENV}, if set)",
    )
    parser.add_argument(
        "--peer-listen",
        metavar="HOST:PORT",
        help="serve direct pipeline links to other workers here (port 0: any free port; "
        "a 0.0.0.0 host is announced as 127.0.0.1). Default: none, the coordinator relays",
    )
    parser.add_argument(
        "--ca-file",
        metavar="FILE",
        help="certificate(s) to trust for a wss:// coordinator, and for peers that serve "
        "wss:// (default: the system's)",
    )
    parser.add_argument(
        "--peer-tls-cert",
        metavar="FILE",
        help="certificate chain (PEM) to serve --peer-listen as wss:// with; without it peer "
        "links are authenticated (a per-job secret) but not encrypted",
    )
    parser.add_argument(
        "--identity-file",
        type=Path,
        metavar="FILE",
        help="this worker's identity key, made on the first start (default: "
        "~/.local/state/somatize/worker-ID.key); the coordinator binds --id to it at the first "
        "registration and refuses that id with any other key",
    )
    parser.add_argument(
        "--fingerprint",
        action="store_true",
        help="print the fingerprint of --id's identity key (made if need be) and exit: what "
        "somatize-coordinator --enroll ID=FINGERPRINT binds the id to",
    )
    parser.add_argument(
        "--max-job-memory",
        type=byte_count,
        metavar="BYTES",
        help="resident memory a job's filter daemon may hold, with what it forks (e.g. 8G); "
        "over it the daemon is killed and its job fails resource_limit (default: no limit)",
    )
    parser.add_argument(
        "--max-job-procs",
        type=int,
        metavar="N",
        help="processes a job's filter daemon may run, itself included; over it the daemon "
        "is killed and its job fails resource_limit (default: no limit)",
    )
    parser.add_argument(
        "--job-cgroups",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): each job's filter daemon gets a cgroup v2 of its own where this "
        "agent may make one (what its filters fork cannot leave it, even by setsid; the log "
        "says which), else a process group; off: a process group only",
    )
    parser.add_argument(
        "--sandbox",
        choices=LEVELS,
        default="auto",
        help="what each job's filter daemon runs inside: bwrap (bubblewrap: a user namespace "
        "with no capabilities, as an unprivileged uid of its own on a root agent; file system "
        "read-only, private /tmp and /dev/shm counted in its memory, its own /proc and PIDs, "
        "this agent's token, identity and TLS keys hidden), uid (a root agent gives each "
        "daemon an unprivileged uid of its own; datasets must be readable by others), none (as "
        "this agent's user: job code can read its secrets); auto (default): bwrap where it "
        "works, else uid where it works, else the worker refuses to start, saying why",
    )
    parser.add_argument(
        "--job-network",
        choices=("on", "off"),
        default="on",
        help="on (default): sandboxed job code shares this machine's network (the torch "
        "collective needs it); off: each daemon gets a network of its own, loopback only "
        "(bwrap), and jobs that need the torch collective are not placed here",
    )
    parser.add_argument(
        "--daemon-malloc",
        choices=MALLOC_LEVELS,
        default="auto",
        help="the malloc each filter daemon runs with: tcmalloc (preloaded: it keeps freed "
        "blocks for the next step, unfragmented; a sharded step 0.93x torch's fully_shard, "
        "where glibc's takes 1.6x), glibc (the C library's own; a sharded replica maps its "
        "large blocks: a little less memory); auto (default): tcmalloc where installed "
        "(apt-get install libtcmalloc-minimal4), else glibc",
    )
    parser.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="NAME",
        help="pass the agent's environment variable NAME on to the filter daemons (repeatable); "
        "they get only an allow-list otherwise (locale, PATH, CUDA, NCCL/gloo, torch, BLAS), "
        "never a token",
    )
    parser.add_argument(
        "--peer-tls-key",
        metavar="FILE",
        help="the private key (PEM) of --peer-tls-cert",
    )
    parser.add_argument(
        "--peer-advertise",
        metavar="HOST:PORT",
        help="the address other workers dial for --peer-listen, when it differs from it "
        "(a container's service name, a NAT's public address)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help="largest message accepted from the coordinator or a peer, reassembled from its "
        f"chunks (default {DEFAULT_MAX_MESSAGE_BYTES}: 2 GiB); a larger one gets too_large",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        metavar="N",
        help="requests handled at once per connection; one more gets a busy error "
        f"(default {DEFAULT_MAX_INFLIGHT})",
    )
    parser.add_argument(
        "--fork-server",
        choices=["on", "off"],
        default="on",
        help="fork each job's filter daemon from one process that imported torch once (default "
        "on: a daemon starts in milliseconds, sharing that memory; CPU workers only); off starts "
        "each anew",
    )
    parser.add_argument(
        "--fork-server-share",
        type=Path,
        metavar="DIR",
        help="share the fork server's imports with the other workers you start on this machine "
        "with the same DIR (a folder only you can open): the first starts a server that "
        "listens there, the others fork their daemons from siblings of it, each worker's "
        "daemons still its own; the server outlives its worker for the workers started "
        "there later, for --fork-server-linger after the last, or until DIR is removed (a "
        "local cluster's workers; default: a server of its own)",
    )
    parser.add_argument(
        "--fork-server-linger",
        type=seconds,
        metavar="DURATION",
        help="how long a shared fork server this worker starts waits, serving no worker, for "
        "the next one started with the same --fork-server-share (e.g. 10m; default "
        f"{LINGER_SECONDS:g} s: an idle server holds its imports, ~230 MiB)",
    )
    parser.add_argument(
        "--spare-daemon",
        choices=["auto", "on", "off"],
        default="auto",
        help="keep the next jobs' filter daemons started ahead (on: a job starts without "
        "waiting for torch to import; off saves their memory, ~300 MB each, and their start's "
        f"CPU during a job; default auto: on, off on a machine of less than "
        f"{SPARE_MEMORY_FLOOR >> 30} GiB)",
    )
    parser.add_argument(
        "--spare-daemons",
        type=int,
        metavar="N",
        help="how many filter daemons to keep started ahead (default: 1 where daemons are "
        "forked, 2 where each starts anew in its sandbox, seconds each, so that a job right "
        "after another finds one up; each holds ~300 MB)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=1,
        metavar="N",
        help="run up to N jobs at once, each in its own daemon and cgroup, a job of one slot "
        "getting 1/N of the threads (default 1: one job at a time); more slots than cores "
        "oversubscribes them",
    )
    parser.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N|mps",
        help="where the filter daemons train (default: auto, the first CUDA device if there "
        "is one, else cpu); a device this machine lacks is refused at startup",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: INFO)",
    )
    return parser


def _token(parser: argparse.ArgumentParser, token_file: str | None) -> str | None:
    if token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        with open(token_file, encoding="utf-8") as f:
            mode, text = os.fstat(f.fileno()).st_mode, f.read()
    except OSError as exc:
        parser.error(f"cannot read the token file: {exc}")
    problem = token_file_problem(token_file, mode, text)
    if problem is not None:
        parser.error(problem)
    return text.strip()


def _on_signal(agent: Agent, sig: signal.Signals) -> None:
    if not agent.stopping:
        log.info("received %s: stopping (send it again to force)", sig.name)
        agent.stop()
        return
    log.warning("received %s again: killing the filter daemons and exiting now", sig.name)
    agent.kill_daemons()
    os._exit(1)  # forced: no cleanup that could hang is waited for


async def _serve(agent: Agent) -> int:
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, agent, sig)
    try:
        await agent.run()
    except (RegistrationRefused, UntrustedCoordinator):
        return 1  # the agent logged why
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("worker %s stopped", agent.worker_id or "(never registered)")
    return 0


def _print_fingerprint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--fingerprint``: print ``--id``'s key fingerprint (its key made if need be)."""
    if args.id is None:
        parser.error("--fingerprint names the key of a worker id: give --id")
    try:
        key = load_or_create_key(args.identity_file or default_identity_file(args.id))
    except ValueError as exc:
        parser.error(str(exc))
    print(fingerprint(public_key(key)))
    return 0


def _secret_files(args: argparse.Namespace) -> list[str]:
    """The files a job must not read: this agent's token file, identity key, peer TLS key."""
    files = [args.token_file, args.identity_file, args.peer_tls_key]
    if args.id is not None and args.identity_file is None:
        files.append(default_identity_file(args.id))
    return [str(f) for f in files if f]


def _secret_folders(args: argparse.Namespace) -> list[str]:
    """The folders a job must not read: where this agent's identity key is kept (other
    workers of this machine keep theirs there too), and the default one."""
    folders = [default_identity_file("any").parent]
    if args.identity_file is not None:
        folders.append(args.identity_file.resolve().parent)
    return [str(f) for f in dict.fromkeys(folders)]


def _sandbox(args: argparse.Namespace, datasets: dict[str, Path]) -> Sandbox:
    """``--sandbox``'s, as :func:`~worker.confinement.sandbox.choose` finds it here."""
    return choose(
        args.sandbox,
        _secret_files(args),
        [str(p) for p in datasets.values()],
        _secret_folders(args),
        network=args.job_network == "on",
    )


def _daemon_malloc(requested: str) -> Allocator:
    """``--daemon-malloc``'s allocator; ``auto`` without tcmalloc says what it costs."""
    allocator = choose_allocator(requested)
    if requested == "auto" and allocator.library is None:
        log.warning(
            "no tcmalloc here: filter daemons use the C library's malloc, and a sharded "
            "replica's step takes about 1.6x as long (apt-get install libtcmalloc-minimal4)"
        )
    return allocator


def main(argv: list[str] | None = None) -> int:
    """Run the agent; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.fingerprint:
        return _print_fingerprint(parser, args)
    if args.connect is None:
        parser.error("the following arguments are required: --connect")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.slots < 1:
        parser.error("--slots must be at least 1")
    if args.spare_daemons is not None and args.spare_daemons < 1:
        parser.error("--spare-daemons must be at least 1 (--spare-daemon off keeps none)")
    if args.max_message_bytes < 1 or args.max_inflight < 1:
        parser.error("--max-message-bytes and --max-inflight must be at least 1")
    log_to(sys.stderr, args.log_level)  # one line per record, whatever it quotes
    token = _token(parser, args.token_file)
    try:
        datasets = parse_data_option(args.data)
        identity_key = None
        if args.id is not None:
            identity_key = load_or_create_key(args.identity_file or default_identity_file(args.id))
        sandbox = _sandbox(args, datasets)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.closing(sandbox):  # it may keep a process running (its root)
        try:
            config = AgentConfig(
                args.connect,
                worker_id=args.id,
                tags=args.tag,
                threads=args.threads,
                token=token,
                datasets=datasets,
                peer_listen=args.peer_listen,
                peer_advertise=args.peer_advertise,
                ca_file=args.ca_file,
                peer_tls_cert=args.peer_tls_cert,
                peer_tls_key=args.peer_tls_key,
                daemon_env=args.daemon_env,
                max_job_memory=args.max_job_memory,
                max_job_procs=args.max_job_procs,
                job_cgroups=args.job_cgroups == "auto",
                sandbox=sandbox,
                daemon_malloc=_daemon_malloc(args.daemon_malloc),
                identity_key=identity_key,
                max_message_bytes=args.max_message_bytes,
                max_inflight=args.max_inflight,
                device=args.device,
                spare=_spare(args.spare_daemon, memory_bytes()),
                spares=args.spare_daemons,
                slots=args.slots,
                fork_server=args.fork_server == "on",
                fork_server_share=args.fork_server_share,
                fork_server_linger=args.fork_server_linger,
            )
            agent = Agent(config)
        except ValueError as exc:
            parser.error(str(exc))
        # (torch is not imported here: the agent relays tensors as bytes, RelayedTensor)
        keep_freed_memory()
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(_serve(agent))


if __name__ == "__main__":
    sys.exit(main())
