"""A sharded run's checkpoint made whole on the client.

A DataParallel run with ``sharding`` saves its checkpoints as its replicas hold the model: each
replica's shards in the files torch.distributed.checkpoint (DCP) wrote of them, replica 0's
with the ``.metadata`` that says where each shard lies, and what every replica holds alike
(``rest``: buffers, step counts, the groups' settings, schedulers), which names the sharded
tensors' places (``rest["split"][i]`` is the path of the tensor saved under key ``str(i)``).
The coordinator stores them as they came and never joins them; :func:`whole_states` fetches
them one file at a time, each written to disk before the next, and joins them here, with
DCP's own reader (:func:`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`),
for :meth:`somatize.jobs.Job.checkpoint`.

DCP reads the ``.metadata`` with plain :mod:`pickle`, which would run whatever code a forged
one names: it is first read here by an unpickler that builds DCP's own metadata classes and
torch's sizes, dtypes and layouts and nothing else (:func:`_checked_metadata`), so a checkpoint
runs no code of the workers' on the client, as a result or a saved graph does not. The shards
themselves DCP reads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from protocol.shard_files import METADATA, is_plain_file_name
from somatize.errors import ClientError

__all__ = ["whole_states"]

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
"""What a ``.metadata`` may name besides :mod:`torch.distributed.checkpoint.metadata`'s classes
and torch's dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module == "torch.distributed.checkpoint.metadata" or dtype or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a checkpoint's {METADATA} may not name {module}.{name}")


def _checked_metadata(data: bytes | bytearray) -> None:
    """Raise ClientError unless ``data`` is a ``.metadata`` of DCP's own classes alone."""
    try:
        _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # what a forged or damaged pickle raises: say what it is not
        raise ClientError(f"the checkpoint's {METADATA} is not DCP's: {exc}") from exc


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
