"""A sharded checkpoint's ``.metadata`` read without trusting the worker that wrote it.

torch.distributed.checkpoint (DCP) writes where each shard lies into a ``.metadata`` file as a
plain :mod:`pickle`, and its own reader loads it with :func:`pickle.load`: a forged one runs
whatever its pickle names. Replica 0 of a sharded run writes that file, and it is read again
by the client (:meth:`somatize.remote.jobs.Job.checkpoint`) and by every replica that resumes from
it, so each of them reads it here first, with :func:`checked_metadata`:

* an unpickler that builds only the classes a ``.metadata`` of this project holds — an exact
  list of DCP's metadata classes, ``torch.Size``, torch's dtypes and layouts, a path — each
  named by module and plain name (protocol 4 resolves a dotted name, ``os.system`` under an
  allowed module, attribute by attribute: a dotted name is refused whatever its module);
* then the object it built is checked as DCP will use it: tensors only (DCP reads a
  ``BytesStorageMetadata`` item with ``torch.load(weights_only=False)``, which would run code;
  :meth:`engine.data_parallel.sharding.ShardedRun.save_shards` never writes one), every storage item
  in a plain file name of the same folder at a non-negative offset and length, and no stream
  transforms (none is written here).

:class:`CheckedReader` is DCP's file-system reader with that read in place of its own, so a
resuming replica unpickles the file once, here; the shards themselves DCP reads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from protocol.files.shard_files import METADATA, is_plain_file_name

__all__ = ["CheckedReader", "MetadataRefused", "checked_metadata"]

_DCP = "torch.distributed.checkpoint.metadata"

ALLOWED = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)
"""Every ``(module, name)`` a ``.metadata`` may name, besides torch's dtypes (``("torch",
"float32")``): what DCP's writer puts in one for tensors (read off its files)."""


class MetadataRefused(ValueError):
    """A ``.metadata`` that is not one DCP wrote of tensors: the message says what it holds."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and ((module, name) in ALLOWED or _is_dtype(module, name)):
            return super().find_class(module, name)
        raise MetadataRefused(f"it names {module}.{name}, which is not DCP's metadata")


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def checked_metadata(data: bytes | bytearray | memoryview) -> Metadata:
    """The DCP metadata ``data`` holds, built by the restricted unpickler and checked.

    Raises:
        MetadataRefused: it names anything else, is not a pickle, or describes other than
            tensors in plain files of its folder (the message says which).
    """
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except MetadataRefused:
        raise
    except Exception as exc:  # what a damaged pickle raises: say what it is not
        raise MetadataRefused(f"it is not a pickle DCP wrote: {exc!r}") from exc
    return _check(metadata)


def _check(metadata: Any) -> Metadata:
    if not isinstance(metadata, Metadata):
        raise MetadataRefused(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise MetadataRefused("its state_dict_metadata is not a dict")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise MetadataRefused(f"its entry {key!r} is a {type(item).__name__}, not a tensor")
        if not all(isinstance(chunk, ChunkStorageMetadata) for chunk in item.chunks):
            raise MetadataRefused(f"its entry {key!r} has chunks DCP does not write")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise MetadataRefused("its storage_data is not a dict")
    for index, where in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(where, _StorageInfo):
            raise MetadataRefused("its storage_data holds other than DCP's storage items")
        if not (isinstance(where.relative_path, str) and is_plain_file_name(where.relative_path)):
            raise MetadataRefused(f"it places {index.fqn!r} in {where.relative_path!r}")
        if not all(isinstance(n, int) and n >= 0 for n in (where.offset, where.length)):
            raise MetadataRefused(f"it places {index.fqn!r} at {where.offset}+{where.length}")
        if where.transform_descriptors:
            raise MetadataRefused(f"it reads {index.fqn!r} through {where.transform_descriptors}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise MetadataRefused("its storage_meta is not DCP's")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's reader of a checkpoint folder, its ``.metadata`` read by :func:`checked_metadata`.

    Raises (from ``read_metadata``, so from DCP's ``load``):
        MetadataRefused: as :func:`checked_metadata`.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = checked_metadata((Path(self.path) / METADATA).read_bytes())
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
