"""The integration tests' cluster: :class:`somatize.cli.cluster.LocalCluster`, time-scaled."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from somatize.cli.cluster import LocalCluster, wait_for
from tests import zygote
from tests.utils import FORK_SERVER_LINGER, UNIT, shared_fork_servers

__all__ = ["Cluster", "cluster", "healthy", "wait_for"]


class Cluster(LocalCluster):
    """A :class:`LocalCluster` whose waits scale with ``SOMATIZE_TEST_TIMEOUT_SCALE``, and whose
    workers keep no spare daemon unless asked (``spare_daemons=True``): a spare's start is a
    torch import and a warm-up, about 3 s of CPU, and most tests run one job and stop. Its
    workers run ``--sandbox none`` unless asked: a sandboxed daemon is started anew for each
    job (2-3 s of CPU, where the fork server forks one in milliseconds);
    :mod:`tests.integration.security.test_sandbox` runs them sandboxed. Its workers share fork
    servers with every cluster of the run (:func:`tests.utils.shared_fork_servers`), each
    server waiting :data:`~tests.utils.FORK_SERVER_LINGER` for the next. Its coordinator and
    agents are forked by the suite's zygotes (:mod:`tests.zygote`), which imported them once
    (the coordinators' zygote torch too), where they can give them what they would have been
    started with; ``fork=False`` starts them as console scripts."""

    def __init__(
        self,
        state_dir: Path,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 3.0,
        spare_daemons: bool = False,
        sandbox: str = "none",
        fork: bool = True,
        **options: Any,
    ):
        self.fork = fork
        super().__init__(
            state_dir,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            spare_daemons=spare_daemons,
            sandbox=sandbox,
            startup=60 * UNIT,
            **{
                "fork_server_share": shared_fork_servers(),
                "fork_server_linger": FORK_SERVER_LINGER,
                **options,
            },
        )

    def _spawn(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        if not self.fork:
            return super()._spawn(name, argv, env)
        with open(self.logs / f"{name}.log", "ab") as log:
            forked = zygote.spawn(argv, {**os.environ, **(env or {})}, log.fileno())
        return forked or super()._spawn(name, argv, env)  # type: ignore[return-value]

    def wait_connected(self, worker_id: str) -> dict[str, object]:
        return wait_for(
            lambda: self.worker_state(worker_id) == "idle" and self.worker(worker_id),
            30 * UNIT,
            f"worker {worker_id} to register",
        )


@contextlib.contextmanager
def cluster(
    tmp_path: Path,
    workers: dict[str, tuple[str, ...]],
    data: Mapping[str, Mapping[str, Path]] | None = None,
    peer_links: bool = False,
    **kwargs: Any,
) -> Iterator[Cluster]:
    """A started cluster with ``workers`` (id → tags), each with its ``data`` (id → dataset name
    → ``.npz`` path) if given, listening for peer links if ``peer_links``; everything is stopped
    on exit."""
    c = Cluster(tmp_path / "state", **kwargs)
    try:
        c.start_coordinator()
        for worker_id, tags in workers.items():
            c.start_worker(worker_id, *tags, data=(data or {}).get(worker_id), peer_link=peer_links)
        yield c
    finally:
        c.close()


def healthy(port: int) -> bool:
    """Whether a coordinator on 127.0.0.1:``port`` answers ``GET /healthz`` with 200 now."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False
