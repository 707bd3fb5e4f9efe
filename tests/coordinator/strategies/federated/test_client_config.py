"""Per-round client config (``sz.FedAvg(..., client_config=f)``): each round's ``lr``,
``local_epochs`` and ``batch_size`` reach every client's training, against plain-torch
trainings with those settings averaged by hand; bad configs refused at submit, naming the
round."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from coordinator.strategies import StrategyOptionsError, strategy_from_spec
from tests.coordinator.strategies.federated.test_fedavg import (
    D,
    graph,
    job_inputs,
    model,
    own_data_context,
    run,
    shards,
    weighted_average,
)


def trained(start, x, y, lr: float, epochs: int, batch: int):
    """ClientUpdate by hand: ``epochs`` of SGD at ``lr`` over the centred rows, ``batch`` at a
    time, in order."""
    net = torch.nn.Linear(D, 2)
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    for _ in range(epochs):
        for s in range(0, len(xt), batch):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(xt[s : s + batch]), yt[s : s + batch]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def decay(r: int) -> dict:
    return {"lr": 0.1 * 0.5 ** (r - 1), "local_epochs": r, "batch_size": 4 * r}


def test_each_rounds_config_reaches_every_clients_training():
    data = shards()
    w = model().state_dict()
    for r in (1, 2, 3):
        c = decay(r)
        w = weighted_average(
            [
                (len(x), trained(w, x, y, c["lr"], c["local_epochs"], c["batch_size"]))
                for x, y in data
            ]
        )
    spec = sz.FedAvg(3, client_config=decay).spec()
    assert spec.options["client_config"] == [decay(1), decay(2), decay(3)]
    states, events = run(
        strategy_from_spec("fedavg", spec.options), own_data_context(data), job_inputs(graph())
    )
    for key, value in w.items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=1e-6)
    assert [e["client_config"] for e in events] == [decay(1), decay(2), decay(3)]


def test_a_config_that_sets_only_lr_keeps_the_other_settings():
    data = shards()
    spec = sz.FedAvg(1, local_epochs=2, client_config=lambda r: {"lr": 0.01}).spec()
    states, _ = run(
        strategy_from_spec("fedavg", spec.options), own_data_context(data), job_inputs(graph())
    )
    start = model().state_dict()
    expected = weighted_average([(len(x), trained(start, x, y, 0.01, 2, 8)) for x, y in data])
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: {"lr": -1.0}, r"FedAvg: client_config\(1\) returned \{'lr': -1.0\}: lr must be"),
        (lambda r: {"momentum": 0.9}, r"it may set \['lr', 'local_epochs', 'batch_size'\]"),
        (lambda r: {"local_epochs": 0} if r == 2 else {}, r"client_config\(2\) returned"),
        (lambda r: {"lr": 1 / (2 - r) ** 2}, r"client_config\(2\) raised ZeroDivisionError"),
        (lambda r: [r], "a round's client config must be a dict"),
        ("lr", "client_config must be a function of the round"),
    ],
)
def test_bad_client_configs_are_refused_naming_the_round(make, message):
    with pytest.raises(ValueError, match=message):
        sz.FedAvg(3, client_config=make)


def test_the_wire_refuses_a_config_list_of_the_wrong_length():
    with pytest.raises(StrategyOptionsError, match=r"client_config must be a list of 2 objects"):
        strategy_from_spec("fedavg", {"rounds": 2, "client_config": [{"lr": 0.1}]})
    with pytest.raises(StrategyOptionsError, match=r"round 2 .*batch_size must be a positive"):
        strategy_from_spec("fedavg", {"rounds": 2, "client_config": [{}, {"batch_size": 0}]})
