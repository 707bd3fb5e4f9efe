"""``somatize-coordinator``: run the coordinator daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.ws_server import Coordinator


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
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, metavar="S")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=3600.0,
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
        default=10.0,
        metavar="S",
        help="seconds running jobs get to finish on shutdown",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"somatize-coordinator: --listen takes HOST:PORT, not {listen!r}")
    return host.strip("[]"), int(port)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return None
    return uvloop.new_event_loop


async def _main(args: argparse.Namespace) -> None:
    host, port = _split(args.listen)
    coordinator = Coordinator(
        host,
        port,
        args.state_dir,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        call_timeout=args.call_timeout,
        job_threads=args.job_threads,
    )
    await coordinator.start()
    print(f"somatize-coordinator listening on ws://{host}:{coordinator.port}", flush=True)
    loop = asyncio.get_running_loop()
    stopping: list[Any] = []

    def on_signal() -> None:
        if stopping:  # the second signal: no more waiting
            os._exit(1)
        stopping.append(asyncio.ensure_future(coordinator.stop(args.grace)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await coordinator.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # websockets logs every connection at INFO; ours already says what matters, once.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
