"""Worker-local datasets: ``somatize-worker --data NAME=PATH``.

Jobs on worker data train on rows the coordinator never uploads: the job names a dataset, the
agent knows where it is, and the filter daemon reads it from disk (the kinds of path, and how
each is opened without reading it whole: :mod:`engine.data.dataset_files`). The agent hands the
daemon the map of names to paths in the environment variable :data:`ENV`, so no path crosses the
wire, and announces what each holds (rows, shapes, dtypes: :func:`summaries`) in its hello.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.data.dataset_files import ArrayInfo, DatasetInfo, describe, open_dataset
from engine.data.dataset_rows import loader_rows
from engine.errors import EngineError
from protocol.errors import ErrorCode
from protocol.filters import load_filter
from protocol.messages import ArrayShape, DatasetSummary

ENV = "SOMATIZE_DATASETS"
"""The variable holding ``{"NAME": "PATH", ...}`` (JSON) in the daemon's environment."""


def parse_data_option(values: list[str]) -> dict[str, Path]:
    """``["mnist=/data/m.npz", ...]`` → ``{"mnist": Path(...)}``; each path is checked now.

    Raises:
        ValueError: a malformed option, a name given twice, or a path that is not a dataset
            (naming the path, or the shard, that is not).
    """
    datasets: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--data takes NAME=PATH, not {value!r}")
        if name in datasets:
            raise ValueError(f"--data names {name!r} twice")
        datasets[name] = Path(path).expanduser().resolve()
        describe(datasets[name])  # fail at startup, not in the middle of a job
    return datasets


def summaries(datasets: Mapping[str, Path]) -> dict[str, DatasetSummary]:
    """What each dataset holds, for the hello (blocking: reads headers, an ``.npz`` whole)."""
    return {name: summary(describe(path)) for name, path in datasets.items()}


def summary(info: DatasetInfo) -> DatasetSummary:
    def shape(array: ArrayInfo | None) -> ArrayShape | None:
        return None if array is None else ArrayShape(shape=list(array.shape), dtype=array.dtype)

    return DatasetSummary(
        rows=info.rows, kind=info.kind, x=shape(info.x), y=shape(info.y), shards=info.shards
    )


def environment(datasets: Mapping[str, Path]) -> dict[str, str]:
    """The daemon environment entry that carries ``datasets``."""
    return {ENV: json.dumps({name: str(path) for name, path in datasets.items()})}


def load_dataset(
    name: str, loader: bytes | None = None, split: str | None = None
) -> tuple[Any, Any]:
    """In the daemon: the dataset the agent registered as ``name``, or its ``split``
    (:func:`~engine.data.dataset_files.open_dataset`).

    Raises:
        EngineError: ``BAD_REQUEST`` when this worker has no such dataset (or split), or it
            cannot be read.
    """
    known = json.loads(os.environ.get(ENV, "{}"))
    if name not in known:
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"this worker has no dataset {name!r} (it has {sorted(known)})",
            {"dataset": name},
        )
    if split is not None and loader is not None:
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"dataset {name!r} opens with the job's loader, which has no splits: give the "
            "validation rows with the job, or serve them as a dataset",
            {"dataset": name},
        )
    try:
        if loader is None:
            return open_dataset(Path(known[name]), split)
    except ValueError as exc:
        raise EngineError(ErrorCode.BAD_REQUEST, str(exc), {"dataset": name}) from exc
    try:
        return loader_rows(load_filter(loader), Path(known[name]))
    except Exception as exc:  # the job's own code: a filter error, with its traceback
        raise EngineError(
            ErrorCode.FILTER_ERROR,
            f"the loader of dataset {name!r} failed: {type(exc).__name__}: {exc}",
            {"dataset": name, "traceback": "".join(traceback.format_exception(exc))},
        ) from exc
