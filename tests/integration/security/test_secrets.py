"""Issue 14, row 3: what a job's code can learn of the worker's secrets.

A filter is code the client sent; it runs in the worker's filter daemon. Here a real
coordinator and a real ``somatize-worker`` (its token in its environment, as compose passes
it, and other variables of the operator's) run a filter that reports the daemon's environment:
no token and nothing off the allow-list reaches it, except what ``--daemon-env`` names. Token
files that others can read are refused by both programs before they start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import somatize as sz
from tests.integration.cluster import cluster
from tests.utils import UNIT
from worker.confinement.environment import daemon_environment

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


class Environment(sz.Filter):
    """Its state is the daemon's environment."""

    def fit(self, x, y=None):
        return {"env": dict(os.environ)}

    def forward(self, x, state):
        return x


def test_a_filter_sees_no_token_and_only_the_allowed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator-secret")
    monkeypatch.setenv("WANDB_API_KEY", "passed-on-purpose")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tokens = {"worker_token": "worker-token-for-the-test", "client_token": "client-token-xyz"}
    with cluster(tmp_path, {}, **tokens) as c:
        c.start_worker("w1", args=["--daemon-env", "WANDB_API_KEY"])
        with c.client() as client:
            job = client.submit(sz.Graph([Environment().named("env")]), np.zeros((2, 1)))
            env = job.result(timeout=120 * UNIT).states["env"]["env"]
    assert "SOMATIZE_WORKER_TOKEN" not in env and "SOMATIZE_TOKEN" not in env
    assert tokens["worker_token"] not in str(env)
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["WANDB_API_KEY"] == "passed-on-purpose"
    assert env["OMP_NUM_THREADS"] == "1" and "PATH" in env


def test_the_tokens_are_never_passed_on_even_when_named():
    parent = {"SOMATIZE_WORKER_TOKEN": "t", "SOMATIZE_TOKEN": "c", "LC_ALL": "C", "X": "1"}
    named = ["SOMATIZE_WORKER_TOKEN", "SOMATIZE_TOKEN", "X"]
    assert daemon_environment(parent, named, {"SOMATIZE_DATASETS": "{}"}) == {
        "LC_ALL": "C",
        "X": "1",
        "SOMATIZE_DATASETS": "{}",
    }
    argv = [str(BIN / "somatize-worker"), "--connect", "ws://127.0.0.1:1"]
    out = subprocess.run(
        [*argv, "--daemon-env", "SOMATIZE_WORKER_TOKEN"],
        capture_output=True,
        text=True,
        timeout=60 * UNIT,
        check=False,
    )
    assert out.returncode == 2
    assert "no filter daemon is given SOMATIZE_WORKER_TOKEN" in out.stderr


@pytest.mark.parametrize(
    ("program", "option"),
    [
        ("somatize-worker", "--token-file"),
        ("somatize-coordinator", "--worker-token-file"),
        ("somatize-coordinator", "--client-token-file"),
    ],
)
def test_a_token_file_others_can_read_is_refused(tmp_path, program, option):
    token = tmp_path / "token"
    token.write_text("a-token-for-the-test\n")
    token.chmod(0o644)
    argv = [str(BIN / program), option, str(token)]
    argv += ["--connect", "ws://127.0.0.1:1"] if program == "somatize-worker" else []
    argv += ["--state-dir", str(tmp_path / "state")] if program != "somatize-worker" else []
    env = {k: v for k, v in os.environ.items() if "SOMATIZE_" not in k}
    out = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=60 * UNIT, check=False
    )
    assert out.returncode != 0
    assert f"the token file {token} is open to others (mode 0644): chmod 600 it" in out.stderr
