"""A sharded run's checkpoint made whole on the client.

A DataParallel run with ``sharding`` saves its checkpoints as its replicas hold the model: each
replica's shards in the files torch.distributed.checkpoint (DCP) wrote of them, replica 0's
with the ``.metadata`` that says where each shard lies, and what every replica holds alike
(``rest``: buffers, step counts, the groups' settings, schedulers), which names the sharded
tensors' places (``rest["split"][i]`` is the path of the tensor saved under key ``str(i)``).
The coordinator stores them as they came and never joins them; :func:`whole_states` fetches
them one file at a time, each written to disk before the next, and joins them here, with
DCP's own reader (:func:`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`),
for :meth:`somatize.remote.jobs.Job.checkpoint`.

DCP reads the ``.metadata`` with plain :mod:`pickle`, which would run whatever code a forged
one names: it is first read here as :func:`engine.data_parallel.dcp_metadata.checked_metadata` reads
it (an exact list of DCP's metadata classes, tensors only, plain file names), so a checkpoint runs
no code of the workers' on the client, as a result or a saved graph does not; DCP then reads the
same bytes. The shards themselves DCP reads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from engine.data_parallel.dcp_metadata import MetadataRefused, checked_metadata
from protocol.files.shard_files import METADATA, is_plain_file_name
from somatize.errors import ClientError

__all__ = ["whole_states"]


def _checked_metadata(data: bytes | bytearray) -> None:
    """Raise ClientError unless ``data`` is a ``.metadata`` of DCP's own, of tensors alone."""
    try:
        checked_metadata(data)
    except MetadataRefused as exc:
        raise ClientError(f"the checkpoint's {METADATA} is refused: {exc}") from exc


def whole_states(
    shards: Mapping[str, Any], fetch: Callable[[str], bytes | bytearray]
) -> dict[str, Any]:
    """Every node's state from a sharded checkpoint as the coordinator describes it
    (``names``: its DCP files, ``rest``, ``plain``: the plain filters' states), its sharded
    tensors whole; ``fetch(name)`` gives a file's bytes, each written to disk here before
    the next is fetched.

    Raises:
        ClientError: the files are not a checkpoint DCP can read.
    """
    rest = shards["rest"]
    with tempfile.TemporaryDirectory(prefix="somatize-shards-") as folder:
        written = Path(folder) / "dcp"
        written.mkdir()
        for name in shards["names"]:
            if not is_plain_file_name(name):
                raise ClientError(f"the checkpoint names a file {name!r}")
            data = fetch(name)
            if name == METADATA:
                _checked_metadata(data)
            (written / name).write_bytes(data)
            del data
        whole = Path(folder) / "whole.pt"
        try:
            dcp_to_torch_save(written, whole)
            flat = torch.load(whole, weights_only=True)
        except (Exception, CheckpointException) as exc:  # what DCP met: say where
            raise ClientError(f"the checkpoint's shards cannot be read: {exc}") from exc
    states = {node: dict(state) for node, state in rest["states"].items()}
    for i, path in enumerate(rest["split"]):
        if path[0] == "states":
            _, node, name = path
            states[node][name] = flat[str(i)]
    return dict(shards["plain"]) | states
