"""Flower's simulation engine as the anchor of ``benchmarks.federated``'s big round, run in
Flower's own environment: a separate virtualenv (``benchmarks/federated/flower_env.sh``, ``make
flower-env``) whose Python runs :mod:`benchmarks.federated.flower_sim` as a subprocess, so that
``flwr[simulation]`` (Ray) never moves this environment's pins (it would, of ``rich`` and
``pycryptodome``).

:func:`run_flower` hands it the round's data files, clients per worker, initial weights and
hyper-parameters, and reads back its figures and final weights. :func:`flower_python` says
where that Python is: ``--flower-python PATH`` or :data:`PYTHON_ENV`, else ``None``, and then
:data:`HOW_TO` is what the benchmark prints in place of its figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "SOMATIZE_FLOWER_PYTHON"
"""The environment variable naming Flower's Python (as ``--flower-python`` does)."""
SETUP = (
    "`make flower-env` (benchmarks/federated/flower_env.sh: a separate virtualenv .flower-venv/ "
    f"with flwr[simulation]), then --flower-python .flower-venv/bin/python or "
    f"{PYTHON_ENV}=.flower-venv/bin/python"
)
HOW_TO = f"not run: {SETUP}"
"""What the benchmark says in place of Flower's figures."""
TOLERANCE = 1e-5
"""The largest difference of final weights that still counts as the same training: identical
data, initial weights and steps; only the order and precision of the sums differ (Flower sums
the weighted updates in float32, in the order its replies arrive)."""


class FlowerFailed(RuntimeError):
    """Flower's side did not give its figures (its output's tail in the message)."""


def flower_python(given: str | Path | None = None) -> Path | None:
    """Flower's Python: ``given``, else :data:`PYTHON_ENV`'s, else ``None``; a named one that
    is not an executable file is an error, not a silent skip."""
    named = given if given is not None else os.environ.get(PYTHON_ENV) or None
    if named is None:
        return None
    path = Path(named)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FlowerFailed(
            f"Flower's Python {str(path)!r} is not an executable file; to make one: {SETUP}"
        )
    return path


def run_flower(
    python: Path,
    directory: Path,
    data: Sequence[Path],
    per_worker: int,
    rounds: int,
    initial: Mapping[str, np.ndarray],
    *,
    lr: float,
    batch: int,
    cpus: int,
    timeout: float = 3600,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Flower's simulation of the same rounds on the same data: its figures (with
    ``round_s``, the median of its measured rounds) and its final weights."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = dict(initial)
    np.savez(directory / "initial.npz", **arrays)
    spec = {
        "data": [str(p) for p in data],
        "per_worker": per_worker,
        "rounds": rounds,
        "lr": lr,
        "batch": batch,
        "initial": str(directory / "initial.npz"),
        "cpus": cpus,
        "out": str(directory / "flower.json"),
        "weights_out": str(directory / "flower_final.npz"),
    }
    (directory / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    command = [str(python), "-m", "benchmarks.federated.flower_sim", str(directory / "spec.json")]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise FlowerFailed(f"Flower's simulation ran past {timeout:.0f} s") from exc
    if done.returncode != 0 or not (directory / "flower.json").exists():
        tail = (done.stdout + done.stderr)[-4000:]
        raise FlowerFailed(f"Flower's simulation exited {done.returncode}:\n{tail}")
    figures: dict[str, Any] = json.loads((directory / "flower.json").read_text())
    figures["round_s"] = statistics.median(figures["rounds_s"])
    with np.load(directory / "flower_final.npz") as f:
        final = {k: f[k] for k in f.files}
    return figures, final


def largest_difference(ours: Mapping[str, Any], theirs: Mapping[str, np.ndarray]) -> float:
    """The largest absolute difference between two sets of weights with the same keys."""
    if set(ours) != set(theirs):
        raise FlowerFailed(
            f"the weights' keys differ: ours {sorted(ours)}, Flower's {sorted(theirs)}"
        )
    return max(
        float(np.max(np.abs(np.asarray(ours[k], np.float64) - np.asarray(theirs[k], np.float64))))
        for k in ours
    )
