"""Server optimizers, against their update rules worked out by hand in plain numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coordinator.strategies.aggregate import AggregationError
from coordinator.strategies.federated.server_optimizers import (
    OPTIMIZERS,
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgServer,
    FedYogi,
    ServerOptimizer,
    from_options,
)
from protocol.codec import decode, encode_frame
from protocol.options.server_optimizers import (
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
)

# A 2-leaf state: a float64 numpy array and a float32 torch tensor.
X0 = {"net": {"w": np.array([1.0, -2.0]), "b": torch.tensor([0.5], dtype=torch.float32)}}
# The round averages x̄_1, x̄_2, x̄_3 (absolute models, as weighted_mean returns them).
AVERAGES = [
    {"net": {"w": np.array([1.5, -1.0]), "b": torch.tensor([0.25], dtype=torch.float32)}},
    {"net": {"w": np.array([2.0, -1.5]), "b": torch.tensor([0.0], dtype=torch.float32)}},
    {"net": {"w": np.array([1.0, 0.5]), "b": torch.tensor([1.0], dtype=torch.float32)}},
]


def flat(state):
    """The state's two leaves as plain float64 numpy arrays."""
    return np.asarray(state["net"]["w"], dtype=np.float64), state["net"]["b"].double().numpy()


def run_rounds(optimizer):
    """The optimizer's global models after each of the three rounds."""
    state, models = X0, []
    for averaged in AVERAGES:
        state = optimizer.step(state, averaged)
        assert isinstance(state["net"]["w"], np.ndarray) and state["net"]["w"].dtype == np.float64
        assert isinstance(state["net"]["b"], torch.Tensor)
        assert state["net"]["b"].dtype == torch.float32
        models.append(state)
    return models


def assert_rounds_match(models, expected):
    for round_, (model, (w, b)) in enumerate(zip(models, expected, strict=True), start=1):
        got_w, got_b = flat(model)
        np.testing.assert_allclose(got_w, w, rtol=1e-12, err_msg=f"round {round_}")
        np.testing.assert_allclose(got_b, b, rtol=1e-6, err_msg=f"round {round_}")  # float32


def by_hand(update):
    """x_t for three rounds of ``update(leaf, x, Δ) -> x_next`` on each leaf, in float64 numpy.

    The float32 leaf is rounded to float32 after each round, as the server stores it.
    """
    x = list(flat(X0))
    out = []
    for averaged in AVERAGES:
        xbar = flat(averaged)
        x = [update(i, x[i], xbar[i] - x[i]) for i in range(2)]
        x[1] = x[1].astype(np.float32).astype(np.float64)
        out.append(tuple(x))
    return out


# Update rules over three rounds ---------------------------------------------------------------


def test_fedavg_takes_the_average():
    models = run_rounds(FedAvgServer())
    assert_rounds_match(models, [flat(a) for a in AVERAGES])


def test_fedavgm_three_rounds():
    lr, beta = 0.5, 0.9
    m = [np.zeros(2), np.zeros(1)]

    def update(i, x, delta):
        m[i] = beta * m[i] + delta  # m_t = β m_{t−1} + Δ_t
        return x + lr * m[i]  # x_{t+1} = x_t + η m_t

    assert_rounds_match(run_rounds(FedAvgM(FedAvgMOptions(lr=lr, momentum=beta))), by_hand(update))


def test_fedavgm_with_nesterov_steps_as_torchs_nesterov_sgd_on_minus_the_pseudo_gradient():
    """DiLoCo's outer step: torch.optim.SGD(nesterov=True) given −Δ_t as the gradient."""
    lr, beta = 0.7, 0.9
    params = [torch.tensor(leaf, dtype=torch.float64) for leaf in flat(X0)]
    sgd = torch.optim.SGD(params, lr=lr, momentum=beta, nesterov=True)
    expected = []
    for averaged in AVERAGES:
        for p, xbar in zip(params, flat(averaged), strict=True):
            p.grad = p.detach() - torch.as_tensor(xbar)  # −Δ_t = x_t − x̄
        sgd.step()
        params[1].data = params[1].data.float().double()  # the server stores float32
        expected.append(tuple(p.detach().numpy().copy() for p in params))
    options = FedAvgMOptions(lr=lr, momentum=beta, nesterov=True)
    assert_rounds_match(run_rounds(FedAvgM(options)), expected)
    heavy_ball = run_rounds(FedAvgM(FedAvgMOptions(lr=lr, momentum=beta)))
    assert not np.allclose(flat(heavy_ball[1])[0], expected[1][0])


def test_fedadam_three_rounds():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    m = [np.zeros(2), np.zeros(1)]
    v = [np.full(2, tau**2), np.full(1, tau**2)]  # v_{-1} = τ²

    def update(i, x, delta):
        m[i] = b1 * m[i] + (1 - b1) * delta
        v[i] = b2 * v[i] + (1 - b2) * delta**2
        return x + lr * m[i] / (np.sqrt(v[i]) + tau)

    assert_rounds_match(
        run_rounds(FedAdam(FedAdamOptions(lr=lr, beta1=b1, beta2=b2, tau=tau))), by_hand(update)
    )


def test_fedyogi_three_rounds():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    m = [np.zeros(2), np.zeros(1)]
    v = [np.full(2, tau**2), np.full(1, tau**2)]

    def update(i, x, delta):
        m[i] = b1 * m[i] + (1 - b1) * delta
        v[i] = v[i] - (1 - b2) * delta**2 * np.sign(v[i] - delta**2)
        return x + lr * m[i] / (np.sqrt(v[i]) + tau)

    assert_rounds_match(
        run_rounds(FedYogi(FedYogiOptions(lr=lr, beta1=b1, beta2=b2, tau=tau))), by_hand(update)
    )


def test_fedadagrad_three_rounds():
    lr, b1, tau = 0.1, 0.9, 1e-3
    m = [np.zeros(2), np.zeros(1)]
    v = [np.full(2, tau**2), np.full(1, tau**2)]  # v_{-1} = τ²

    def update(i, x, delta):
        m[i] = b1 * m[i] + (1 - b1) * delta
        v[i] = v[i] + delta**2  # Reddi et al. 2021, Algorithm 2, FedAdagrad
        return x + lr * m[i] / (np.sqrt(v[i]) + tau)

    assert_rounds_match(
        run_rounds(FedAdagrad(FedAdagradOptions(lr=lr, beta1=b1, tau=tau))), by_hand(update)
    )


def test_fedadagrad_two_rounds_in_numbers():
    # x = 1, x̄ = 4: Δ = 3. β1 = 0.5, τ = 1, η = 2: m = 1.5; v = 1 + 9 = 10;
    # x' = 1 + 2·1.5 / (√10 + 1) = 1 + 3 / 4.16227766... = 1.72075922...
    # Then x̄ = x': Δ = 0, m = 0.75, v = 10: x'' = x' + 2·0.75 / (√10 + 1) = 2.08113883...
    opt = FedAdagrad(FedAdagradOptions(lr=2.0, beta1=0.5, tau=1.0))
    first = opt.step({"n": {"x": 1.0}}, {"n": {"x": 4.0}})["n"]["x"]
    assert first == pytest.approx(1.7207592200561264, rel=1e-15)
    assert opt.step({"n": {"x": first}}, {"n": {"x": first}})["n"]["x"] == pytest.approx(
        2.0811388300841895, rel=1e-15
    )


def test_fedadam_first_round_in_numbers():
    # x = 1, x̄ = 3: Δ = 2. β1 = 0.5, β2 = 0.75, τ = 2, η = 1:
    # m = 0.5·0 + 0.5·2 = 1; v = 0.75·τ² + 0.25·4 = 3 + 1 = 4; x' = 1 + 1·1 / (√4 + 2) = 1.25.
    opt = FedAdam(FedAdamOptions(lr=1.0, beta1=0.5, beta2=0.75, tau=2.0))
    assert opt.step({"n": {"x": 1.0}}, {"n": {"x": 3.0}}) == {"n": {"x": 1.25}}


def test_fedyogi_first_round_in_numbers():
    # x = 1, x̄ = 5: Δ = 4, Δ² = 16. β1 = 0.5, β2 = 0.25, τ = 2, η = 3:
    # m = 0.5·4 = 2; v = 4 − 0.75·16·sign(4 − 16) = 4 + 12 = 16; x' = 1 + 3·2 / (4 + 2) = 2.
    opt = FedYogi(FedYogiOptions(lr=3.0, beta1=0.5, beta2=0.25, tau=2.0))
    assert opt.step({"n": {"x": 1.0}}, {"n": {"x": 5.0}}) == {"n": {"x": 2.0}}


def test_fedavgm_with_no_momentum_and_lr_1_is_fedavg():
    plain, momentum = (
        run_rounds(FedAvgServer()),
        run_rounds(FedAvgM(FedAvgMOptions(lr=1.0, momentum=0.0))),
    )
    for a, b in zip(plain, momentum, strict=True):
        np.testing.assert_allclose(a["net"]["w"], b["net"]["w"], rtol=1e-15)
        assert torch.equal(a["net"]["b"], b["net"]["b"])


@pytest.mark.parametrize(
    "make",
    [lambda: FedAvgM(FedAvgMOptions(lr=1.0, momentum=0.5)), FedAdam, FedYogi],
    ids=["m", "adam", "yogi"],
)
def test_moments_persist_between_rounds(make):
    opt = make()
    x1 = opt.step(X0, AVERAGES[0])
    second = opt.step(x1, AVERAGES[1])
    fresh = make().step(x1, AVERAGES[1])
    assert not np.allclose(second["net"]["w"], fresh["net"]["w"])


def test_non_float_leaves_come_from_the_average():
    x = {"bn": {"w": np.array([0.0]), "num_batches_tracked": torch.tensor(3), "kind": "bn"}}
    xbar = {"bn": {"w": np.array([2.0]), "num_batches_tracked": torch.tensor(8), "kind": "bn"}}
    # FedAvgM η = 1, β = 0.5, first round: m = Δ = 2, x' = 0 + 2.
    new = FedAvgM(FedAvgMOptions(lr=1.0, momentum=0.5)).step(x, xbar)
    assert new["bn"]["w"].tolist() == [2.0]
    assert new["bn"]["num_batches_tracked"].item() == 8
    assert new["bn"]["kind"] == "bn"


def test_python_float_and_numpy_scalar_leaves_keep_their_type():
    # η = 1, β = 0: x' = x̄.
    new = FedAvgM(FedAvgMOptions(lr=1.0, momentum=0.0)).step(
        {"f": {"mu": 1.0, "sd": np.float32(1.0)}}, {"f": {"mu": 2.0, "sd": np.float32(3.0)}}
    )
    assert type(new["f"]["mu"]) is float and new["f"]["mu"] == 2.0
    assert type(new["f"]["sd"]) is np.float32 and new["f"]["sd"] == 3.0


# Refusals -------------------------------------------------------------------------------------


def test_global_and_average_must_match():
    opt = FedAdam()
    with pytest.raises(
        AggregationError,
        match="^"
        + re.escape(
            "node 'n', key 'w': the average has a float64 array of shape [3], "
            "the global model has a float64 array of shape [2]"
        )
        + "$",
    ):
        opt.step({"n": {"w": np.zeros(2)}}, {"n": {"w": np.zeros(3)}})
    with pytest.raises(
        AggregationError, match=r"^node 'n': key 'b' of the global model is missing"
    ):
        opt.step({"n": {"w": np.zeros(2), "b": np.zeros(1)}}, {"n": {"w": np.zeros(2)}})
    with pytest.raises(AggregationError, match="complex"):
        opt.step({"n": {"z": np.zeros(1, complex)}}, {"n": {"z": np.zeros(1, complex)}})


def test_a_leaf_whose_shape_changes_between_rounds_is_refused():
    opt = FedAvgM()
    opt.step({"n": {"w": np.zeros(2)}}, {"n": {"w": np.ones(2)}})
    with pytest.raises(AggregationError, match=re.escape("differs from [2] in earlier rounds")):
        opt.step({"n": {"w": np.zeros(3)}}, {"n": {"w": np.ones(3)}})


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fedavgm", {"lr": 0}, "fedavgm: lr must be > 0, got 0"),
        ("fedavgm", {"lr": -1.0}, "fedavgm: lr must be > 0, got -1.0"),
        ("fedavgm", {"momentum": 1.0}, "fedavgm: momentum must be in [0, 1), got 1.0"),
        ("fedavgm", {"momentum": -0.1}, "fedavgm: momentum must be in [0, 1), got -0.1"),
        ("fedadam", {"beta1": 1}, "fedadam: beta1 must be in [0, 1), got 1"),
        ("fedadam", {"beta2": 1.5}, "fedadam: beta2 must be in [0, 1), got 1.5"),
        ("fedyogi", {"tau": 0.0}, "fedyogi: tau must be > 0, got 0.0"),
        ("fedyogi", {"lr": float("nan")}, "fedyogi: lr must be a finite number, got nan"),
        ("fedadam", {"lr": "0.1"}, "fedadam: lr must be a finite number, got '0.1'"),
        ("fedadam", {"lr": True}, "fedadam: lr must be a finite number, got True"),
        (
            "fedadam",
            {"momentum": 0.9},
            "'fedadam' takes options ['lr', 'beta1', 'beta2', 'tau']",
        ),
        ("fedavg", {"lr": 1.0}, "'fedavg' takes no options; got unknown ['lr']"),
        ("fedprox", {}, "unknown server optimizer 'fedprox'; expected one of"),
    ],
)
def test_bad_names_and_hyperparameters_are_refused(name, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_options(name, options)


def test_from_options_builds_each_and_round_trips():
    assert set(OPTIMIZERS) == {"fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"}
    opt = from_options("fedyogi", {"lr": 0.5, "tau": 0.01})
    assert isinstance(opt, FedYogi) and isinstance(opt, ServerOptimizer)
    assert opt.options.hyperparameters() == {"lr": 0.5, "beta1": 0.9, "beta2": 0.99, "tau": 0.01}
    again = from_options(opt.name, opt.options.hyperparameters())
    assert repr(again) == repr(opt) == "FedYogi(lr=0.5, beta1=0.9, beta2=0.99, tau=0.01)"
    assert isinstance(from_options("fedavg", {}), FedAvgServer)
    assert from_options("fedavgm", {}).options.hyperparameters() == {
        "lr": 1.0,
        "momentum": 0.9,
        "nesterov": False,
    }
    assert from_options("fedadam", {}).options.hyperparameters() == {
        "lr": 0.01,
        "beta1": 0.9,
        "beta2": 0.99,
        "tau": 1e-3,
    }


def test_a_refused_step_keeps_the_moments():
    # FedAvgM η = 1, β = 0.5. Round 1 on "a" then a refused step ("b" mismatches), then round 2:
    # m_1 = 2, m_2 = 0.5·2 + 2 = 3 — the refused step must not have counted.
    opt = FedAvgM(FedAvgMOptions(lr=1.0, momentum=0.5))
    state = opt.step({"n": {"a": 0.0, "b": 0.0}}, {"n": {"a": 2.0, "b": 0.0}})
    assert state == {"n": {"a": 2.0, "b": 0.0}}
    with pytest.raises(AggregationError):
        opt.step(state, {"n": {"a": 100.0, "b": np.zeros(2)}})
    assert opt.step(state, {"n": {"a": 4.0, "b": 0.0}}) == {"n": {"a": 5.0, "b": 0.0}}


@pytest.mark.parametrize(
    "make", [FedAvgServer, lambda: FedAvgM(FedAvgMOptions(lr=0.5, momentum=0.9)), FedAdam, FedYogi]
)
def test_a_server_optimizer_resumed_from_its_state_dict_goes_on_as_the_uninterrupted_one(make):
    """A checkpoint holds ``state_dict()`` (through the codec, as a checkpoint file does); a
    new optimizer loaded with it takes round 3 exactly as the one that ran rounds 1 and 2."""
    straight = run_rounds(make())
    first = make()
    state = first.step(first.step(X0, AVERAGES[0]), AVERAGES[1])
    saved = decode(encode_frame(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(saved)
    third = resumed.step(state, AVERAGES[2])
    np.testing.assert_array_equal(flat(third)[0], flat(straight[2])[0])
    np.testing.assert_array_equal(flat(third)[1], flat(straight[2])[1])
    fresh = make().step(state, AVERAGES[2])  # without the moments it would differ
    if make is not FedAvgServer:
        assert not np.array_equal(flat(fresh)[0], flat(straight[2])[0])
