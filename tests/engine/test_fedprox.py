"""The client side of FedProx and FedAvg in the engine: the proximal term (Li et al. 2020) against
a plain torch loop that adds it by hand, and the fresh optimizer of each federated round."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import somatize as sz
from engine.engine import Engine, FitSettings
from protocol.codec import encode_frame
from worker.daemon.main import Daemon


def _data(n: int = 20, d: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return x, y


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def _engine(module: torch.nn.Module, **options) -> Engine:
    engine = Engine()
    net = sz.TorchFilter(module, loss="mse", batch_size=6, shuffle=False, **options)
    engine.load({"lin": net})
    return engine


def _by_hand(module, x, y, mu: float, lr: float = 0.1, batch: int = 6, *, momentum: float = 0.0):
    """One epoch of SGD on mse + mu/2 ||w - w0||^2, w0 the weights it starts from."""
    net = copy.deepcopy(module)
    w0 = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    losses = []
    for start in range(0, len(xt), batch):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(
            net(xt[start : start + batch]), yt[start : start + batch]
        )
        proximal = sum(((p - a) ** 2).sum() for p, a in zip(net.parameters(), w0, strict=True))
        loss = loss + mu / 2 * proximal
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()) * len(xt[start : start + batch]))
    return net.state_dict(), sum(losses) / len(xt)


def test_one_epoch_with_prox_mu_equals_the_proximal_loss_by_hand_and_differs_without_it():
    x, y = _data()
    module = _linear()
    expected, expected_loss = _by_hand(module, x, y, mu=0.5)

    prox = _engine(copy.deepcopy(module), lr=0.1).fitting.batched_fit(
        ["lin"], x, y, FitSettings(prox_mu=0.5)
    )
    plain = _engine(copy.deepcopy(module), lr=0.1).fitting.batched_fit(
        ["lin"], x, y, FitSettings(prox_mu=0.0)
    )

    for key, value in expected.items():
        torch.testing.assert_close(prox.states["lin"][key], value, rtol=0, atol=1e-6)
    assert prox.loss == pytest.approx(expected_loss, abs=1e-6)
    # The term pulls towards w0 from the second batch on: the weights differ from mu = 0.
    assert not torch.allclose(plain.states["lin"]["weight"], prox.states["lin"]["weight"])
    mu0, _ = _by_hand(module, x, y, mu=0.0)
    torch.testing.assert_close(plain.states["lin"]["weight"], mu0["weight"], rtol=0, atol=1e-6)


def test_the_proximal_anchor_is_the_state_each_call_starts_from():
    """Each round's w0 is the global model it was given, not the weights of the first call."""
    x, y = _data()
    engine = _engine(_linear(), lr=0.1)
    engine.fitting.batched_fit(["lin"], x, y, FitSettings(prox_mu=0.5))
    start = _linear(seed=7)
    engine.nodes.set_state({"lin": start.state_dict()})
    second = engine.fitting.batched_fit(
        ["lin"], x, y, FitSettings(prox_mu=0.5, reset_optimizer=True)
    )
    expected, _ = _by_hand(start, x, y, mu=0.5)
    for key, value in expected.items():
        torch.testing.assert_close(second.states["lin"][key], value, rtol=0, atol=1e-6)


def test_reset_optimizer_trains_with_a_fresh_optimizer_and_the_default_keeps_its_momentum():
    x, y = _data()
    options = {"lr": 0.1, "optimizer_options": {"momentum": 0.9}}
    kept = _engine(_linear(), **options)
    fresh = _engine(_linear(), **options)
    for engine in (kept, fresh):
        engine.fitting.batched_fit(["lin"], x, y)
    start = _linear(seed=3)
    for engine in (kept, fresh):
        engine.nodes.set_state({"lin": start.state_dict()})

    reset = fresh.fitting.batched_fit(["lin"], x, y, FitSettings(reset_optimizer=True))
    carried = kept.fitting.batched_fit(["lin"], x, y)

    expected, _ = _by_hand(start, x, y, mu=0.0, momentum=0.9)
    for key, value in expected.items():
        torch.testing.assert_close(reset.states["lin"][key], value, rtol=0, atol=1e-6)
    # Without the reset, the first round's momentum buffers push the second round elsewhere.
    assert not torch.allclose(carried.states["lin"]["weight"], expected["weight"], atol=1e-4)


def test_the_daemon_passes_prox_mu_epochs_and_reset_optimizer_through():
    x, y = _data()
    module = _linear()
    daemon = Daemon()
    daemon.engine.load(
        {"lin": sz.TorchFilter(copy.deepcopy(module), lr=0.1, batch_size=6, shuffle=False)}
    )
    daemon.engine.rows.hold("local", x, y)
    request = {
        "id": 1,
        "cmd": "batched_fit",
        "node_ids": ["lin"],
        "data": "local",
        "epochs": 1,
        "prox_mu": 0.5,
        "reset_optimizer": True,
    }
    reply = daemon.handle(bytearray(encode_frame(request)))
    assert reply["ok"], reply
    expected, _ = _by_hand(module, x, y, mu=0.5)
    for key, value in expected.items():
        torch.testing.assert_close(reply["result"]["states"]["lin"][key], value, rtol=0, atol=1e-6)
    assert reply["result"]["epoch_losses"] and len(reply["result"]["epoch_losses"]) == 1
    bad = daemon.handle(bytearray(encode_frame({**request, "id": 2, "reset_optimizer": "x"})))
    assert not bad["ok"] and bad["error"]["detail"]["field"] == "reset_optimizer"
