"""q-FedAvg (Li et al. 2020, Algorithm 3) on in-memory workers against its update worked out
by the test from independent plain-torch local trainings and losses, and the engine's pieces it
rests on (the loss before training) and that a round's client config uses (the learning rate)."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from coordinator.strategies import QFedAvg, StrategyOptionsError, strategy_from_spec
from engine.engine import Engine, FitSettings
from protocol.options.strategies import QFedAvgOptions
from tests.coordinator.strategies.federated.test_fedavg import (
    LR,
    D,
    graph,
    job_inputs,
    local_training,
    model,
    own_data_context,
    run,
    shards,
)


def flat(state) -> torch.Tensor:
    return torch.cat([state["weight"].double().reshape(-1), state["bias"].double()])


def unflat(vector: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"weight": vector[: 2 * D].reshape(2, D).float(), "bias": vector[2 * D :].float()}


def loss_at(state, x, y) -> float:
    """F_k(w): the mean squared error of ``state`` on the centred shard, all rows at once."""
    net = torch.nn.Linear(D, 2)
    net.load_state_dict(state)
    with torch.no_grad():
        return float(
            torch.nn.functional.mse_loss(net(torch.as_tensor(x - x.mean(0))), torch.as_tensor(y))
        )


def q_rounds(data, rounds: int, q: float, lipschitz: float):
    """Li et al. 2020, Algorithm 3, written out: Δw_k = L(w_t − w̄_k), Δ_k = F_k^q Δw_k,
    h_k = q F_k^(q−1) ‖Δw_k‖² + L F_k^q, w_{t+1} = w_t − Σ Δ_k / Σ h_k."""
    w = {k: v.detach().clone() for k, v in model().state_dict().items()}
    for _ in range(rounds):
        deltas, hs = [], []
        for x, y in data:
            f = loss_at(w, x, y)
            trained, _ = local_training(w, x, y, epochs=1)
            dw = lipschitz * (flat(w) - flat(trained))
            deltas.append(f**q * dw)
            hs.append(q * f ** (q - 1) * float(dw @ dw) + lipschitz * f**q)
        w = unflat(flat(w) - torch.stack(deltas).sum(0) / sum(hs))
    return w


@pytest.mark.parametrize("q", [0.0, 1.0, 5.0])
def test_qfedavg_equals_the_papers_update_worked_out_by_hand(q):
    data = shards()
    expected = q_rounds(data, 2, q, 1 / LR)
    spec = sz.QFedAvg(rounds=2, q=q, lipschitz=1 / LR).spec()
    strategy = strategy_from_spec(spec.name, spec.options)
    assert isinstance(strategy, QFedAvg)
    states, events = run(strategy, own_data_context(data), job_inputs(graph()))
    for key, value in expected.items():
        torch.testing.assert_close(states["lin"][key], value, rtol=0, atol=1e-5)
    assert [e["round"] for e in events] == [1, 2]


def test_qfedavg_with_q_0_is_the_unweighted_mean_of_the_client_models():
    data = shards()
    start = model().state_dict()
    trained = [flat(local_training(start, x, y, epochs=1)[0]) for x, y in data]
    expected = unflat(torch.stack(trained).mean(0))
    states, _ = run(
        QFedAvg(QFedAvgOptions(q=0.0, lipschitz=1 / LR, rounds=1)),
        own_data_context(data),
        job_inputs(graph()),
    )
    for key, value in expected.items():
        torch.testing.assert_close(states["lin"][key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rounds": 1, "lipschitz": 1.0}, "q must be a finite number, not None"),
        ({"rounds": 1, "q": -1, "lipschitz": 1.0}, "q must be >= 0, not -1"),
        ({"rounds": 1, "q": 1, "lipschitz": 0}, r"lipschitz must be > 0 \(the paper takes 1/lr\)"),
        (
            {"rounds": 1, "q": 1, "lipschitz": 1, "server": {"name": "fedadam"}},
            "server must be None: q-FedAvg's server update is its own",
        ),
        (
            {"rounds": 1, "q": 1, "lipschitz": 1, "aggregator": {"name": "fedmedian"}},
            "aggregator must be None",
        ),
    ],
)
def test_bad_qfedavg_options_are_refused(options, message):
    with pytest.raises(StrategyOptionsError, match=message):
        strategy_from_spec("qfedavg", options)
    with pytest.raises(ValueError, match="QFedAvg: lipschitz must be > 0"):
        sz.QFedAvg(rounds=1, q=1.0, lipschitz=-2.0)


# -- the engine's pieces ----------------------------------------------------------------------


def engine_with(g: sz.Graph) -> Engine:
    engine = Engine()
    engine.load(dict(g.items()))
    return engine


def test_the_loss_before_training_is_the_mean_loss_at_the_starting_weights():
    (x, y), *_ = shards()
    engine = engine_with(graph())
    result = engine.fitting.batched_fit(
        ["center", "lin"], x, y, FitSettings(epochs=1, start_loss=True)
    )
    assert result.start_loss == pytest.approx(loss_at(model().state_dict(), x, y), rel=1e-6)
    assert result.loss != pytest.approx(result.start_loss)  # training did move on from there


def test_lr_sets_the_fresh_optimizers_learning_rate():
    (x, y), *_ = shards()
    engine = engine_with(graph())
    settings = FitSettings(epochs=1, reset_optimizer=True, lr=0.01)
    result = engine.fitting.batched_fit(["center", "lin"], x, y, settings)
    expected = local_training_with_lr(model().state_dict(), x, y, 0.01)
    for key, value in expected.items():
        torch.testing.assert_close(result.states["lin"][key], value, rtol=0, atol=1e-6)


def local_training_with_lr(start, x, y, lr: float):
    """One epoch of plain SGD at ``lr`` over the centred rows, 8 at a time, in order."""
    net = torch.nn.Linear(D, 2)
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    for s in range(0, len(xt), 8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xt[s : s + 8]), yt[s : s + 8]).backward()
        opt.step()
    return net.state_dict()


def test_start_loss_leaves_batchnorm_statistics_alone():
    def normed() -> sz.Graph:
        torch.manual_seed(0)
        net = sz.TorchFilter(
            torch.nn.Sequential(torch.nn.BatchNorm1d(D), torch.nn.Linear(D, 2)),
            loss="mse",
            optimizer="sgd",
            lr=0.01,
            batch_size=8,
            epochs=1,
        )
        return sz.Graph([net.named("n")])

    (x, y), *_ = shards()
    a = engine_with(normed()).fitting.batched_fit(["n"], x, y, FitSettings(start_loss=True))
    b = engine_with(normed()).fitting.batched_fit(["n"], x, y)
    assert a.start_loss is not None and a.start_loss > 0 and b.start_loss is None
    for key in a.states["n"]:
        assert torch.equal(a.states["n"][key], b.states["n"][key]), key
