"""worker.confinement.sandbox and sandbox_root, the logic: which directories a root agent covers so
that an unprivileged uid reaches the environment, what bubblewrap is told, and a daemon's
process tree put in its cgroup whole (the sandbox itself, on live workers:
tests/integration/security/test_sandbox.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from worker.confinement.cgroup import CgroupParent
from worker.confinement.procfs import descendants, exited
from worker.confinement.sandbox import Sandbox, SandboxRefused, choose
from worker.confinement.sandbox_root import Cover, plan, script
from worker.supervision.start import enter


def test_only_directories_others_cannot_enter_are_covered_each_keeping_its_paths():
    closed = {"/root", "/home/ann", "/tmp/pytest-of-root"}
    paths = [
        "/root/.pyenv/versions/3.11.7",
        "/root/.pyenv/versions/3.11.7/lib",  # inside a kept one: comes with it
        "/root/work/.venv",
        "/usr/lib/python3",  # reachable: not covered
        "/tmp/pytest-of-root/t0/data.npz",
        "/home/ann/src",
    ]
    covers = plan(paths, lambda d: d not in closed)
    assert covers == [
        Cover("/home/ann", ("/home/ann/src",)),
        Cover("/root", ("/root/.pyenv/versions/3.11.7", "/root/work/.venv")),
        Cover("/tmp/pytest-of-root", ("/tmp/pytest-of-root/t0/data.npz",)),
    ]
    assert plan(["/usr/lib/python3", "/work/main"], lambda d: True) == []


def test_a_cover_is_made_with_its_paths_bound_before_and_moved_back_after():
    text = script([Cover("/root", ("/root/.pyenv",))], "/tmp/staging")
    lines = text.splitlines()
    bind = lines.index("mount --rbind /root/.pyenv /tmp/staging/0-0")
    cover = lines.index("mount -t tmpfs -o mode=0755 somatize-cover /root")
    move = lines.index("mount --move /tmp/staging/0-0 /root/.pyenv")
    assert bind < cover < move
    assert lines[-2:] == ["echo ready", "read -r _ || true"]


def test_a_root_agents_bubblewrap_runs_as_a_uid_of_its_own_with_no_capability(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret")
    keys = tmp_path / "keys"
    keys.mkdir()
    sandbox = Sandbox(
        "bwrap",
        hidden=(str(token), str(tmp_path / "absent")),
        hidden_folders=(str(keys),),
        unprivileged=True,
        network=False,
    )
    options = sandbox.bwrap_options(61007, 61007, "", tmpfs_bytes=1 << 30)
    said = " ".join(options)
    for wanted in (
        "--unshare-user --uid 61007 --gid 61007 --disable-userns",
        "--cap-drop ALL",
        "--unshare-cgroup-try",
        "--unshare-net",
        f"--size {1 << 30} --tmpfs /tmp --size {1 << 30} --tmpfs /dev/shm",
        f"--ro-bind /dev/null {token}",
        f"--tmpfs {keys}",
    ):
        assert wanted in said
    assert "absent" not in said  # nothing to mask where there is no file
    assert "--unshare-net" not in " ".join(Sandbox("bwrap").bwrap_options(1000, 1000))


def test_a_launch_waits_at_bubblewraps_gate_and_a_uid_launch_needs_none():
    launch = Sandbox("bwrap", unprivileged=False).launch(["python", "-m", "worker.daemon"], {})
    assert launch.gate is not None and launch.release is not None
    at = launch.argv.index("--block-fd")
    assert launch.argv[at + 1] == str(launch.gate)
    assert launch.argv[-4:] == ["--", "python", "-m", "worker.daemon"]
    os.close(launch.gate)
    os.close(launch.release)
    plain = Sandbox("none").launch(["python"], {"A": "1"})
    assert plain.argv == ["python"] and plain.options == {"env": {"A": "1"}}
    assert plain.gate is None


def test_an_unknown_level_is_refused_naming_the_levels():
    with pytest.raises(SandboxRefused, match="--sandbox takes one of auto, bwrap, uid, none"):
        choose("chroot")


ZOMBIE_PARENT = """
import os, sys, time
child = os.fork()
if child == 0:
    os._exit(0)  # exits at once; never reaped while the parent waits at its gate
print(child, flush=True)
time.sleep(30)
"""


def test_a_zombie_below_the_process_is_left_out_not_waited_for():
    """A child that exited and waits for its parent to reap it can never be moved (the
    kernel takes the write and moves nothing): ``enter`` returns, the parent inside, rather
    than waiting for it for ever (a daemon's parent reaps only once past the gate)."""
    found = CgroupParent.find()
    assert not isinstance(found, str), found
    cgroup = found.new()
    assert cgroup is not None
    parent = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_PARENT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        zombie = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while not exited(zombie) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exited(zombie) and zombie in descendants(parent.pid)
        began = time.monotonic()
        assert enter(cgroup, parent.pid, seconds=30)
        assert time.monotonic() - began < 5  # not the 30 s of waiting for the zombie
        assert cgroup.pids() == [parent.pid]
    finally:
        parent.kill()
        parent.communicate(timeout=10)  # reaped, its pipe closed
        cgroup.remove()
        found.remove()


def test_a_process_and_what_it_forked_already_are_put_in_the_cgroup_whole():
    found = CgroupParent.find()
    assert not isinstance(found, str), found
    cgroup = found.new()
    assert cgroup is not None
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(descendants(shell.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert enter(cgroup, shell.pid)
        assert sorted(cgroup.pids()) == sorted([shell.pid, *descendants(shell.pid)])
    finally:
        cgroup.remove()
        shell.wait()
        found.remove()
