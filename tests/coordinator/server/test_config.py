"""coordinator.server.config: a coordinator's settings are checked when they are made, before
anything listens, and the status page is one document made of its static files."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from coordinator.server.clients import EVERYONE, ClientIdentity, ClientTokens
from coordinator.server.config import CoordinatorConfig
from coordinator.server.status import CSP, PAGE
from tests.utils import self_signed

CLIENT, WORKER = "client-token-0123456789", "worker-token-9876543210"
STATE = Path("state")  # never made: nothing here opens the store


def test_beyond_loopback_a_coordinator_needs_both_tokens_unless_insecure(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost"):
        assert CoordinatorConfig(host, 0, tmp_path).clients is None
    for tokens in ({}, {"client_token": CLIENT}, {"worker_token": WORKER}):
        with pytest.raises(ValueError, match=r"refusing to listen on 10\.0\.0\.1 without tokens"):
            CoordinatorConfig("10.0.0.1", 0, tmp_path, **tokens)
    CoordinatorConfig("10.0.0.1", 0, tmp_path, insecure=True)
    named = ClientTokens({"alice-token-0123456": ClientIdentity("alice")})
    CoordinatorConfig("10.0.0.1", 0, tmp_path, worker_token=WORKER, client_tokens=named)


def test_a_worker_token_cannot_be_a_clients():
    named = ClientTokens({WORKER: ClientIdentity("alice")})
    for clients in ({"client_token": WORKER}, {"client_tokens": named}):
        with pytest.raises(ValueError, match="worker and client tokens must differ"):
            CoordinatorConfig("127.0.0.1", 0, STATE, worker_token=WORKER, **clients)


def test_the_client_tokens_are_the_single_one_and_the_named_ones():
    named = ClientTokens({"alice-token-0123456": ClientIdentity("alice")})
    config = CoordinatorConfig(
        "127.0.0.1", 0, STATE, client_token=CLIENT, client_tokens=named, worker_token=WORKER
    )
    assert config.clients is not None
    assert config.clients.identify(CLIENT.encode()) == EVERYONE
    assert config.clients.identify(b"alice-token-0123456") == ClientIdentity("alice")
    assert config.clients.identify(WORKER.encode()) is None
    assert CLIENT not in repr(config) and WORKER not in repr(config)  # no token in a log line


def test_tls_is_a_certificate_and_its_key_loaded_at_construction(tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        CoordinatorConfig("127.0.0.1", 0, tmp_path, tls_cert="cert.pem")
    with pytest.raises(ValueError, match="cannot load the TLS certificate"):
        CoordinatorConfig("127.0.0.1", 0, tmp_path, tls_cert="none.pem", tls_key="none.pem")
    cert, key = self_signed(tmp_path)
    config = CoordinatorConfig("127.0.0.1", 0, tmp_path, tls_cert=str(cert), tls_key=str(key))
    assert isinstance(config.tls, ssl.SSLContext) and config.scheme == "wss"
    assert CoordinatorConfig("127.0.0.1", 0, tmp_path).scheme == "ws"


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"heartbeat_interval": 10.0, "heartbeat_timeout": 10.0}, "heartbeat timeout"),
        ({"max_message_bytes": 0}, "limits must be positive"),
        ({"max_inflight": 0}, "limits must be positive"),
        ({"max_pending_connections": 0}, "limits must be positive"),
        ({"max_pending_per_address": 0}, "limits must be positive"),
        ({"handshake_timeout": 0.0}, "handshake timeout must be positive"),
    ],
)
def test_limits_are_checked_at_construction(setting, words):
    with pytest.raises(ValueError, match=words):
        CoordinatorConfig("127.0.0.1", 0, STATE, **setting)


def test_the_status_page_is_one_document_with_its_style_and_script_inlined():
    assert PAGE.startswith("<!doctype html>") and PAGE.rstrip().endswith("</html>")
    assert PAGE.count("<style>") == 1 and PAGE.count("<script>") == 1
    assert 'href="status.css"' not in PAGE and 'src="status.js"' not in PAGE
    assert "const POLL_MS = 1000;" in PAGE and 'id="job-view"' in PAGE and "#job-cancel" in PAGE
    assert "style-src 'unsafe-inline'" in CSP and "script-src 'unsafe-inline'" in CSP
