"""engine.rendezvous_store: a group's store that only its members can use (issue 53: another
job listed a job's rendezvous keys and wrote into its TCPStore). Real sockets on loopback, and a
real two-process gloo group meeting through it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.rendezvous_store import AuthenticatedStore, StoreRefused, StoreServer
from tests.utils import UNIT

SECRET = "5e" * 32
OTHER = "0f" * 32


def test_members_that_prove_the_secret_share_its_keys():
    server = StoreServer(SECRET, "127.0.0.1", 5.0)
    try:
        one = AuthenticatedStore("127.0.0.1", server.port, SECRET, 5.0)
        two = AuthenticatedStore("127.0.0.1", server.port, SECRET, 5.0)
        one.set("addr/0", b"\x00\x01gloo")
        assert two.get("addr/0") == b"\x00\x01gloo"
        assert one.add("count", 2) == 2 and two.add("count", 3) == 5
        assert two.check(["addr/0", "count"]) and not two.check(["addr/1"])
        assert one.compare_set("flag", b"", b"first") == b"first"
        assert two.compare_set("flag", b"nope", b"second") == b"first"
        assert one.num_keys() == 3 and one.delete_key("flag") and one.num_keys() == 2
        with pytest.raises(dist.DistStoreError, match="not set in time"):
            two.wait(["never"], timedelta(seconds=0.2))
        two.set_timeout(timedelta(seconds=0.3))
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            two.get("never")  # within the store's own timeout
        assert time.monotonic() - started < 3.0
        one.close()
        two.close()
    finally:
        server.close()


def test_a_connection_without_the_secret_reads_and_writes_nothing():
    server = StoreServer(SECRET, "127.0.0.1", 5.0)
    try:
        member = AuthenticatedStore("127.0.0.1", server.port, SECRET, 5.0)
        member.set("addr/0", b"10.0.0.7:4000")
        with pytest.raises(StoreRefused, match="refused this member's proof"):
            AuthenticatedStore("127.0.0.1", server.port, OTHER, 5.0)
        # A raw client that skips the proof and sends a request as the wire lays it out.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.recv(32)  # the server's nonce
            raw.sendall(b"\x02\x01\x00\x00\x00\x06\x00\x00\x00addr/0" + bytes(64))
            raw.settimeout(5)
            try:
                said = raw.recv(4096)
            except ConnectionResetError:  # closed with the request unread
                said = b""
            assert said == b""  # closed, having said nothing
        deadline = time.monotonic() + 5
        while server.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused == 2
        # torch's own TCPStore client (what the attack used to list and write keys) gets in
        # no further.
        with pytest.raises((RuntimeError, dist.DistError)):
            dist.TCPStore(
                "127.0.0.1", server.port, None, False, timedelta(seconds=2), False
            ).list_keys()
        assert member.num_keys() == 1 and member.get("addr/0") == b"10.0.0.7:4000"
        member.close()
    finally:
        server.close()


def test_a_member_refuses_a_store_that_cannot_prove_the_secret():
    """An impostor listening where the store should be (it answers any proof with noise)."""
    with socket.socket() as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen()
        port = impostor.getsockname()[1]

        def answer() -> None:
            connection, _ = impostor.accept()
            with connection:
                connection.sendall(bytes(32))
                connection.recv(64)
                connection.sendall(bytes(32))

        import threading

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(StoreRefused, match="did not prove the group's secret"):
            AuthenticatedStore("127.0.0.1", port, SECRET, 5.0)


_RANK = """
import sys, datetime, torch, torch.distributed as dist
from engine.rendezvous_store import AuthenticatedStore
port, rank = int(sys.argv[1]), int(sys.argv[2])
store = AuthenticatedStore("127.0.0.1", port, "{secret}", 30.0)
dist.init_process_group("gloo", store=dist.PrefixStore("job/1/", store), rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=30))
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
print(t.tolist())
dist.destroy_process_group()
"""


def test_two_processes_form_a_gloo_group_through_it():
    server = StoreServer(SECRET, "127.0.0.1", 30.0)
    try:
        code = _RANK.format(secret=SECRET)
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(server.port), str(rank)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={"GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin:/bin"},
            )
            for rank in range(2)
        ]
        for rank in ranks:
            out, err = rank.communicate(timeout=60 * UNIT)
            assert rank.returncode == 0, err[-2000:]
            assert out.strip() == "[3.0, 3.0, 3.0]"
    finally:
        server.close()
