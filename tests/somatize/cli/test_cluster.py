"""What a LocalCluster reads of its processes' logs: the port a coordinator bound (it is started
with ``--listen HOST:0``, so no port is picked for another process to take first)."""

from __future__ import annotations

from somatize.cli.cluster import LISTENING


def _port(log: str) -> int | None:
    found = LISTENING.search(log)
    return None if found is None else int(found.group(1))


def test_the_port_a_coordinator_says_it_listens_on_is_read_from_its_log():
    assert _port("") is None
    assert _port("INFO coordinator listening on ws://127.0.0.1:0 (state in /s)\n") is None
    log = (
        "2026-12-05 INFO coordinator.server.app: coordinator listening on ws://127.0.0.1:41234\n"
        "somatize-coordinator listening on ws://127.0.0.1:41234\n"
    )
    assert _port(log) == 41234
    assert _port("somatize-coordinator listening on wss://::1:8765\n") == 8765
