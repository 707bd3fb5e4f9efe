"""The agent's settings: checked at construction, no socket, no event loop."""

from __future__ import annotations

import dataclasses

import pytest

from worker.config import AgentConfig, split_host_port


def test_the_endpoint_is_the_coordinators_worker_path() -> None:
    assert AgentConfig("host:8765").endpoint == "ws://host:8765/worker"
    assert AgentConfig("wss://host/custom").endpoint == "wss://host/custom"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"url": "http://host:1"}, "not a coordinator URL"),
        ({"max_message_bytes": 0}, "must be positive"),
        ({"max_inflight": 0}, "must be positive"),
        ({"peer_listen": "127.0.0.1"}, "not HOST:PORT"),
        ({"peer_listen": "127.0.0.1:70000"}, "not HOST:PORT"),
    ],
)
def test_a_setting_that_cannot_work_is_a_value_error_at_construction(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        AgentConfig(**{"url": "ws://host:1", **options})  # type: ignore[arg-type]


def test_the_config_is_frozen_and_split_host_port_reads_v6() -> None:
    config = AgentConfig("ws://host:1", peer_listen="[::1]:0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.spare = False  # type: ignore[misc]
    assert split_host_port("[::1]:8000") == ("::1", 8000)
    assert split_host_port(":0") == ("", 0)
