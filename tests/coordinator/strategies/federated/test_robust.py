"""Robust aggregation: each rule against its paper worked by hand on small points, FedAvg with
each rule against the rule applied by the test to independent local trainings, a poisoned
client that ruins FedAvg and none of the rules, and the refusals at submit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext
from coordinator.strategies import FedAvg, StrategyOptionsError, strategy_from_spec
from coordinator.strategies.federated.robust import Bulyan, FedMedian, Krum, TrimmedMean
from protocol.options.aggregators import BulyanOptions, KrumOptions, TrimmedMeanOptions
from protocol.options.strategies import FedAvgOptions
from tests.coordinator.strategies.federated.test_fedavg import (
    D,
    OwnData,
    graph,
    job_inputs,
    local_training,
    model,
    own_data_context,
    run,
    shards,
)

# -- the rules on points worked by hand -----------------------------------------------------


def column(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64).reshape(-1, 1)


def test_fedmedian_is_the_coordinate_wise_median():
    stack = np.array([[1.0, 5.0], [2.0, -1.0], [10.0, 0.0]])
    np.testing.assert_array_equal(FedMedian().combine(stack)[0], [2.0, 0.0])
    # n even: the mean of the two middle values, coordinate by coordinate.
    stack = np.array([[1.0, 4.0], [3.0, 0.0], [8.0, 2.0], [-5.0, 1.0]])
    np.testing.assert_array_equal(FedMedian().combine(stack)[0], [2.0, 1.5])


def test_trimmed_mean_drops_floor_beta_n_values_at_each_end():
    stack = np.array([[1.0, -7.0], [2.0, 0.0], [3.0, 1.0], [4.0, 2.0], [100.0, 3.0]])
    # beta n = 1.25: one value off each end -> (2 + 3 + 4) / 3 and (0 + 1 + 2) / 3.
    np.testing.assert_allclose(
        TrimmedMean(TrimmedMeanOptions(beta=0.25)).combine(stack)[0], [3.0, 1.0]
    )
    # beta n = 0.95: nothing dropped, the plain mean.
    np.testing.assert_allclose(
        TrimmedMean(TrimmedMeanOptions(beta=0.19)).combine(stack)[0], [22.0, -0.2]
    )


def test_krum_and_multi_krum_on_points_worked_by_hand():
    # n = 5, f = 1: each score sums the n - f - 2 = 2 smallest squared distances.
    # s(0) = 1 + 4 = 5, s(1) = 1 + 1 = 2, s(2) = 1 + 1 = 2, s(3) = 1 + 4 = 5,
    # s(100) = 97^2 + 98^2 = 19013. Krum: the least, the first of equal ones: V_1 = 1.
    stack = column(0, 1, 2, 3, 100)
    value, kept = Krum(KrumOptions(byzantine=1)).combine(stack)
    assert kept == [1] and value.tolist() == [1.0]
    # Multi-Krum, m = 3: the three least scores are V_1, V_2 and V_0 (5, before V_3's 5).
    value, kept = Krum(KrumOptions(byzantine=1, keep=3)).combine(stack)
    assert kept == [0, 1, 2] and value.tolist() == [1.0]


def test_bulyan_on_points_worked_by_hand():
    # n = 7, f = 1: theta = 5 picked by Krum one after the other, then per coordinate the mean
    # of the beta = theta - 2f = 3 values closest to their median.
    # pick 1 (4 neighbours): s = 90, 63, 39, 42, 91, 126, ~4e4 -> 3
    # pick 2 over 0, 1, 4, 8, 9, -100 (3): s = 81, 59, 41, 66, 90, ... -> 4
    # pick 3 over 0, 1, 8, 9, -100 (2): s = 65, 50, 50, 65, ... -> 1 (before 8)
    # pick 4 over 0, 8, 9, -100 (1): s = 64, 1, 1, ... -> 8 (before 9)
    # pick 5 over 0, 9, -100 (n - f - 2 = 0, counted as 1): s = 81, 81, ... -> 0
    # selected 0, 1, 3, 4, 8: median 3; the 3 closest: 3, 4, 1 -> 8/3.
    stack = column(0, 1, 3, 4, 8, 9, -100)
    value, kept = Bulyan(BulyanOptions(byzantine=1)).combine(stack)
    assert kept == [0, 1, 2, 3, 4]
    assert value.tolist() == pytest.approx([8 / 3], rel=1e-15)


# -- FedAvg with a rule, against the rule applied by hand to independent trainings -----------


def brute_krum(vectors: list[torch.Tensor], f: int, keep: int) -> torch.Tensor:
    """Krum as Blanchard et al. write it, by brute force over every pair."""
    n = len(vectors)
    scores = []
    for i in range(n):
        others = sorted(float(((vectors[i] - vectors[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(others[: n - f - 2]))
    best = sorted(range(n), key=lambda i: (scores[i], i))[:keep]
    return torch.stack([vectors[i] for i in best]).mean(0)


def by_hand_round(data, rule):
    """One round from the initial model: independent local trainings, each flattened
    (weight then bias), aggregated by ``rule``."""
    start = model().state_dict()
    trained = [local_training(start, x, y, epochs=1)[0] for x, y in data]
    flat = [torch.cat([s["weight"].double().reshape(-1), s["bias"].double()]) for s in trained]
    out = rule(flat)
    return {"weight": out[: 2 * D].reshape(2, D).float(), "bias": out[2 * D :].float()}


HAND_RULES = {
    "median": (sz.FedMedian(), lambda v: torch.stack(v).median(0).values),  # n odd: no mean
    "trimmed": (
        sz.TrimmedMean(0.2),
        lambda v: torch.stack(v).sort(0).values[1:-1].mean(0),  # 0.2 * 5 = 1 each end
    ),
    "krum": (sz.Krum(byzantine=1), lambda v: brute_krum(v, 1, 1)),
    "multi_krum": (sz.Krum(byzantine=1, keep=2), lambda v: brute_krum(v, 1, 2)),
}


@pytest.mark.parametrize("which", sorted(HAND_RULES))
def test_fedavg_with_a_rule_equals_the_rule_on_independent_local_trainings(which):
    aggregator, by_hand = HAND_RULES[which]
    data = shards((30, 50, 80, 40, 60), seed=3)
    spec = sz.FedAvg(1, min_workers=5, aggregator=aggregator).spec()
    states, events = run(
        strategy_from_spec("fedavg", spec.options), own_data_context(data), job_inputs(graph())
    )
    expected = by_hand_round(data, by_hand)
    for key, value in expected.items():
        torch.testing.assert_close(states["lin"][key], value, rtol=0, atol=1e-6)
    # The plain filter's state is still the row-weighted mean.
    n = sum(len(x) for x, _ in data)
    center = sum(len(x) * x.mean(0).astype(np.float64) for x, _ in data) / n
    np.testing.assert_allclose(states["center"]["mean"], center, rtol=1e-6)
    assert ("kept" in events[0]) == which.endswith("krum")


# -- a poisoned client ----------------------------------------------------------------------


class Poisoner(OwnData):
    """A client that sends back its update scaled by -100: w_t - 100 (w - w_t)."""

    def on_set_state(self, req):
        self.start = {n: {k: v.clone() for k, v in s.items()} for n, s in req.states.items()}
        return super().on_set_state(req)

    def on_batched_fit(self, req):  # w_t comes with the training call
        if req.start is not None:
            self.start = {n: {k: v.clone() for k, v in s.items()} for n, s in req.start.items()}
        return super().on_batched_fit(req)

    def on_get_state(self, req):
        states = super().on_get_state(req)
        lin, start = states["lin"], self.start["lin"]
        states["lin"] = {k: start[k] - 100 * (lin[k] - start[k]) for k in lin}
        return states


def iid_shards(k: int, rows: int = 40) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    w = rng.normal(size=(D, 2))
    out = []
    for _ in range(k):
        x = rng.normal(size=(rows, D)).astype(np.float32)
        out.append((x, (x @ w + 0.1 * rng.normal(size=(rows, 2))).astype(np.float32)))
    return out


def loss_on(states, data) -> float:
    """The final model's mean squared error on every honest client's centred rows."""
    net = model()
    net.load_state_dict({k: torch.as_tensor(v) for k, v in states["lin"].items()})
    with torch.no_grad():
        errors = [
            torch.nn.functional.mse_loss(net(torch.as_tensor(x - x.mean(0))), torch.as_tensor(y))
            for x, y in data
        ]
    return float(torch.stack(errors).mean())


def test_one_poisoned_client_ruins_fedavg_and_no_robust_rule():
    data = iid_shards(7)
    honest = data[1:]

    def poisoned_context():
        daemons = iter([Poisoner(*data[0])] + [OwnData(x, y) for x, y in honest])
        return InMemoryContext(len(data), lambda: next(daemons))

    untrained = loss_on({"lin": model().state_dict()}, honest)
    clean, _ = run(FedAvg(FedAvgOptions(rounds=6)), own_data_context(honest), job_inputs(graph()))
    clean_loss = loss_on(clean, honest)
    assert clean_loss < untrained / 10
    # FedAvg with the poisoned client: far worse than no training at all.
    ruined, _ = run(FedAvg(FedAvgOptions(rounds=6)), poisoned_context(), job_inputs(graph()))
    assert loss_on(ruined, honest) > 1000 * untrained
    # Each rule learns nearly what the honest clients learn alone.
    rules = [sz.FedMedian(), sz.TrimmedMean(0.15), sz.Krum(1, keep=3), sz.Bulyan(1)]
    for rule in rules:
        spec = sz.FedAvg(6, min_workers=7, aggregator=rule).spec()
        strategy = strategy_from_spec("fedavg", spec.options)
        states, events = run(strategy, poisoned_context(), job_inputs(graph()))
        assert loss_on(states, honest) < 2 * clean_loss, rule
        if "kept" in events[-1]:  # the selecting rules never keep the poisoned client
            assert all("mem-0" not in e["kept"] for e in events)


def test_a_rule_composes_with_a_server_optimizer():
    """FedAvgM steps on the median in place of the mean: x_1 = x_0 + lr (median - x_0)."""
    data = shards((30, 50, 80), seed=3)
    expected = by_hand_round(data, lambda v: torch.stack(v).median(0).values)
    start = model().state_dict()
    stepped = {
        k: (start[k].double() + 0.5 * (expected[k].double() - start[k].double())).float()
        for k in expected
    }
    spec = sz.FedAvg(
        1, min_workers=3, aggregator=sz.FedMedian(), server=sz.FedAvgM(lr=0.5, momentum=0.0)
    ).spec()
    states, _ = run(
        strategy_from_spec("fedavg", spec.options), own_data_context(data), job_inputs(graph())
    )
    for key, value in stepped.items():
        torch.testing.assert_close(states["lin"][key], value, rtol=0, atol=1e-6)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"rounds": 1, "min_workers": 4, "aggregator": {"name": "krum", "byzantine": 1}},
            r"needs n > 2f \+ 2 = 4: at least 5 clients .* with 4 \(min_workers is 4: raise it\)",
        ),
        (
            {
                "rounds": 1,
                "min_workers": 6,
                "aggregator": {"name": "krum", "byzantine": 1, "keep": 6},
            },
            r"n >= keep \+ f = 7: at least 7 clients",
        ),
        (
            {"rounds": 1, "min_workers": 10, "aggregator": {"name": "bulyan", "byzantine": 2}},
            r"needs n >= 4f \+ 3 = 11: at least 11 clients",
        ),
        ({"rounds": 1, "aggregator": {"name": "mean"}}, r"unknown aggregator 'mean'"),
        (
            {"rounds": 1, "aggregator": "krum"},
            "aggregator must be FedMedian.* an object with a name",
        ),
        (
            {"rounds": 1, "aggregator": {"name": "trimmed_mean", "beta": 0.5}},
            r"beta must be in \[0, 0.5\)",
        ),
        (
            {"rounds": 1, "aggregator": {"name": "fedmedian", "beta": 0.1}},
            r"aggregator 'fedmedian' takes no options; got unknown \['beta'\]",
        ),
        (
            {"rounds": 1, "aggregator": {"name": "krum", "byzantine": -1}},
            "byzantine must be an integer >= 0, not -1",
        ),
    ],
)
def test_a_rule_the_rounds_cannot_hold_is_refused_at_submit(options, message):
    with pytest.raises(StrategyOptionsError, match=message):
        strategy_from_spec("fedavg", options)


def test_the_sdk_refuses_the_same_naming_its_classes():
    with pytest.raises(ValueError, match=r"FedAvg: aggregator Krum\(byzantine=1, keep=1\)"):
        sz.FedAvg(1, min_workers=4, aggregator=sz.Krum(1))
    with pytest.raises(ValueError, match=r"FedProx: aggregator must be FedMedian\(\)"):
        sz.FedProx(0.1, 1, aggregator="krum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Bulyan: byzantine must be an integer >= 0"):
        sz.Bulyan(byzantine=1.5)  # type: ignore[arg-type]
    spec = sz.FedProx(0.1, 1, min_workers=7, aggregator=sz.Bulyan(1)).spec()
    assert spec.options["aggregator"] == {"name": "bulyan", "byzantine": 1}
