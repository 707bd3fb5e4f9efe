"""A user's traceback: their frames with their source, ours and torch's folded; the source
filled in on the client from its own copy of the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz
from protocol.text.user_tracebacks import folded, with_source


class Picky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pick(self.lin(x))


def pick(out: torch.Tensor) -> torch.Tensor:
    return out[:, 5]  # the user's bug, two frames deep in their own code


def test_the_users_frames_stay_with_their_source_and_the_rest_is_folded():
    graph = sz.Graph([sz.TorchFilter(Picky(), loss="cross_entropy")])
    with pytest.raises(IndexError) as caught:
        graph.fit(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    text = folded(caught.value)
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    mine = [line for line in lines if line.startswith('  File "')]
    assert len(mine) == 3 and all(__file__ in line for line in mine)  # this test, forward, pick
    assert "    return out[:, 5]  # the user's bug, two frames deep in their own code" in lines
    folds = [line for line in lines if line.startswith("  ... ")]
    # graph.fit's engine and torch's Module.__call__ between the test and forward: one fold.
    assert len(folds) == 1 and "somatize" in folds[0] and "torch" in folds[0]
    assert lines[-1] == "IndexError: index 5 is out of bounds for dimension 1 with size 2"
    assert len(lines) < 15  # against about 40 unfolded


def test_chained_exceptions_keep_both_parts():
    try:
        try:
            pick(torch.zeros(2, 2))
        except IndexError as exc:
            raise ValueError("the batch was malformed") from exc
    except ValueError as exc:
        text = folded(exc)
    assert "IndexError: index 5" in text and "ValueError: the batch was malformed" in text
    assert "The above exception was the direct cause of the following exception:" in text


def test_the_client_fills_in_source_lines_from_its_own_files(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("x = 1\ny = x / 0\n")
    # As a daemon without the file formats it: no source line under the frame.
    trace = (
        "Traceback (most recent call last):\n"
        "  ... 4 frames of somatize\n"
        f'  File "{script}", line 2, in fit\n'
        "ZeroDivisionError: division by zero\n"
    )
    assert with_source(trace) == (
        "Traceback (most recent call last):\n"
        "  ... 4 frames of somatize\n"
        f'  File "{script}", line 2, in fit\n'
        "    y = x / 0\n"
        "ZeroDivisionError: division by zero\n"
    )
    gone = trace.replace(str(script), str(tmp_path / "elsewhere.py"))
    assert with_source(gone) == gone  # no copy here: left as it is
