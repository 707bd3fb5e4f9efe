"""The worker registry with no sockets: ids kept across reconnects, heartbeats, reaping, states."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.context import WorkerIdentity
from coordinator.errors import DuplicateWorker
from coordinator.workers.registry import Registry, WorkerState
from protocol.messages import ArrayShape, Capabilities, DatasetSummary

CAPS = Capabilities(cpus=2, memory_bytes=1 << 30, torch="2", python="3.11", cloudpickle="3")


class FakeChannel:
    """What the registry reads of a connection: whether it is closed, when it last brought
    a message."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.received_at = 0.0

    def close(self) -> None:
        self.closed.set()


def _registry(timeout=10.0):
    changes = []
    registry = Registry(timeout, on_change=lambda: changes.append(1))
    return registry, changes


def test_attach_gives_an_id_and_keeps_it_across_reconnects():
    registry, changes = _registry()
    first = FakeChannel()
    mnist = {"mnist": DatasetSummary(rows=60)}
    record = registry.attach(None, ["a", "b"], CAPS, first, mnist, peer_address="ws://h:1")
    assert record.id.startswith("w-") and len(record.id) == len("w-") + 6
    # Where other workers reach it: its announced peer address's host.
    assert record.identity == WorkerIdentity(
        record.id, frozenset({"a", "b"}), {"mnist": 60}, host="h"
    )
    assert record.state is WorkerState.IDLE and record.connected
    assert record.peer_address == "ws://h:1"
    assert changes == [1]

    first.close()
    registry.detach(record, first, "bye")
    assert record.state is WorkerState.OFFLINE and record.reason == "bye"
    assert not record.connected

    again = registry.attach(record.id, ["c"], CAPS, FakeChannel(), remote_host="10.0.0.7")
    assert again is record
    assert record.host == "10.0.0.7"  # no peer address: where its connection came from
    assert record.connections == 2
    assert record.tags == frozenset({"c"})
    assert record.datasets == {} and record.peer_address is None
    assert record.state is WorkerState.IDLE and record.reason == ""
    assert len(registry) == 1 and list(registry) == [record]
    assert changes == [1, 1, 1]


def test_an_id_in_use_by_a_connected_worker_is_refused():
    registry, _ = _registry()
    registry.attach("w1", [], CAPS, FakeChannel())
    with pytest.raises(DuplicateWorker, match="'w1' is already connected; choose another --id"):
        registry.attach("w1", [], CAPS, FakeChannel())


def test_a_worker_disconnecting_during_a_job_is_lost_and_an_old_connection_is_ignored():
    registry, _ = _registry()
    old = FakeChannel()
    record = registry.attach("w1", [], CAPS, old)
    old.close()
    new = FakeChannel()
    registry.attach("w1", [], CAPS, new)
    registry.detach(record, old, "late news of the old connection")
    assert record.channel is new and record.state is WorkerState.IDLE

    record.take("j1", 1)
    new.close()
    registry.detach(record, new, "connection reset")
    assert record.state is WorkerState.LOST and record.reason == "connection reset"
    assert registry.counts()[WorkerState.LOST] == 1


def test_a_worker_whose_connection_brings_chunks_is_heard_though_its_heartbeats_wait():
    # A large reply streams in: its heartbeats queue behind it, its chunks keep coming.
    registry, _ = _registry(timeout=5.0)
    channel = FakeChannel()
    streaming = registry.attach("streaming", [], CAPS, channel)
    base = streaming.last_heartbeat
    channel.received_at = base + 4.0  # a chunk, no heartbeat
    assert registry.reap(now=base + 6.5) == []
    assert streaming.heard() == base + 4.0
    lost = registry.reap(now=base + 9.5)  # then nothing at all
    assert lost == [streaming] and streaming.reason == "no heartbeat for 5.5s (timeout 5.0s)"


def test_reap_declares_silent_connected_workers_lost():
    registry, changes = _registry(timeout=5.0)
    quiet = registry.attach("quiet", [], CAPS, FakeChannel())
    chatty = registry.attach("chatty", [], CAPS, FakeChannel())
    gone = FakeChannel()
    offline = registry.attach("offline", [], CAPS, gone)
    gone.close()
    registry.detach(offline, gone, "bye")
    base = quiet.last_heartbeat
    changes.clear()

    assert registry.reap(now=base + 4.0) == []
    assert changes == []
    registry.heartbeat(chatty)
    chatty.last_heartbeat = base + 4.0
    lost = registry.reap(now=base + 6.5)
    assert lost == [quiet]
    assert quiet.state is WorkerState.LOST
    assert quiet.reason == "no heartbeat for 6.5s (timeout 5.0s)"
    assert chatty.state is WorkerState.IDLE
    assert offline.state is WorkerState.OFFLINE  # not connected: nothing to reap
    assert changes == [1]


def test_idle_lists_connected_workers_without_a_job_in_registration_order():
    registry, _ = _registry()
    a = registry.attach("a", [], CAPS, FakeChannel())
    b = registry.attach("b", [], CAPS, FakeChannel())
    c = registry.attach("c", [], CAPS, FakeChannel())
    d_channel = FakeChannel()
    registry.attach("d", [], CAPS, d_channel)
    b.state = WorkerState.BUSY
    d_channel.close()  # closed but not detached yet: not idle either
    assert registry.idle() == [a, c]
    counts = registry.counts()
    assert counts == {
        WorkerState.IDLE: 3,
        WorkerState.BUSY: 1,
        WorkerState.LOST: 0,
        WorkerState.OFFLINE: 0,
    }


def test_summary_is_what_status_shows():
    registry, _ = _registry()
    x = ArrayShape(shape=[3, 2], dtype="float32")
    d = DatasetSummary(rows=3, kind="npy", x=x)
    record = registry.attach("a", ["z", "y"], CAPS, FakeChannel(), {"d": d})
    summary = record.summary(now=record.last_heartbeat + 1.25)
    assert summary == {
        "id": "a",
        "tags": ["y", "z"],
        "state": "idle",
        "last_heartbeat_age": 1.25,
        "job_id": None,
        "jobs": [],
        "slots": 1,
        "reason": "",
        "connections": 1,
        "datasets": {
            "d": {
                "rows": 3,
                "kind": "npy",
                "x": {"shape": [3, 2], "dtype": "float32"},
                "y": None,
                "shards": 1,
            }
        },
        "capabilities": CAPS.model_dump(),
    }


def test_workers_sharing_a_host_share_its_cores_as_their_default_threads():
    registry = Registry(heartbeat_timeout=5)
    eight = CAPS.model_copy(update={"cpus": 8})
    a = registry.attach("a", [], eight, FakeChannel(), remote_host="10.0.0.1")
    assert registry.thread_share(a) is None  # alone on its machine: the agent's own default
    b = registry.attach("b", [], eight, FakeChannel(), remote_host="10.0.0.1")
    c = registry.attach("c", [], eight, FakeChannel(), remote_host="10.0.0.1")
    elsewhere = registry.attach("d", [], eight, FakeChannel(), remote_host="10.0.0.2")
    assert [registry.thread_share(w) for w in (a, b, c, elsewhere)] == [2, 2, 2, None]
    gone = FakeChannel()
    e = registry.attach("e", [], eight, gone, remote_host="10.0.0.2")
    assert registry.thread_share(elsewhere) == 4
    registry.detach(e, gone, "closed")
    assert registry.thread_share(elsewhere) is None  # only connected workers share


def test_a_worker_of_several_slots_takes_jobs_until_they_are_spent():
    registry, _ = _registry()
    record = registry.attach("a", [], CAPS.model_copy(update={"slots": 4}), FakeChannel())
    record.take("j1", 1)
    record.take("j2", 2)
    assert record.state is WorkerState.BUSY and record.free_slots == 1
    assert record.job_id == "j1" and record.summary()["jobs"] == ["j1", "j2"]
    record.give_back("j1")
    assert record.state is WorkerState.BUSY and record.free_slots == 2
    record.give_back("j2")
    assert record.state is WorkerState.IDLE and record.free_slots == 4
    record.state = WorkerState.BUSY  # held otherwise, with no job of its own: nothing free
    assert record.free_slots == 0
