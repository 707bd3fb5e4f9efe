"""benchmarks.slow_links.links: the names, commands and delay queue by hand; then real sites (root,
TUN, ``tc``), held to their rate and delay, and gone afterwards, also after their owner was killed.

Timings are lower bounds only: a slow machine makes a link slower, never faster. Without root
the real-site tests fail with :class:`benchmarks.slow_links.links.LinkUnavailable`'s message: a
benchmark that needs slow links must not pass without them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.slow_links import links
from benchmarks.slow_links.links import (
    MTU,
    DelayQueue,
    LinkShape,
    LinkUnavailable,
    Sites,
    plan,
    rate_bytes_per_second,
    shaping_commands,
)

ROOT = Path(__file__).resolve().parents[3]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")])),
}

# One connection: 3 one-byte round trips, then N bytes answered with one byte.
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(3):
    conn.sendall(conn.recv(1))
left = int(sys.argv[2])
while left:
    left -= len(conn.recv(min(left, 1 << 20)))
conn.sendall(b"k")
"""
# Prints [the shortest round trip, the seconds from the first byte sent to the server's answer].
CLIENT = """
import json, socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(3):
    start = time.perf_counter()
    conn.sendall(b"x")
    conn.recv(1)
    rtts.append(time.perf_counter() - start)
start = time.perf_counter()
conn.sendall(bytes(int(sys.argv[3])))
conn.recv(1)
print(json.dumps([min(rtts), time.perf_counter() - start]))
"""


# -- by hand -------------------------------------------------------------------------------------


def test_names_and_addresses_derive_from_the_number():
    first, second = plan(4321, 2)

    assert (first.namespace, first.host_if, first.site_if) == (
        "szl4321-0",
        "szlh4321-0",
        "szls4321-0",
    )
    assert second.namespace == "szl4321-1"
    # 4321 % 1024 = 225: 10.232.225.0/24; site i at .2i+2, its gateway at .2i+1.
    assert (first.host_ip, first.site_ip) == ("10.232.225.1", "10.232.225.2")
    assert (second.host_ip, second.site_ip) == ("10.232.225.3", "10.232.225.4")
    assert plan(1023, 1)[0].host_ip == "10.235.255.1"  # the last /24 of 10.232.0.0/14


@pytest.mark.parametrize(("number", "count"), [(1, 0), (1, 128), (-1, 1), (12345678901, 1)])
def test_a_plan_that_cannot_be_built_is_refused(number, count):
    with pytest.raises(ValueError):
        plan(number, count)


def test_the_longest_number_that_fits():
    # pid_max is at most 4194304: seven digits and a two-digit site still make a 15-character name.
    assert plan(4194304, 100)[-1].host_if == "szlh4194304-99"


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        ("100mbit", 12.5e6),
        ("1Gbit", 125e6),
        ("12.5mbps", 12.5e6),
        ("8000", 1000.0),
        ("1mibit", 131072.0),
    ],
)
def test_tc_rates(rate, expected):
    assert rate_bytes_per_second(rate) == pytest.approx(expected)


@pytest.mark.parametrize("rate", ["fast", "100 furlongs", "0mbit", ""])
def test_a_rate_tc_would_refuse_is_refused_first(rate):
    with pytest.raises(ValueError):
        LinkShape(rate=rate, delay=0.01)


@pytest.mark.parametrize("delay", [-0.001, float("nan"), float("inf")])
def test_a_delay_is_seconds_not_below_zero(delay):
    with pytest.raises(ValueError):
        LinkShape(rate=None, delay=delay)


def test_describe():
    assert LinkShape(rate="100mbit", delay=0.01).describe() == "100mbit, 10 ms each way"
    assert LinkShape(rate=None, delay=0.0025).describe() == "unlimited, 2.5 ms each way"


def test_htb_bursts_are_two_packets_or_a_millisecond():
    def burst(rate):
        argv = shaping_commands(["tc"], "dev0", rate)[1]
        return int(argv[argv.index("burst") + 1])

    assert burst("100mbit") == 2 * MTU
    assert burst("10gbit") == 1_250_000


def test_packets_come_out_in_order_after_the_delay():
    queue = DelayQueue(0.5)
    queue.push(10.0, b"a")
    queue.push(10.1, b"b")
    queue.push(10.1, b"c")

    assert queue.next_release() == 10.5
    assert queue.pop_due(10.49) == []
    assert queue.pop_due(10.5) == [b"a"]
    assert queue.next_release() == pytest.approx(10.6)
    assert queue.pop_due(11.0) == [b"b", b"c"]
    assert queue.next_release() is None
    assert len(queue) == 0


@pytest.mark.parametrize(
    ("missing", "said"),
    [("root", "need root"), ("ip", "`ip` command"), ("tc", "`tc` command"), ("tun", "no TUN")],
)
def test_what_is_missing_is_said_before_anything_is_built(monkeypatch, missing, said):
    if missing == "root":
        monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
    elif missing == "tun":
        monkeypatch.setattr(links, "_TUN", "/nonexistent/tun")
    else:
        monkeypatch.setattr(links.shutil, "which", lambda name: None if name == missing else name)
    monkeypatch.setattr(links, "_run", lambda argv: pytest.fail(f"ran {argv}"))

    with pytest.raises(LinkUnavailable, match=said):
        Sites(1, LinkShape(rate="10mbit", delay=0.01)).create()


# -- real sites ----------------------------------------------------------------------------------


def _exchange(sites: Sites, server_at: int | None, size: int, unit: float) -> tuple[float, float]:
    """A server in site ``server_at`` (``None``: this namespace), a client in site 0: the
    shortest round trip and the seconds ``size`` bytes took."""
    if server_at is None:
        server_argv, host = [sys.executable, "-c", SERVER, "0.0.0.0"], sites.gateway(0)
    else:
        host = sites.address(server_at)
        server_argv = [*sites.prefix(server_at), sys.executable, "-c", SERVER, host]
    with subprocess.Popen([*server_argv, str(size)], stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            client = subprocess.run(
                [*sites.prefix(0), sys.executable, "-c", CLIENT, host, port, str(size)],
                capture_output=True,
                text=True,
                timeout=30 * unit,
                check=True,
            )
            assert server.wait(timeout=10 * unit) == 0
        finally:
            server.kill()
    rtt, seconds = json.loads(client.stdout)
    return rtt, seconds


def _links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.integration
def test_sites_are_held_to_their_rate_and_delay_and_removed_after(unit):
    shape = LinkShape(rate="50mbit", delay=0.02)
    size = 2_000_000

    with Sites(2, shape) as sites:
        to_root, _ = _exchange(sites, None, 1, unit)
        to_site, seconds = _exchange(sites, 1, size, unit)
        sites.ensure_running()
        made = sites.links

    assert to_root >= 2 * shape.delay  # one link, each way
    assert to_site >= 4 * shape.delay  # two links (through this namespace), each way
    assert seconds >= size / rate_bytes_per_second("50mbit") * 0.8
    assert not {link.namespace for link in made} & _namespaces()
    assert not {name for link in made for name in (link.host_if, link.site_if)} & _links()


OWNER = """
import sys, time
from benchmarks.slow_links.links import LinkShape, Sites
sites = Sites(2, LinkShape(rate="10mbit", delay=0.01))
sites.create()
print(sites.number, sites.delay_line_pid, flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_a_killed_owners_links_go_and_the_next_run_clears_the_rest(unit):
    argv = [sys.executable, "-c", OWNER]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=ENV) as owner:
        try:
            assert owner.stdout is not None
            number, _ = (int(x) for x in owner.stdout.readline().split())
        finally:
            owner.send_signal(signal.SIGKILL)
    leftovers = plan(number, 2)

    # Its delay line saw the pipe close and exited: the TUN devices went with it...
    assert _wait_for(lambda: not {link.host_if for link in leftovers} & _links(), 10 * unit)
    # ...but the namespaces stay until a run of that number deletes them.
    assert {link.namespace for link in leftovers} <= _namespaces()
    Sites(2, LinkShape(rate=None, delay=0.0), number=number).delete()
    assert not {link.namespace for link in leftovers} & _namespaces()
