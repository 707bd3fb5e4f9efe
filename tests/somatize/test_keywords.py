"""A misspelt keyword to the SDK's own calls, and a batch of several arrays a forward cannot
take spread over its arguments: Python's TypeError, with what was meant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz


def test_a_misspelt_keyword_says_the_names_near_it():
    refusals = {
        "TorchFilter.__init__() got an unexpected keyword argument 'los' (did you mean "
        "'loss'?)": lambda: sz.TorchFilter(torch.nn.Linear(2, 2), los="mse"),
        "DataParallel: got an unexpected keyword argument 'checkpoint_evry' (did you mean "
        "'checkpoint_every' or 'keep_checkpoints'?)": lambda: sz.DataParallel(2, checkpoint_evry=3),
        "connect() got an unexpected keyword argument 'timout' (did you mean 'timeout'?)": (
            lambda: sz.connect("ws://127.0.0.1:9", timout=1)
        ),
        "Graph.fit() got an unexpected keyword argument 'validaton' (did you mean "
        "'validation'?)": lambda: sz.Graph([sz.TorchFilter(torch.nn.Linear(2, 2))]).fit(
            np.zeros((4, 2), np.float32), validaton=None
        ),
    }
    for words, call in refusals.items():
        with pytest.raises(TypeError) as refused:
            call()
        assert str(refused.value) == words
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        sz.TorchFilter(torch.nn.Linear(2, 2), zzz=1)  # nothing near: Python's words alone


class TakesTheDict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, batch):
        return self.linear(batch["a"])


class Raises(TakesTheDict):
    def forward(self, a, b):
        raise TypeError("the forward's own")


def test_a_dict_batch_a_forward_cannot_take_spread_names_inputs_one():
    x = {"a": np.zeros((8, 3), np.float32), "b": np.ones((8, 3), np.float32)}
    y = np.zeros(8, np.int64)
    with pytest.raises(TypeError) as refused:
        sz.Graph([sz.TorchFilter(TakesTheDict(), loss="cross_entropy")]).fit(x, y)
    assert "got an unexpected keyword argument 'a'" in str(refused.value)
    assert "called as module(**batch) with its keys ['a', 'b']; give the TorchFilter " in str(
        refused.value
    )
    net = sz.TorchFilter(TakesTheDict(), loss="cross_entropy", inputs="one")
    assert sz.Graph([net]).fit(x, y).history
    with pytest.raises(TypeError) as own:  # a forward that takes them, raising its own
        sz.Graph([sz.TorchFilter(Raises(), loss="cross_entropy")]).fit(x, y)
    assert str(own.value) == "the forward's own"
