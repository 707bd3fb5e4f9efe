"""engine.data_parallel.dcp_metadata: a sharded checkpoint's ``.metadata``, written by a worker,
read without running anything it names — on a replica that resumes from it, through DCP's own
load."""

from __future__ import annotations

import dataclasses
import pickle
import struct
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict_saver import save

import somatize as sz
from engine.data_parallel.chain import Chain
from engine.data_parallel.dcp_metadata import CheckedReader, MetadataRefused, checked_metadata
from engine.data_parallel.sharding import ShardedRun
from engine.engine import Engine
from engine.errors import EngineError
from protocol.errors import ErrorCode
from tests.gloo_group import one_rank_gloo_group


def _written(folder: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    with pytest.warns(UserWarning, match="single process"):  # DCP's own writer, one process
        save(tensors, checkpoint_id=folder, no_dist=True)
    return (folder / ".metadata").read_bytes()


def _short_string(text: str) -> bytes:
    encoded = text.encode()
    return b"\x8c" + struct.pack("<B", len(encoded)) + encoded  # SHORT_BINUNICODE


def dotted_call(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (dotted: resolved attribute by
    attribute) with one string: the forged ``.metadata`` of issue 53."""
    return (
        b"\x80\x04"  # PROTO 4
        + _short_string(module)
        + _short_string(name)
        + b"\x93"  # STACK_GLOBAL
        + _short_string(argument)
        + b"\x85"  # TUPLE1
        + b"R"  # REDUCE
        + b"."  # STOP
    )


def test_a_metadata_dcp_wrote_of_tensors_reads_as_its_metadata(tmp_path):
    data = _written(tmp_path, {"0": torch.ones(3, 2), "1": torch.arange(4, dtype=torch.int64)})
    metadata = checked_metadata(data)
    assert isinstance(metadata, Metadata)
    assert metadata.state_dict_metadata["0"].size == torch.Size([3, 2])
    assert metadata.state_dict_metadata["1"].properties.dtype is torch.int64


def test_a_dotted_name_under_an_allowed_module_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    # The module imports os, so a plain unpickler resolves os.system from it.
    forged = dotted_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    with pytest.raises(MetadataRefused, match=r"names torch\.distributed\.checkpoint\.metadata\."):
        checked_metadata(forged)
    for module, name in (("torch", "load"), ("builtins", "eval"), ("torch", "float32.__class__")):
        with pytest.raises(MetadataRefused, match="which is not DCP's metadata"):
            checked_metadata(dotted_call(module, name, "x"))
    assert not marker.exists()


def test_what_dcp_would_read_with_a_plain_unpickler_or_outside_its_folder_is_refused(tmp_path):
    metadata = checked_metadata(_written(tmp_path, {"0": torch.ones(2)}))
    index = next(iter(metadata.storage_data))
    where = metadata.storage_data[index]
    forgeries = {
        # A bytes item: DCP loads it with torch.load(weights_only=False).
        "BytesStorageMetadata, which is not": dataclasses.replace(
            metadata, state_dict_metadata={"0": BytesStorageMetadata()}
        ),
        "in '../x.distcp'": dataclasses.replace(
            metadata,
            storage_data={index: _StorageInfo("../x.distcp", where.offset, where.length)},
        ),
        "at -1": dataclasses.replace(
            metadata, storage_data={index: _StorageInfo(where.relative_path, -1, 4)}
        ),
        "through": dataclasses.replace(
            metadata,
            storage_data={index: _StorageInfo(where.relative_path, 0, 4, ["zstd"])},
        ),
    }
    for said, forged in forgeries.items():
        with pytest.raises(MetadataRefused, match=said):
            checked_metadata(pickle.dumps(forged))
    with pytest.raises(MetadataRefused, match="holds a dict"):
        checked_metadata(pickle.dumps({}))
    with pytest.raises(MetadataRefused, match="not a pickle DCP wrote"):
        checked_metadata(b"\x80\x04garbage")


def test_a_resuming_sharded_replica_refuses_a_forged_metadata_and_loads_a_genuine_one(tmp_path):
    marker = tmp_path / "ran"
    engine = Engine()
    torch.manual_seed(0)
    engine.load({"net": sz.TorchFilter(torch.nn.Linear(3, 2), loss="mse")})
    run = engine.nodes.select(["net"])
    with one_rank_gloo_group():
        sharded = ShardedRun(Chain(run, torch.device("cpu")), run, engine.optimizers, True, None)
        folder = tmp_path / "dcp"
        rest = sharded.save_shards(str(folder))
        saved = {k: v.full_tensor().clone() for k, v in sharded.chain.state_dict().items()}
        genuine = (folder / ".metadata").read_bytes()
        (folder / ".metadata").write_bytes(
            dotted_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
        )
        with pytest.raises(EngineError, match=r"\.metadata is refused: it names") as refused:
            sharded.load_shards(str(folder), rest)
        assert refused.value.code is ErrorCode.STATE_MISMATCH
        assert not marker.exists()
        with torch.no_grad():
            for parameter in sharded.chain.parameters():
                parameter.zero_()
        (folder / ".metadata").write_bytes(genuine)
        sharded.load_shards(str(folder), rest)  # through CheckedReader: the saved weights back
        for key, value in sharded.chain.state_dict().items():
            torch.testing.assert_close(value.full_tensor(), saved[key], rtol=0, atol=0)


def test_the_checked_reader_reads_the_folders_metadata_as_dcp_would(tmp_path):
    _written(tmp_path, {"0": torch.ones(2)})
    metadata = CheckedReader(tmp_path).read_metadata()
    assert metadata.storage_meta is not None and metadata.storage_meta.load_id is not None
