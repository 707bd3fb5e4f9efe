"""Worker-local datasets: ``somatize-worker --data NAME=PATH``, an ``.npz`` with ``x`` (and ``y``).

Federated jobs train on data the coordinator never uploads: the job names a dataset, the agent
knows where it is, and the filter daemon reads it from disk. The agent hands the daemon the map
of names to paths in the environment variable :data:`ENV`, so no path crosses the wire.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protocol.errors import ErrorCode
from worker.errors import EngineError

ENV = "SOMATIZE_DATASETS"
"""The variable holding ``{"NAME": "PATH", ...}`` (JSON) in the daemon's environment."""


def parse_data_option(values: list[str]) -> dict[str, Path]:
    """``["mnist=/data/m.npz", ...]`` → ``{"mnist": Path(...)}``; each file is checked now.

    Raises:
        ValueError: a malformed option, a name given twice, or a file that is not a readable
            ``.npz`` with ``x`` (and, if present, ``y`` of as many rows).
    """
    datasets: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--data takes NAME=PATH, not {value!r}")
        if name in datasets:
            raise ValueError(f"--data names {name!r} twice")
        datasets[name] = Path(path).expanduser().resolve()
        rows(datasets[name])  # fail at startup, not in the middle of a job
    return datasets


def rows(path: Path) -> int:
    """How many rows the dataset at ``path`` has (and that it is well formed)."""
    x, _ = read(path)
    return int(x.shape[0])


def read(path: Path) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """``x`` and ``y`` (or ``None``) of an ``.npz`` file."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "x" not in npz.files:
                raise ValueError(f"{path} has no array named 'x' (it has {npz.files})")
            x = npz["x"]
            y = npz["y"] if "y" in npz.files else None
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset {path}: {exc}") from exc
    if x.ndim == 0 or (y is not None and (y.ndim == 0 or y.shape[0] != x.shape[0])):
        raise ValueError(f"dataset {path}: x and y must have the same number of rows")
    return x, y


def environment(datasets: Mapping[str, Path]) -> dict[str, str]:
    """The daemon environment entry that carries ``datasets``."""
    return {ENV: json.dumps({name: str(path) for name, path in datasets.items()})}


def load_dataset(name: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """In the daemon: the dataset the agent registered as ``name``.

    Raises:
        EngineError: ``BAD_REQUEST`` when this worker has no such dataset, or it cannot be read.
    """
    known = json.loads(os.environ.get(ENV, "{}"))
    if name not in known:
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"this worker has no dataset {name!r} (it has {sorted(known)})",
            {"dataset": name},
        )
    try:
        return read(Path(known[name]))
    except ValueError as exc:
        raise EngineError(ErrorCode.BAD_REQUEST, str(exc), {"dataset": name}) from exc
