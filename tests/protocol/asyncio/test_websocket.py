"""protocol.asyncio.websocket and .loop: the settings every endpoint shares."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from protocol.asyncio.loop import loop_factory
from protocol.asyncio.websocket import (
    WS_MAX_SIZE,
    client_tls,
    close_reason,
    server_tls,
    tls_hint,
    ws_options,
)
from protocol.messages import CHUNK_BYTES


def test_every_endpoint_has_no_compression_and_room_for_a_chunk():
    options = ws_options(open_timeout=3.0, ping_interval=None, close_timeout=1.0)
    assert options["compression"] is None
    assert options["max_size"] == WS_MAX_SIZE == 4 * CHUNK_BYTES
    assert (options["open_timeout"], options["ping_interval"], options["close_timeout"]) == (
        3.0,
        None,
        1.0,
    )
    assert ws_options()["ping_timeout"] == 20.0  # websockets' own default


def test_a_custom_tls_context_goes_to_wss_urls_only():
    context = ssl.create_default_context()
    assert client_tls("wss://h:1", context) == {"ssl": context}
    assert client_tls("ws://h:1", context) == {}
    assert client_tls("wss://h:1", None) == {}


def test_a_server_context_needs_readable_files(tmp_path):
    with pytest.raises(OSError):
        server_tls(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"))


def test_a_close_reason_fits_a_close_frame_without_splitting_a_character():
    assert close_reason("short") == "short"
    cut = close_reason("é" * 100)  # 200 bytes of UTF-8
    assert len(cut.encode()) <= 123 and cut == "é" * 61


def test_the_loop_factory_makes_a_running_loop():
    factory = loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(asyncio.sleep(0, result=7)) == 7


def _raised(exc: BaseException, cause: BaseException) -> BaseException:
    """``exc`` raised from ``cause``, as a dial's wrapper exception is."""
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_tls_hints_say_what_a_failed_dial_most_likely_means():
    verify = ssl.SSLCertVerificationError(1, "certificate verify failed")
    verify.verify_message = "self-signed certificate"
    assert tls_hint("wss://c:8765/worker", _raised(OSError("dial"), verify), None, "--ca-file") == (
        "the coordinator's certificate is not one this machine trusts (self-signed "
        "certificate): give it, or its CA's, with --ca-file?"
    )
    assert tls_hint("wss://c:8765", verify, "ca.pem", "--ca-file") == (
        "ca.pem does not vouch for the coordinator's certificate (self-signed certificate): "
        "is it that certificate, or its CA's?"
    )
    eof = _raised(ValueError("did not receive a valid HTTP response"), EOFError("closed"))
    assert "does it serve TLS (--tls-cert)? then its URL is wss://" in tls_hint(
        "ws://c:8765", eof, None, "--ca-file"
    )
    assert tls_hint("wss://c:8765", ConnectionResetError(), None, "--ca-file") == (
        "the TLS handshake failed: does the coordinator serve TLS? without --tls-cert it is ws://"
    )
    # Nothing to say about TLS: a refused connection, an EOF on wss://, a reset on ws://.
    assert tls_hint("ws://c:8765", ConnectionRefusedError(), None, "--ca-file") == ""
    assert tls_hint("wss://c:8765", eof, None, "--ca-file") == ""
    assert tls_hint("ws://c:8765", ConnectionResetError(), None, "--ca-file") == ""
