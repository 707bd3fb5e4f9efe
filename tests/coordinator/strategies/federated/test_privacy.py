"""Differential privacy for FedAvg (McMahan et al. 2018; Andrew et al. 2021): clipping checked
against norms worked out by the test from independent plain-torch trainings (server side, client
side, adaptive), the noise's statistics, and the ε each round reports against opacus' own RDP
accountant called by the test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from opacus.accountants import RDPAccountant

import somatize as sz
from coordinator.strategies import StrategyOptionsError, strategy_from_spec
from coordinator.strategies.federated.privacy import DPFold
from engine.engine import Engine, FitSettings
from protocol.options.privacy import AdaptiveClippingOptions, privacy_options
from tests.coordinator.strategies.federated.test_fedavg import (
    LR,
    D,
    job_inputs,
    model,
    own_data_context,
    run,
)
from tests.utils import Center

BATCH = 8


def private_graph() -> sz.Graph:
    net = sz.TorchFilter(
        model(), loss="mse", optimizer="sgd", lr=LR, batch_size=BATCH, shuffle=False, epochs=1
    )
    return sz.Graph([net.named("lin")])


def client_data(k: int = 4, rows: int = 40, seed: int = 5):
    rng = np.random.default_rng(seed)
    out = []
    for c in range(k):
        w = rng.normal(size=(D, 2)) * (1 + c)  # the clients disagree: their updates differ
        x = rng.normal(size=(rows, D)).astype(np.float32)
        out.append((x, (x @ w).astype(np.float32)))
    return out


def flat(state) -> torch.Tensor:
    return torch.cat([state["weight"].double().reshape(-1), state["bias"].double()])


def unflat(v: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"weight": v[: 2 * D].reshape(2, D).float(), "bias": v[2 * D :].float()}


def update(start, x, y) -> torch.Tensor:
    """Δ_k = ClientUpdate(k, θ) − θ by hand: one epoch of SGD, BATCH rows at a time, in order."""
    net = torch.nn.Linear(D, 2)
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for s in range(0, len(xt), BATCH):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xt[s : s + BATCH]), yt[s : s + BATCH]).backward()
        opt.step()
    return flat(net.state_dict()) - flat(start)


def clipped(delta: torch.Tensor, s: float) -> torch.Tensor:
    return delta * min(1.0, s / float(delta.norm()))


def assert_lin(states, expected):
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=2e-6)


def run_spec(strategy: sz.FedAvg, data):
    spec = strategy.spec()
    return run(
        strategy_from_spec(spec.name, spec.options),
        own_data_context(data),
        job_inputs(private_graph()),
    )


# -- clipping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["server", "client"])
def test_fixed_clipping_without_noise_is_the_mean_of_the_clipped_updates(side):
    data = client_data()
    norms = [float(update(model().state_dict(), x, y).norm()) for x, y in data]
    s = float(np.median(norms))  # half the updates are clipped, half are not
    theta = model().state_dict()
    for _ in range(2):
        total = sum(clipped(update(theta, x, y), s) for x, y in data)
        theta = unflat(flat(theta) + total / len(data))
    privacy = sz.FixedClipping(clip_norm=s, noise_multiplier=0.0, side=side)
    states, events = run_spec(sz.FedAvg(2, privacy=privacy), data)
    assert_lin(states, theta)
    assert [e["privacy"]["clip"] for e in events] == [s, s]
    assert events[-1]["privacy"]["epsilon"] == math.inf  # no noise, no privacy


def test_a_client_clips_its_own_update_in_its_engine():
    (x, y), *_ = client_data()
    start = model().state_dict()
    delta = update(start, x, y)
    engine = Engine()
    engine.load(dict(private_graph().items()))
    result = engine.fitting.batched_fit(
        ["lin"], x, y, FitSettings(clip_norm=float(delta.norm()) / 4)
    )
    got = flat(result.states["lin"]) - flat(start)
    torch.testing.assert_close(got, delta / 4, rtol=0, atol=1e-6)
    assert result.clipped is True
    again = Engine()
    again.load(dict(private_graph().items()))
    settings = FitSettings(clip_norm=10 * float(delta.norm()))
    assert again.fitting.batched_fit(["lin"], x, y, settings).clipped is False


def test_adaptive_clipping_follows_the_target_quantile_worked_out_by_hand():
    data = client_data(k=5)
    c, gamma, eta = 0.05, 0.5, 0.3
    theta, clips = model().state_dict(), []
    for _ in range(3):
        deltas = [update(theta, x, y) for x, y in data]
        clips.append(c)
        unclipped = sum(float(d.norm()) <= c for d in deltas)
        theta = unflat(flat(theta) + sum(clipped(d, c) for d in deltas) / len(data))
        c = c * math.exp(-eta * (unclipped / len(data) - gamma))  # Andrew et al., Algorithm 1
    privacy = sz.AdaptiveClipping(
        noise_multiplier=0.0, initial_clip=0.05, target_quantile=gamma, clip_lr=eta
    )
    states, events = run_spec(sz.FedAvg(3, privacy=privacy), data)
    assert_lin(states, theta)
    assert [e["privacy"]["clip"] for e in events] == pytest.approx(clips, rel=1e-12)
    assert len(set(clips)) == 3  # the clip really moved


def test_adaptive_clipping_splits_the_noise_between_update_and_count():
    # z = 0.5, m = 20: σ_b = m/20 = 1, z_Δ = (0.5^-2 − 2^-2)^-1/2 = 3.75^-1/2 (Theorem 1).
    options = AdaptiveClippingOptions(noise_multiplier=0.5)
    assert options.count_noise(20) == 1.0
    assert options.update_noise(20) == pytest.approx(3.75**-0.5, rel=1e-15)
    with pytest.raises(ValueError, match=r"needs count_stddev > 0.5, and a round of 10 clients"):
        AdaptiveClippingOptions(noise_multiplier=1.0).update_noise(10)


# -- noise ------------------------------------------------------------------------------------


def test_the_noise_is_gaussian_with_sigma_z_s_over_m():
    d, m, z, s = 40_000, 4, 1.5, 0.4
    start = {"lin": {"w": np.zeros(d, dtype=np.float64)}}
    fold = DPFold(
        start, ["lin"], s, update_noise=z, count_noise=0.0, selected=m, rng=np.random.default_rng(0)
    )
    for k in range(m):  # updates of zero: what comes out is the noise alone, over m
        fold.add(f"c{k}", {"rows": 1}, {"lin": {"w": np.zeros(d)}})
    noise = np.asarray(fold.result()[0]["lin"]["w"])
    sigma = z * s / m
    assert abs(noise.std() / sigma - 1) < 0.02
    assert abs(noise.mean()) < 4 * sigma / math.sqrt(d)
    assert scipy.stats.kstest(noise / sigma, "norm").pvalue > 1e-3


def test_a_noised_run_differs_from_the_clipped_mean_by_about_sigma_over_m():
    data = client_data()
    s, z = 0.5, 2.0
    total = sum(clipped(update(model().state_dict(), x, y), s) for x, y in data)
    clean = flat(model().state_dict()) + total / len(data)
    states, _ = run_spec(sz.FedAvg(1, privacy=sz.FixedClipping(s, z)), data)
    noise = flat({k: torch.as_tensor(v) for k, v in states["lin"].items()}) - clean
    # 12 numbers of N(0, (z s / m)²): their RMS within a wide band around σ = 0.25.
    assert 0.1 < float(noise.square().mean().sqrt()) < 0.5


# -- accounting -------------------------------------------------------------------------------


def test_the_epsilon_each_round_reports_is_opacus_rdp_accountants():
    data = client_data()
    privacy = sz.FixedClipping(clip_norm=1.0, noise_multiplier=1.1, delta=1e-5)
    _, events = run_spec(sz.FedAvg(3, fraction=0.5, privacy=privacy), data)
    accountant = RDPAccountant()
    for event in events:
        accountant.step(noise_multiplier=1.1, sample_rate=2 / 4)  # m = ⌈0.5 · 4⌉ of K = 4
        expected = accountant.get_epsilon(delta=1e-5)
        assert event["privacy"]["epsilon"] == pytest.approx(expected, rel=1e-3)
        assert event["privacy"]["delta"] == 1e-5
    assert events[0]["privacy"]["epsilon"] < events[-1]["privacy"]["epsilon"]


# -- refusals ---------------------------------------------------------------------------------


def test_privacy_refusals():
    private = {"name": "fixed_clipping", "clip_norm": 1.0, "noise_multiplier": 1.0}
    plain = sz.Graph([Center().named("center"), *(f for _, f in private_graph().items())])
    strategy = strategy_from_spec("fedavg", {"rounds": 1, "privacy": private})
    with pytest.raises(StrategyOptionsError, match=r"plain filters \['center'\] would be averaged"):
        strategy.validate(job_inputs(plain))
    with pytest.raises(StrategyOptionsError, match="privacy and a robust aggregator"):
        strategy_from_spec(
            "fedavg", {"rounds": 1, "privacy": private, "aggregator": {"name": "fedmedian"}}
        )
    with pytest.raises(StrategyOptionsError, match="privacy must be None"):
        strategy_from_spec("qfedavg", {"rounds": 1, "q": 1, "lipschitz": 1, "privacy": private})
    adaptive = {"name": "adaptive_clipping", "noise_multiplier": 1.0}
    with pytest.raises(StrategyOptionsError, match=r"needs count_stddev > 0.5, and a round of 5"):
        strategy_from_spec("fedavg", {"rounds": 1, "min_workers": 5, "privacy": adaptive})
    strategy_from_spec(
        "fedavg", {"rounds": 1, "min_workers": 5, "privacy": adaptive | {"count_stddev": 1}}
    )
    with pytest.raises(ValueError, match="FixedClipping: clip_norm must be > 0"):
        sz.FixedClipping(clip_norm=0, noise_multiplier=1)
    with pytest.raises(ValueError, match="side must be 'server' or 'client'"):
        sz.FixedClipping(clip_norm=1, noise_multiplier=1, side="both")
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        sz.AdaptiveClipping(noise_multiplier=1, delta=0)
    with pytest.raises(ValueError, match="FedAvg: privacy must be FixedClipping"):
        sz.FedAvg(1, privacy={"name": "fixed_clipping"})  # type: ignore[arg-type]


def test_a_checkpoint_keeps_the_clip_and_the_privacy_spent():
    from coordinator.strategies.federated.privacy import Privacy

    spec = sz.AdaptiveClipping(noise_multiplier=0.3, count_stddev=1.0).options()
    first = Privacy(privacy_options(spec), np.random.default_rng(1))
    for _ in range(2):
        fold = first.fold({"lin": {"w": np.zeros(3)}}, ["lin"], 4)
        for k in range(4):
            fold.add(f"c{k}", {"rows": 1}, {"lin": {"w": np.full(3, 0.1 * k)}})
        fold.result()
        first.spent(fold, 4, 10)
    again = Privacy(privacy_options(spec))
    again.load_state_dict(first.state_dict())
    assert again.clip == first.clip != 0.1
    assert again.epsilon() == first.epsilon() > 0
