"""Issue 14, row 8: clients with names, jobs with owners, and a quota on queued jobs.

A real ``somatize-coordinator`` with ``--client-tokens-file`` (alice, bob, and root the admin)
and ``--max-queued-jobs 2``, no worker: every job stays queued. Alice sees, watches and cancels
only her jobs (bob's is "no job" to her, as one that does not exist, and is missing from her
lists); root sees and cancels anyone's; a third queued job of one client is refused ``busy``
while the other's still go in.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import somatize as sz
from somatize.cluster import free_port, wait_for
from tests.integration.cluster import healthy
from tests.utils import UNIT, Center

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def _graph() -> sz.Graph:
    return sz.Graph([Center().named("c")])


def test_a_client_sees_and_cancels_only_its_own_jobs_and_queues_at_most_its_quota(tmp_path):
    tokens = {name: secrets.token_urlsafe(16) for name in ("alice", "bob", "root")}
    tokens_file = tmp_path / "clients"
    tokens_file.write_text(
        "# name token [admin]\n"
        f"alice {tokens['alice']}\nbob {tokens['bob']}\nroot {tokens['root']} admin\n"
    )
    tokens_file.chmod(0o600)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if "SOMATIZE_" not in k}
    env["SOMATIZE_WORKER_TOKEN"] = secrets.token_urlsafe(16)  # wanted beside client tokens
    argv = [str(BIN / "somatize-coordinator"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--state-dir", str(tmp_path / "state"), "--client-tokens-file", str(tokens_file)]
    argv += ["--max-queued-jobs", "2"]
    with (tmp_path / "coordinator.log").open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"ws://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(port), 30 * UNIT, "the coordinator to listen")
        with (
            sz.connect(url, token=tokens["alice"], timeout=10 * UNIT) as alice,
            sz.connect(url, token=tokens["bob"], timeout=10 * UNIT) as bob,
            sz.connect(url, token=tokens["root"], timeout=10 * UNIT) as root,
        ):
            mine = [alice.submit(_graph(), np.ones((2, 2))) for _ in range(2)]
            theirs = bob.submit(_graph(), np.ones((2, 2)))
            with pytest.raises(sz.ClientError, match="alice has 2 jobs queued or running") as no:
                alice.submit(_graph(), np.ones((2, 2)))
            assert no.value.code == "busy"
            assert {j["id"] for j in alice.jobs()} == {j.id for j in mine}
            assert {j["id"] for j in bob.jobs()} == {theirs.id}
            assert {j["id"] for j in root.jobs()} == {theirs.id, *(j.id for j in mine)}
            assert {j["id"] for j in alice.status()["jobs"]} == {j.id for j in mine}
            for step in (
                lambda: alice.job(theirs.id).status(),
                lambda: alice.job(theirs.id).cancel(),
                lambda: list(alice.job(theirs.id).events(timeout=5 * UNIT)),
            ):
                with pytest.raises(sz.ClientError, match=f"no job '{theirs.id}'") as hidden:
                    step()
                assert hidden.value.code == "unknown_job"
            assert bob.job(theirs.id).status()["state"] == "queued"  # untouched
            mine[0].cancel()  # her own
            assert alice.job(mine[0].id).status()["state"] == "cancelled"
            alice.submit(_graph(), np.ones((2, 2)))  # room again under her quota
            root.job(theirs.id).cancel()  # the admin cancels anyone's
            assert bob.job(theirs.id).status()["state"] == "cancelled"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20 * UNIT)
