"""protocol.handshake: the hello and its answer, checked with no event loop."""

from __future__ import annotations

import pytest

from protocol import PROTOCOL_VERSION
from protocol.errors import (
    ErrorCode,
    ErrorInfo,
    RemoteError,
    RequestRefused,
    UnexpectedHello,
    UnexpectedReply,
)
from protocol.handshake import expect_hello, expect_reply, refusal
from protocol.messages import Ack, ClientHello, Error, Heartbeat, PeerHello, Welcome

WELCOME = Welcome(heartbeat_interval=1.0, heartbeat_timeout=5.0, server="s")


def test_an_expected_hello_is_returned():
    hello = ClientHello(id=4, name="n")
    assert expect_hello(hello, (ClientHello, PeerHello), "{kind}") is hello


def test_another_first_message_is_refused_naming_its_kind():
    with pytest.raises(UnexpectedHello, match="/client expects client_hello first, got heartbeat"):
        expect_hello(
            Heartbeat(id=8, sent_at=0.0),
            ClientHello,
            "/client expects client_hello first, got {kind}",
        )
    with pytest.raises(RequestRefused) as refused:
        expect_hello(Ack(id=3), PeerHello, "a peer link starts with peer_hello, not {kind!r}")
    assert refused.value.info.message == "a peer link starts with peer_hello, not 'ack'"
    assert refused.value.code == ErrorCode.BAD_REQUEST
    assert isinstance(refused.value, UnexpectedHello) and refused.value.reply_to == 3


def test_the_expected_answer_is_returned_and_an_error_is_the_peers_refusal():
    assert expect_reply(WELCOME, Welcome) is WELCOME
    error = Error(error=ErrorInfo(code=ErrorCode.UNAUTHORIZED, message="no"))
    with pytest.raises(RemoteError, match="no") as refused:
        expect_reply(error, Welcome)
    assert refused.value.code == ErrorCode.UNAUTHORIZED


def test_another_answer_is_unexpected_and_names_who_sent_it():
    with pytest.raises(UnexpectedReply, match="the peer answered the hello with 'welcome'") as got:
        expect_reply(WELCOME, Ack)
    assert got.value.kind == "welcome"
    with pytest.raises(UnexpectedReply, match=r"^the coordinator answered the hello with 'ack'$"):
        expect_reply(Ack(), Welcome, "the coordinator")


def test_a_refusal_names_this_sides_version():
    error = refusal(ErrorCode.VERSION_MISMATCH, "protocol version mismatch")
    assert error.error.code == ErrorCode.VERSION_MISMATCH
    assert error.error.message == "protocol version mismatch"
    assert error.error.detail == {"server_version": PROTOCOL_VERSION}
