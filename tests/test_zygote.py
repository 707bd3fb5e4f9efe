"""The suite's zygote (:mod:`tests.zygote`): what it forks runs as the console script would have,
and what it cannot give a process is left to an exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from somatize.cli.cluster import LISTENING, wait_for
from tests import zygote
from tests.utils import UNIT

BIN = Path(sys.executable).parent


def _spawn(argv: list[str], log: Path, **env: str) -> zygote.Forked | None:
    with open(log, "ab") as out:
        return zygote.spawn(argv, {**os.environ, **env}, out.fileno(), cwd=log.parent)


def test_a_forked_coordinator_has_its_own_session_environment_folder_and_exit_status(tmp_path):
    log = tmp_path / "coordinator.log"
    argv = [str(BIN / "somatize-coordinator"), "--listen", "127.0.0.1:0"]
    forked = _spawn(argv, log, SOMATIZE_STATE_DIR="relative-state")
    assert forked is not None, "the zygote did not fork somatize-coordinator"
    try:
        wait_for(lambda: LISTENING.search(log.read_text()), 30 * UNIT, "the coordinator to listen")
        assert os.getpgid(forked.pid) == forked.pid == os.getsid(forked.pid)
        assert Path(f"/proc/{forked.pid}/cwd").resolve() == tmp_path.resolve()
        assert (tmp_path / "relative-state").is_dir()  # its environment, read in its folder
        assert forked.poll() is None
        forked.send_signal(signal.SIGTERM)
        assert forked.wait(timeout=30 * UNIT) == 0, log.read_text()
    finally:
        forked.kill()


def test_a_forked_processs_exit_code_and_killing_signal_come_back(tmp_path):
    refused = _spawn([str(BIN / "somatize-worker"), "--no-such-option"], tmp_path / "usage.log")
    assert refused is not None
    assert refused.wait(timeout=30 * UNIT) == 2  # argparse's usage error
    assert "usage: somatize-worker" in (tmp_path / "usage.log").read_text()
    dialling = [str(BIN / "somatize-worker"), "--connect", "ws://127.0.0.1:9", "--threads", "1"]
    # (what torch and OpenMP read as they load: neither is loaded in the agents' zygote)
    waiting = _spawn(dialling, tmp_path / "worker.log", OMP_NUM_THREADS="7")
    assert waiting is not None
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.5 * UNIT)  # it dials again and again
    waiting.kill()
    assert waiting.wait(timeout=30 * UNIT) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["somatize-worker", "--help"], {"PYTHONFAULTHANDLER": "1"}),
        (["somatize-worker", "--help"], {"LD_PRELOAD": "libm.so.6"}),
        (["somatize", "--help"], {"TORCH_SHOW_CPP_STACKTRACES": "1"}),
        (["somatize-coordinator", "--help"], {"OMP_NUM_THREADS": "7"}),  # torch imported
        (["ip", "netns", "exec", "ns", "somatize-worker"], {}),
        (["python", "-c", "pass"], {}),
    ],
)
def test_what_a_process_reads_as_it_starts_or_another_command_is_left_to_an_exec(
    tmp_path, argv, env
):
    argv = [str(BIN / argv[0]), *argv[1:]]
    assert _spawn(argv, tmp_path / "log", **env) is None
    assert zygote.run(argv, {**os.environ, **env}, timeout=30 * UNIT) is None


def test_a_forked_commands_output_and_status_come_back_as_subprocess_run_gives_them():
    argv = [str(BIN / "somatize"), "result", "no-such-job", "--coordinator", "ws://127.0.0.1:9"]
    # (as a test process has it once torch.compile ran in it: read when the compiler runs)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_test"}
    forked = zygote.run(argv, env, timeout=60 * UNIT)
    execd = subprocess.run(argv, capture_output=True, text=True, timeout=60 * UNIT, check=False)
    assert forked is not None, "the zygote did not fork somatize"
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        execd.returncode,
        execd.stdout,
        execd.stderr,
    )
    assert forked.returncode != 0 and forked.stderr  # it says why it could not
    assert zygote.run([str(BIN / "somatize"), "--help"], dict(os.environ), 60 * UNIT).stdout
