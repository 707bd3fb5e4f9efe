"""Shipping user filters: by value for the user's own code, loadable where that code is absent."""

from __future__ import annotations

import subprocess
import sys

import cloudpickle
import numpy as np
import pytest
import torch

import somatize as sz
from protocol.codec import decode, encode_frame
from protocol.filters import MAGIC, ROWS, dump_filter, load_filter, split_rows


class Scale(sz.Filter):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def fit(self, x, y=None):
        return {"factor": self.factor}

    def forward(self, x, state):
        return x * state["factor"]


class Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def test_a_filter_from_the_users_module_loads_in_a_process_without_that_module(tmp_path):
    blob = dump_filter(sz.TorchFilter(torch.nn.Sequential(Doubler(), torch.nn.Identity())))
    plain = dump_filter(Scale(3.0))
    (tmp_path / "t.pkl").write_bytes(blob)
    (tmp_path / "p.pkl").write_bytes(plain)
    script = (
        "import sys, torch; from protocol.filters import load_filter\n"
        f"t = load_filter(open({str(tmp_path / 't.pkl')!r}, 'rb').read())\n"
        f"p = load_filter(open({str(tmp_path / 'p.pkl')!r}, 'rb').read())\n"
        "print(float(t.module(torch.ones(1))[0]), p.forward(2.0, p.fit(None)))\n"
    )
    # A fresh interpreter in an empty directory: the test module is not importable there.
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.0", "6.0"]


def test_installed_packages_are_pickled_by_reference():
    blob = dump_filter(sz.TorchFilter(torch.nn.Linear(2, 2)))
    # torch's and somatize's code is not inside the pickle, only references to it.
    assert b"torch.nn.modules.linear" in blob
    assert b"somatize.filters" in blob
    assert isinstance(load_filter(blob), sz.TorchFilter)


class Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares, a frozen layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.out = torch.nn.Linear(64, 300, bias=False)
        self.out.weight = self.embed.weight
        self.frozen = torch.nn.Linear(64, 256)
        self.frozen.requires_grad_(False)
        self.register_buffer("table", torch.arange(300 * 64, dtype=torch.float64).reshape(300, 64))
        self.small = torch.nn.Parameter(torch.ones(3))


def test_a_models_tensors_travel_beside_its_pickle_and_come_back_as_they_were():
    """Each large tensor leaves the pickle (it holds neither its bytes nor torch.save's) and
    comes back the same: values, dtype, a parameter still one (frozen where it was), a tied
    weight one tensor, a small one inside the pickle as before."""
    torch.manual_seed(0)
    model = Tied()
    blob = dump_filter(sz.TorchFilter(model))
    assert blob.startswith(MAGIC)
    assert blob.count(model.table.numpy().tobytes()) == 1  # once: apart, not in the pickle
    once = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}  # the tied weight once
    assert len(blob) < sum(once.values()) + 16_384
    back = load_filter(blob).module
    for name, value in model.state_dict().items():
        assert back.state_dict()[name].dtype == value.dtype
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0)
    assert back.out.weight is back.embed.weight
    assert isinstance(back.embed.weight, torch.nn.Parameter) and back.embed.weight.requires_grad
    assert not back.frozen.weight.requires_grad and isinstance(
        back.frozen.weight, torch.nn.Parameter
    )
    assert back.small.requires_grad and "table" in dict(back.named_buffers())


def test_over_a_writable_buffer_a_models_tensors_are_its_bytes_not_copies():
    """What the filter daemon holds of a model it loads is the weights once: over a
    ``bytearray`` the parameters are views of it; over ``bytes``, one copy each."""
    model = Tied()
    blob = bytearray(dump_filter(sz.TorchFilter(model)))
    start = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    back = load_filter(blob).module
    for tensor in (back.embed.weight, back.frozen.weight, back.table):
        assert start <= tensor.data_ptr() < start + len(blob)
    back.embed.weight.data.add_(1.0)  # writable, and the bytes it lies in with it
    copied = load_filter(bytes(blob)).module
    assert not start <= copied.embed.weight.data_ptr() < start + len(blob)
    torch.testing.assert_close(copied.embed.weight, model.embed.weight + 1.0)


def test_a_filter_pickled_whole_by_an_earlier_version_still_loads():
    model = torch.nn.Linear(128, 128)
    whole = cloudpickle.dumps(sz.TorchFilter(model), protocol=5)
    back = load_filter(whole).module
    torch.testing.assert_close(back.weight, model.weight, rtol=0, atol=0)


def test_a_sharded_replica_gets_its_rows_of_each_parameter_and_every_other_tensor_whole():
    """``split_rows``: FSDP2's rows of dim 0 (torch.chunk: 7 rows over 3 replicas are 3, 3
    and 1; 2 rows are 1, 1 and none), cut without unpickling; loaded, each such parameter is a
    ``meta`` one of its whole shape with this replica's rows beside it, in its own dtype;
    buffers and small tensors whole, as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 7), torch.nn.Linear(7, 2))
    model[1].weight = torch.nn.Parameter(torch.randn(2, 32768, dtype=torch.bfloat16))
    model.register_buffer("table", torch.randn(7, 4096))
    blob = dump_filter(sz.TorchFilter(model))
    start = np.frombuffer(blob, np.uint8).ctypes.data
    got = []
    for rank in range(3):
        cut = split_rows(blob, rank, 3)
        assert len(cut) < len(blob)
        for part in cut.parts:  # the rows are views over the filter's bytes, not copies
            address = np.frombuffer(part, np.uint8).ctypes.data if part.nbytes else start
            assert part.nbytes < 4096 or start <= address < start + len(blob)
        back = load_filter(_arrived(cut)).module
        first, second = back[0].weight, back[1].weight
        assert first.is_meta and first.shape == (7, 4096) and isinstance(first, torch.nn.Parameter)
        assert second.is_meta and getattr(second, ROWS).dtype == torch.bfloat16
        got.append((getattr(first, ROWS), getattr(second, ROWS)))
        torch.testing.assert_close(back.table, model.table, rtol=0, atol=0)  # a buffer: whole
        assert not back[0].bias.is_meta  # small: inside the pickle, whole
        with pytest.raises(AttributeError):
            getattr(back.table, ROWS)
    assert [len(a) for a, _ in got] == [3, 3, 1] and [len(b) for _, b in got] == [1, 1, 0]
    for k, rows in enumerate(zip(*got, strict=True)):
        torch.testing.assert_close(torch.cat(rows), model[k].weight.detach(), rtol=0, atol=0)
    plain = dump_filter(Scale(2.0))
    assert split_rows(cloudpickle.dumps(Scale(2.0)), 0, 2) == cloudpickle.dumps(Scale(2.0))
    assert load_filter(_arrived(split_rows(plain, 1, 2))).factor == 2.0


def _arrived(cut):
    """A filter's cut as a daemon gets it: through a frame, landed in writable memory."""
    return decode(bytearray(encode_frame({"filter": cut})))["filter"]
