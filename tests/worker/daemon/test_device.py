"""``python -m worker.daemon --device cpu`` through a real supervisor, against plain torch; the
hello of an agent on ``--device cpu``."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from tests.utils import UNIT
from tests.worker.daemon.supervised import driving
from tests.worker.standin import StandIn, drive, no_process_left, running

pytestmark = pytest.mark.integration

__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind


def test_the_hello_announces_the_agents_device():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, device="cpu") as agent:
            await stand_in.next_channel()
            await asyncio.wait_for(agent.connected.wait(), 10 * UNIT)

    drive(main)
    (hello,) = stand_in.hellos
    caps = hello.capabilities
    assert (caps.device, caps.device_name, caps.device_memory_bytes) == ("cpu", "", 0)


def test_a_daemon_started_on_the_cpu_trains_like_a_plain_torch_loop():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = (x @ rng.normal(size=(3, 1))).astype(np.float32)
    torch.manual_seed(2)
    module = torch.nn.Linear(3, 1)
    reference = copy.deepcopy(module)
    lin = sz.TorchFilter(module, lr=0.1, batch_size=8, epochs=2, shuffle=False, precision="bf16")

    with driving(device="cpu") as daemon:
        argv = Path(f"/proc/{daemon.supervisor.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--device") + 1] == b"cpu"
        daemon.load(lin=lin)
        reply = daemon("batched_fit", node_ids=["lin"], x=x, y=y)

    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(2):
        for start in range(0, 50, 8):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(reference(xt[start : start + 8]), yt[start : start + 8])
            loss.backward()
            opt.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(
            torch.as_tensor(reply["states"]["lin"][key]), value, rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(
    ("device", "message"),
    [("cuda:99", "device 'cuda:99' is not on this machine; it has cpu"), ("gpu", "not a device")],
)
def test_a_daemon_refuses_a_device_it_does_not_have_at_startup(device, message):
    done = subprocess.run(
        [sys.executable, "-m", "worker.daemon", "--device", device],
        capture_output=True,
        text=True,
        timeout=60 * UNIT,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
