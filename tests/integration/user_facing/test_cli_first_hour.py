"""What a new user meets first, through the real ``somatize`` command line (issue 18): cancelling
a job, Ctrl-C while following one, refusals at submit, the job list and the progress line.

One cluster for the module: a coordinator and two workers tagged ``dp`` (as the README's
``examples/digits_job.py`` wants them), stopped at the end whatever happened. Ctrl-C questions
are answered on a real pseudo-terminal.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import Cluster, wait_for
from tests.utils import UNIT, interruptible, somatize_cli

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent

SLEEPY_JOB = textwrap.dedent(
    """
    import time
    import numpy as np
    import somatize as sz

    class Sleepy(sz.Filter):
        def fit(self, x, y=None):
            time.sleep(3600)
            return {}

        def forward(self, x, state):
            return x

    x = np.zeros((8, 2), dtype=np.float32)
    graph = sz.Graph([Sleepy()])
    strategy = sz.Local(tag="dp")
    """
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("first-hour") / "state")
    try:
        c.start_coordinator()
        c.start_worker("box-1", "dp", device="cpu")
        c.start_worker("box-2", "dp", device="cpu")
        yield c
    finally:
        c.close()


@pytest.fixture
def client(live: Cluster) -> Iterator[sz.Client]:
    with sz.connect(live.url, timeout=20 * UNIT) as c:
        yield c


def _env(live: Cluster) -> dict[str, str]:
    env = {**os.environ, "SOMATIZE_COORDINATOR": live.url, "COLUMNS": "200"}
    env.pop("SOMATIZE_TOKEN", None)
    return env


def _somatize(live: Cluster, *args: str, seconds: float = 120) -> subprocess.CompletedProcess[str]:
    return somatize_cli(live.url, *args, seconds=seconds)


def _job_file(tmp_path: Path, text: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _running(client: sz.Client, job_id: str) -> None:
    wait_for(lambda: client.job(job_id).status()["state"] == "running", 60 * UNIT, "the job to run")


def _newest_running(client: sz.Client, before: set[str]) -> str:
    """The id of the job a command submitted (one not in ``before``), once it runs."""

    def found() -> str | None:
        for record in client.jobs(limit=5):
            if record["id"] not in before and record["state"] == "running":
                return str(record["id"])
        return None

    return str(wait_for(found, 60 * UNIT, "the submitted job to run"))


def _state(client: sz.Client, job_id: str) -> str:
    return str(client.job(job_id).status()["state"])


def _free_workers(live: Cluster) -> None:
    live.wait_connected("box-1")
    live.wait_connected("box-2")


# -- 1. cancel, and Ctrl-C while following ---------------------------------------------------


def test_somatize_cancel_ends_a_running_job_and_says_so(live, client, tmp_path):
    submitted = _somatize(live, "submit", "--no-wait", _job_file(tmp_path, SLEEPY_JOB))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    _running(client, job_id)

    cancelled = _somatize(live, "cancel", job_id, seconds=60)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"job {job_id} cancelled"
    assert _state(client, job_id) == "cancelled"

    again = _somatize(live, "cancel", job_id, seconds=60)
    assert again.returncode == 2
    assert f"job {job_id} already ended (cancelled): nothing to cancel" in again.stderr
    unknown = _somatize(live, "cancel", "no-such-job", seconds=60)
    assert unknown.returncode == 2 and "unknown_job" in unknown.stderr
    _free_workers(live)


class _Terminal:
    """``somatize ARGS`` on a pseudo-terminal (its stdin, stdout and stderr), as a user runs it."""

    def __init__(self, live: Cluster, *args: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            interruptible([str(BIN / "somatize"), *args]),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=_env(live),
        )
        os.close(slave)
        self.seen = b""

    def read_until(self, text: str, seconds: float) -> str:
        """What the terminal showed, once it shows ``text``."""
        deadline = time.monotonic() + seconds
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} on the terminal: {self.seen.decode(errors='replace')}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # the other side closed: the command ended
                    raise AssertionError(
                        f"the command ended before {text!r}: {self.seen.decode(errors='replace')}"
                    ) from None
        return self.seen.decode(errors="replace")

    def type(self, line: str) -> None:
        os.write(self.master, line.encode())

    def finish(self, seconds: float) -> int:
        try:
            code = self.proc.wait(timeout=seconds)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._drain()
        return code

    def _drain(self) -> None:
        """Read what is left on the terminal, then close it."""
        while True:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if not ready:
                break
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.seen += chunk
        os.close(self.master)


@pytest.mark.parametrize("answer", ["y", ""])
def test_ctrl_c_in_submit_asks_whether_to_cancel_the_job(live, client, tmp_path, answer):
    before = {r["id"] for r in client.jobs(limit=50)}
    term = _Terminal(live, "submit", _job_file(tmp_path, SLEEPY_JOB))
    job_id = _newest_running(client, before)
    term.read_until(job_id, 30 * UNIT)  # the command has the job: a Ctrl-C from now asks
    term.proc.send_signal(signal.SIGINT)
    term.read_until(f"interrupted: cancel job {job_id} too? [y/N] ", 30 * UNIT)
    term.type(answer + "\n")
    assert term.finish(30 * UNIT) == 130
    shown = term.seen.decode(errors="replace")
    if answer == "y":
        assert f"interrupted: job {job_id} cancelled" in shown
        assert _state(client, job_id) == "cancelled"
    else:
        assert f"job {job_id} goes on on the coordinator" in shown
        assert f"somatize cancel {job_id}" in shown
        assert _state(client, job_id) == "running"
        client.job(job_id).cancel()
    _free_workers(live)


def test_ctrl_c_without_a_terminal_leaves_the_job_running_without_asking(live, client, tmp_path):
    before = {r["id"] for r in client.jobs(limit=50)}
    proc = subprocess.Popen(
        interruptible([str(BIN / "somatize"), "submit", _job_file(tmp_path, SLEEPY_JOB)]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(live),
    )
    try:
        job_id = _newest_running(client, before)
        printed = proc.stdout.readline()  # the command has the job: a Ctrl-C from now is about it
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30 * UNIT)
        out = printed + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert out.strip() == job_id
    assert "too? [y/N]" not in err
    assert f"interrupted: job {job_id} goes on on the coordinator" in err
    assert _state(client, job_id) == "running"
    client.job(job_id).cancel()
    _free_workers(live)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cancel_on_exit_cancels_the_job_when_submit_stops(live, client, tmp_path, sig):
    before = {r["id"] for r in client.jobs(limit=50)}
    argv = [str(BIN / "somatize"), "submit", "--cancel-on-exit", _job_file(tmp_path, SLEEPY_JOB)]
    proc = subprocess.Popen(
        interruptible(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(live),
    )
    try:
        job_id = _newest_running(client, before)
        assert proc.stdout.readline().strip() == job_id  # the command has the job
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30 * UNIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    how = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"
    assert f"{how}: job {job_id} cancelled" in err
    assert _state(client, job_id) == "cancelled"
    _free_workers(live)


# -- 2. what graph.fit refuses is refused at submit ------------------------------------------

MLP_JOB = textwrap.dedent(
    """
    import numpy as np
    import torch
    import somatize as sz

    rng = np.random.default_rng(0)
    x = rng.normal(size=({x_rows}, 8)).astype(np.float32)
    y = rng.integers(0, 2, size={y_rows})
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(8, 2), loss="cross_entropy", batch_size=32, epochs=2)
    graph = sz.Graph([net.named("net")])
    strategy = {strategy}
    """
)


def _mlp_job(x_rows: int = 256, y_rows: int = 256, strategy: str = "sz.DataParallel(2)") -> str:
    return (
        MLP_JOB.replace("{x_rows}", str(x_rows))
        .replace("{y_rows}", str(y_rows))
        .replace("{strategy}", strategy)
    )


def test_piped_submit_prints_its_progress_as_plain_lines(live, tmp_path):
    """Without a terminal (as in CI or ``| tee log``) the bar would show nothing until the
    end: each stage and the progress come as plain lines, the progress at most once each
    ``--progress-every`` seconds, and where the job stood as it ended."""
    job_file = _job_file(tmp_path, _mlp_job(strategy="sz.DataParallel(2, collective='torch')"))
    submitted = _somatize(live, "submit", "--progress-every", "0.2", job_file)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    lines = submitted.stderr.splitlines()
    said = [line.split(": ", 1)[1] for line in lines if line.startswith(f"job {job_id}: ")]
    stages = [line.split(" ")[0].rstrip(":") for line in said]
    stages = [stage for stage in stages if stage in ("queued", "placed", "succeeded")]
    assert stages in (["queued", "placed", "succeeded"], ["placed", "succeeded"]), lines
    progress = [line for line in said if line.startswith("epoch ")]
    assert progress and progress[-1].startswith("epoch 2/2 · step 8/8"), lines
    assert "\x1b" not in submitted.stderr and "━" not in submitted.stderr  # no bar, no colour
    assert lines[-1].startswith(f"job {job_id} succeeded in ")


FLAKY_JOB = textwrap.dedent(
    """
    import numpy as np
    import torch
    import somatize as sz

    class Flaky(torch.nn.Linear):
        calls = 0  # in each daemon that loads the job: a resumed job loads it afresh

        def forward(self, x):
            type(self).calls += 1
            if type(self).calls == 7:
                raise RuntimeError("the 7th step fails")
            return super().forward(x)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.integers(0, 2, size=256)
    torch.manual_seed(0)
    net = sz.TorchFilter(Flaky(8, 2), loss="cross_entropy", batch_size=32, epochs=1)
    graph = sz.Graph([net.named("net")])
    strategy = sz.DataParallel(2, checkpoint_every=3, collective="coordinator")
    """
)


def test_a_failed_submit_names_its_checkpoint_and_submit_resume_from_goes_on(live, tmp_path):
    """The job fails at its 7th step, after its checkpoint at step 6: the failure says so and
    the command that continues it; that command trains the last 2 steps and succeeds."""
    job_file = _job_file(tmp_path, FLAKY_JOB)
    failed = _somatize(live, "submit", job_file)
    assert failed.returncode == 1, failed.stderr
    job_id = failed.stdout.strip()
    assert "the 7th step fails" in failed.stderr
    command = f"somatize submit {job_file} --resume-from {job_id}"
    assert f"its newest checkpoint is 2, at step 6 (epoch 1): {command}" in failed.stderr
    resumed = _somatize(live, *command.split()[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert "epoch 1/1 · step 8/8" in resumed.stderr


def test_x_and_y_of_different_lengths_are_refused_at_submit(live, client, tmp_path):
    before = [r["id"] for r in client.jobs(limit=50)]
    job_file = _job_file(tmp_path, _mlp_job(256, 200, 'sz.DataParallel(2, tag="dp")'))
    submitted = _somatize(live, "submit", job_file, seconds=60)
    assert submitted.returncode == 2, (submitted.stdout, submitted.stderr)
    assert submitted.stdout == ""
    assert (
        "somatize submit: [bad_request] x has 256 rows and y has 200: they must match"
        in submitted.stderr
    )
    assert "Traceback" not in submitted.stderr
    assert [r["id"] for r in client.jobs(limit=50)] == before  # never stored


# -- 3. a plain filter alone on the first pipeline stage ---------------------------------------

PIPELINE_JOB = textwrap.dedent(
    """
    import numpy as np
    from somatize.cli.demo import digits_graph
    import somatize as sz

    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=96)
    graph = digits_graph(epochs=2)
    stages = [
        sz.Partition(["standardize"], worker="box-1"),
        sz.Partition(["hidden", "head"], worker="box-2"),
    ]
    strategy = sz.ModelParallel(stages, micro_batches=2)
    """
)


def test_a_pipeline_whose_first_stage_is_a_plain_filter_trains_like_graph_fit(
    live, client, tmp_path
):
    job_file = _job_file(tmp_path, PIPELINE_JOB, "pipeline_job.py")
    submitted = _somatize(live, "submit", job_file)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert f"job {job_id} succeeded" in submitted.stderr

    from somatize.cli.job_files import load_job_file

    spec = load_job_file(job_file)
    graph, x, y = spec.graph, spec.x, spec.y
    fitted = client.job(job_id, graph).result(timeout=30 * UNIT)
    reference = graph.fit(x, y)
    for node, state in reference.states.items():
        for key, value in state.items():
            got = fitted.states[node][key]
            assert float((torch.as_tensor(got) - torch.as_tensor(value)).abs().max()) <= 1e-5


# -- 5. from a result to a model of one's own -----------------------------------------------

SCALED_JOB = textwrap.dedent(
    """
    import numpy as np
    import torch
    import somatize as sz

    class Scale(sz.Filter):
        def fit(self, x, y=None):
            return {"scale": np.abs(x).max(0) + 1e-6}

        def forward(self, x, state):
            return (np.asarray(x) / state["scale"]).astype(np.float32)

    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(4, 2), loss="cross_entropy", lr=0.5, epochs=2)
    graph = Scale().named("scale") >> net.named("linear")
    strategy = sz.Local(tag="dp")
    """
)


def test_a_result_saved_by_the_cli_loads_without_pickle_and_predicts(live, client, tmp_path):
    job_file = _job_file(tmp_path, SCALED_JOB, "scaled_job.py")
    submitted = _somatize(live, "submit", job_file)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    saved = tmp_path / "states.pt"
    result = _somatize(live, "result", job_id, "--states", "--save", str(saved), seconds=60)
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[2].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "float32" in rows["scale"] and "float32" in rows["weight"]
    assert "torch." not in result.stdout  # numpy's and torch's float32 named one way

    raw = torch.load(saved, weights_only=True)  # what a user tries first
    assert sorted(raw["states"]) == ["linear", "scale"]

    from somatize.cli.job_files import load_job_file

    spec = load_job_file(job_file)
    graph, x = spec.graph, spec.x
    loaded = sz.load(saved, graph)
    remote = client.job(job_id, graph).result(timeout=30 * UNIT)
    assert isinstance(loaded.states["scale"]["scale"], np.ndarray)  # as the filter made it
    np.testing.assert_array_equal(np.asarray(loaded.forward(x)), np.asarray(remote.forward(x)))


# -- 6. a tag no worker has --------------------------------------------------------------------


def test_a_tag_typo_is_refused_with_the_nearest_tag_unless_the_job_waits(live, client, tmp_path):
    before = [r["id"] for r in client.jobs(limit=50)]
    job_file = _job_file(tmp_path, _mlp_job(strategy='sz.DataParallel(2, tag="dpp")'))
    refused = _somatize(live, "submit", job_file, seconds=60)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert (
        "somatize submit: [no_workers] no worker answers to tag 'dpp' (did you mean 'dp'?): "
        "workers ['box-1', 'box-2'], tags ['dp']; to wait for such a worker instead, submit "
        "with wait_for_workers=SECONDS"
    ) in refused.stderr
    assert [r["id"] for r in client.jobs(limit=50)] == before  # never stored

    waited = _somatize(live, "submit", "--wait-for-workers", "1", job_file, seconds=60)
    assert waited.returncode == 1, (waited.stdout, waited.stderr)
    job_id = waited.stdout.strip()
    assert (
        f"job {job_id} failed: [no_workers] waited 1 s for its workers (wait_for_workers): no "
        "worker answers to tag 'dpp' (did you mean 'dp'?)"
    ) in waited.stderr
    queued = next(e for e in client.job(job_id).events(timeout=10 * UNIT) if e.event == "queued")
    assert queued.data == {
        "placement": "2 workers tagged 'dpp'",
        "name": "job",
        "wait_for_workers": 1.0,
    }


# -- 7. progress in words, and the job list ----------------------------------------------------


def test_submit_ends_with_the_epoch_mean_loss_and_jobs_lists_name_file_and_time(
    live, client, tmp_path
):
    job_file = _job_file(tmp_path, _mlp_job(256, 256, 'sz.DataParallel(2, tag="dp")'), "mlp.py")
    submitted = _somatize(live, "submit", job_file)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    said = next(line for line in submitted.stderr.splitlines() if "succeeded in" in line)
    # 256 rows in batches of 32: 8 steps an epoch; the loss is the last epoch's mean, which
    # graph.fit reports as its last epoch loss (DataParallel trains what it trains).
    found = re.search(r"epoch 2/2 · step 8/8 · loss ([\d.]+) \(epoch mean\) · [\d,]+ rows/s$", said)
    assert found, said
    from somatize.cli.job_files import load_job_file

    spec = load_job_file(job_file)
    graph, x, y = spec.graph, spec.x, spec.y
    assert float(found.group(1)) == pytest.approx(graph.fit(x, y).epoch_losses[-1], rel=1e-3)

    listed = subprocess.run(
        [str(BIN / "somatize"), "jobs"],
        capture_output=True,
        text=True,
        env=_env(live) | {"COLUMNS": "400"},  # the temporary file's path whole on one line
        timeout=30 * UNIT,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    cells = [c.strip() for c in row.split("│")]
    header = next(line for line in listed.stdout.splitlines() if "submitted" in line)
    names = [c.strip() for c in header.split("┃")]
    created = client.job(job_id).status()["created"]
    assert cells[names.index("name")] == "mlp"
    assert cells[names.index("file")] == job_file
    assert cells[names.index("submitted")] == time.strftime("%H:%M:%S", time.localtime(created))
    assert cells[names.index("progress")].startswith("epoch 2/2 · step 8/8 · loss")

    # The coordinator's log tells the job's life at INFO.
    log = (live.logs / "coordinator.log").read_text()
    life = [line.split(": ", 1)[1] for line in log.splitlines() if f"job {job_id}" in line]
    assert life[0] == f"job {job_id} (mlp) queued: waiting for 2 workers tagged 'dp'"
    assert life[1].startswith(f"job {job_id} placed on box-1, box-2; gradients by ")
    assert re.fullmatch(rf"job {job_id} succeeded after [\d.]+ s running", life[-1])


# -- 11. smaller things -------------------------------------------------------------------------


def test_somatize_status_does_not_import_torch(live):
    """It only talks to the coordinator: importing torch was 1.5 s of its 2 s."""
    shown = subprocess.run(
        [sys.executable, "-X", "importtime", str(BIN / "somatize"), "status"],
        capture_output=True,
        text=True,
        env=_env(live),
        timeout=60 * UNIT,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "box-1" in shown.stdout and "box-2" in shown.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in shown.stderr.splitlines()]
    assert "numpy" in imported  # (the import log is there)
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]
