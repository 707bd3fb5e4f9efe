"""somatize.remote.sharded_checkpoints: a sharded run's checkpoint, as the coordinator sends it,
made whole on the client from files torch.distributed.checkpoint itself wrote."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save

from somatize.errors import ClientError
from somatize.remote.sharded_checkpoints import whole_states


def _files(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning, match="single process"):  # DCP's own writer, one process
        save(tensors, checkpoint_id=folder, no_dist=True)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_the_sharded_tensors_are_put_back_where_the_rest_says_beside_the_plain_states(tmp_path):
    weight, moment = torch.arange(12.0).reshape(4, 3), torch.ones(4, 3) * 0.5
    files = _files(tmp_path, {"0": weight, "1": moment})
    rest = {
        "states": {"mlp": {"weight": None, "steps": torch.tensor(3)}},
        "optimizers": {"mlp": {"state": {0: {"exp_avg": None}}, "param_groups": []}},
        "split": [["states", "mlp", "weight"], ["optimizers", "mlp", "state", 0, "exp_avg"]],
    }
    plain = {"center": {"mean": np.arange(3.0)}}
    fetched: list[str] = []

    def fetch(name: str) -> bytes:
        fetched.append(name)
        return files[name]

    states = whole_states({"names": sorted(files), "rest": rest, "plain": plain}, fetch)
    assert fetched == sorted(files)  # each once, in turn
    assert list(states) == ["center", "mlp"]  # graph order: the plain filters come first
    torch.testing.assert_close(states["mlp"]["weight"], weight, rtol=0, atol=0)
    assert states["mlp"]["steps"] == 3
    np.testing.assert_array_equal(states["center"]["mean"], np.arange(3.0))


class _Forged:
    """What a hostile worker's ``.metadata`` could hold: a pickle that calls a function."""

    def __reduce__(self):
        return (print, ("ran the worker's code",))


def test_files_that_are_not_a_checkpoint_are_said_so_and_a_forged_metadata_runs_nothing(
    tmp_path, capsys
):
    files = _files(tmp_path, {"0": torch.ones(2)})
    rest = {"states": {"mlp": {"weight": None}}, "split": [["states", "mlp", "weight"]]}
    damaged = files | {name: b"not a checkpoint" for name in files if name != ".metadata"}
    with pytest.raises(ClientError, match="shards cannot be read"):
        whole_states({"names": sorted(damaged), "rest": rest, "plain": {}}, damaged.__getitem__)
    forged = files | {".metadata": pickle.dumps(_Forged())}
    with pytest.raises(ClientError, match=r"is refused: it names builtins\.print"):
        whole_states({"names": sorted(forged), "rest": rest, "plain": {}}, forged.__getitem__)
    assert "ran the worker's code" not in capsys.readouterr().out
    with pytest.raises(ClientError, match=r"names a file '\.\./x'"):
        whole_states({"names": ["../x"], "rest": rest, "plain": {}}, {"../x": b""}.__getitem__)
