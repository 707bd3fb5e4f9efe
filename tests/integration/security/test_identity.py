"""Issue 14, row 3: a worker token alone cannot register as another worker.

A real coordinator and a real ``somatize-worker`` on loopback. The worker's first hello enrols
its id with its identity key; while it is down, a process holding the worker token (as a filter
that read it could) says hello as that id, with no key or a guessed one, and is refused — so a
job submitted meanwhile waits for the real worker and runs there. A rebuilt machine that lost
its key registers again once the operator runs the coordinator with ``--forget-worker``. With
``--enroll``, an id the operator did not enrol is refused even to its first hello.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess

import numpy as np
import pytest
import websockets

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import send_hello
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Welcome, WorkerHello
from protocol.security.identity_proof import CHALLENGE_HEADER, fingerprint, prove, public_key
from somatize.cli.cluster import BIN
from somatize.errors import ClusterError
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Center
from worker.capabilities import Capabilities

pytestmark = pytest.mark.integration

_CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")


async def _hello_as(
    url: str, token: str, worker_id: str, secret: str | None, forged: str | None = None
) -> RemoteError:
    """Say hello as ``worker_id`` with the worker token, proving the key derived from
    ``secret`` for the connection's challenge (or presenting its public key with the proof
    ``forged``); the refusal it gets."""
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(f"{url}/worker", additional_headers=headers) as ws:
        channel = Channel(ws, "impostor")
        issued = ws.response.headers[CHALLENGE_HEADER]
        proven = {}
        if secret is not None:
            proof = forged if forged is not None else prove(secret, issued, worker_id)
            proven = {"public_key": public_key(secret), "proof": proof}
        hello = WorkerHello(id=1, worker_id=worker_id, capabilities=_CAPS, **proven)
        with pytest.raises(RemoteError) as refused:
            await send_hello(channel, hello, Welcome, 10 * UNIT, first=True)
    return refused.value


def test_an_enrolled_worker_id_is_refused_to_anyone_without_its_key(tmp_path):
    worker_token = secrets.token_urlsafe(16)
    tokens = {"worker_token": worker_token, "client_token": secrets.token_urlsafe(16)}
    with cluster(tmp_path, {"w1": ()}, **tokens) as c, c.client() as client:
        c.send_signal(c.workers["w1"], signal.SIGKILL)
        c.workers.pop("w1").wait(timeout=10 * UNIT)
        wait_for(lambda: c.worker_state("w1") != "idle", 20 * UNIT, "w1 to be seen gone")
        for key in (None, secrets.token_urlsafe(32)):
            refused = asyncio.run(_hello_as(c.url, worker_token, "w1", key))
            assert refused.code == ErrorCode.UNAUTHORIZED
            assert "worker id 'w1' is enrolled with another identity key" in refused.info.message
            assert "--forget-worker w1" in refused.info.message
        # The real key's public half with a proof made for another connection's challenge
        # (what a listener on an old hello could replay): refused. The key itself never
        # travelled: the hello carries its public half and a signature.
        real = (tmp_path / "identities" / "w1.key").read_text().strip()
        replayed = prove(real, "another connection's challenge", "w1")
        refused = asyncio.run(_hello_as(c.url, worker_token, "w1", real, forged=replayed))
        assert refused.code == ErrorCode.UNAUTHORIZED
        assert "its hello does not prove its identity key" in refused.info.message
        job = client.submit(sz.Graph([Center().named("f")]), np.ones((4, 2)))
        c.start_worker("w1")  # the same machine: its identity file
        fitted = job.result(timeout=60 * UNIT)
        np.testing.assert_array_equal(fitted.states["f"]["mean"], np.ones(2))
        assert job.status()["workers"] == ["w1"]

        # The machine is rebuilt and its key is gone: refused, until the operator forgets it.
        c.send_signal(c.workers["w1"], signal.SIGTERM)
        c.workers.pop("w1").wait(timeout=20 * UNIT)
        rebuilt = ["--identity-file", str(tmp_path / "rebuilt" / "w1.key")]
        with pytest.raises(ClusterError, match="exited with status 1"):
            c.start_worker("w1", args=rebuilt)
        c.workers.pop("w1").wait(timeout=20 * UNIT)
        assert c.stop_coordinator() == 0
        c.start_coordinator(args=["--forget-worker", "w1"])
        c.start_worker("w1", args=rebuilt)
        assert c.worker_state("w1") == "idle"


def test_with_enrolled_ids_any_other_id_is_refused_at_its_first_hello(tmp_path):
    """Issue 32: a worker id not yet enrolled was claimed by any worker-token holder. With
    ``--enroll w1``, only w1 may register (binding its key); w2 — never seen before — and a
    worker without an id are refused, and the refusal names no enrolled id."""
    worker_token = secrets.token_urlsafe(16)
    tokens = {"worker_token": worker_token, "client_token": secrets.token_urlsafe(16)}
    with cluster(tmp_path, {}, **tokens) as c:
        assert c.stop_coordinator() == 0
        c.start_coordinator(args=["--enroll", "w1"])
        for worker_id in ("w2", None):
            hello = WorkerHello(id=1, worker_id=worker_id, capabilities=_CAPS)

            async def say(hello: WorkerHello = hello) -> RemoteError:
                headers = {"Authorization": f"Bearer {worker_token}"}
                async with websockets.connect(f"{c.url}/worker", additional_headers=headers) as ws:
                    with pytest.raises(RemoteError) as refused:
                        await send_hello(Channel(ws, "new"), hello, Welcome, 10 * UNIT, first=True)
                return refused.value

            refused = asyncio.run(say())
            assert refused.code == ErrorCode.UNAUTHORIZED
            assert "is not enrolled on this coordinator" in refused.info.message
            assert "w1" not in refused.info.message
        c.start_worker("w1")
        assert c.worker_state("w1") == "idle"


def test_an_id_enrolled_with_its_fingerprint_is_refused_to_whoever_claims_it_first(tmp_path):
    """Issue 53, a Low: ``--enroll w9`` bound the id to the first key to say hello, so
    whoever held the worker token claimed w9 before the real worker and locked it out. With
    ``--enroll w9=FINGERPRINT`` (what ``somatize-worker --id w9 --fingerprint`` prints) a
    claim with another key, or none, is refused from the first, and the real w9 registers."""
    worker_token = secrets.token_urlsafe(16)
    tokens = {"worker_token": worker_token, "client_token": secrets.token_urlsafe(16)}
    key_file = tmp_path / "identities" / "w9.key"
    argv = ["--id", "w9", "--identity-file", str(key_file), "--fingerprint"]
    printed = subprocess.run(
        [str(BIN / "somatize-worker"), *argv],
        capture_output=True,
        text=True,
        timeout=60 * UNIT,
        check=True,
    ).stdout.strip()
    assert printed == fingerprint(public_key(key_file.read_text().strip()))
    with cluster(tmp_path, {}, **tokens) as c:
        assert c.stop_coordinator() == 0
        c.start_coordinator(args=["--enroll", f"w9={printed}"])
        for key in (secrets.token_urlsafe(32), None):  # the claim comes first
            refused = asyncio.run(_hello_as(c.url, worker_token, "w9", key))
            assert refused.code == ErrorCode.UNAUTHORIZED
            said = "enrolled with another identity key" if key else "proves no identity key"
            assert said in refused.info.message
        c.start_worker("w9")  # its --identity-file: the key enrolled
        assert c.worker_state("w9") == "idle"
