"""Your own model, the ways its user trains it: ``examples/gpt2_job.py`` (a GPT-2 with its own
byte-level BPE tokenizer on the standard library's sources, written as a Hugging Face user
writes one) with ``sz.DataParallel(2)`` on two local workers, submitted through ``sz.connect``
and with ``somatize submit``, and with torch DDP as ``torchrun`` runs it; their wall times,
validation losses and memory. ``--model char_lm``: the same for ``examples/char_lm_job.py``, a
character-level transformer LM.

``python -m benchmarks.own_model [--model gpt2|char_lm] [--steps N] [--rows R] [--plain]
[--write]`` sizes the job file through its environment (``GPT2_STEPS`` = N optimizer steps,
default :data:`STEPS` = 60 of 64 rows, one epoch, validated every N/3;
``GPT2_ROWS``/``CHAR_LM_ROWS`` = R training windows, one epoch) and trains it each way, each in
a process of its own that this one starts (none of them sees another's pages):

- *ours, sz.connect*: a process loads the job file as ``somatize submit`` does
  (:func:`somatize.cli.job_files.load_job_file`), starts a
  :class:`~somatize.cli.cluster.LocalCluster` (a real coordinator and 2 real workers, ``--threads
  1`` each, each keeping a spare filter daemon), waits until they are idle, connects and submits the
  file's graph, data, validation and strategy; the time is the client's, submit to result. That
  process is the client.
- *ours, somatize submit*: a process starts the same cluster, waits until it is idle and runs
  ``somatize submit FILE --coordinator URL``; the time is that command's, start to exit (its
  interpreter, imports and the file's loading included). The command is the client; the
  process holding the cluster is not counted.
- *anchor*: ``torchrun --nproc-per-node 2`` starts 2 ranks of 1 thread over gloo; each loads
  the job file and trains ``DistributedDataParallel`` of its model, with its own optimizer and
  schedule (a GPT-2 user's AdamW and warmup-cosine; the char LM's named AdamW and cosine,
  written here), clipping, on its half of every global batch (the batching rule:
  :func:`plan`); rank 0 evaluates the validation windows where ours does (an epoch's end,
  every ``validate_every`` steps) while rank 1 waits at the next all-reduce, as ours does on
  replica 0. The time is torchrun's, start to exit; its processes the launcher and the ranks.
- *plain loop* (``--plain``): the anchor's loop in one process of 2 threads; the time is the
  loop's.

While each runs, a thread here polls ``/proc`` every 0.2 s for the process tree below the
process it started and keeps each process's peak resident set (``VmHWM``, the kernel's own
high-water mark, so a peak between two polls is not missed) and the largest proportional set
size it sampled (``Pss`` of ``smaps_rollup``, every second: a page shared by several
processes, as the fork server's pages are by the daemons it forks, counted once over them).
The summed peak of a way is the sum of its processes' ``VmHWM``. Their CPU time, read on
the same polls, tells what the rest of the machine did meanwhile: the table's *other load*,
the cores kept busy by processes outside the benchmark (the noise). The validation losses of
every way agree to float rounding (the same batches, the same steps). Targets: ours ≤ 1.05 ×
the anchor's wall time, each way; ours ≤ 1.3 × the anchor's summed peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.periodic import Periodic
from benchmarks.report import Row, Target, machine, now, with_section
from somatize.cli.job_files import JobFile, load_job_file
from worker.confinement.procfs import descendants

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "docs" / "benchmarks.md"
TIME_TARGET = 1.05
"""Ours must take at most this many times the DDP anchor's wall time (each submit path)."""
MEMORY_TARGET = 1.3
"""Ours may hold at most this many times the DDP anchor's summed peak memory."""
POLL = 0.2
"""Seconds between two polls of ``/proc``."""
PSS_EVERY = 5
"""Every how many polls the proportional set sizes are read (``smaps_rollup`` walks the page
tables: dearer than ``status``)."""


@dataclass(frozen=True)
class Example:
    """A job file this benchmark trains, and the environment variables that size it."""

    path: Path
    node: str
    rows_env: str
    steps_env: str | None
    validate_env: str | None
    title: str


EXAMPLES = {
    "gpt2": Example(
        ROOT / "examples" / "gpt2_job.py",
        "gpt2",
        "GPT2_ROWS",
        "GPT2_STEPS",
        "GPT2_VALIDATE_EVERY",
        "GPT-2",
    ),
    "char_lm": Example(
        ROOT / "examples" / "char_lm_job.py", "char_lm", "CHAR_LM_ROWS", None, None, "char LM"
    ),
}
EXAMPLE = EXAMPLES["char_lm"].path
"""The job file :func:`load` and :func:`_example` take by default."""
STEPS = 60
"""The GPT-2's steps unless ``--steps`` or ``--rows`` says (about 2 s each on 2 cores: the
three ways in about 8 minutes; the file's own 300 would take 35)."""


# -- the job file and its training ------------------------------------------------------------


def sizes(example: Example, rows: int | None, steps: int | None) -> dict[str, str]:
    """The environment that sizes ``example``: ``rows`` training windows, ``steps`` steps
    (validated every third of them)."""
    if steps is not None and example.steps_env is None:
        raise SystemExit(f"the {example.title} takes --rows, not --steps (one epoch)")
    env = {example.rows_env: str(rows)} if rows is not None else {}
    if steps is not None and example.steps_env is not None:
        env[example.steps_env] = str(steps)
        if example.validate_env is not None:
            env[example.validate_env] = str(max(1, steps // 3))
    return env


def load(rows: int | None, example: Example = EXAMPLES["char_lm"]) -> JobFile:
    """The job file, with ``rows`` training windows (default: its own)."""
    os.environ.update(sizes(example, rows, None))
    return load_job_file(str(example.path))


def trained_filter(spec: JobFile) -> Any:
    """The job file's one TorchFilter."""
    (net,) = (f for _, f in spec.graph.items())
    return net


def settings(spec: JobFile) -> dict[str, Any]:
    """What the job file's TorchFilter trains with."""
    net = trained_filter(spec)
    return {
        "lr": net.lr,
        "batch": net.batch_size,
        "epochs": net.epochs,
        "seed": net.seed,
        "clip": net.clip_grad_norm,
    }


def plan(rows: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The global batches: one seeded permutation an epoch, cut in order (the batching rule)."""
    order = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(rows, generator=order)
        out += [perm[s : s + batch] for s in range(0, rows, batch)]
    return out


def tensors(data: Any) -> Any:
    """An array as a tensor; a ``datasets.Dataset``'s columns as a dict of tensors."""
    if data is None or isinstance(data, torch.Tensor):
        return data
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data)
    columns = data.with_format("numpy")
    return {name: torch.from_numpy(np.asarray(columns[name])) for name in data.column_names}


def training_data(spec: JobFile) -> tuple[Any, Any, Any, Any]:
    """``x``, ``y``, ``x_val`` and ``y_val`` as tensors (a dataset's as dicts, no labels)."""
    validation = spec.validation
    x_val, y_val = validation if isinstance(validation, tuple) else (validation, None)
    return tensors(spec.x), tensors(spec.y), tensors(x_val), tensors(y_val)


def rows_in(x: Any) -> int:
    """The rows of a tensor or of a dict of row-aligned tensors."""
    return len(next(iter(x.values())) if isinstance(x, dict) else x)


def run_plan(spec: JobFile, rows: int) -> list[torch.Tensor]:
    """The global batches of a run over ``rows`` rows: :func:`plan`, stopped at ``max_steps``."""
    config, net = settings(spec), trained_filter(spec)
    batches = plan(rows, config["batch"], config["epochs"], config["seed"])
    return batches[: net.max_steps] if net.max_steps else batches


def evaluated_after(step: int, per_epoch: int, total: int, every: int | None) -> bool:
    """Whether the model is evaluated after ``step``: where an epoch ends (the run's last step
    included) and every ``every`` steps (``validate_every``)."""
    return step == total or step % per_epoch == 0 or bool(every and step % every == 0)


def lm_loss(model: torch.nn.Module, x: Any, y: Any, rows: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of ``rows``: the model's own given ``labels`` (a dict batch, no
    ``y``), else the cross-entropy of its ``(batch, time, vocab)`` logits against ``y``."""
    if y is None:
        return model(**{name: column[rows] for name, column in x.items()}).loss  # type: ignore[no-any-return]
    logits = model(x[rows])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[rows].reshape(-1))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, x: Any, y: Any, batch: int) -> float:
    """The mean token loss over the validation windows, ``batch`` rows at a time, each batch's
    mean weighted by its rows."""
    model.eval()
    rows = len(next(iter(x.values())) if isinstance(x, dict) else x)
    total = 0.0
    for s in range(0, rows, batch):
        part = torch.arange(s, min(s + batch, rows))
        total += float(lm_loss(model, x, y, part)) * len(part)
    model.train()
    return total / rows


Recipe = Callable[[list[torch.nn.Parameter]], tuple[torch.optim.Optimizer, Any]]


def recipe_of(spec: JobFile) -> Recipe | None:
    """The job file's own optimizer and schedule, where it gives them as functions (what its
    user's torchrun script calls); ``None``: the named AdamW and cosine (:func:`train_steps`)."""
    net = trained_filter(spec)
    if not (callable(net.optimizer) and callable(net.scheduler)):
        return None

    def made(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
        optimizer = net.optimizer(params)
        return optimizer, net.scheduler(optimizer)

    return made


def train_steps(
    model: torch.nn.Module,
    x: Any,
    y: Any,
    batches: list[torch.Tensor],
    config: dict[str, Any],
    part: tuple[int, int] = (0, 1),
    *,
    recipe: Recipe | None = None,
    evaluate: Callable[[int], None] | None = None,
) -> None:
    """The optimizer and schedule of ``recipe`` (default AdamW at ``config["lr"]`` and a cosine
    schedule over every step) and clipping, on ``batches``; with ``part`` ``(rank, world)``
    each step takes that replica's slice of its batch (``np.array_split``). ``evaluate`` is
    called with each step's number once it is taken."""
    params = list(model.parameters())
    if recipe is None:
        opt = torch.optim.AdamW(params, lr=config["lr"])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(batches))
    else:
        opt, schedule = recipe(params)
    rank, world = part
    model.train()
    for step, rows in enumerate(batches, 1):
        mine = torch.from_numpy(np.array_split(rows.numpy(), world)[rank])
        loss = lm_loss(model, x, y, mine)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"])
        opt.step()
        schedule.step()
        if evaluate is not None:
            evaluate(step)


def _example(path: Path = EXAMPLE) -> dict[str, Any]:
    import runpy

    return runpy.run_path(str(path), run_name="benchmark")


def _train_here(spec: JobFile, part: tuple[int, int], model: torch.nn.Module) -> dict[str, Any]:
    """The anchor's loop on ``model`` (DDP's or a plain one), the validations on rank 0:
    ``{"validations": [[step, loss], ...], "val_loss": the last}`` there, ``{}`` elsewhere."""
    config, every = settings(spec), trained_filter(spec).validate_every
    x, y, x_val, y_val = training_data(spec)
    batches = run_plan(spec, rows_in(x))
    per_epoch = -(-rows_in(x) // config["batch"])
    plain = getattr(model, "module", model)
    scores: list[list[float]] = []

    def evaluate(step: int) -> None:
        if part[0] == 0 and evaluated_after(step, per_epoch, len(batches), every):
            scores.append([step, validation_loss(plain, x_val, y_val, config["batch"])])

    train_steps(model, x, y, batches, config, part, recipe=recipe_of(spec), evaluate=evaluate)
    return {"validations": scores, "val_loss": scores[-1][1]} if scores else {}


# -- the ways, each in a process of its own ---------------------------------------------------


@contextlib.contextmanager
def _cluster() -> Iterator[Any]:
    """A coordinator and 2 workers of 1 thread, each keeping a spare daemon, once they are
    idle: as a cluster stands when its user submits (not still warming its spares up)."""
    from somatize.cli.cluster import LocalCluster

    with LocalCluster(job_threads=1, heartbeat_interval=1.0, heartbeat_timeout=30.0) as cluster:
        cluster.start_coordinator()
        for worker in ("w1", "w2"):
            cluster.start_worker(worker, threads=1)
        _settle()
        yield cluster


def _settle(idle: float = 0.05, seconds: float = 60.0) -> None:
    """Wait (at most ``seconds``) until the processes below this one use less than ``idle``
    of a core over a second, twice in a row."""

    def used() -> float:
        return sum(_cpu_s(pid) for pid in descendants(os.getpid()))

    quiet, last, deadline = 0, used(), time.monotonic() + seconds
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
        now = used()
        quiet = quiet + 1 if now - last < idle else 0
        last = now


def _scores(history: list[dict[str, Any]], validations: list[dict[str, Any]]) -> dict[str, Any]:
    """A job's validation losses: ``[step, loss]`` between epoch ends (``validations``),
    ``[epoch, loss]`` at each epoch's end (``epochs``: :func:`run` finds their steps), and the
    last."""
    ends = [r for r in history if "val_loss" in r]
    return {
        "validations": [[int(r["step"]), float(r["val_loss"])] for r in validations],
        "epochs": [[int(r["epoch"]), float(r["val_loss"])] for r in ends],
        "val_loss": float(ends[-1]["val_loss"]),
    }


def _way_connect(example: Example) -> dict[str, Any]:
    import somatize as sz

    spec = load_job_file(str(example.path))
    with _cluster() as cluster, sz.connect(cluster.url, timeout=60) as client:
        started = time.perf_counter()
        job = client.submit(
            spec.graph, spec.x, spec.y, spec.strategy, spec.validation, name=spec.name
        )
        fitted = job.result(timeout=3600)
        wall = time.perf_counter() - started
    return {"wall_s": wall, **_scores(fitted.history, fitted.validations)}


def _way_cli(example: Example) -> dict[str, Any]:
    import somatize as sz
    from somatize.cli.cluster import BIN
    from somatize.cli.curves import history_of, validations_of

    with _cluster() as cluster:
        argv = [str(BIN / "somatize"), "submit", str(example.path), "--coordinator", cluster.url]
        started = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr}")
        job_id = done.stdout.split()[0]
        with sz.connect(cluster.url, timeout=60) as client:
            record = client.job(job_id).status()
    return {"wall_s": wall, **_scores(history_of(record), validations_of(record))}


def _way_rank(example: Example) -> dict[str, Any]:
    """One DDP rank, as ``torchrun`` starts it (``RANK``, ``WORLD_SIZE``, ``MASTER_*``)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spec = load_job_file(str(example.path))
    model = torch.nn.parallel.DistributedDataParallel(trained_filter(spec).module)
    started = time.perf_counter()
    scores = _train_here(spec, (rank, world), model)
    trained = time.perf_counter() - started
    dist.destroy_process_group()
    return {"train_s": trained, **scores} if rank == 0 else {}


def _way_plain(example: Example) -> dict[str, Any]:
    torch.set_num_threads(2)
    spec = load_job_file(str(example.path))
    started = time.perf_counter()
    scores = _train_here(spec, (0, 1), trained_filter(spec).module)
    return {"wall_s": time.perf_counter() - started, **scores}


WAYS: dict[str, Callable[[Example], dict[str, Any]]] = {
    "connect": _way_connect,
    "cli": _way_cli,
    "rank": _way_rank,
    "plain": _way_plain,
}


def _way_main(way: str, example: Example, out: Path) -> None:
    """What a way's process runs: the way, then its figures and its own peak into ``out``."""
    figures = WAYS[way](example)
    if figures:  # (DDP's rank 0 only)
        figures["self_peak"] = [os.getpid(), _status_kib(os.getpid(), "VmHWM")]
        out.write_text(json.dumps(figures))


# -- memory: every process of a tree ----------------------------------------------------------


@dataclass
class Seen:
    """One process of a measured tree: what it is, the peaks seen of it (KiB)."""

    pid: int
    role: str
    worker: str | None = None
    counted: bool = True
    peak_kib: int = 0  # VmHWM
    pss_kib: int = 0  # the largest Pss sampled
    cpu_s: float = 0.0  # its CPU time, as last read


def _status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (0: gone, or none)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (``[]``: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _cpu_s(pid: int) -> float:
    """The CPU time ``pid`` has spent, user and system."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS if fields else 0.0


TICKS = os.sysconf("SC_CLK_TCK")


def role_of(argv: list[str], parent: Seen | None, pid: int) -> tuple[str, str | None]:
    """What a process of a measured tree is, from its command line and its parent: its role
    and the worker it belongs to."""
    text = " ".join(argv)
    worker = parent.worker if parent is not None else None
    above = parent.role if parent is not None else ""
    if "somatize-coordinator" in text:
        return "coordinator", None
    if "somatize-worker" in text:
        named = argv[argv.index("--id") + 1] if "--id" in argv[:-1] else "?"
        return f"worker agent {named}", named
    if above.startswith("fork server"):  # forked: the server's command line, a daemon's job
        return f"filter daemon ({worker})", worker
    if Path(argv[0]).name == "bwrap":  # a sandbox's wrapper (what it runs is below it)
        return f"bwrap ({worker})", worker
    if "worker.daemon.fork_server" in text:
        return f"fork server ({worker})", worker
    if "worker.daemon" in text:
        return f"filter daemon ({worker})", worker
    if "torch.distributed.run" in text:
        return "torchrun launcher", None
    if len(argv) > 2 and Path(argv[1]).name == "somatize" and argv[2] == "submit":
        return "client: somatize submit", None
    if above == "torchrun launcher":
        env = dict(e.split("=", 1) for e in _read(f"/proc/{pid}/environ") if "=" in e)
        return f"rank {env.get('RANK', '?')}", None
    if "python" in Path(argv[0]).name and "-c" in argv:
        return f"python -c (under {above or '?'})", worker
    words = [a for a in argv[1:] if not a.startswith("-")] if "python" in argv[0] else argv
    return f"{Path((words or argv)[0]).name} (under {above or '?'})", worker


class Peaks:
    """The peak memory of every process of the tree below ``root`` (``root`` included),
    polled from ``/proc`` every :data:`POLL` seconds while in its ``with`` block.

    Args:
        root: the process the tree hangs from.
        role: what it is.
        counted: whether ``root`` counts in the sums (not where it only holds the cluster).
    """

    def __init__(self, root: int, role: str, *, counted: bool = True) -> None:
        self.root = root
        self.seen: dict[int, Seen] = {root: Seen(root, role, counted=counted)}
        self._ticks = 0
        self._periodic = Periodic(self._tick, POLL, "peaks")

    def __enter__(self) -> Peaks:
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._periodic.__exit__(*exc)

    def _tick(self) -> None:
        self.poll(pss=self._ticks % PSS_EVERY == 0)
        self._ticks += 1

    def poll(self, pss: bool = True) -> None:
        """Read every process of the tree once: a new one's role, each one's peaks."""
        for pid in [self.root, *descendants(self.root)]:
            seen = self.seen.get(pid)
            if seen is None:
                parent = self.seen.get(_parent_of(pid) or -1)
                argv = _read(f"/proc/{pid}/cmdline")
                if not argv:
                    continue  # gone already
                role, worker = role_of(argv, parent, pid)
                seen = self.seen[pid] = Seen(pid, role, worker)
            seen.peak_kib = max(seen.peak_kib, _status_kib(pid, "VmHWM"))
            seen.cpu_s = max(seen.cpu_s, _cpu_s(pid))
            if pss:
                seen.pss_kib = max(seen.pss_kib, _pss_kib(pid))

    def processes(self) -> list[dict[str, Any]]:
        """Every process seen, in the order seen (a process that never held a page skipped)."""
        return [asdict(s) for s in self.seen.values() if s.peak_kib]


def _busy_s() -> float:
    """The CPU seconds the whole machine has spent busy (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / TICKS  # user nice system, irq softirq steal


def _measured(argv: list[str], role: str, counted: bool, out: Path, log: Path) -> dict[str, Any]:
    """Run ``argv`` (a way's process) with its tree's peaks polled; its figures (from ``out``),
    its wall time start to exit (``launch_s``) and its processes."""
    with open(log, "wb") as output:
        before, started = _busy_s(), time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        with Peaks(proc.pid, role, counted=counted) as peaks:
            code = proc.wait()
        launch, busy = time.perf_counter() - started, _busy_s() - before
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(argv)} exited {code}; the end of its output:\n{tail}")
    figures = json.loads(out.read_text())
    pid, kib = figures.pop("self_peak")  # read as it ended: nothing later was missed
    if pid in peaks.seen:
        peaks.seen[pid].peak_kib = max(peaks.seen[pid].peak_kib, kib)
    processes = peaks.processes()
    counted = [p for p in processes if p["counted"]]
    return figures | {
        "launch_s": launch,
        "foreign_cores": max(0.0, busy - sum(s.cpu_s for s in peaks.seen.values())) / launch,
        "processes": processes,
        "peak_mib": sum(p["peak_kib"] for p in counted) / 1024,
        "pss_mib": sum(p["pss_kib"] for p in counted) / 1024,
    }


def run(
    rows: int | None = None,
    steps: int | None = None,
    model: str = "gpt2",
    plain: bool = False,
) -> dict[str, Any]:
    """Each way once, in order: ours through ``sz.connect``, ours through ``somatize submit``,
    DDP (and the plain loop)."""
    example = EXAMPLES[model]
    if model == "gpt2" and rows is None and steps is None:
        steps = STEPS
    for name in (example.rows_env, example.steps_env, example.validate_env):
        if name is not None:  # (what an earlier run in this process set)
            os.environ.pop(name, None)
    os.environ.update(sizes(example, rows, steps))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spec = load_job_file(str(example.path))  # fills the file's own caches before any timing
    net, config, rows_of = trained_filter(spec), settings(spec), len(spec.x)
    total = len(run_plan(spec, rows_of))
    per_epoch = -(-rows_of // config["batch"])
    results: dict[str, Any] = {
        "model": model,
        "rows": rows_of,
        "steps": total,
        "validate_every": net.validate_every,
        "config": config,
        "parameters": sum(p.numel() for p in net.module.parameters()),
    }
    del spec, net
    me = [sys.executable, "-m", "benchmarks.own_model", "--model", model]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "-m", "benchmarks.own_model", "--model", model]
    ways = {
        "connect": (me, "client: sz.connect (and the cluster's parent)", True),
        "cli": (me, "the cluster's parent (not counted)", False),
        "ddp": (torchrun, "torchrun launcher", True),
    }
    if plain:
        ways["plain"] = (me, "plain loop", True)
    with tempfile.TemporaryDirectory(prefix="own-model-") as scratch:
        for key, (argv, role, counted) in ways.items():
            out, log = Path(scratch) / f"{key}.json", Path(scratch) / f"{key}.log"
            way = "rank" if key == "ddp" else key
            command = [*argv, "--way", way, "--out", str(out)]
            results[key] = _measured(command, role, counted, out, log)
    results["ddp"]["wall_s"] = results["ddp"]["launch_s"]
    for key in ("connect", "cli"):  # their epochs' ends by step, as the anchor's
        ours = results[key]
        ends = [[min(e * per_epoch, total), v] for e, v in ours.pop("epochs")]
        ours["validations"] = sorted(ours["validations"] + ends)
    return results


# -- the report -------------------------------------------------------------------------------

WAY_NAMES = {
    "connect": "ours, `sz.DataParallel(2)` through `sz.connect`",
    "cli": "ours, `sz.DataParallel(2)` through `somatize submit`",
    "ddp": "torch DDP, 2 ranks started by `torchrun`",
    "plain": "plain single-process loop (2 threads)",
}


def _ours_ways(results: Mapping[str, Any]) -> list[str]:
    return [k for k in ("connect", "cli") if k in results]


def rows(results: dict[str, Any]) -> list[Row]:
    ddp, example = results["ddp"], EXAMPLES[results.get("model", "char_lm")]
    what = f"{example.title} ({example.path.relative_to(ROOT)}), {results['steps']} steps"
    losses = ", ".join(f"{k} {results[k]['val_loss']:.5f}" for k in (*_ours_ways(results), "ddp"))
    times, memory = [], []
    for key, how in (("connect", "sz.connect"), ("cli", "somatize submit")):
        ours = results[key]
        times.append(
            Row(
                bench="own-model",
                name=f"{what}, DataParallel(2) via {how}: wall time",
                ours=ours["wall_s"],
                unit="s",
                anchor=ddp["wall_s"],
                anchor_name="torchrun DDP, 2 ranks",
                target=Target("<=", TIME_TARGET, text=f"<= {TIME_TARGET:g} x DDP"),
                note=f"val loss {losses}",
            )
        )
        memory.append(
            Row(
                bench="own-model",
                name=f"{what}, DataParallel(2) via {how}: summed peak memory",
                ours=ours["peak_mib"],
                unit="MiB",
                anchor=ddp["peak_mib"],
                anchor_name="torchrun DDP: launcher + 2 ranks",
                target=Target("<=", MEMORY_TARGET, text=f"<= {MEMORY_TARGET:g} x DDP"),
                note=(
                    f"sum of VmHWM over {sum(p['counted'] for p in ours['processes'])} "
                    f"processes; sampled PSS {ours['pss_mib']:.0f} vs {ddp['pss_mib']:.0f} MiB"
                ),
            )
        )
    return times + memory


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


def table(results: dict[str, Any]) -> str:
    """The ways, their processes' memory and the ratios, as markdown."""
    ddp = results["ddp"]
    steps = [s for s, _ in ddp["validations"]]
    head = " | ".join(f"val loss @{s}" for s in steps)
    lines = [f"| way | wall time | summed peak (VmHWM) | summed PSS | {head} | other load |"]
    lines.append("|---|---:|---:|---:|" + "---:|" * len(steps) + "---:|")
    for key in ("connect", "cli", "ddp", "plain"):
        if key not in results:
            continue
        r = results[key]
        scores = dict((int(s), v) for s, v in r["validations"])
        cells = " | ".join(f"{scores[s]:.5f}" if s in scores else "—" for s in steps)
        lines.append(
            f"| {WAY_NAMES[key]} | {r['wall_s']:.1f} s | {r['peak_mib']:,.0f} MiB | "
            f"{r['pss_mib']:,.0f} MiB | {cells} | {r['foreign_cores']:.2f} cores |"
        )
    lines.append("")
    for key in _ours_ways(results):
        time_ratio = results[key]["wall_s"] / ddp["wall_s"]
        memory_ratio = results[key]["peak_mib"] / ddp["peak_mib"]
        lines.append(
            f"{WAY_NAMES[key]} ÷ DDP: wall time **{time_ratio:.3f}×** (target ≤ "
            f"{TIME_TARGET:g}×), summed peak memory **{memory_ratio:.3f}×** (target ≤ "
            f"{MEMORY_TARGET:g}×)."
        )
    lines.append(
        f"DDP's ranks trained for {ddp['train_s']:.1f} s of torchrun's {ddp['wall_s']:.1f} s "
        "(the rest: starting the launcher and the ranks, their imports, loading the job file)."
    )
    clients = [
        f"{p['role']} {_mib(p['peak_kib'])} MiB"
        for key in _ours_ways(results)
        for p in results[key]["processes"]
        if p["role"].startswith("client")
    ]
    lines.append(f"The client's own peak: {'; '.join(clients)}.")
    lines.append(
        "Other load: the cores that processes outside this benchmark kept busy, on average, "
        "while the way ran (the noise)."
    )
    lines += ["", "Each process's peaks, MiB (a way's sums leave out what is not counted):", ""]
    lines += ["| way | process | peak (VmHWM) | largest PSS sampled |", "|---|---|---:|---:|"]
    for key in ("connect", "cli", "ddp", "plain"):
        processes = results.get(key, {}).get("processes", [])
        small = [p for p in processes if p["peak_kib"] < SMALL_KIB]
        for p in processes:
            if p["peak_kib"] >= SMALL_KIB:
                role = _told_apart(p, processes)
                lines.append(f"| {key} | {role} | {_mib(p['peak_kib'])} | {_mib(p['pss_kib'])} |")
        if small:
            peak, pss = sum(p["peak_kib"] for p in small), sum(p["pss_kib"] for p in small)
            what = f"{len(small)} small ones (sandbox wrappers and probes, shells)"
            lines.append(f"| {key} | {what} | {_mib(peak)} | {_mib(pss)} |")
    return "\n".join(lines)


SMALL_KIB = 32 * 1024
"""Processes that peak below this are summed in one line of the table."""


def _told_apart(process: dict[str, Any], processes: list[dict[str, Any]]) -> str:
    """A process's role; a worker's filter daemons told apart: the one that peaked highest ran
    the job (one job a way), the others are spares started for the next one."""
    role = str(process["role"])
    if not role.startswith("filter daemon"):
        return role
    same = [p for p in processes if p["role"] == role and p["peak_kib"] >= SMALL_KIB]
    ran = max(same, key=lambda p: p["peak_kib"]) is process
    return role.replace("filter daemon", "job's filter daemon" if ran else "spare daemon")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(EXAMPLES), default="gpt2", help="the job file")
    p.add_argument("--rows", type=int, help="training windows (default: the job file's)")
    p.add_argument("--steps", type=int, help=f"GPT-2: optimizer steps (default {STEPS})")
    p.add_argument("--plain", action="store_true", help="also the loop in one process")
    p.add_argument("--write", action="store_true", help="into docs/benchmarks.md, its section")
    p.add_argument("--way", choices=sorted(WAYS), help=argparse.SUPPRESS)  # a way's process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.way is not None:
        _way_main(args.way, EXAMPLES[args.model], args.out)
        return
    started = time.time()
    results = run(args.rows, args.steps, args.model, args.plain)
    text = table(results)
    print(text)
    for row in rows(results):
        print(f"{row.name}: {row.ours:.1f} {row.unit} vs {row.anchor:.1f}, met: {row.met}")
    print(f"({time.time() - started:.0f} s in all)")
    if args.write:
        command = "python -m benchmarks.own_model" + "".join(
            f" --{name} {value}"
            for name, value in (("model", args.model), ("rows", args.rows), ("steps", args.steps))
            if value is not None and not (name == "model" and value == "gpt2")
        )
        command += " --plain" if args.plain else ""
        body = (
            f"Written by `{command} --write` ({now()}, {machine()['cpu']}, "
            f"{machine()['cores']} cores): `{EXAMPLES[args.model].path.relative_to(ROOT)}`, "
            f"{results['parameters'] / 1e6:.1f} M parameters, {results['rows']} training "
            f"windows, {results['steps']} steps of {results['config']['batch']} rows.\n\n"
            + text
            + "\n"
        )
        DOCUMENT.write_text(with_section(DOCUMENT.read_text(), "own_model", body))
        print(f"wrote its section of {DOCUMENT}")


if __name__ == "__main__":
    main()
