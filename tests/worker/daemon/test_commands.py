"""Every daemon command, through the supervisor, over real pipes to a real daemon; user code that
raises, prints or sends invalid requests leaves the daemon up."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from protocol.daemon import FitRequest
from protocol.errors import ErrorCode
from tests.utils import UNIT, Boom
from tests.utils import Center as CenterFilter
from tests.worker.daemon.supervised import (
    Center,
    Driver,
    Printer,
    assert_states_equal,
    driving,
    make_data,
    make_linear,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon() -> Iterator[Driver]:
    """One long-lived daemon for every test here: none of them leaves it down."""
    with driving() as driver:
        yield driver


# -- every command ------------------------------------------------------------------------------


def test_ping_answers_none_and_load_returns_the_node_ids(daemon):
    assert daemon("ping") is None
    assert daemon.load(center=Center(), boom=Boom()) == ["center", "boom"]


def test_fit_and_forward_of_a_plain_filter(daemon):
    daemon.load(center=Center())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    result = daemon("fit", node_id="center", x=x)
    assert result["rows"] == 4 and result["loss"] is None
    np.testing.assert_array_equal(result["states"]["center"]["mean"], x.mean(0))
    np.testing.assert_array_equal(daemon("forward", node_id="center", x=x), x - x.mean(0))
    state = {"mean": np.ones(3, dtype=np.float32)}
    np.testing.assert_array_equal(daemon("forward", node_id="center", x=x, state=state), x - 1)


def test_a_request_model_works_like_a_dict(daemon):
    daemon.load(center=Center())
    x = torch.ones(2, 2)
    result = daemon.run(
        daemon.supervisor.request(FitRequest(id=0, cmd="fit", node_id="center", x=x))
    )
    torch.testing.assert_close(result["states"]["center"]["mean"], torch.ones(2))


def test_chain_commands_match_local_graph_fit(daemon):
    x, y = make_data(n=32)
    net = sz.TorchFilter(make_linear(), lr=0.1, batch_size=8, epochs=3, seed=1)
    center, local_net = CenterFilter().named("center"), copy.deepcopy(net).named("lin")
    fitted = (center >> local_net).fit(x, y)

    daemon.load(center=CenterFilter(), lin=net)
    result = daemon("batched_fit", node_ids=["center", "lin"], x=x, y=y)
    assert result["rows"] == 32 and len(result["epoch_losses"]) == 3
    assert_states_equal(result["states"]["lin"], fitted.states["lin"])
    torch.testing.assert_close(result["loss"], fitted.epoch_losses[-1])

    out = daemon("composite_forward", node_ids=["center", "lin"], x=x)
    torch.testing.assert_close(out, fitted.forward(x))
    with_states = daemon("composite_forward", node_ids=["center", "lin"], x=x, states=fitted.states)
    torch.testing.assert_close(with_states, fitted.forward(x))


def test_composite_fit_is_one_gradient_pass_without_a_step(daemon):
    x, y = make_data()
    module = make_linear()
    daemon.load(center=CenterFilter(), lin=sz.TorchFilter(module, lr=0.1))
    result = daemon("composite_fit", node_ids=["center", "lin"], x=x, y=y)
    assert_states_equal(result["states"]["lin"], module.state_dict())

    reference = copy.deepcopy(module)
    loss = F.mse_loss(reference(x - x.mean(0)), y)
    loss.backward()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-6)
    grads = daemon("get_gradients", node_ids=["lin"])["lin"]
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_get_state_and_set_state_round_trip_plain_and_torch_states(daemon):
    x = torch.arange(8.0).reshape(4, 2)
    module = torch.nn.Linear(2, 2)
    daemon.load(center=Center(), lin=sz.TorchFilter(module))
    daemon("fit", node_id="center", x=x)

    states = daemon("get_state")
    assert set(states) == {"center", "lin"}
    assert_states_equal(states["lin"], module.state_dict())

    changed = {
        "center": {"mean": states["center"]["mean"] + 10},
        "lin": {k: v + 1 for k, v in states["lin"].items()},
    }
    assert daemon("set_state", states=changed) is None
    again = daemon("get_state", node_ids=["center", "lin"])
    torch.testing.assert_close(again["center"]["mean"], changed["center"]["mean"])
    assert_states_equal(again["lin"], changed["lin"])
    # What get_state returned is accepted as it is.
    daemon("set_state", states=again)
    torch.testing.assert_close(
        daemon("forward", node_id="center", x=x), x - again["center"]["mean"]
    )


def test_a_state_for_another_model_is_refused(daemon):
    daemon.load(lin=sz.TorchFilter(torch.nn.Linear(2, 2)))
    error = daemon.error("set_state", states={"lin": {"weight": torch.zeros(3, 3)}})
    assert error.code == ErrorCode.STATE_MISMATCH


# -- gradients ----------------------------------------------------------------------------------


def test_fit_leaves_autograd_gradients_and_does_not_step(daemon):
    x, y = make_data()
    module = make_linear()
    daemon.load(lin=sz.TorchFilter(module, lr=0.1))
    result = daemon("fit", node_id="lin", x=x, y=y)

    assert_states_equal(daemon("get_state")["lin"], module.state_dict())  # weights unchanged
    reference = copy.deepcopy(module)
    loss = F.mse_loss(reference(x), y)
    loss.backward()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-6)
    grads = daemon("get_gradients")["lin"]
    assert set(grads) == {"weight", "bias"}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_apply_gradients_steps_and_the_read_back_shows_it(daemon):
    module = make_linear()
    daemon.load(lin=sz.TorchFilter(module, optimizer="sgd", lr=0.1))
    g = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    assert daemon("apply_gradients", gradients={"lin": g}) == {"lin": 2}
    state = daemon("get_state")["lin"]
    torch.testing.assert_close(state["weight"], module.weight.detach() - 0.1 * g["weight"])
    torch.testing.assert_close(state["bias"], module.bias.detach() - 0.1 * g["bias"])


@pytest.mark.parametrize(
    ("optimizer", "options", "reference"),
    [
        ("adam", {}, lambda ps: torch.optim.Adam(ps, lr=0.01)),
        ("sgd", {"momentum": 0.9}, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
    ],
)
def test_the_optimizer_persists_across_apply_calls(daemon, optimizer, options, reference):
    module = make_linear()
    daemon.load(lin=sz.TorchFilter(module, optimizer=optimizer, lr=0.01, optimizer_options=options))
    local = copy.deepcopy(module)
    opt = reference(list(local.parameters()))
    for seed in (1, 2):
        torch.manual_seed(seed)
        g = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
        daemon("apply_gradients", gradients={"lin": g})
        for name, p in local.named_parameters():
            p.grad = g[name].clone()
        opt.step()
    state = daemon("get_state")["lin"]
    for name, p in local.named_parameters():
        torch.testing.assert_close(state[name], p.detach())


def test_no_gradients_is_an_error_not_an_empty_success(daemon):
    daemon.load(
        center=Center(),
        lin=sz.TorchFilter(make_linear()),
        relu=sz.TorchFilter(torch.nn.ReLU()),
    )
    assert daemon.error("get_gradients", node_ids=["lin"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("get_gradients", node_ids=["center"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("get_gradients", node_ids=["relu"]).code == ErrorCode.NO_GRADIENTS
    assert daemon.error("apply_gradients", gradients={}).code == ErrorCode.NO_GRADIENTS


def test_gradients_of_another_model_are_refused_and_nothing_moves(daemon):
    module = make_linear()
    daemon.load(lin=sz.TorchFilter(module, lr=0.1))
    missing = daemon.error("apply_gradients", gradients={"lin": {"weight": torch.ones(3, 4)}})
    assert missing.code == ErrorCode.GRADIENT_MISMATCH
    assert "bias" in missing.message
    shapes = daemon.error(
        "apply_gradients", gradients={"lin": {"weight": torch.ones(4, 3), "bias": torch.ones(3)}}
    )
    assert shapes.code == ErrorCode.GRADIENT_MISMATCH
    assert shapes.detail["parameter"] == "weight"
    assert_states_equal(daemon("get_state")["lin"], module.state_dict())


def test_a_100_mb_gradient_set_ships_out_and_back(daemon):
    module = make_linear(d=5000, out=5000)  # 25,005,000 float32 parameters
    daemon.load(big=sz.TorchFilter(module, lr=0.5))
    x, y = make_data(n=4, d=5000, out=5000)
    daemon("fit", node_id="big", x=x, y=y)

    grads = daemon("get_gradients", timeout=30 * UNIT)["big"]
    assert sum(g.nbytes for g in grads.values()) > 100_000_000
    reference = copy.deepcopy(module)
    F.mse_loss(reference(x), y).backward()
    torch.testing.assert_close(grads["weight"], reference.weight.grad)
    torch.testing.assert_close(grads["bias"], reference.bias.grad)

    assert daemon("apply_gradients", gradients={"big": grads}, timeout=30 * UNIT) == {"big": 2}
    state = daemon("get_state", timeout=30 * UNIT)["big"]
    expected = module.weight.detach() - 0.5 * reference.weight.grad
    torch.testing.assert_close(state["weight"], expected)
    daemon.load(center=Center())  # let the daemon drop 200 MB


def test_large_frames_cross_through_shared_memory_both_ways(daemon):
    module = make_linear(d=1024, out=1024)  # a 4 MB weight: over SHARED_MIN_BYTES
    daemon.load(big=sz.TorchFilter(module))
    before = daemon.supervisor.shared_bytes
    state = daemon("get_state")["big"]  # a large reply
    assert_states_equal(state, module.state_dict())
    changed = {k: v + 1 for k, v in state.items()}
    daemon("set_state", states={"big": changed})  # a large request
    assert_states_equal(daemon("get_state")["big"], changed)
    moved = daemon.supervisor.shared_bytes - before
    assert moved >= 3 * module.weight.nbytes  # two replies and one request, none by the pipe
    daemon.load(center=Center())


def _shared_fds() -> list[str]:
    """This process's open shared-memory regions (memfds), by their targets."""
    targets = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/memfd:somatize-"):
                targets.append(target)
    return targets


def test_a_daemons_shared_memory_goes_with_it():
    before = len(_shared_fds())
    with driving() as driver:
        assert len(_shared_fds()) == before + 2  # one region each way
        driver.run(driver.supervisor.restart())  # a new daemon, new regions
        assert len(_shared_fds()) == before + 2
    assert len(_shared_fds()) == before


# -- user code misbehaving (the daemon stays up) ------------------------------------------------


def test_a_filter_that_raises_reports_its_traceback_and_the_daemon_answers_on(daemon):
    daemon.load(center=Center(), boom=Boom())
    error = daemon.error("fit", node_id="boom", x=[1.0])
    assert error.code == ErrorCode.FILTER_ERROR
    assert error.detail["node_id"] == "boom"
    assert error.detail["type"] == "ValueError"
    assert "boom in fit" in error.message
    assert "in explode" in error.detail["traceback"]
    assert "boom in fit" in str(error)

    chain = daemon.error("composite_fit", node_ids=["center", "boom"], x=torch.ones(2, 2))
    assert chain.detail["node_id"] == "boom"
    assert daemon("ping") is None


def test_prints_in_a_filter_do_not_touch_the_protocol(daemon):
    daemon.load(printer=Printer())
    assert daemon("fit", node_id="printer", x=[1, 2, 3])["states"] == {"printer": {"rows": 3}}
    assert daemon("forward", node_id="printer", x=[4, 5]) == [4, 5]
    assert daemon("ping") is None


def test_invalid_requests_get_typed_errors_and_the_daemon_stays(daemon):
    unknown = daemon.error("launch")
    assert unknown.code == ErrorCode.BAD_REQUEST and unknown.detail["field"] == "cmd"
    bad = daemon.error("fit", node_id=["not", "a", "string"], x=1)
    assert bad.code == ErrorCode.BAD_REQUEST and bad.detail["field"] == "node_id"
    extra = daemon.error("ping", colour="red")
    assert extra.detail["field"] == "colour"
    unknown_node = daemon.error("forward", node_id="nobody", x=1)
    assert unknown_node.code == ErrorCode.UNKNOWN_NODE
    assert daemon("ping") is None
