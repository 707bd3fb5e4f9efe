"""Leaving a group, again and again, right after a step whose communication hook ran on gloo's
threads: the daemon neither hangs nor aborts (a fresh process, so a failure is this test's)."""

from __future__ import annotations

import subprocess
import sys

from tests.utils import UNIT

LEAVES = 80
"""Before the fix, the daemon hung or aborted within 12 to 92 leaves (4 runs of 300)."""

_JOIN_STEP_LEAVE = f"""
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from engine.group_member import GroupMember

member = GroupMember(torch.device("cpu"))
secret = "ab" * 32
for formation in range({LEAVES}):
    port = member.open_store(secret, "127.0.0.1", 10.0)
    member.join(
        "127.0.0.1", port, secret, f"{{formation}}/", backend="gloo", rank=0, world=1, timeout=10.0
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 10))
    ddp = DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(3):  # the third step compresses: the hook's closures hold the group
        ddp(torch.randn(2, 64)).sum().backward()
    del ddp, state, model
    member.leave()
print("left", formation + 1, "groups")
"""


def test_leaving_right_after_a_hooked_step_neither_hangs_nor_aborts():
    try:
        done = subprocess.run(
            [sys.executable, "-c", _JOIN_STEP_LEAVE],
            capture_output=True,
            text=True,
            timeout=60 * UNIT,
        )
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"leaving the groups hung: {hung.stdout!r}") from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"left {LEAVES} groups"
