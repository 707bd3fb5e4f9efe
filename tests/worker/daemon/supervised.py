"""Filter daemons under a real :class:`~worker.supervision.supervisor.DaemonSupervisor`, for the
tests.

A test module keeps one long-lived supervisor (:func:`driving` in a module-scoped fixture) to
keep the number of (torch-importing, ~1 s) spawns down; the filters here are pickled by value
into the daemon.

Every timeout is a multiple of ``timeout_unit()`` (``SOMATIZE_TEST_TIMEOUT_SCALE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop

from protocol.filters import dump_filter
from tests.utils import UNIT
from worker.errors import DaemonError
from worker.supervision.supervisor import DaemonSupervisor

# -- filters (pickled by value into the daemon) --------------------------------------------------


class Center:
    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Draw:
    """Draws from the generators a job that seeds nothing uses: torch's and numpy's global."""

    def fit(self, x, y=None):
        import numpy as np
        import torch

        return {"torch": torch.rand(4), "numpy": torch.as_tensor(np.random.rand(4))}

    def forward(self, x, state):
        return x


class Printer:
    """Writes to stdout every way it can: print, sys.stdout, and fd 1 directly (as C code would)."""

    def fit(self, x, y=None):
        print("printer: hello from print()")
        sys.stdout.write("printer: " + "x" * 200_000 + "\n")  # more than a pipe holds
        sys.stdout.flush()
        os.write(1, b"printer: hello from fd 1\n")
        return {"rows": len(x)}

    def forward(self, x, state):
        print("printer: forward")
        os.write(1, b"\x00\x00\x00\x00\x00\x00\x00\x00 not a frame\n")
        return x


class Hang:
    def __init__(self, marker: str | None = None):
        self.marker = marker

    def fit(self, x, y=None):
        if self.marker:
            Path(self.marker).touch()
        while True:
            time.sleep(0.05)

    def forward(self, x, state):
        return x


class Die:
    """Ends its own process the way user code can."""

    def __init__(self, how: str):
        self.how = how

    def fit(self, x, y=None):
        if self.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.how == "exit":
            os._exit(3)
        elif self.how == "segfault":
            ctypes.string_at(0)
        time.sleep(60)

    def forward(self, x, state):
        return x


# -- harness ----------------------------------------------------------------------------------


class Driver:
    """A supervisor on its own event loop, driven from synchronous tests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, supervisor: DaemonSupervisor) -> None:
        self.loop = loop
        self.supervisor = supervisor

    def run(self, awaitable: Any) -> Any:
        return self.loop.run_until_complete(awaitable)

    def __call__(self, cmd: str, timeout: float | None = None, **fields: Any) -> Any:
        return self.run(self.supervisor.request_dict({"cmd": cmd, **fields}, timeout))

    def load(self, **filters: Any) -> list[str]:
        return self("load", filters={k: dump_filter(f) for k, f in filters.items()})

    def error(self, cmd: str, **fields: Any) -> DaemonError:
        with pytest.raises(DaemonError) as info:
            self(cmd, **fields)
        assert type(info.value) is DaemonError, "a reply from a live daemon"
        return info.value

    def ensure_running(self) -> None:
        if not self.supervisor.running:
            self.run(self.supervisor.restart())

    def wait_until(self, predicate: Callable[[], bool], seconds: float) -> None:
        """Let the loop run until ``predicate()`` holds (EOF and reaping are loop callbacks)."""
        deadline = time.monotonic() + seconds
        while not predicate():
            assert time.monotonic() < deadline, "timed out waiting"
            self.run(asyncio.sleep(0.01))


@contextlib.contextmanager
def driving(**kwargs: Any) -> Iterator[Driver]:
    loop = uvloop.new_event_loop()
    supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, **kwargs)
    try:
        loop.run_until_complete(supervisor.start())
        yield Driver(loop, supervisor)
    finally:
        loop.run_until_complete(supervisor.close(5 * UNIT))
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: an init that does not reap is not ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def make_data(n: int = 16, d: int = 4, out: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, out, generator=g)


def make_linear(d: int = 4, out: int = 3, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(d, out)


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


class Collect:
    """Runs a full collection, then says what the collector tracks, what it leaves alone
    (``gc.freeze``) and how much of its memory is the process's own (private pages)."""

    def fit(self, x, y=None):
        import gc
        from pathlib import Path

        import torch

        gc.collect()
        rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
        private = sum(int(line.split()[1]) for line in rollup if line.startswith("Private_"))
        return {
            "frozen": torch.tensor(gc.get_freeze_count()),
            "tracked": torch.tensor(len(gc.get_objects())),
            "private_kib": torch.tensor(private),
        }
