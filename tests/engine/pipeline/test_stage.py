"""Pipeline stages (ModelParallel): micro-batches forward and backward, one step per batch.

The reference is plain torch: the unsplit model trained on the whole global batch, one optimizer
step per batch. GPipe (Huang et al. 2019) accumulates the micro-batches' gradients and steps once,
so with each micro-batch's loss scaled by its share of the rows the split run must land on the
same weights.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from engine.engine import Engine
from engine.errors import EngineError
from protocol.codec import encode_frame
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from worker.daemon.main import Daemon

Stage = tuple[Engine, list[str]]


class HeldCenter:
    """A plain filter that must only be applied in a pipeline: fitting it again is a failure."""

    def fit(self, x, y=None):
        raise AssertionError("a pipeline stage must not refit a plain filter")

    def forward(self, x, state):
        return x - state["mean"]


def _data(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)), rng.normal(size=(n, 2))


def _stage_modules(n_stages: int, seed: int = 0) -> list[torch.nn.Module]:
    """A 3-layer MLP (4 → 8 → 6 → 2), cut into 2 or 3 stages, in float64."""
    torch.manual_seed(seed)
    l1, l2, l3 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 2)
    if n_stages == 2:
        parts = [
            torch.nn.Sequential(l1, torch.nn.Tanh()),
            torch.nn.Sequential(l2, torch.nn.Tanh(), l3),
        ]
    else:
        parts = [
            torch.nn.Sequential(l1, torch.nn.Tanh()),
            torch.nn.Sequential(l2, torch.nn.Tanh()),
            l3,
        ]
    return [p.double() for p in parts]


def _engines(modules: Sequence[torch.nn.Module], optimizer: str, lr: float) -> list[Stage]:
    """One engine per stage, each holding a copy of its stage as one TorchFilter."""
    stages = []
    for i, module in enumerate(modules):
        engine = Engine()
        f = sz.TorchFilter(copy.deepcopy(module), loss="mse", optimizer=optimizer, lr=lr)
        engine.load({f"s{i}": f})
        stages.append((engine, [f"s{i}"]))
    return stages


def _run_batch(stages: list[Stage], x: np.ndarray, y: np.ndarray, sizes: Sequence[int]) -> Any:
    """One global batch on the stages, GPipe order: F0..F(M-1) on every stage, then B(M-1)..B0,
    then one step per stage. Returns the losses and every stage's input gradients per micro."""
    n = len(x)
    bounds = np.cumsum([0, *sizes])
    losses, input_grads = [], {s: {} for s in range(len(stages))}
    for m, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        act: Any = x[lo:hi]
        for s, (engine, ids) in enumerate(stages):
            last = s == len(stages) - 1
            act = engine.stage.stage_forward(
                ids, m, act, y[lo:hi] if last else None, (hi - lo) / n, last, first=s == 0
            )
        losses.append(act)
    for m in reversed(range(len(sizes))):
        grad = None
        for s in reversed(range(len(stages))):
            engine, _ = stages[s]
            grad = engine.stage.stage_backward(m, grad)
            input_grads[s][m] = grad
    for engine, ids in stages:
        assert engine.stage.stage_step(ids) > 0
    return losses, input_grads


def _assert_same_weights(stages: list[Stage], reference: Sequence[torch.nn.Module]) -> None:
    for (engine, ids), module in zip(stages, reference, strict=True):
        state = engine.nodes.get_state(ids)[ids[-1]]  # the stage's torch node
        for key, value in module.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("n_stages", "sizes", "optimizer", "lr", "batches"),
    [
        (2, [4, 4, 4], "sgd", 0.1, 1),
        (2, [12], "sgd", 0.1, 1),
        (3, [5, 4, 3], "sgd", 0.1, 1),
        (2, [4, 4, 4], "sgd", 0.1, 3),
        (3, [5, 4, 3], "adam", 0.05, 3),
    ],
)
def test_split_training_equals_unsplit_training(n_stages, sizes, optimizer, lr, batches):
    modules = _stage_modules(n_stages)
    stages = _engines(modules, optimizer, lr)
    reference = [copy.deepcopy(m) for m in modules]
    model = torch.nn.Sequential(*reference)
    make = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    opt = make(model.parameters(), lr=lr)

    for b in range(batches):
        x, y = _data(seed=b)
        losses, _ = _run_batch(stages, x, y, sizes)
        opt.zero_grad()
        loss = F.mse_loss(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        # The micro-batches' unscaled losses, weighted by rows, are the batch's mean loss.
        mean = sum(r["loss"] * r["rows"] for r in losses) / len(x)
        assert mean == pytest.approx(float(loss.detach()), abs=1e-9)
        assert [r["rows"] for r in losses] == list(sizes)

    _assert_same_weights(stages, reference)


def test_input_gradient_is_autograd_gradient_of_the_previous_output():
    modules = _stage_modules(2)
    stages = _engines(modules, "sgd", 0.1)
    x, y = _data()
    hidden = modules[0](torch.as_tensor(x))
    hidden.retain_grad()
    F.mse_loss(modules[1](hidden), torch.as_tensor(y)).backward()
    assert hidden.grad is not None

    _, input_grads = _run_batch(stages, x, y, [4, 4, 4])

    for m in range(3):
        torch.testing.assert_close(
            input_grads[1][m], hidden.grad[4 * m : 4 * m + 4], rtol=0, atol=1e-10
        )
        assert input_grads[0][m] is None  # the first stage's input needs no gradient


def test_a_plain_filter_opening_the_first_stage_is_applied_not_refitted():
    modules = _stage_modules(2)
    stages = _engines(modules, "sgd", 0.1)
    engine0 = Engine()
    s0 = sz.TorchFilter(copy.deepcopy(modules[0]), optimizer="sgd", lr=0.1)
    engine0.load({"center": HeldCenter(), "s0": s0})
    mean = np.array([0.5, -1.0, 2.0, 0.0])
    engine0.nodes.set_state({"center": {"mean": mean}})
    stages[0] = (engine0, ["center", "s0"])
    x, y = _data()
    model = torch.nn.Sequential(*[copy.deepcopy(m) for m in modules])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.as_tensor(x - mean)), torch.as_tensor(y)).backward()
    opt.step()

    _run_batch(stages, x, y, [6, 6])

    _assert_same_weights(stages, list(model))
    np.testing.assert_array_equal(engine0.nodes.get_state(["center"])["center"]["mean"], mean)


# -- refusals -------------------------------------------------------------------------------------


@pytest.fixture
def last_stage() -> Engine:
    engine, _ = _engines(_stage_modules(2), "sgd", 0.1)[1]
    return engine


def _refused(call: Any, *args: Any, **kwargs: Any) -> EngineError:
    with pytest.raises(EngineError) as info:
        call(*args, **kwargs)
    return info.value


def test_backward_of_an_unknown_micro_names_the_ones_in_flight(last_stage):
    h, y = torch.zeros(4, 8, dtype=torch.float64), np.zeros((4, 2))
    last_stage.stage.stage_forward(["s1"], 3, h, y, last=True)
    error = _refused(last_stage.stage.stage_backward, 7)
    assert error.code == ErrorCode.BAD_REQUEST
    assert "7" in error.message and error.detail["in_flight"] == [3]


def test_a_micro_id_already_in_flight_is_refused(last_stage):
    h, y = torch.zeros(4, 8, dtype=torch.float64), np.zeros((4, 2))
    last_stage.stage.stage_forward(["s1"], 0, h, y, last=True)
    error = _refused(last_stage.stage.stage_forward, ["s1"], 0, h, y, last=True)
    assert "already in flight" in error.message


def test_step_with_micro_batches_in_flight_is_refused(last_stage):
    h, y = torch.zeros(4, 8, dtype=torch.float64), np.zeros((4, 2))
    for m in (0, 1):
        last_stage.stage.stage_forward(["s1"], m, h, y, last=True)
    last_stage.stage.stage_backward(0)
    error = _refused(last_stage.stage.stage_step, ["s1"])
    assert error.detail["in_flight"] == [1] and "[1]" in error.message
    last_stage.stage.stage_backward(1)
    assert last_stage.stage.stage_step(["s1"]) == 4  # two Linear layers: weight and bias each


def test_the_last_stage_needs_labels(last_stage):
    error = _refused(last_stage.stage.stage_forward, ["s1"], 0, torch.zeros(4, 8), None, last=True)
    assert error.code == ErrorCode.BAD_REQUEST and "labels" in error.message


def test_a_plain_filter_cannot_open_a_later_stage():
    engine = Engine()
    engine.load({"center": HeldCenter(), "lin": sz.TorchFilter(torch.nn.Linear(4, 2))})
    engine.nodes.set_state({"center": {"mean": np.zeros(4)}})
    error = _refused(engine.stage.stage_forward, ["center", "lin"], 0, torch.zeros(3, 4))
    assert "not the first" in error.message


# -- through the daemon ---------------------------------------------------------------------------


def _ask(daemon: Daemon, **message: Any) -> Any:
    reply = daemon.handle(bytearray(encode_frame(message)))
    assert reply["ok"] is True, reply
    return reply["result"]


@pytest.mark.parametrize("staged_labels", [False, True])
def test_daemon_commands_drive_a_two_stage_pipeline(staged_labels):
    modules = _stage_modules(2)
    daemons = []
    for i, module in enumerate(modules):
        d = Daemon()
        f = sz.TorchFilter(copy.deepcopy(module), loss="mse", optimizer="sgd", lr=0.1)
        _ask(d, id=1, cmd="load", filters={f"s{i}": dump_filter(f)})
        daemons.append(d)
    x, y = _data()
    _ask(daemons[0], id=2, cmd="stage", name="train", x=x)
    if staged_labels:  # as a last stage on its worker's own data holds them
        _ask(daemons[1], id=2, cmd="stage", name="labels", x=y)
    model = torch.nn.Sequential(*[copy.deepcopy(m) for m in modules])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.as_tensor(x)), torch.as_tensor(y)).backward()
    opt.step()

    d0, d1 = daemons
    for m in range(2):
        rows = list(range(6 * m, 6 * m + 6))
        h = _ask(d0, id=3, cmd="stage_forward", node_ids=["s0"], micro=m, data="train",
                 rows=rows, first=True)  # fmt: skip
        labels = {"labels": "labels", "label_rows": rows} if staged_labels else {"y": y[rows]}
        out = _ask(d1, id=4, cmd="stage_forward", node_ids=["s1"], micro=m, x=h, scale=0.5,
                   last=True, **labels)  # fmt: skip
        assert out["rows"] == 6
    for m in (1, 0):
        g = _ask(d1, id=5, cmd="stage_backward", micro=m)
        assert _ask(d0, id=6, cmd="stage_backward", micro=m, grad_output=g) is None
    assert _ask(d0, id=7, cmd="stage_step", node_ids=["s0"]) == 2
    assert _ask(d1, id=8, cmd="stage_step", node_ids=["s1"]) == 4

    for (i, d), module in zip(enumerate(daemons), model, strict=True):
        state = _ask(d, id=9, cmd="get_state", node_ids=[f"s{i}"])[f"s{i}"]
        for key, value in module.state_dict().items():
            torch.testing.assert_close(torch.as_tensor(state[key]), value, rtol=0, atol=1e-6)

    error = d1.handle(bytearray(encode_frame({"id": 10, "cmd": "stage_backward", "micro": 5})))
    assert error["ok"] is False and error["error"]["code"] == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"labels": "labels", "last": True}, "labels and label_rows come together"),
        ({"labels": "labels", "label_rows": [0]}, "staged labels are the last stage's y"),
        ({"labels": "labels", "label_rows": [0], "y": [[1.0]], "last": True}, "not both"),
    ],
)
def test_staged_labels_are_refused_where_they_cannot_be_the_last_stages_y(fields, says):
    request = {"id": 1, "cmd": "stage_forward", "node_ids": ["s1"], "micro": 0} | fields
    reply = Daemon().handle(bytearray(encode_frame(request)))
    assert reply["ok"] is False and reply["error"]["code"] == ErrorCode.BAD_REQUEST
    assert says in reply["error"]["message"]
