"""Tokens: checked on the upgrade, before any message; separate for workers and clients."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import websockets
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus

import somatize as sz
from somatize.cli.cluster import wait_for
from tests.integration.cluster import healthy
from tests.utils import UNIT, said_port, self_signed, stop_groups

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
CLIENT, WORKER = "client-token-0123456789", "worker-token-9876543210"
NO_JOBS = ("--threads", "1", "--spare-daemon", "off")
"""A worker that only registers here: no spare daemon started for a job that never comes (two
sandboxed ones by default, about 7 s of CPU)."""


def _start(argv: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    environment = {k: v for k, v in os.environ.items() if "SOMATIZE_" not in k} | env
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )


async def _upgrade(url: str, headers: Headers) -> None:
    async with websockets.connect(url, additional_headers=headers, open_timeout=10 * UNIT):
        pass


def test_tokens_are_checked_before_any_message_and_a_worker_token_cannot_submit(
    tmp_path, monkeypatch
):
    coordinator = _start(
        [
            str(BIN / "somatize-coordinator"),
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        tmp_path / "coordinator.log",
        SOMATIZE_TOKEN=CLIENT,
        SOMATIZE_WORKER_TOKEN=WORKER,
    )
    procs = [coordinator]
    try:
        port = said_port(coordinator, tmp_path / "coordinator.log")
        url = f"ws://127.0.0.1:{port}"
        wait_for(lambda: healthy(port), 30 * UNIT, "/healthz (open without a token)")
        monkeypatch.delenv("SOMATIZE_TOKEN", raising=False)
        with pytest.raises(sz.ConnectionFailed, match=r"401: .* wants a client token and none"):
            sz.connect(url, timeout=10 * UNIT)
        for token in ("wrong", WORKER):  # a wrong one, the workers' one
            with pytest.raises(sz.ConnectionFailed, match=r"401: the coordinator refused the"):
                sz.connect(url, token=token, timeout=10 * UNIT)
        with sz.connect(url, token=CLIENT, timeout=10 * UNIT) as client:
            assert client.status()["workers"] == []
        monkeypatch.setenv("SOMATIZE_TOKEN", CLIENT)  # what the SDK reads, as the CLI does
        with sz.connect(url, timeout=10 * UNIT) as client:
            assert client.status()["workers"] == []
        # Two Authorization headers, the right token in one: refused, not a server error.
        twice = Headers([("Authorization", f"Bearer {CLIENT}"), ("Authorization", "Bearer x")])
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(_upgrade(f"{url}/client", twice))
        assert refused.value.response.status_code == 401

        wrong = _start(
            [str(BIN / "somatize-worker"), "--connect", url, "--id", "intruder"],
            tmp_path / "intruder.log",
            SOMATIZE_WORKER_TOKEN=CLIENT,  # a client token: refused
        )
        procs.append(wrong)
        assert wrong.wait(timeout=30 * UNIT) == 1  # refused for good: no retry loop
        right = _start(
            [str(BIN / "somatize-worker"), "--connect", url, "--id", "w1", *NO_JOBS],
            tmp_path / "w1.log",
            SOMATIZE_WORKER_TOKEN=WORKER,
        )
        procs.append(right)

        def registered() -> bool:
            with sz.connect(url, token=CLIENT, timeout=10 * UNIT) as client:
                return [w["id"] for w in client.status()["workers"]] == ["w1"]

        wait_for(registered, 30 * UNIT, "w1 to register with its token")
    finally:
        stop_groups(*procs)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "refusing to listen on 10.0.0.1 without tokens"),
        ({"SOMATIZE_TOKEN": CLIENT}, "refusing to listen on 10.0.0.1 without tokens"),
        ({"SOMATIZE_TOKEN": CLIENT, "SOMATIZE_WORKER_TOKEN": CLIENT}, "must differ"),
    ],
)
def test_the_coordinator_will_not_listen_beyond_loopback_without_tokens(tmp_path, env, message):
    # Refused before anything is bound: no traffic leaves this machine.
    environment = {k: v for k, v in os.environ.items() if "SOMATIZE_" not in k} | env
    out = subprocess.run(
        [
            str(BIN / "somatize-coordinator"),
            "--listen",
            "10.0.0.1:8765",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60 * UNIT,
        check=False,
    )
    assert out.returncode != 0
    assert message in out.stderr


def test_tls_with_a_certificate_the_test_makes(tmp_path):
    cert, key = self_signed(tmp_path)
    coordinator = _start(
        [
            str(BIN / "somatize-coordinator"),
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "state"),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        tmp_path / "coordinator.log",
        SOMATIZE_TOKEN=CLIENT,
        SOMATIZE_WORKER_TOKEN=WORKER,
    )
    procs = [coordinator]
    try:
        port = said_port(coordinator, tmp_path / "coordinator.log")
        url = f"wss://127.0.0.1:{port}"

        def up() -> bool:
            try:
                sz.connect(url, token=CLIENT, timeout=2, ca_file=str(cert)).close()
                return True
            except sz.ConnectionFailed:
                return coordinator.poll() is None and False

        wait_for(up, 30 * UNIT, "the coordinator on wss://")
        worker = _start(
            [
                str(BIN / "somatize-worker"),
                "--connect",
                url,
                "--id",
                "w1",
                *NO_JOBS,
                "--ca-file",
                str(cert),
            ],
            tmp_path / "w1.log",
            SOMATIZE_WORKER_TOKEN=WORKER,
        )
        procs.append(worker)

        def registered() -> bool:
            with sz.connect(url, token=CLIENT, timeout=10 * UNIT, ca_file=str(cert)) as client:
                return [w["id"] for w in client.status()["workers"]] == ["w1"]

        wait_for(registered, 30 * UNIT, "w1 to register over wss://")
        # A client that does not trust the certificate, or speaks plain ws://, gets nowhere,
        # and is told why (issue 18).
        with pytest.raises(sz.ConnectionFailed, match=r"(?i)certificate") as untrusted:
            sz.connect(url, token=CLIENT, timeout=10 * UNIT)
        assert (
            "the coordinator's certificate is not one this machine trusts (self-signed "
            "certificate): give it, or its CA's, with --ca-file (sz.connect(url, ca_file=...))?"
        ) in str(untrusted.value)
        with pytest.raises(sz.ConnectionFailed) as plain:
            sz.connect(f"ws://127.0.0.1:{port}", token=CLIENT, timeout=5 * UNIT)
        assert "does it serve TLS (--tls-cert)? then its URL is wss://" in str(plain.value)
        cli = subprocess.run(
            [str(BIN / "somatize"), "status", "--coordinator", url, "--timeout", str(10 * UNIT)],
            capture_output=True,
            text=True,
            env={**os.environ, "SOMATIZE_TOKEN": CLIENT},
            timeout=60 * UNIT,
        )
        assert cli.returncode == 2 and "with --ca-file (sz.connect(" in cli.stderr, cli.stderr
        # A worker that does not trust it stops at once, saying what to give --ca-file; one
        # on ws:// keeps trying, each failure saying that the coordinator may speak TLS.
        untrusting = _start(
            [str(BIN / "somatize-worker"), "--connect", url, "--id", "w2", "--threads", "1"],
            tmp_path / "w2.log",
            SOMATIZE_WORKER_TOKEN=WORKER,
        )
        procs.append(untrusting)
        assert untrusting.wait(timeout=60 * UNIT) == 1
        said = (tmp_path / "w2.log").read_text()
        assert "cannot trust the coordinator at " in said
        assert "give it, or its CA's, with --ca-file?" in said
        plain_worker = _start(
            [str(BIN / "somatize-worker"), "--connect", f"ws://127.0.0.1:{port}", "--id", "w3"],
            tmp_path / "w3.log",
            SOMATIZE_WORKER_TOKEN=WORKER,
        )
        procs.append(plain_worker)
        hint = "does it serve TLS (--tls-cert)? then its URL is wss://"
        wait_for(
            lambda: (tmp_path / "w3.log").read_text().count(hint) >= 2,
            60 * UNIT,
            "the ws:// worker to say, twice, that the coordinator may speak TLS",
        )
        assert plain_worker.poll() is None
    finally:
        stop_groups(*procs)
