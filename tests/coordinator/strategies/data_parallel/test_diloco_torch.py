"""DiLoCo's outer momentum as a checkpoint holds it: the replicas' torch SGD buffers saved as
the coordinator's outer step keeps its momentum, so that a checkpoint from either path resumes
on the other. (Live: test_far_apart_live.py, test_resume.py, test_restarts.py.)"""

from __future__ import annotations

import numpy as np
import torch

from coordinator.strategies.data_parallel.diloco_torch import momentum_of, saved_momentum
from coordinator.strategies.federated.server_optimizers import FedAvgM
from protocol.options.server_optimizers import FedAvgMOptions


def test_torch_sgds_buffers_are_saved_as_the_coordinators_outer_momentum_and_back():
    """Nesterov SGD on the global weights with the pseudo-gradient as its gradient (the
    replicas') and FedAvgM with Nesterov on −pseudo-gradient (the coordinator's) step alike;
    after two steps the replicas' buffers, saved, are FedAvgM's state; FedAvgM's state, set on
    a fresh torch SGD, takes the third step as the one that ran on."""
    rng = np.random.default_rng(0)
    shapes = {"0.weight": (4, 3), "0.bias": (4,)}
    start = {k: torch.tensor(rng.normal(size=s), dtype=torch.float32) for k, s in shapes.items()}
    deltas = [
        {k: torch.tensor(rng.normal(size=s), dtype=torch.float32) for k, s in shapes.items()}
        for _ in range(3)
    ]
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    sgd = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    server = FedAvgM(FedAvgMOptions(lr=0.7, momentum=0.9, nesterov=True))
    global_state = {"mlp": {k: v.double().numpy() for k, v in start.items()}}
    for delta in deltas[:2]:
        for k, p in params.items():
            p.grad = delta[k].clone()
        sgd.step()
        towards = {"mlp": {k: (-d).double().numpy() for k, d in delta.items()}}
        mean = {"mlp": {k: global_state["mlp"][k] + towards["mlp"][k] for k in shapes}}
        global_state = server.step(global_state, mean)
    buffers = {"mlp": {k: sgd.state[p]["momentum_buffer"] for k, p in params.items()}}
    saved = saved_momentum(buffers)
    expected = {tuple(path): moments[0] for path, moments in server.state_dict()}
    assert {tuple(path) for path, _ in saved} == set(expected)
    for path, (moment,) in saved:
        np.testing.assert_allclose(moment, expected[tuple(path)], rtol=0, atol=1e-6)

    fresh = {k: p.detach().clone().requires_grad_(True) for k, p in params.items()}
    again = torch.optim.SGD(fresh.values(), lr=0.7, momentum=0.9, nesterov=True)
    loaded = momentum_of(server.state_dict())["mlp"]
    for k, p in fresh.items():
        again.state[p] = {"momentum_buffer": torch.from_numpy(loaded[k])}
    for k in shapes:
        params[k].grad = deltas[2][k].clone()
        fresh[k].grad = deltas[2][k].clone()
    sgd.step()
    again.step()
    for k in shapes:
        torch.testing.assert_close(fresh[k], params[k], rtol=0, atol=1e-6)
