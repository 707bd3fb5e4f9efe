"""Sites on slow links, built on this machine: network namespaces whose only link to this one is
held to a given rate and one-way delay.

::

    this namespace (forwards between sites)              namespace szl<n>-<i>
    szlh<n>-<i>  10.2xx.b.2i+1  ══ rate ══ delay ══>  szls<n>-<i>  10.2xx.b.2i+2  (default route)
                                <══ delay ══ rate ══

Each link is a pair of TUN devices, one left here and one moved into the site's namespace, with a
*delay line* between them: a process of its own (``python -m benchmarks.slow_links.links
--serve``) that reads every packet the kernel sends out of either end and writes it into the other
end :attr:`LinkShape.delay` seconds later, in order. This kernel has no ``sch_netem``, so the delay
cannot come from ``tc``; a process of its own keeps the copying off the caller's GIL. The rate is an
HTB class on the egress of both ends (here: towards the site; in the namespace: from it), so a
packet waits for the rate first and then crosses the delay. Site-to-site traffic is routed through
this namespace (``net.ipv4.ip_forward=1``, no NAT) and crosses both sites' links: twice the delay
each way, and the smaller of the two rates.

Both ends have a 9,000-byte MTU (:data:`MTU`, jumbo frames): at 100 Mbit/s that is ~1,400
packets a second for the delay line to copy, ~10% of a core. (A 65,000-byte MTU would be ~200
packets, but TCP's receive window then often stalls for seconds: a 20 MB transfer at 100mbit ran
at 6-12 MB/s from one run to the next, against a steady 11-12 MB/s at 9,000.)

The TUN devices are not persistent: they vanish with the delay line, which exits on SIGTERM or
when its parent's end of a pipe closes (the parent died or deleted the sites), and ignores SIGINT
(a Ctrl-C is the caller's to handle, and its cleanup stops the delay line).

Names and addresses derive from a number (the pid by default), so parallel runs do not collide
and a run that died before its cleanup is cleaned up by the next one with that number: the run's
block of addresses is one /24 of ``10.232.0.0/14`` (``number % 1024``), away from the
``10.231.0.0/16`` of :mod:`tests.integration.netns`.

Needs root (``CAP_NET_ADMIN``), iproute2 (``ip``, and ``tc`` for a rate) and ``/dev/net/tun``;
:meth:`Sites.create` raises :class:`LinkUnavailable` saying which is missing.

Self-check (2 sites; round trips and 20 MB transfers, printed next to what the shape implies)::

    python -m benchmarks.slow_links.links --check --rate 100mbit --delay 0.01
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = [
    "MTU",
    "DelayQueue",
    "LinkShape",
    "LinkUnavailable",
    "SiteLink",
    "Sites",
    "link_commands",
    "plan",
    "rate_bytes_per_second",
    "serve",
    "shaping_commands",
]

MTU = 9000
"""Both TUN ends' MTU: jumbo frames, few enough packets for a Python delay line to copy."""
MAX_SITES = 127
"""Sites per run: each takes two addresses of the run's /24."""

_ROOT = Path(__file__).resolve().parents[2]
_TUN = "/dev/net/tun"
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFNAMSIZ = 16  # including the NUL: names have at most 15 characters
_READS_PER_WAKE = 64  # packets read from one fd before the others get a turn


class LinkUnavailable(RuntimeError):
    """This machine cannot build the sites (not root, no ``ip``/``tc``, no ``/dev/net/tun``, or
    the kernel refused a step): the message says which."""


# -- the shape of a link -------------------------------------------------------------------------

_RATE_UNITS = {
    "": 1 / 8,
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "kibit": 1024 / 8,
    "mibit": 1024**2 / 8,
    "gibit": 1024**3 / 8,
    "tibit": 1024**4 / 8,
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "tbps": 1e12,
    "kibps": 1024.0,
    "mibps": 1024.0**2,
    "gibps": 1024.0**3,
    "tibps": 1024.0**4,
}
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def rate_bytes_per_second(rate: str) -> float:
    """The bytes per second of a ``tc`` rate (``"100mbit"``, ``"12.5mbps"``, ``"1gibit"``...).

    ``tc``'s units: ``bit`` (or a bare number) and ``bps`` (bytes!) with SI (``k``, ``m``...) or
    IEC (``ki``, ``mi``...) prefixes, any case.

    Raises:
        ValueError: not a rate ``tc`` reads, or not positive.
    """
    match = _RATE.fullmatch(rate)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. '100mbit', '1gbit', '12mbps')")
    value = float(match.group(1)) * _RATE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"a rate must be positive: {rate!r}")
    return value


@dataclass(frozen=True)
class LinkShape:
    """What every site's link is held to, in each direction."""

    rate: str | None
    """A ``tc`` rate, e.g. ``"100mbit"``; ``None``: not limited (then the delay line's copying,
    a few hundred MB/s, is the limit)."""
    delay: float
    """Seconds, one way, each direction of each site's link."""

    def __post_init__(self) -> None:
        if self.rate is not None:
            rate_bytes_per_second(self.rate)  # fails here, before anything is built
        if not (math.isfinite(self.delay) and self.delay >= 0):
            raise ValueError(f"a delay is a finite number of seconds >= 0, not {self.delay!r}")

    @property
    def bytes_per_second(self) -> float | None:
        """The rate in bytes per second (``None``: not limited)."""
        return None if self.rate is None else rate_bytes_per_second(self.rate)

    def describe(self) -> str:
        """One line for a report, e.g. ``"100mbit, 10 ms each way"``."""
        return f"{self.rate or 'unlimited'}, {self.delay * 1e3:g} ms each way"


# -- names, addresses and commands (no I/O) ------------------------------------------------------


@dataclass(frozen=True)
class SiteLink:
    """The names and addresses of one site and its link."""

    namespace: str
    host_if: str
    """The TUN end left in this namespace."""
    site_if: str
    """The TUN end moved into the site's namespace."""
    host_ip: str
    """The address of :attr:`host_if`: where the site reaches this namespace."""
    site_ip: str
    """The address of :attr:`site_if`: where everyone reaches the site."""


def plan(number: int, count: int) -> tuple[SiteLink, ...]:
    """The sites of run ``number``: ``szl<number>-<i>``, ``10.2xx.b.2i+1`` ⟷ ``10.2xx.b.2i+2``.

    Raises:
        ValueError: ``count`` not in 1..:data:`MAX_SITES`, a negative number, or a number whose
            names would not fit an interface name (15 characters).
    """
    if not 1 <= count <= MAX_SITES:
        raise ValueError(f"between 1 and {MAX_SITES} sites, not {count}")
    if number < 0:
        raise ValueError(f"a run's number is >= 0, not {number}")
    longest = f"szlh{number}-{count - 1}"
    if len(longest) >= _IFNAMSIZ:
        raise ValueError(f"run number {number} is too long for interface names ({longest!r})")
    block = number % 1024  # one /24 of 10.232.0.0/14
    net = f"10.{232 + block // 256}.{block % 256}"
    return tuple(
        SiteLink(
            namespace=f"szl{number}-{i}",
            host_if=f"szlh{number}-{i}",
            site_if=f"szls{number}-{i}",
            host_ip=f"{net}.{2 * i + 1}",
            site_ip=f"{net}.{2 * i + 2}",
        )
        for i in range(count)
    )


NETNS_ETC = Path("/etc/netns")
"""Where ``ip netns exec`` finds files it mounts over ``/etc`` in a namespace."""


def _no_dns(namespace: str) -> None:
    """Point the site's resolver at its own loopback, where nothing answers: a name lookup
    fails at once instead of waiting out the host's DNS server, which a site cannot reach
    (torch's store looks up its peers' names on connecting, and would wait 10 s for it)."""
    etc = NETNS_ETC / namespace
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def link_commands(link: SiteLink, rate: str | None, mtu: int = MTU) -> list[list[str]]:
    """The ``ip``/``tc`` commands that join ``link``'s two (open) TUN ends into a site."""
    ns, here, there = link.namespace, link.host_if, link.site_if
    inside = ["ip", "-n", ns]
    commands = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "set", there, "netns", ns],
        ["ip", "link", "set", here, "mtu", str(mtu)],
        ["ip", "addr", "add", link.host_ip, "peer", link.site_ip, "dev", here],
        ["ip", "link", "set", here, "up"],
        [*inside, "link", "set", "lo", "up"],
        [*inside, "link", "set", there, "mtu", str(mtu)],
        [*inside, "addr", "add", link.site_ip, "peer", link.host_ip, "dev", there],
        [*inside, "link", "set", there, "up"],
        [*inside, "route", "add", "default", "dev", there],
    ]
    if rate is not None:
        commands += shaping_commands(["tc"], here, rate, mtu)
        commands += shaping_commands(["tc", "-n", ns], there, rate, mtu)
    return commands


def shaping_commands(tc: list[str], dev: str, rate: str, mtu: int = MTU) -> list[list[str]]:
    """HTB holding ``dev``'s egress to ``rate``.

    The bursts are two packets or a millisecond of the rate, whichever is more: less would keep
    a fast link under its rate (the qdisc's timer has to fire between bursts), more lets a link
    outrun its rate after an idle spell. The quantum is one packet (a single class: it only has
    to be at least a packet, and under tc's "quantum is big" warning).
    """
    burst = str(max(2 * mtu, math.ceil(rate_bytes_per_second(rate) / 1000)))
    return [
        [*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        [
            *[*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb"],
            *["rate", rate, "ceil", rate, "burst", burst, "cburst", burst],
            *["quantum", str(mtu), "mtu", str(mtu)],
        ],
    ]


class DelayQueue:
    """The packets of one direction of one link, each released ``delay`` seconds after it came.

    The delay is constant, so release times are in arrival order: a FIFO, never reordered.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._items: deque[tuple[float, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, now: float, packet: bytes) -> None:
        """Take ``packet``, arrived at ``now``."""
        self._items.append((now + self.delay, packet))

    def pop_due(self, now: float) -> list[bytes]:
        """The packets whose time has come by ``now``, oldest first."""
        due = []
        while self._items and self._items[0][0] <= now:
            due.append(self._items.popleft()[1])
        return due

    def next_release(self) -> float | None:
        """When the oldest packet is due (``None``: empty)."""
        return self._items[0][0] if self._items else None


# -- the sites -----------------------------------------------------------------------------------


class Sites:
    """``count`` network namespaces, each joined to this one by a link of ``shape``.

    Nothing exists until :meth:`create` (or ``with``); :meth:`delete` (or leaving the ``with``,
    also on an exception or Ctrl-C) removes the delay line, the TUN devices and the namespaces.
    A server listening on ``0.0.0.0`` in this namespace is reached from site ``i`` at
    :meth:`gateway`; site ``j``, from anywhere, at :meth:`address`. :attr:`links` holds every
    site's names and addresses; :attr:`number` is the run's (the pid unless given).

    Programs a caller starts in a site (:meth:`prefix`) are its own to stop: one still running
    after :meth:`delete` lives on in a namespace without a link.
    """

    def __init__(self, count: int, shape: LinkShape, number: int | None = None) -> None:
        self.count = count
        self.shape = shape
        self.number = os.getpid() if number is None else number
        self.links = plan(self.number, count)
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # our end of the pipe whose closing stops the process

    # what a benchmark asks

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in site ``i``."""
        return ["ip", "netns", "exec", self.links[i].namespace]

    def address(self, i: int) -> str:
        """Site ``i``'s own address: where the other sites (and this namespace) reach it."""
        return self.links[i].site_ip

    def gateway(self, i: int) -> str:
        """This namespace's end of site ``i``'s link: where site ``i`` reaches a server here."""
        return self.links[i].host_ip

    def interface(self, i: int) -> str:
        """Site ``i``'s TUN device in its namespace (its only interface but ``lo``)."""
        return self.links[i].site_if

    @property
    def delay_line_pid(self) -> int | None:
        """The pid of the delay line (``None``: not running)."""
        return self._process.pid if self._process is not None else None

    def ensure_running(self) -> None:
        """Raise if the delay line has exited: the links are gone with it.

        Raises:
            LinkUnavailable: it exited (its status is in the message), or was never started.
        """
        if self._process is None:
            raise LinkUnavailable("the sites are not created")
        status = self._process.poll()
        if status is not None:
            raise LinkUnavailable(f"the delay line exited with status {status}: links are down")

    # lifecycle

    def create(self) -> None:
        """Build the sites (after removing leftovers of this number).

        Raises:
            LinkUnavailable: not root, no ``ip``/``tc``/``/dev/net/tun``, or a step failed (the
                message says which); whatever was built is removed first.
        """
        self._require()
        self.delete()
        try:
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")  # site to site via here
            self._start_delay_line()
            for link in self.links:
                for argv in link_commands(link, self.shape.rate):
                    _run(argv)
                _no_dns(link.namespace)
            self.ensure_running()
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        """Stop the delay line and remove the devices and namespaces of this number, ours or a
        dead run's (idempotent)."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self._process is not None:
            _stop(self._process)
            self._process = None
        # A dead run's delay line saw its pipe close and exited, taking its devices; these are
        # what a run that died halfway through create() can leave behind.
        devices, namespaces = (re.compile(rf"szl{k}{self.number}-[0-9]+") for k in ("[hs]", ""))
        for dev in _existing_links():
            if devices.fullmatch(dev):
                subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
        for ns in _existing_namespaces():
            if namespaces.fullmatch(ns):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for leftover in NETNS_ETC.glob(f"szl{self.number}-*"):
            if namespaces.fullmatch(leftover.name):
                shutil.rmtree(leftover, ignore_errors=True)

    def _require(self) -> None:
        if shutil.which("ip") is None:
            raise LinkUnavailable("the `ip` command (iproute2) is not installed")
        if self.shape.rate is not None and shutil.which("tc") is None:
            raise LinkUnavailable("the `tc` command (iproute2) is not installed; a rate needs it")
        if os.geteuid() != 0:
            raise LinkUnavailable(
                f"network namespaces and TUN devices need root (CAP_NET_ADMIN); "
                f"running as uid {os.geteuid()}"
            )
        if not os.path.exists(_TUN):
            raise LinkUnavailable(f"{_TUN} is missing: this kernel or container has no TUN")

    def _start_delay_line(self) -> None:
        """Open both ends of every link and hand them to a delay-line process.

        The devices live as long as an fd on them is open: once the process holds them, ours are
        closed and the devices die with it.
        """
        fds: list[int] = []
        lifeline_r, lifeline_w = os.pipe()
        try:
            for link in self.links:
                fds += [_open_tun(link.host_if), _open_tun(link.site_if)]
            pairs = ",".join(f"{fds[k]}:{fds[k + 1]}" for k in range(0, len(fds), 2))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(_python_path())}
            argv = [sys.executable, "-m", "benchmarks.slow_links.links", "--serve"]
            argv += ["--delay", repr(self.shape.delay), "--pairs", pairs]
            argv += ["--lifeline", str(lifeline_r)]
            self._process = subprocess.Popen(
                argv, pass_fds=[lifeline_r, *fds], stdin=subprocess.DEVNULL, env=env
            )
        except BaseException:
            os.close(lifeline_w)
            raise
        else:
            self._lifeline = lifeline_w
        finally:
            for fd in [lifeline_r, *fds]:
                os.close(fd)

    def __enter__(self) -> Self:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete()


def _python_path() -> list[str]:
    return [str(_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise LinkUnavailable(
            f"`{' '.join(argv)}` failed with status {done.returncode}: {done.stderr.strip()}"
        )


def _open_tun(name: str) -> int:
    """A new TUN device ``name`` (IFF_TUN | IFF_NO_PI: bare IP packets), open (close-on-exec)."""
    try:
        fd = os.open(_TUN, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise LinkUnavailable(f"cannot open {_TUN}: {exc}") from exc
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        raise LinkUnavailable(f"cannot create the TUN device {name}: {exc}") from exc
    return fd


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _existing_links() -> list[str]:
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return []


def _existing_namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


# -- the delay line (its own process) ------------------------------------------------------------


def serve(pairs: Sequence[tuple[int, int]], delay: float, stops: Sequence[int]) -> None:
    """Copy packets both ways between each pair of TUN fds, ``delay`` seconds late, until one of
    ``stops`` becomes readable (the lifeline's writer closed it, or a signal came).

    Sleeps in the selector until the next packet comes or is due; never spins.
    """
    selector = selectors.DefaultSelector()
    routes: list[tuple[int, DelayQueue]] = []  # (write to, packets waiting) per direction
    for a, b in pairs:
        for src, dst in ((a, b), (b, a)):
            os.set_blocking(src, False)
            queue = DelayQueue(delay)
            routes.append((dst, queue))
            selector.register(src, selectors.EVENT_READ, (dst, queue))
    for fd in stops:
        selector.register(fd, selectors.EVENT_READ, None)
    while True:
        now = time.monotonic()
        for dst, queue in routes:
            for packet in queue.pop_due(now):
                with contextlib.suppress(OSError):  # the far end is down: lost, as on a wire
                    os.write(dst, packet)
        due = [t for _, queue in routes if (t := queue.next_release()) is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        for key, _ in selector.select(timeout):
            if key.data is None:
                return
            dst, queue = key.data
            for _ in range(_READS_PER_WAKE):
                try:
                    packet = os.read(key.fd, MTU + 4096)
                except BlockingIOError:
                    break
                except OSError:  # the device went away: nothing more will come from it
                    selector.unregister(key.fd)
                    break
                queue.push(time.monotonic(), packet)


def _serve_main(args: argparse.Namespace) -> None:
    """The delay line's process: SIGTERM (through a wakeup pipe) or the lifeline stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and then stops us
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler: the wakeup pipe is written
    pairs = [tuple(int(fd) for fd in pair.split(":")) for pair in args.pairs.split(",")]
    serve([(a, b) for a, b in pairs], args.delay, [args.lifeline, woken])


# -- the self-check ------------------------------------------------------------------------------


def probe_server(host: str) -> None:
    """Serve probes on ``host`` (port printed as ``ready PORT``), one connection at a time.

    A connection's first byte says what it wants: ``e``, every byte echoed back; ``s``, the
    bytes counted until the client shuts its side, then the count sent back (8 bytes).
    """
    with socket.create_server((host, 0)) as server:
        print(f"ready {server.getsockname()[1]}", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                mode = conn.recv(1)
                if mode == b"e":
                    while data := conn.recv(1 << 16):
                        conn.sendall(data)
                elif mode == b"s":
                    total = 0
                    while data := conn.recv(1 << 20):
                        total += len(data)
                    conn.sendall(struct.pack("!Q", total))


def probe_client(host: str, port: int, mode: str, n: int) -> list[float]:
    """Against :func:`probe_server`: ``rtt``, ``n`` one-byte round trips' seconds; ``send``, the
    seconds from the first of ``n`` bytes sent to the server's count of them received."""
    with socket.create_connection((host, port), timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mode == "rtt":
            conn.sendall(b"e")
            times = []
            for _ in range(n):
                start = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                times.append(time.perf_counter() - start)
            return times
        conn.sendall(b"s")
        block = memoryview(bytes(1 << 20))
        start = time.perf_counter()
        left = n
        while left:
            left -= conn.send(block[: min(left, len(block))])
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 8 and (data := conn.recv(8 - len(reply))):
            reply += data
        if struct.unpack("!Q", reply)[0] != n:
            raise RuntimeError(f"the server counted {reply!r}, not {n} bytes")
        return [time.perf_counter() - start]


def _stdout(process: subprocess.Popen[bytes]) -> IO[bytes]:
    assert process.stdout is not None  # started with stdout=PIPE
    return process.stdout


def _module(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.slow_links.links", *args]


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check(shape: LinkShape, size: int = 20_000_000, rounds: int = 5) -> None:
    """Build 2 sites of ``shape``, print round trips and transfer rates from site 0, tear down."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(_python_path())}
    print(f"2 sites, {shape.describe()}")
    with Sites(2, shape) as sites:
        servers = [
            subprocess.Popen(_module("--probe-server", "0.0.0.0"), stdout=subprocess.PIPE, env=env),
            subprocess.Popen(
                [*sites.prefix(1), *_module("--probe-server", sites.address(1))],
                stdout=subprocess.PIPE,
                env=env,
            ),
        ]
        try:
            ports = [int(_stdout(server).readline().split()[1]) for server in servers]
            targets = {
                "site0 -> root": (sites.gateway(0), ports[0], 2),
                "site0 -> site1": (sites.address(1), ports[1], 4),
            }
            print(f"{'':16}{'measured':>13}{'expected':>13}")
            for name, (host, port, links) in targets.items():
                rtts = _probe(sites.prefix(0), env, host, port, "rtt", rounds)
                median = statistics.median(rtts) * 1e3
                print(f"{name + ' RTT':16}{median:10.1f} ms{links * shape.delay * 1e3:10.1f} ms")
            rate = shape.bytes_per_second
            for name, (host, port, _) in targets.items():
                cpu = _cpu_seconds(sites.delay_line_pid)
                (seconds,) = _probe(sites.prefix(0), env, host, port, "send", size)
                cpu = (_cpu_seconds(sites.delay_line_pid) - cpu) / seconds * 100
                expected = f"{rate / 1e6:8.2f} MB/s" if rate else "-"
                print(
                    f"{name + ' send':16}{size / seconds / 1e6:8.2f} MB/s{expected:>13}"
                    f"   ({size / 1e6:g} MB in {seconds:.2f} s; delay line {cpu:.0f}% of a core)"
                )
            sites.ensure_running()
        finally:
            for server in servers:
                server.kill()
                server.wait()
                _stdout(server).close()


def _probe(
    prefix: list[str], env: dict[str, str], host: str, port: int, mode: str, n: int
) -> list[float]:
    argv = [*prefix, *_module("--probe", host, str(port), mode, str(n))]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True)
    return [float(x) for x in json.loads(done.stdout)]


def main(argv: Sequence[str] | None = None) -> None:
    """``--check`` (the self-check), or the helpers it and :class:`Sites` start."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_links.links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="build 2 sites and measure them")
    parser.add_argument("--rate", default="100mbit", help="tc rate, or 'none' (default 100mbit)")
    parser.add_argument("--delay", type=float, default=0.01, help="one way, seconds (0.01)")
    parser.add_argument("--size", type=int, default=20_000_000, help="bytes per transfer")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", help=argparse.SUPPRESS)
    parser.add_argument("--lifeline", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe-server", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=4, metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.serve:
            _serve_main(args)
        elif args.probe_server:
            probe_server(args.probe_server)
        elif args.probe:
            host, port, mode, n = args.probe
            print(json.dumps(probe_client(host, int(port), mode, int(n))))
        elif args.check:
            try:
                shape = LinkShape(rate=None if args.rate == "none" else args.rate, delay=args.delay)
            except ValueError as exc:
                parser.error(str(exc))
            check(shape, size=args.size)
        else:
            parser.print_help()
    except LinkUnavailable as exc:
        sys.exit(f"links unavailable: {exc}")
    except KeyboardInterrupt:  # the sites are gone by now (Sites.__exit__); no traceback
        sys.exit(130)


if __name__ == "__main__":
    main()
