"""Shipping user filters: by value for the user's own code, loadable where that code is absent."""

from __future__ import annotations

import subprocess
import sys

import torch

import somatize as sz
from protocol.filters import dump_filter, load_filter


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
