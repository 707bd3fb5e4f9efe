"""docker-compose.yml and the Dockerfile: their structure, then the topology run as local
processes (no Docker).

Each service's ``command`` runs as a subprocess on loopback, in dependency order, with the
compose names mapped to this machine: the host ``coordinator`` → ``127.0.0.1``, port 8765 → a
free port, ``/state`` and ``/results`` → temporary directories, ``/jobs/`` → the directory the
job service mounts there (``./examples``), and ``${VAR:-default}`` / ``${VAR:?message}``
interpolated as compose does. The coordinator must answer its own healthcheck URL before the
workers start, the job must exit 0 and leave its states where its volume is. Every process
group is killed at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import somatize as sz
from somatize.cli.cluster import wait_for
from tests.utils import UNIT, said_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = {"coordinator", "worker-1", "worker-2", "job"}
WORKERS = ("worker-1", "worker-2")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
HEALTHZ = re.compile(r"http://(?:127\.0\.0\.1|localhost):8765/healthz")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with COMPOSE.open(encoding="utf-8") as f:
        document = yaml.safe_load(f)
    assert isinstance(document, dict)
    return document


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def healthcheck_url(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    text = test if isinstance(test, str) else " ".join(test)
    match = HEALTHZ.search(text)
    assert match, f"the coordinator's healthcheck does not GET /healthz: {text}"
    return match.group(0)


# -- structure -----------------------------------------------------------------------------------


def test_services_and_commands(compose: dict[str, Any]) -> None:
    found = services(compose)
    assert set(found) >= SERVICES
    for name in SERVICES:
        command = found[name]["command"]
        assert isinstance(command, list), f"{name}: keep the command a list"
        assert all(isinstance(arg, str) for arg in command), f"{name}: quote numbers"
    assert found["coordinator"]["command"][0] == "somatize-coordinator"
    for name in WORKERS:
        # root, to sandbox job code (a uid per daemon where bubblewrap cannot make namespaces)
        assert found[name]["user"] == "root"
        command = found[name]["command"]
        assert "--sandbox" not in command  # auto: the strongest the container allows
        assert command[0] == "somatize-worker"
        assert command[command.index("--connect") + 1] == "ws://coordinator:8765"
        assert command[command.index("--id") + 1] == name
        depends = found[name]["depends_on"]
        assert depends["coordinator"]["condition"] == "service_healthy"
    job = found["job"]
    assert job["command"][:2] == ["somatize", "submit"]
    assert job["restart"] == "no"
    assert job["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert (ROOT / "examples" / "digits_job.py").is_file()


def test_the_job_file_is_mounted_and_its_result_lands_on_a_volume(compose: dict[str, Any]) -> None:
    job = services(compose)["job"]
    command = job["command"]
    mounts = {target: source for source, target, *_ in (str(v).split(":") for v in job["volumes"])}
    assert mounts["/jobs"] == "./examples"  # read when it runs: an edit needs no rebuild
    assert command[2] == "/jobs/${SOMATIZE_JOB:-digits_job.py}"
    saved = command[command.index("--save") + 1]
    assert saved.startswith("/results/") and mounts["/results"] in compose["volumes"]
    # The workers register as the job starts: it waits for them, a bounded time.
    assert float(command[command.index("--wait-for-workers") + 1]) > 0
    assert "examples" in (ROOT / ".dockerignore").read_text().split()  # not built in


def test_every_worker_service_serves_the_job(compose: dict[str, Any]) -> None:
    """No service that nothing uses: the example job's strategy takes every worker."""
    from somatize.cli.job_files import load_job_file

    strategy = load_job_file(str(ROOT / "examples" / "digits_job.py")).strategy
    options = strategy.spec().options
    workers = [s["command"] for s in services(compose).values()]
    workers = [c for c in workers if c[0] == "somatize-worker"]
    tagged = [c for c in workers if c[c.index("--tag") + 1] == options["tag"]]
    assert len(tagged) == len(workers) == options["workers"]


def test_the_dockerfile_installs_tcmalloc_cpu_torch_and_the_dependencies_before_the_source(
    tmp_path: Path,
) -> None:
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert f"ARG TORCH_INDEX_URL={CPU_INDEX}" in lines  # the CPU build unless told otherwise
    assert "libtcmalloc-minimal4" in text  # the workers' daemons' malloc (--daemon-malloc auto)
    assert "bubblewrap" in text  # their sandbox (--sandbox auto), where namespaces are allowed
    steps = [line for line in lines if line.split(" ", 1)[0] in ("COPY", "RUN")]
    source = steps.index("COPY . /app")
    first = steps.index("COPY pyproject.toml constraints.txt /app/")
    assert all("apt-get" in step for step in steps[:first])  # system packages only, before
    deps = steps[first + 1]
    assert deps.startswith("RUN ") and source > first + 1
    assert "--no-deps" in " ".join(lines[lines.index(steps[source + 1]) :])
    # The step lists the project's dependencies from pyproject.toml alone: run its script.
    script = re.search(r'python -c "(.*?)" > /tmp/requirements.txt', deps)
    assert script, deps
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    listed = subprocess.run(
        [sys.executable, "-c", script.group(1)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert any(line.startswith("torch") for line in listed) and len(listed) >= 8


def test_coordinator_health_and_state_volume(compose: dict[str, Any]) -> None:
    coordinator = services(compose)["coordinator"]
    healthcheck_url(coordinator)
    assert "8765:8765" in [str(p) for p in coordinator["ports"]]
    mounts = [str(v).split(":") for v in coordinator["volumes"]]
    named = [source for source, target, *_ in mounts if target == "/state"]
    assert named, "the coordinator's /state is not a volume"
    assert named[0] in (compose.get("volumes") or {}), "the /state volume is not a named volume"


def test_each_worker_keeps_its_identity_key_on_a_volume_of_its_own(
    compose: dict[str, Any],
) -> None:
    workers = {n: s for n, s in services(compose).items() if s["command"][0] == "somatize-worker"}
    assert len(workers) == len(WORKERS)
    volumes = set()
    for name, service in workers.items():
        command = service["command"]
        key = command[command.index("--identity-file") + 1]
        mounts = [str(v).split(":") for v in service["volumes"]]
        (volume,) = [source for source, target, *_ in mounts if key.startswith(target + "/")]
        assert volume in (compose.get("volumes") or {}), f"{name}'s key is not on a named volume"
        volumes.add(volume)
    assert len(volumes) == len(workers), "workers share an identity volume"


def test_tokens_are_required_from_the_environment_never_written(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    values = re.findall(r"^\s*-?\s*(SOMATIZE_\w*TOKEN)\s*[:=]\s*(.*?)\s*$", text, re.MULTILINE)
    assert values, "the tokens are not passed through"
    for name, value in values:
        # ${VAR:?message}: compose stops at once when it is unset or empty, naming it.
        assert value.startswith(f"${{{name}:?") and value.endswith("}"), (name, value)
    assert "--token" not in text
    coordinator = services(compose)["coordinator"]["environment"]
    with pytest.raises(ValueError, match="set SOMATIZE_TOKEN to the clients' secret"):
        interpolate(coordinator["SOMATIZE_TOKEN"], {"SOMATIZE_TOKEN": ""})
    assert interpolate(coordinator["SOMATIZE_TOKEN"], {"SOMATIZE_TOKEN": "s3"}) == "s3"


def interpolate(value: str, env: dict[str, str]) -> str:
    """``value`` with ``${VAR:-default}`` and ``${VAR:?message}`` as compose reads them.

    Raises:
        ValueError: a ``${VAR:?message}`` whose variable is unset or empty (its message).
    """

    def one(match: re.Match[str]) -> str:
        name, how, word = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if how == ":?":
            raise ValueError(f"required variable {name} is missing a value: {word}")
        return word

    return re.sub(r"\$\{(\w+)(:-|:\?)([^}]*)\}", one, value)


# -- the topology, as local processes ----------------------------------------------------------


def order(found: dict[str, dict[str, Any]]) -> list[str]:
    """The services, each after those it depends on."""
    done: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {[*path, name]}"
        if name in done:
            return
        for dep in found[name].get("depends_on") or {}:
            visit(dep, (*path, name))
        done.append(name)

    for name in sorted(found):
        visit(name, ())
    return done


def localise(
    command: list[str], port: int, state: Path, env: dict[str, str] | None = None
) -> list[str]:
    """A service's command with the compose names (and variables) mapped to this machine."""
    argv = []
    command = [interpolate(arg, env or {}) for arg in command]
    for i, arg in enumerate(command):
        previous = command[i - 1] if i else ""
        if arg == "--peer-advertise" or previous == "--peer-advertise":
            continue  # a peer port of its choosing, announced as it is bound
        if previous == "--listen" and arg == "0.0.0.0:8765":
            arg = f"127.0.0.1:{port}"
        elif previous == "--peer-listen" and arg == "0.0.0.0:9000":
            arg = "127.0.0.1:0"
        arg = arg.replace("ws://coordinator:8765", f"ws://127.0.0.1:{port}")
        if arg == "/state":
            arg = str(state)
        elif arg.startswith("/identity/"):  # the worker's own identity volume
            worker_id = command[command.index("--id") + 1]
            arg = str(state.parent / f"identity-{worker_id}" / arg.removeprefix("/identity/"))
        elif arg.startswith("/jobs/"):  # the job service's mount of ./examples
            arg = str(ROOT / "examples" / arg.removeprefix("/jobs/"))
        elif arg.startswith("/results/"):  # its results volume
            arg = str(state.parent / "results" / arg.removeprefix("/results/"))
        argv.append(arg)
    argv[0] = str(BIN / argv[0])
    assert not any(
        "coordinator:" in a or "0.0.0.0" in a or a.startswith(("/jobs", "/identity")) for a in argv
    )
    return argv


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


CLIENT_TOKEN, WORKER_TOKEN = "client-secret-for-the-test", "worker-secret-for-the-test"


def listed(url: str, worker_ids: list[str]) -> bool:
    with sz.connect(url, token=CLIENT_TOKEN, timeout=10) as client:
        states = {w["id"]: w.get("state") for w in client.status()["workers"]}
    return all(states.get(w) == "idle" for w in worker_ids)


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=10 * UNIT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10 * UNIT)
    for proc in procs.values():  # the daemons of each session too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def spawned() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        yield procs
    finally:
        stop(procs)


def test_topology_runs_the_job(compose: dict[str, Any], tmp_path: Path) -> None:
    found = services(compose)
    port = 0  # the coordinator binds one and says which (read below), then the rest dial it
    url = "ws://127.0.0.1:0"
    state = tmp_path / "state"
    logs = tmp_path / "logs"
    logs.mkdir()
    # As `docker compose` would pass them from the environment or an .env file.
    env = {
        **os.environ,
        "SOMATIZE_COORDINATOR": url,
        "SOMATIZE_TOKEN": CLIENT_TOKEN,
        "SOMATIZE_WORKER_TOKEN": WORKER_TOKEN,
    }
    started = time.monotonic()

    def log_of(name: str) -> str:
        path = logs / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    with spawned() as procs:

        def alive_and(ready: bool) -> bool:
            for other, proc in procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{other} exited {proc.returncode}:\n{log_of(other)}")
            return ready

        def up_at(health: str) -> bool:
            return alive_and(healthy(health))

        servers = [name for name in order(found) if name != "job"]
        assert servers[0] == "coordinator", servers  # the others are told its port
        for name in servers:
            argv = localise(found[name]["command"], port, state)
            with (logs / f"{name}.log").open("ab") as log:
                procs[name] = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            if name == "coordinator":
                port = said_port(procs[name], logs / f"{name}.log", 60)
                url = env["SOMATIZE_COORDINATOR"] = f"ws://127.0.0.1:{port}"
                health = healthcheck_url(found["coordinator"]).replace(":8765/", f":{port}/")
                wait_for(functools.partial(up_at, health), 60 * UNIT, "/healthz")
        workers = [name for name in servers if name != "coordinator"]
        assert sorted(workers) == sorted(WORKERS)
        wait_for(lambda: alive_and(listed(url, workers)), 60 * UNIT, "the workers")

        argv = localise(found["job"]["command"], port, state, env)
        (state.parent / "results").mkdir()
        job = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=180 * UNIT,
            check=False,
        )
        output = (job.stdout + job.stderr).decode(errors="replace")
        assert job.returncode == 0, output
        job_id = job.stdout.decode().split()[0]

        jobs = subprocess.run(
            [str(BIN / "somatize"), "jobs", "--coordinator", url],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={**env, "COLUMNS": "200"},
            timeout=30 * UNIT,
            check=False,
        )
        table = jobs.stdout.decode(errors="replace")
        assert jobs.returncode == 0, table + jobs.stderr.decode(errors="replace")
        rows = [line for line in table.splitlines() if job_id in line]
        assert rows and "succeeded" in rows[0], table
        assert "data_parallel" in rows[0], table
        # The result, where the results volume is: it loads without pickle, as the graph.
        from somatize.cli.job_files import load_job_file

        graph = load_job_file(str(ROOT / "examples" / "digits_job.py")).graph
        fitted = sz.load(state.parent / "results" / "states.pt", graph)
        assert fitted.graph.node_ids == ["standardize", "hidden", "head"]
    print(f"compose topology ran its job in {time.monotonic() - started:.1f} s")
