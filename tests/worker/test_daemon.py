"""The filter daemon and its supervisor, over real pipes to real subprocesses.

Three kinds of daemon are used, to keep the number of (torch-importing, ~1 s) spawns down:

* ``daemon`` — one long-lived supervisor for every test that leaves the daemon running;
* ``crashing`` — one supervisor the destructive tests kill, hang and restart in turn (each test
  starts by making sure it runs);
* a bare ``python -m worker.daemon`` driven by hand (``RawDaemon``) for what a well-behaved
  supervisor never sends: broken frames and a stream that cannot be read any more.

Every timeout is a multiple of ``timeout_unit()`` (``SOMATIZE_TEST_TIMEOUT_SCALE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import uvloop

import somatize as sz
from protocol.codec import decode, encode
from protocol.daemon import FitRequest
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from tests.conftest import timeout_unit
from worker.errors import DaemonCrashed, DaemonError, DaemonNotRunning, DaemonTimeout
from worker.pipe import LENGTH, FrameReader, FrameWriter
from worker.supervisor import DaemonSupervisor

pytestmark = pytest.mark.integration

UNIT = timeout_unit()


# -- filters (pickled by value into the daemon) --------------------------------------------------


class Center:
    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class CenterFilter(sz.Filter):
    """``Center`` as an SDK filter, so it can be part of a local ``Graph``."""

    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Boom:
    def fit(self, x, y=None):
        return self.explode()

    def explode(self):
        raise ValueError("boom in fit")

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
        return self.run(self.supervisor.request({"cmd": cmd, **fields}, timeout))

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
def _driving(**kwargs: Any) -> Iterator[Driver]:
    loop = uvloop.new_event_loop()
    supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, **kwargs)
    try:
        loop.run_until_complete(supervisor.start())
        yield Driver(loop, supervisor)
    finally:
        loop.run_until_complete(supervisor.close(5 * UNIT))
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


@pytest.fixture(scope="module")
def daemon() -> Iterator[Driver]:
    with _driving() as driver:
        yield driver


@pytest.fixture(scope="module")
def crashing() -> Iterator[Driver]:
    with _driving() as driver:
        yield driver


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: an init that does not reap is not ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _data(n: int = 16, d: int = 4, out: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, out, generator=g)


def _linear(d: int = 4, out: int = 3, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(d, out)


def _assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


# -- every command ------------------------------------------------------------------------------


def test_ping_answers_none_and_load_returns_the_node_ids(daemon):
    assert daemon("ping") is None
    assert daemon.load(center=Center(), boom=Boom()) == ["center", "boom"]


def test_fit_and_forward_of_a_plain_filter(daemon):
    daemon.load(center=Center())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    result = daemon("fit", node_id="center", x=x)
    assert result["rows"] == 4 and result["loss"] is None
    np.testing.assert_array_equal(result["states"]["center"]["mean"], x.mean(0))
    np.testing.assert_array_equal(daemon("forward", node_id="center", x=x), x - x.mean(0))
    state = {"mean": np.ones(3, dtype=np.float32)}
    np.testing.assert_array_equal(daemon("forward", node_id="center", x=x, state=state), x - 1)


def test_a_request_model_works_like_a_dict(daemon):
    daemon.load(center=Center())
    x = torch.ones(2, 2)
    result = daemon.run(
        daemon.supervisor.request(FitRequest(id=0, cmd="fit", node_id="center", x=x))
    )
    torch.testing.assert_close(result["states"]["center"]["mean"], torch.ones(2))


def test_chain_commands_match_local_graph_fit(daemon):
    x, y = _data(n=32)
    net = sz.TorchFilter(_linear(), lr=0.1, batch_size=8, epochs=3, seed=1)
    center, local_net = CenterFilter().named("center"), copy.deepcopy(net).named("lin")
    fitted = (center >> local_net).fit(x, y)

    daemon.load(center=CenterFilter(), lin=net)
    result = daemon("batched_fit", node_ids=["center", "lin"], x=x, y=y)
    assert result["rows"] == 32 and len(result["epoch_losses"]) == 3
    _assert_states_equal(result["states"]["lin"], fitted.states["lin"])
    torch.testing.assert_close(result["loss"], fitted.epoch_losses[-1])

    out = daemon("composite_forward", node_ids=["center", "lin"], x=x)
    torch.testing.assert_close(out, fitted.forward(x))
    with_states = daemon("composite_forward", node_ids=["center", "lin"], x=x, states=fitted.states)
    torch.testing.assert_close(with_states, fitted.forward(x))


def test_composite_fit_is_one_gradient_pass_without_a_step(daemon):
    x, y = _data()
    module = _linear()
    daemon.load(center=CenterFilter(), lin=sz.TorchFilter(module, lr=0.1))
    result = daemon("composite_fit", node_ids=["center", "lin"], x=x, y=y)
    _assert_states_equal(result["states"]["lin"], module.state_dict())

    reference = copy.deepcopy(module)
    loss = F.mse_loss(reference(x - x.mean(0)), y)
    loss.backward()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-6)
    grads = daemon("get_gradients", node_ids=["lin"])["lin"]
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_get_state_and_set_state_round_trip_plain_and_torch_states(daemon):
    x = torch.arange(8.0).reshape(4, 2)
    module = torch.nn.Linear(2, 2)
    daemon.load(center=Center(), lin=sz.TorchFilter(module))
    daemon("fit", node_id="center", x=x)

    states = daemon("get_state")
    assert set(states) == {"center", "lin"}
    _assert_states_equal(states["lin"], module.state_dict())

    changed = {
        "center": {"mean": states["center"]["mean"] + 10},
        "lin": {k: v + 1 for k, v in states["lin"].items()},
    }
    assert daemon("set_state", states=changed) is None
    again = daemon("get_state", node_ids=["center", "lin"])
    torch.testing.assert_close(again["center"]["mean"], changed["center"]["mean"])
    _assert_states_equal(again["lin"], changed["lin"])
    # What get_state returned is accepted as it is.
    daemon("set_state", states=again)
    torch.testing.assert_close(
        daemon("forward", node_id="center", x=x), x - again["center"]["mean"]
    )


def test_a_state_for_another_model_is_refused(daemon):
    daemon.load(lin=sz.TorchFilter(torch.nn.Linear(2, 2)))
    error = daemon.error("set_state", states={"lin": {"weight": torch.zeros(3, 3)}})
    assert error.code == ErrorCode.STATE_MISMATCH


# -- gradients ----------------------------------------------------------------------------------


def test_fit_leaves_autograd_gradients_and_does_not_step(daemon):
    x, y = _data()
    module = _linear()
    daemon.load(lin=sz.TorchFilter(module, lr=0.1))
    result = daemon("fit", node_id="lin", x=x, y=y)

    _assert_states_equal(daemon("get_state")["lin"], module.state_dict())  # weights unchanged
    reference = copy.deepcopy(module)
    loss = F.mse_loss(reference(x), y)
    loss.backward()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-6)
    grads = daemon("get_gradients")["lin"]
    assert set(grads) == {"weight", "bias"}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_apply_gradients_steps_and_the_read_back_shows_it(daemon):
    module = _linear()
    daemon.load(lin=sz.TorchFilter(module, optimizer="sgd", lr=0.1))
    g = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    assert daemon("apply_gradients", gradients={"lin": g}) == {"lin": 2}
    state = daemon("get_state")["lin"]
    torch.testing.assert_close(state["weight"], module.weight.detach() - 0.1 * g["weight"])
    torch.testing.assert_close(state["bias"], module.bias.detach() - 0.1 * g["bias"])


@pytest.mark.parametrize(
    ("optimizer", "options", "reference"),
    [
        ("adam", {}, lambda ps: torch.optim.Adam(ps, lr=0.01)),
        ("sgd", {"momentum": 0.9}, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
    ],
)
def test_the_optimizer_persists_across_apply_calls(daemon, optimizer, options, reference):
    module = _linear()
    daemon.load(lin=sz.TorchFilter(module, optimizer=optimizer, lr=0.01, optimizer_options=options))
    local = copy.deepcopy(module)
    opt = reference(list(local.parameters()))
    for seed in (1, 2):
        torch.manual_seed(seed)
        g = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
        daemon("apply_gradients", gradients={"lin": g})
        for name, p in local.named_parameters():
            p.grad = g[name].clone()
        opt.step()
    state = daemon("get_state")["lin"]
    for name, p in local.named_parameters():
        torch.testing.assert_close(state[name], p.detach())


def test_no_gradients_is_an_error_not_an_empty_success(daemon):
    daemon.load(
        center=Center(),
        lin=sz.TorchFilter(_linear()),
        relu=sz.TorchFilter(torch.nn.ReLU()),
    )
    assert daemon.error("get_gradients", node_ids=["lin"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("get_gradients", node_ids=["center"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("get_gradients", node_ids=["relu"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("apply_gradients", gradients={}).code == ErrorCode.NO_GRADIENTS


def test_gradients_of_another_model_are_refused_and_nothing_moves(daemon):
    module = _linear()
    daemon.load(lin=sz.TorchFilter(module, lr=0.1))
    missing = daemon.error("apply_gradients", gradients={"lin": {"weight": torch.ones(3, 4)}})
    assert missing.code == ErrorCode.GRADIENT_MISMATCH
    assert "bias" in missing.message
    shapes = daemon.error(
        "apply_gradients", gradients={"lin": {"weight": torch.ones(4, 3), "bias": torch.ones(3)}}
    )
    assert shapes.code == ErrorCode.GRADIENT_MISMATCH
    assert shapes.detail["parameter"] == "weight"
    _assert_states_equal(daemon("get_state")["lin"], module.state_dict())


def test_a_100_mb_gradient_set_ships_out_and_back(daemon):
    module = _linear(d=5000, out=5000)  # 25,005,000 float32 parameters
    daemon.load(big=sz.TorchFilter(module, lr=0.5))
    x, y = _data(n=4, d=5000, out=5000)
    daemon("fit", node_id="big", x=x, y=y)

    grads = daemon("get_gradients", timeout=30 * UNIT)["big"]
    assert sum(g.nbytes for g in grads.values()) > 100_000_000
    reference = copy.deepcopy(module)
    F.mse_loss(reference(x), y).backward()
    torch.testing.assert_close(grads["weight"], reference.weight.grad)
    torch.testing.assert_close(grads["bias"], reference.bias.grad)

    assert daemon("apply_gradients", gradients={"big": grads}, timeout=30 * UNIT) == {"big": 2}
    state = daemon("get_state", timeout=30 * UNIT)["big"]
    expected = module.weight.detach() - 0.5 * reference.weight.grad
    torch.testing.assert_close(state["weight"], expected)
    daemon.load(center=Center())  # let the daemon drop 200 MB


def test_large_frames_cross_through_shared_memory_both_ways(daemon):
    module = _linear(d=1024, out=1024)  # a 4 MB weight: over SHARED_MIN_BYTES
    daemon.load(big=sz.TorchFilter(module))
    before = daemon.supervisor.shared_bytes
    state = daemon("get_state")["big"]  # a large reply
    _assert_states_equal(state, module.state_dict())
    changed = {k: v + 1 for k, v in state.items()}
    daemon("set_state", states={"big": changed})  # a large request
    _assert_states_equal(daemon("get_state")["big"], changed)
    moved = daemon.supervisor.shared_bytes - before
    assert moved >= 3 * module.weight.nbytes  # two replies and one request, none by the pipe
    daemon.load(center=Center())


def _shared_fds() -> list[str]:
    """This process's open shared-memory regions (memfds), by their targets."""
    targets = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/memfd:somatize-"):
                targets.append(target)
    return targets


def test_a_daemons_shared_memory_goes_with_it():
    before = len(_shared_fds())
    with _driving() as driver:
        assert len(_shared_fds()) == before + 2  # one region each way
        driver.run(driver.supervisor.restart())  # a new daemon, new regions
        assert len(_shared_fds()) == before + 2
    assert len(_shared_fds()) == before


# -- user code misbehaving (the daemon stays up) ------------------------------------------------


def test_a_filter_that_raises_reports_its_traceback_and_the_daemon_answers_on(daemon):
    daemon.load(center=Center(), boom=Boom())
    error = daemon.error("fit", node_id="boom", x=[1.0])
    assert error.code == ErrorCode.FILTER_ERROR
    assert error.detail["node_id"] == "boom"
    assert error.detail["type"] == "ValueError"
    assert "boom in fit" in error.message
    assert "in explode" in error.detail["traceback"]
    assert "boom in fit" in str(error)

    chain = daemon.error("composite_fit", node_ids=["center", "boom"], x=torch.ones(2, 2))
    assert chain.detail["node_id"] == "boom"
    assert daemon("ping") is None


def test_prints_in_a_filter_do_not_touch_the_protocol(daemon):
    daemon.load(printer=Printer())
    assert daemon("fit", node_id="printer", x=[1, 2, 3])["states"] == {"printer": {"rows": 3}}
    assert daemon("forward", node_id="printer", x=[4, 5]) == [4, 5]
    assert daemon("ping") is None


def test_invalid_requests_get_typed_errors_and_the_daemon_stays(daemon):
    unknown = daemon.error("launch")
    assert unknown.code == ErrorCode.BAD_REQUEST and unknown.detail["field"] == "cmd"
    bad = daemon.error("fit", node_id=["not", "a", "string"], x=1)
    assert bad.code == ErrorCode.BAD_REQUEST and bad.detail["field"] == "node_id"
    extra = daemon.error("ping", colour="red")
    assert extra.detail["field"] == "colour"
    unknown_node = daemon.error("forward", node_id="nobody", x=1)
    assert unknown_node.code == ErrorCode.UNKNOWN_NODE
    assert daemon("ping") is None


# -- the daemon dying, hanging, orphaned -------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("sigkill", {"signal": "SIGKILL", "returncode": -signal.SIGKILL}),
        ("exit", {"returncode": 3}),
        ("segfault", {"signal": "SIGSEGV", "returncode": -signal.SIGSEGV}),
    ],
)
def test_a_filter_that_kills_its_daemon_is_a_crash_reported_at_once(crashing, how, expected):
    crashing.ensure_running()
    crashing.load(center=Center(), die=Die(how))
    pid = crashing.supervisor.pid
    assert pid is not None

    started = time.monotonic()
    with pytest.raises(DaemonCrashed) as info:
        crashing("fit", node_id="die", x=[1.0], timeout=30 * UNIT)
    assert time.monotonic() - started < 5 * UNIT  # EOF, not the timeout
    assert info.value.code == ErrorCode.DAEMON_CRASHED
    assert info.value.detail.items() >= {"cmd": "fit", "pid": pid, **expected}.items()
    assert not crashing.supervisor.running and crashing.supervisor.pid is None
    assert _gone(pid)
    with pytest.raises(DaemonNotRunning):
        crashing("ping")

    crashing.run(crashing.supervisor.restart())
    assert crashing.supervisor.pid not in (None, pid)
    # The filters are back (the load was replayed), their states are not.
    x = torch.ones(2, 2)
    torch.testing.assert_close(
        crashing("fit", node_id="center", x=x)["states"]["center"]["mean"], torch.ones(2)
    )


def test_a_hanging_filter_times_out_the_daemon_is_killed_and_restart_replays_the_load(crashing):
    crashing.ensure_running()
    crashing.load(center=Center(), hang=Hang())
    pid = crashing.supervisor.pid
    assert pid is not None

    started = time.monotonic()
    with pytest.raises(DaemonTimeout) as info:
        crashing("fit", node_id="hang", x=[1.0], timeout=UNIT)
    elapsed = time.monotonic() - started
    assert UNIT <= elapsed < 6 * UNIT
    assert info.value.code == ErrorCode.TIMEOUT
    assert info.value.detail["cmd"] == "fit"
    assert not crashing.supervisor.running
    assert _gone(pid)

    crashing.run(crashing.supervisor.restart())
    assert crashing("fit", node_id="center", x=torch.ones(2, 2))["rows"] == 2
    error = crashing.error("forward", node_id="hang", x=[1.0])  # the node is loaded again
    assert error.code == ErrorCode.NOT_FITTED


def test_cancelling_a_request_kills_the_daemon(crashing):
    crashing.ensure_running()
    crashing.load(hang=Hang())
    pid = crashing.supervisor.pid
    assert pid is not None

    async def cancel_mid_request() -> None:
        task = asyncio.ensure_future(
            crashing.supervisor.request({"cmd": "fit", "node_id": "hang", "x": [1]}, 30 * UNIT)
        )
        await asyncio.sleep(0.2 * UNIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    crashing.run(cancel_mid_request())
    crashing.wait_until(lambda: _gone(pid), 5 * UNIT)
    with pytest.raises(DaemonNotRunning):
        crashing("ping")
    crashing.run(crashing.supervisor.restart())
    assert crashing("ping") is None


def test_a_daemon_killed_while_idle_is_noticed(crashing):
    crashing.ensure_running()
    pid = crashing.supervisor.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    crashing.wait_until(lambda: not crashing.supervisor.running, 5 * UNIT)
    with pytest.raises(DaemonNotRunning) as info:
        crashing("ping")
    assert info.value.detail["signal"] == "SIGKILL"
    crashing.run(crashing.supervisor.restart())
    assert crashing("ping") is None


_ORPHANING_PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path

    from protocol.filters import dump_filter
    from worker.supervisor import DaemonSupervisor

    class Hang:
        def __init__(self, marker):
            self.marker = marker

        def fit(self, x, y=None):
            import time
            Path(self.marker).touch()
            while True:
                time.sleep(0.05)

        def forward(self, x, state):
            return x

    async def main():
        daemon = DaemonSupervisor(threads=1)
        await daemon.start()
        await daemon.request({"cmd": "load", "filters": {"hang": dump_filter(Hang(sys.argv[1]))}})
        print(daemon.pid, flush=True)
        await daemon.request({"cmd": "fit", "node_id": "hang", "x": [1]}, timeout=3600)

    asyncio.run(main())
    """
)


def test_a_daemon_whose_parent_dies_exits_even_inside_a_filter(tmp_path):
    marker = tmp_path / "inside-fit"
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHANING_PARENT, str(marker)], stdout=subprocess.PIPE
    )
    pid = None
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 30 * UNIT)
        assert ready, "the intermediate process did not report its daemon"
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 10 * UNIT
        while not marker.exists():
            assert time.monotonic() < deadline, "the daemon never entered the filter"
            time.sleep(0.02)
        parent.kill()
        parent.wait()
        assert _wait_gone(pid, 5 * UNIT), "the orphaned daemon is still running"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# -- lifecycle ----------------------------------------------------------------------------------


def test_start_ping_shutdown_on_a_plain_asyncio_loop():
    async def scenario() -> None:
        supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT)
        assert not supervisor.running and supervisor.pid is None
        with pytest.raises(DaemonNotRunning):
            await supervisor.request({"cmd": "ping"})
        async with supervisor:
            pid = supervisor.pid
            assert supervisor.running and pid is not None
            with pytest.raises(RuntimeError):
                await supervisor.start()
            assert await supervisor.request({"cmd": "shutdown"}) is None
            for _ in range(int(500 * UNIT)):
                if not supervisor.running:
                    break
                await asyncio.sleep(0.01)
            assert not supervisor.running
            with pytest.raises(DaemonNotRunning) as info:
                await supervisor.request({"cmd": "ping"})
            assert info.value.detail["returncode"] == 0  # a clean exit after the ack
        assert _gone(pid)

    asyncio.run(scenario())


def test_a_daemon_that_cannot_start_is_reported():
    async def scenario() -> None:
        missing = DaemonSupervisor(python="/nonexistent/python3")
        with pytest.raises(DaemonCrashed, match="cannot start"):
            await missing.start()
        refused = DaemonSupervisor(threads=0, default_timeout=20 * UNIT)  # --threads 0: usage error
        with pytest.raises(DaemonCrashed) as info:
            await refused.start()
        assert info.value.detail["returncode"] == 2
        await refused.close()

    asyncio.run(scenario())


# -- the bare daemon, driven by hand -------------------------------------------------------------


class RawDaemon:
    """``python -m worker.daemon`` with blocking pipes and no supervisor in the way."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.daemon", "--threads", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.reader = FrameReader()

    def send_raw(self, data: bytes) -> None:
        self.stdin.write(data)
        self.stdin.flush()

    def send(self, message: Any) -> None:
        writer = FrameWriter(encode(message))
        self.send_raw(b"".join(bytes(v) for v in writer.buffers(limit=1000)))

    def recv(self) -> dict[str, Any]:
        deadline = time.monotonic() + 20 * UNIT
        while True:
            ready, _, _ = select.select([self.stdout], [], [], max(0, deadline - time.monotonic()))
            assert ready, "no reply from the daemon"
            n = os.readv(self.stdout.fileno(), [self.reader.buffer()])
            assert n > 0, "the daemon closed its stdout"
            frame = self.reader.advance(n)
            if frame is not None:
                return decode(frame)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def raw() -> Iterator[RawDaemon]:
    daemon = RawDaemon()
    try:
        yield daemon
    finally:
        daemon.close()


def test_bad_frames_get_replies_until_the_stream_itself_breaks(raw):
    raw.send_raw(LENGTH.pack(9) + b"not json!")
    reply = raw.recv()
    assert reply["id"] == -1 and reply["error"]["code"] == ErrorCode.BAD_FRAME

    raw.send([1, 2, 3])
    assert raw.recv()["error"]["code"] == ErrorCode.BAD_REQUEST
    raw.send({"id": 7, "cmd": "fit", "node_id": 3, "x": 1})
    reply = raw.recv()
    assert reply["id"] == 7 and reply["error"]["detail"]["field"] == "node_id"

    raw.send({"id": 8, "cmd": "load", "filters": {"printer": dump_filter(Printer())}})
    assert raw.recv() == {"id": 8, "ok": True, "result": ["printer"]}
    raw.send({"id": 9, "cmd": "forward", "node_id": "printer", "x": [1.5], "state": {}})
    assert raw.recv() == {"id": 9, "ok": True, "result": [1.5]}
    raw.send({"id": 10, "cmd": "ping"})
    assert raw.recv() == {"id": 10, "ok": True, "result": None}

    # A length prefix that cannot be right: the next frame cannot be found, so it says why
    # and exits.
    raw.send_raw(LENGTH.pack(2**62))
    reply = raw.recv()
    assert reply["error"]["code"] == ErrorCode.BAD_FRAME and "broken" in reply["error"]["message"]
    assert raw.proc.wait(timeout=5 * UNIT) == 2
    assert raw.proc.stderr is not None
    stderr = raw.proc.stderr.read()
    assert b"printer: forward" in stderr and b"not a frame" in stderr


def test_eof_on_the_protocol_input_ends_the_daemon(raw):
    raw.send({"id": 1, "cmd": "ping"})
    assert raw.recv()["ok"] is True
    raw.stdin.close()
    assert raw.proc.wait(timeout=5 * UNIT) == 0
