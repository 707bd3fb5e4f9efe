"""graph.fit against independent plain-torch training loops written here, not in the package."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import somatize as sz
from tests.utils import Center


def _data(n: int = 203, d: int = 6, classes: int = 3, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32) * 2 + 1
    y = (x @ rng.normal(size=(d, classes))).argmax(1).astype(np.int64)
    return x, y


def _mlp(d: int, hidden: int, out: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out)
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_center_then_mlp_equals_plain_torch_loop_with_shuffling():
    x, y = _data()
    module = _mlp(6, 16, 3, seed=3)
    reference_module = copy.deepcopy(module)
    graph = Center().named("center") >> sz.TorchFilter(
        module,
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.1,
        batch_size=32,
        epochs=4,
        shuffle=True,
        seed=7,
    ).named("mlp")

    fitted = graph.fit(x, y)

    # Expected: centre by hand, then a plain loop with the documented batching rule.
    xt = torch.as_tensor(x - x.mean(0))
    yt = torch.as_tensor(y)
    opt = torch.optim.SGD(reference_module.parameters(), lr=0.1)
    order = torch.Generator().manual_seed(7)
    for _ in range(4):
        perm = torch.randperm(len(xt), generator=order)
        for start in range(0, len(xt), 32):
            idx = perm[start : start + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(reference_module(xt[idx]), yt[idx]).backward()
            opt.step()

    assert _max_diff(fitted.states["mlp"], reference_module.state_dict()) <= 1e-6
    np.testing.assert_allclose(fitted.states["center"]["mean"], x.mean(0), rtol=0, atol=0)
    with torch.no_grad():
        expected = reference_module(torch.as_tensor(x[:50] - x.mean(0)))
    torch.testing.assert_close(fitted.forward(x[:50]), expected, rtol=0, atol=1e-6)
    assert len(fitted.epoch_losses) == 4
    assert fitted.epoch_losses[-1] < fitted.epoch_losses[0]


def test_chain_of_torch_filters_trains_as_one_autograd_graph():
    x, _ = _data(n=70, d=5)
    y = (x[:, :1] * 0.5 - x[:, 1:2]).astype(np.float32)  # (n, 1) regression target
    first, second = _mlp(5, 8, 4, seed=11), _mlp(4, 8, 1, seed=12)
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    graph = sz.TorchFilter(
        first, optimizer="sgd", lr=0.05, optimizer_options={"momentum": 0.9}
    ).named("encoder") >> sz.TorchFilter(
        second, loss="mse", optimizer="adam", lr=0.01, batch_size=16, epochs=3, shuffle=False
    ).named("head")

    fitted = graph.fit(x, y)

    # Expected: rows in order, 16 at a time (the last batch has 6), one loss at the end,
    # both optimizers step every batch.
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    opt1 = torch.optim.SGD(ref_first.parameters(), lr=0.05, momentum=0.9)
    opt2 = torch.optim.Adam(ref_second.parameters(), lr=0.01)
    for _ in range(3):
        for start in range(0, 70, 16):
            opt1.zero_grad()
            opt2.zero_grad()
            out = ref_second(ref_first(xt[start : start + 16]))
            torch.nn.functional.mse_loss(out, yt[start : start + 16]).backward()
            opt1.step()
            opt2.step()

    assert _max_diff(fitted.states["encoder"], ref_first.state_dict()) <= 1e-6
    assert _max_diff(fitted.states["head"], ref_second.state_dict()) <= 1e-6
    # Both stages moved: the first stage really was in the autograd graph.
    assert _max_diff(fitted.states["encoder"], first.state_dict()) > 1e-3


def test_fit_leaves_the_graphs_module_at_its_initial_weights():
    x, y = _data(n=40)
    module = _mlp(6, 4, 3, seed=0)
    before = copy.deepcopy(module.state_dict())
    graph = sz.Graph([sz.TorchFilter(module, loss="cross_entropy", lr=0.5, epochs=2)])
    first = graph.fit(x, y)
    second = graph.fit(x, y)
    assert _max_diff(module.state_dict(), before) == 0
    assert _max_diff(first.states["sequential"], second.states["sequential"]) == 0


def test_mse_accepts_flat_labels_for_a_single_output():
    x, _ = _data(n=32, d=3)
    y = x.sum(1)  # shape (n,), the module outputs (n, 1)
    module = torch.nn.Linear(3, 1)
    reference = copy.deepcopy(module)
    fitted = sz.Graph([sz.TorchFilter(module, lr=0.1, batch_size=None, epochs=5)]).fit(x, y)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        out = reference(torch.as_tensor(x))
        torch.nn.functional.mse_loss(out, torch.as_tensor(y).reshape(-1, 1)).backward()
        opt.step()
    assert _max_diff(fitted.states["linear"], reference.state_dict()) <= 1e-6


def test_node_ids_are_stable_unique_and_chosen_by_named():
    graph = Center() >> Center() >> sz.TorchFilter(torch.nn.Linear(2, 2)) >> Center().named("c")
    assert graph.node_ids == ["center", "center_2", "linear", "c"]
    assert repr(graph) == "center >> center_2 >> linear >> c"
    assert isinstance(graph["linear"], sz.TorchFilter)
    with pytest.raises(KeyError, match="no node 'nope'"):
        graph["nope"]


def test_graph_refuses_duplicate_ids_and_a_filter_used_twice():
    with pytest.raises(sz.GraphError, match=r"\['a'\] named more than once"):
        Center().named("a") >> Center().named("a")
    c = Center()
    with pytest.raises(sz.GraphError, match="appears twice"):
        c >> c


def test_rows_of_x_and_y_must_match():
    x, y = _data(n=10)
    graph = Center() >> sz.TorchFilter(torch.nn.Linear(6, 3), loss="cross_entropy")
    with pytest.raises(Exception, match="x has 10 rows and y has 4"):
        graph.fit(x, y[:4])


def test_torch_filter_fit_alone_returns_its_state_dict():
    x, y = _data(n=30, d=4)
    module = torch.nn.Linear(4, 3)
    state = sz.TorchFilter(module, loss="cross_entropy", epochs=1, batch_size=None).fit(x, y)
    assert set(state) == {"weight", "bias"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())


def test_bad_torch_filter_settings_are_refused():
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        sz.TorchFilter(torch.nn.Linear(1, 1), loss="hinge")
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs'"):
        sz.TorchFilter(torch.nn.Linear(1, 1), optimizer="lbfgs")
    with pytest.raises(TypeError, match=r"wraps a torch\.nn\.Module"):
        sz.TorchFilter(lambda x: x)  # type: ignore[arg-type]
