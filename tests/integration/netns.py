"""A network namespace joined to this one by a veth pair: a second "machine" whose cable can be
pulled without a close.

::

    this namespace                      namespace sz<pid>
    szh<pid>  10.231.X.Y+1/30  <──veth──>  szn<pid>  10.231.X.Y+2/30

Names and subnet derive from a number (the pid by default), so parallel runs do not collide, and
a run that died before its cleanup is cleaned up by the next one with that number. Taking the
host end down (:meth:`Netns.cut`) removes its route and silences the pair: no FIN, no RST, packets
just stop — what a dead switch port, a pulled cable or a partition looks like to TCP.

Needs root (``CAP_NET_ADMIN``) and iproute2; :meth:`Netns.create` raises :class:`NetnsUnavailable`
saying so otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType
from typing import Self

__all__ = ["Netns", "NetnsUnavailable"]


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces here (not root, no ``ip``...)."""


@dataclass(frozen=True)
class Netns:
    """One namespace and its veth pair (nothing exists until :meth:`create`)."""

    name: str
    host_if: str
    inner_if: str
    host_ip: str
    inner_ip: str

    @classmethod
    def numbered(cls, n: int | None = None) -> Netns:
        """The namespace of number ``n`` (default: this process's pid)."""
        n = os.getpid() if n is None else n
        block = n % (1 << 14)  # 16384 /30 subnets of 10.231.0.0/16
        third, fourth = block >> 6, (block & 63) * 4
        return cls(
            name=f"sz{n}",
            host_if=f"szh{n}"[:15],  # IFNAMSIZ
            inner_if=f"szn{n}"[:15],
            host_ip=f"10.231.{third}.{fourth + 1}",
            inner_ip=f"10.231.{third}.{fourth + 2}",
        )

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def create(self) -> None:
        """Make the namespace, the pair and the addresses (after removing leftovers).

        Raises:
            NetnsUnavailable: not root, no ``ip``, or the kernel refused (the message says which).
        """
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable(
                f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
            )
        self.delete()
        inside = self.prefix
        steps = (
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.inner_if],
            ["ip", "link", "set", self.inner_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            [*inside, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner_if],
            [*inside, "ip", "link", "set", self.inner_if, "up"],
            [*inside, "ip", "link", "set", "lo", "up"],
        )
        try:
            for argv in steps:
                self._ip(argv)
        except NetnsUnavailable:
            self.delete()
            raise

    def cut(self) -> None:
        """Take the host end down: the link goes silent, nobody is told."""
        self._ip(["ip", "link", "set", self.host_if, "down"])

    def restore(self) -> None:
        """Bring the host end up again (its route comes back with it)."""
        self._ip(["ip", "link", "set", self.host_if, "up"])

    def delete(self) -> None:
        """Remove the pair and the namespace, if they exist (idempotent)."""
        # Deleting one end deletes the pair; the namespace goes once no process is left in it.
        for argv in (
            ["ip", "link", "del", self.host_if],
            ["ip", "netns", "del", self.name],
        ):
            subprocess.run(argv, capture_output=True, timeout=30, check=False)

    def _ip(self, argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise NetnsUnavailable(
                f"`{' '.join(argv)}` failed with status {done.returncode}: {done.stderr.strip()}"
            )

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
