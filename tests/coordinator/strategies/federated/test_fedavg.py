"""FedAvg and FedProx on in-memory workers, against independent plain-torch local trainings and
a hand-written weighted average (McMahan et al. 2017, Algorithm 1), server update (Reddi et al.
2021) and proximal term (Li et al. 2020). The live counterpart is
tests/integration/strategies/test_fedavg_live.py; both use :func:`reference_rounds`."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext, WorkerCallError
from coordinator.strategies import (
    STRATEGIES,
    FedAvg,
    FedProx,
    JobInputs,
    StrategyFailed,
    StrategyOptionsError,
    strategy_from_spec,
)
from coordinator.strategies.federated.cohort import Cohort as _Workers
from coordinator.strategies.federated.cohort import DroppedWorker
from protocol.errors import ErrorCode, ErrorInfo
from protocol.filters import dump_filter
from protocol.options.strategies import FedAvgOptions
from somatize.remote.client import graph_info
from tests.utils import Center
from worker.daemon.main import Daemon

D = 5
LR = 0.05
BATCH = 8
SIZES = (30, 50, 80)


class Fragile(sz.Filter):
    """Raises in its ``calls``-th fit (every fit when ``None``) on exactly ``rows`` rows."""

    def __init__(self, rows: int, calls: int | None = None):
        self.rows, self.calls, self.seen = rows, calls, 0

    def fit(self, x, y=None):
        self.seen += 1
        if len(x) == self.rows and self.calls in (None, self.seen):
            raise RuntimeError(f"refusing {len(x)} rows")
        return {}

    def forward(self, x, state):
        return x


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(D, 2)


def graph(*before: sz.Filter, momentum: float = 0.0) -> sz.Graph:
    net = sz.TorchFilter(
        model(),
        loss="mse",
        optimizer="sgd",
        lr=LR,
        batch_size=BATCH,
        shuffle=False,
        epochs=9,
        optimizer_options={"momentum": momentum} if momentum else {},
    )
    return sz.Graph([*before, Center().named("center"), net.named("lin")])


def shards(sizes=SIZES, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each worker's data: its own input distribution (non-IID), one linear target."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(D, 2))
    out = []
    for k, n in enumerate(sizes):
        x = (rng.normal(size=(n, D)) * (1 + k) + k).astype(np.float32)
        y = (x @ w + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
        out.append((x, y))
    return out


# -- the reference: plain torch, written independently of the code under test ------------------


def local_training(start, x, y, epochs: int, mu: float = 0.0, momentum: float = 0.0):
    """ClientUpdate by hand: SGD (a fresh one each round) on mse over the centred shard, in
    order, BATCH rows at a time, plus mu/2 ||w - start||^2; the last epoch's mean loss."""
    net = torch.nn.Linear(D, 2)
    net.load_state_dict(start)
    anchor = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum)
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    loss_sum = 0.0
    for _ in range(epochs):
        loss_sum = 0.0
        for s in range(0, len(xt), BATCH):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xt[s : s + BATCH]), yt[s : s + BATCH])
            if mu:
                gap = sum(
                    ((p - a) ** 2).sum() for p, a in zip(net.parameters(), anchor, strict=True)
                )
                loss = loss + mu / 2 * gap
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(xt[s : s + BATCH])
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, loss_sum / len(xt)


def weighted_average(results):
    """sum_k n_k w_k / n over ``[(n_k, w_k)]``, in float64, back to float32."""
    n = sum(rows for rows, _ in results)
    keys = results[0][1].keys()
    return {k: (sum(rows * s[k].double() for rows, s in results) / n).float() for k in keys}


class HandAdam:
    """Reddi et al. 2021, Algorithm 2 (FedAdam), with v_{-1} = tau^2 and no bias correction."""

    def __init__(self, lr, beta1, beta2, tau):
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau
        self.m: dict = {}
        self.v: dict = {}

    def __call__(self, x, average):
        out = {}
        for k in x:
            delta = average[k].double() - x[k].double()
            self.m[k] = self.beta1 * self.m.get(k, 0.0) + (1 - self.beta1) * delta
            v = self.v.get(k, torch.full_like(delta, self.tau**2))
            self.v[k] = self.beta2 * v + (1 - self.beta2) * delta**2
            out[k] = (x[k].double() + self.lr * self.m[k] / (self.v[k].sqrt() + self.tau)).float()
        return out


def reference_rounds(data, rounds, epochs, *, select=None, server=None, mu=0.0, momentum=0.0):
    """``[(w_r, loss_r, chosen_r)]`` for r = 1..rounds: each round, independent local trainings
    of the chosen workers from w_{r-1}, their row-weighted average, then ``server`` if any."""
    w = {k: v.detach().clone() for k, v in model().state_dict().items()}
    history = []
    for r in range(1, rounds + 1):
        chosen = list(range(len(data))) if select is None else select(r)
        trained = [
            (len(data[k][0]), *local_training(w, *data[k], epochs, mu, momentum)) for k in chosen
        ]
        average = weighted_average([(n, state) for n, state, _ in trained])
        w = average if server is None else server(w, average)
        loss = sum(n * loss for n, _, loss in trained) / sum(n for n, _, _ in trained)
        history.append((w, loss, chosen))
    return history


def assert_model(states, expected, atol=1e-6):
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=atol)


def center_of(data, chosen):
    """The plain filter's global state: the row-weighted mean of the shard means."""
    n = sum(len(data[k][0]) for k in chosen)
    return sum(len(data[k][0]) * data[k][0].mean(0).astype(np.float64) for k in chosen) / n


# -- running the strategy on in-memory workers ------------------------------------------------


class OwnData(Daemon):
    """An in-memory worker whose dataset ``local`` is its own shard: what
    ``somatize-worker --data local=PATH`` gives a live one."""

    def __init__(self, x, y):
        self.own = (x, y)
        super().__init__()

    def on_stage(self, req):
        if req.dataset is None:
            return super().on_stage(req)
        assert req.dataset == "local"
        return {"rows": self.engine.rows.hold(req.name, *self.own)}


def job_inputs(g: sz.Graph, x=None, y=None, dataset: str | None = "local") -> JobInputs:
    filters = {n: dump_filter(f) for n, f in g.items()}
    return JobInputs(g.node_ids, filters, x, y, graph_info(g), dataset)


def own_data_context(data, cls=InMemoryContext) -> InMemoryContext:
    daemons = iter([OwnData(x, y) for x, y in data])
    return cls(len(data), lambda: next(daemons))


def run(strategy, ctx, job):
    events = []

    async def emit(event, info):
        events.append(info)

    states = asyncio.run(strategy.run(ctx, job, emit))
    return states, [e for e in events if e.get("phase") == "round"]


# -- FedAvg ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_fedavg_equals_the_row_weighted_average_of_independent_local_trainings(rounds):
    data = shards()
    expected = reference_rounds(data, rounds, epochs=2)
    states, events = run(
        FedAvg(FedAvgOptions(rounds=rounds, local_epochs=2)),
        own_data_context(data),
        job_inputs(graph()),
    )
    assert_model(states, expected[-1][0])
    np.testing.assert_allclose(states["center"]["mean"], center_of(data, [0, 1, 2]), rtol=1e-6)
    assert [e["round"] for e in events] == list(range(1, rounds + 1))
    for event, (_, loss, _) in zip(events, expected, strict=True):
        assert event["workers"] == ["mem-0", "mem-1", "mem-2"]
        assert event["dropped"] == {}
        assert event["rows"] == sum(SIZES)
        assert event["loss"] == pytest.approx(loss, abs=1e-6)


def test_each_round_trains_with_a_fresh_client_optimizer():
    """With momentum, a client optimizer kept across rounds would carry its buffers over."""
    data = shards()
    expected = reference_rounds(data, 3, epochs=1, momentum=0.9)
    states, _ = run(
        FedAvg(FedAvgOptions(rounds=3)), own_data_context(data), job_inputs(graph(momentum=0.9))
    )
    assert_model(states, expected[-1][0])


def test_fedavg_on_sent_rows_splits_them_in_contiguous_shards():
    x = np.concatenate([a for a, _ in shards()])[:100]
    y = np.concatenate([b for _, b in shards()])[:100]
    data = [(x[:34], y[:34]), (x[34:67], y[34:67]), (x[67:], y[67:])]
    expected = reference_rounds(data, 2, epochs=1)
    states, events = run(
        FedAvg(FedAvgOptions(rounds=2)),
        InMemoryContext(3, Daemon),
        job_inputs(graph(), x, y, dataset=None),
    )
    assert_model(states, expected[-1][0])
    np.testing.assert_allclose(states["center"]["mean"], x.mean(0), rtol=1e-5)
    assert events[-1]["rows"] == 100


def test_fedadam_on_the_server_equals_the_hand_computed_update_on_the_average():
    data = shards()
    options = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    expected = reference_rounds(data, 2, epochs=1, server=HandAdam(**options))
    strategy = FedAvg(FedAvgOptions(rounds=2, server={"name": "fedadam", **options}))
    states, _ = run(strategy, own_data_context(data), job_inputs(graph()))
    assert_model(states, expected[-1][0])
    plain = reference_rounds(data, 2, epochs=1)  # the server step really did something
    assert not torch.allclose(expected[-1][0]["weight"], plain[-1][0]["weight"], atol=1e-3)
    # The moments belong to the run: a second run of the same strategy starts afresh.
    again, _ = run(strategy, own_data_context(data), job_inputs(graph()))
    assert_model(again, expected[-1][0])


def test_fedprox_adds_the_proximal_term_to_every_client_loss():
    data = shards()
    expected = reference_rounds(data, 2, epochs=2, mu=0.5)
    strategy = strategy_from_spec("fedprox", sz.FedProx(0.5, 2, local_epochs=2).spec().options)
    states, events = run(strategy, own_data_context(data), job_inputs(graph()))
    assert_model(states, expected[-1][0])
    assert events[-1]["loss"] == pytest.approx(expected[-1][1], abs=1e-6)
    plain = reference_rounds(data, 2, epochs=2)
    assert not torch.allclose(expected[-1][0]["weight"], plain[-1][0]["weight"], atol=1e-4)


def test_fraction_selects_the_documented_subset_each_round():
    """m = max(min_workers, ceil(C K)) positions drawn with default_rng(seed + round), sorted."""
    data = shards((30, 50, 80, 20))
    seed, fraction = 5, 0.5
    m = max(1, math.ceil(fraction * 4))

    def documented(r):
        return sorted(np.random.default_rng(seed + r).choice(4, m, replace=False).tolist())

    expected = reference_rounds(data, 3, epochs=1, select=documented)
    assert len({tuple(chosen) for _, _, chosen in expected}) > 1  # not the same subset each time
    strategy = FedAvg(FedAvgOptions(rounds=3, fraction=fraction, seed=seed))
    states, events = run(strategy, own_data_context(data), job_inputs(graph()))
    assert_model(states, expected[-1][0])
    for event, (_, _, chosen) in zip(events, expected, strict=True):
        assert event["workers"] == [f"mem-{k}" for k in chosen]
    last = expected[-1][2]
    np.testing.assert_allclose(states["center"]["mean"], center_of(data, last), rtol=1e-6)


# -- failures -----------------------------------------------------------------------------------


def test_a_round_below_min_workers_fails_naming_the_dropped_worker():
    data = shards()
    g = graph(Fragile(rows=50).named("fragile"))
    with pytest.raises(StrategyFailed) as failure:
        run(FedAvg(FedAvgOptions(rounds=2, min_workers=3)), own_data_context(data), job_inputs(g))
    info = failure.value.info
    assert info.code is ErrorCode.NOT_ENOUGH_WORKERS
    assert info.message.startswith(
        "round 1: 2 of 3 selected workers answered, min_workers is 3; dropped: mem-1 "
        "(filter_error: batched_fit of node 'fragile' failed: RuntimeError: refusing 50 rows"
    )
    assert set(info.detail["dropped"]) == {"mem-1"}


def test_a_worker_failing_in_one_round_is_dropped_from_it_and_back_in_the_next():
    data = shards()
    g = graph(Fragile(rows=50, calls=2).named("fragile"))

    def without_1_in_round_2(r):
        return [0, 2] if r == 2 else [0, 1, 2]

    expected = reference_rounds(data, 3, epochs=1, select=without_1_in_round_2)
    states, events = run(
        FedAvg(FedAvgOptions(rounds=3, min_workers=2)), own_data_context(data), job_inputs(g)
    )
    assert_model(states, expected[-1][0])
    assert [e["workers"] for e in events] == [
        ["mem-0", "mem-1", "mem-2"],
        ["mem-0", "mem-2"],
        ["mem-0", "mem-1", "mem-2"],
    ]
    assert list(events[1]["dropped"]) == ["mem-1"]
    assert "refusing 50 rows" in events[1]["dropped"]["mem-1"]
    assert events[1]["rows"] == 30 + 80


class LosesWorker(InMemoryContext):
    """Worker 1's connection goes in its second training: that call and all later ones fail."""

    lost = False
    fits = 0

    async def call(self, worker_idx, request, **kwargs):
        if worker_idx == 1:
            if request.cmd == "batched_fit":
                self.fits += 1
                self.lost = self.lost or self.fits == 2
            if self.lost:
                info = ErrorInfo(code=ErrorCode.WORKER_LOST, message="lost: connection closed")
                raise WorkerCallError(self.workers[1].id, info)
        return await super().call(worker_idx, request, **kwargs)


def test_a_lost_worker_is_not_selected_again_and_training_goes_on():
    data = shards()
    ctx = own_data_context(data, LosesWorker)
    select = {1: [0, 1, 2], 2: [0, 2], 3: [0, 2]}
    expected = reference_rounds(data, 3, epochs=1, select=select.__getitem__)
    states, events = run(FedAvg(FedAvgOptions(rounds=3, min_workers=2)), ctx, job_inputs(graph()))
    assert_model(states, expected[-1][0])
    assert events[1]["dropped"] == {"mem-1": "worker_lost: lost: connection closed"}
    assert events[2]["selected"] == ["mem-0", "mem-2"] and events[2]["dropped"] == {}
    two = own_data_context(data[:2], LosesWorker)
    with pytest.raises(StrategyFailed, match=r"round 2: 1 of 2 selected workers answered") as e:
        run(FedAvg(FedAvgOptions(rounds=3, min_workers=2)), two, job_inputs(graph()))
    assert e.value.info.detail["dropped"] == {"mem-1": "worker_lost: lost: connection closed"}


class CrashesOnce(InMemoryContext):
    """Worker 1's daemon dies in its second training; the agent has a fresh, empty one."""

    fits = 0

    async def call(self, worker_idx, request, **kwargs):
        if worker_idx == 1 and request.cmd == "batched_fit":
            self.fits += 1
            if self.fits == 2:
                self.daemons[1] = OwnData(*self.daemons[1].own)
                info = ErrorInfo(code=ErrorCode.DAEMON_CRASHED, message="the daemon died")
                raise WorkerCallError(self.workers[1].id, info)
        return await super().call(worker_idx, request, **kwargs)


def test_a_worker_whose_daemon_crashed_is_set_up_again_before_it_trains_next():
    data = shards()
    ctx = own_data_context(data, CrashesOnce)
    expected = reference_rounds(data, 3, epochs=1, select=lambda r: [0, 2] if r == 2 else [0, 1, 2])
    states, events = run(FedAvg(FedAvgOptions(rounds=3, min_workers=2)), ctx, job_inputs(graph()))
    assert_model(states, expected[-1][0])
    assert events[1]["dropped"] == {"mem-1": "daemon_crashed: the daemon died"}
    assert events[2]["workers"] == ["mem-0", "mem-1", "mem-2"]


def test_aggregation_that_does_not_fit_fails_the_job_as_a_mismatch():
    class Shape(sz.Filter):  # a state whose shape depends on the shard: no mean exists
        def fit(self, x, y=None):
            return {"rows": np.zeros(len(x), dtype=np.float32)}

        def forward(self, x, state):
            return x

    with pytest.raises(StrategyFailed, match="round 1: node 'shape', key 'rows'") as failure:
        run(
            FedAvg(FedAvgOptions(rounds=1)),
            own_data_context(shards()),
            job_inputs(graph(Shape().named("shape"))),
        )
    assert failure.value.info.code is ErrorCode.AGGREGATION_MISMATCH


def test_a_client_state_that_is_not_finite_fails_the_round_naming_the_worker():
    """Issue 53, Medium 3: a NaN in one client's model is refused, naming it, rather than
    averaged into a NaN global model that 'succeeds'."""
    data = shards()
    made = iter(range(len(data)))

    class Poisoned(OwnData):
        def __init__(self, x, y):
            self.poisons = next(made) == 2  # mem-2
            super().__init__(x, y)

        def on_get_state(self, req):
            states = super().on_get_state(req)
            if self.poisons and "lin" in states:
                states["lin"]["bias"][0] = float("inf")
            return states

    daemons = iter([Poisoned(x, y) for x, y in data])
    ctx = InMemoryContext(len(data), lambda: next(daemons))
    with pytest.raises(StrategyFailed) as failure:
        run(FedAvg(FedAvgOptions(rounds=2)), ctx, job_inputs(graph()))
    assert failure.value.info.code is ErrorCode.AGGREGATION_MISMATCH
    assert "worker 'mem-2' sent states that are not finite (NaN or infinity) at node 'lin'" in (
        str(failure.value)
    )


# -- options, validation, placement -----------------------------------------------------------


def test_the_sdk_objects_travel_to_the_coordinator_strategies():
    spec = sz.FedAvg(4, local_epochs=2, fraction=0.5, min_workers=2, workers=3, tag="edge").spec()
    strategy = strategy_from_spec(spec.name, spec.options)
    assert isinstance(strategy, FedAvg) and not isinstance(strategy, FedProx)
    assert (strategy.rounds, strategy.options.local_epochs, strategy.options.fraction) == (
        4,
        2,
        0.5,
    )
    assert strategy.placement().workers == 3 and not strategy.placement().all_matching
    assert strategy.placement().tag == "edge"
    server = sz.FedYogi(lr=0.1, tau=0.01)
    spec = sz.FedProx(0.1, 2, server=server).spec()
    assert spec.name == "fedprox" and spec.options["server"]["name"] == "fedyogi"
    strategy = strategy_from_spec(spec.name, spec.options)
    assert isinstance(strategy, FedProx) and strategy.proximal_mu() == 0.1
    server = strategy.options.server_optimizer()
    assert server.name == "fedyogi" and server.hyperparameters()["tau"] == 0.01
    placement = strategy.placement()
    assert placement.all_matching and placement.workers == 1
    assert placement.describe() == "every idle worker (at least 1)"
    assert STRATEGIES["fedavg"] is FedAvg and STRATEGIES["fedprox"] is FedProx


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fedavg", {}, "rounds must be a positive integer, not None"),
        ("fedavg", {"rounds": 2, "fraction": 0}, r"fraction must be a number in \(0, 1\]"),
        ("fedavg", {"rounds": 2, "fraction": 1.5}, r"fraction must be a number in \(0, 1\]"),
        ("fedavg", {"rounds": 2, "local_epochs": 0}, "local_epochs must be a positive integer"),
        ("fedavg", {"rounds": 2, "workers": 2, "min_workers": 3}, r"workers \(2\) must be at"),
        ("fedavg", {"rounds": 2, "seed": -1}, "seed must be a non-negative integer"),
        ("fedavg", {"rounds": 2, "mu": 0.1}, r"takes no option \['mu'\]"),
        (
            "fedavg",
            {"rounds": 2, "server": "fedadam"},
            "server must be FedAvgM.* an object with a name",
        ),
        ("fedavg", {"rounds": 2, "server": {"name": "sgd"}}, "unknown server optimizer 'sgd'"),
        ("fedavg", {"rounds": 2, "server": {"name": "fedadam", "beta1": 1}}, r"beta1 must be in"),
        ("fedprox", {"rounds": 2}, r"mu must be a finite number > 0, not None \(mu = 0 is"),
        ("fedprox", {"rounds": 2, "mu": 0}, "mu must be a finite number > 0, not 0"),
    ],
)
def test_bad_options_are_refused_naming_them(name, options, message):
    with pytest.raises(StrategyOptionsError, match=message):
        strategy_from_spec(name, options)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sz.FedAvg(0), "FedAvg: rounds must be a positive integer, not 0"),
        (lambda: sz.FedAvg(2, fraction=0.0), r"fraction must be a number in \(0, 1\]"),
        (lambda: sz.FedAvg(2, workers=1, min_workers=2), r"workers \(1\) must be at least"),
        (lambda: sz.FedAvg(2, tag=""), "tag must be a non-empty string"),
        (lambda: sz.FedAvg(2, server="fedadam"), "server must be FedAvgM"),
        (lambda: sz.FedAvg(2, seed=1.5), "seed must be a non-negative integer"),
        (lambda: sz.FedProx(0, 2), "FedProx: mu must be a finite number > 0, not 0"),
        (lambda: sz.FedProx(float("nan"), 2), "mu must be a finite number"),
        (lambda: sz.FedAdam(lr=0), "FedAdam: lr must be > 0"),
        (lambda: sz.FedYogi(beta2=1.0), r"FedYogi: beta2 must be in \[0, 1\)"),
        (lambda: sz.FedAvgM(momentum=-0.1), r"FedAvgM: momentum must be in \[0, 1\)"),
    ],
)
def test_the_sdk_refuses_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_jobs_fedavg_cannot_run_are_refused_up_front():
    x, y = shards()[0]
    plain = sz.Graph([Center().named("c")])
    with pytest.raises(StrategyOptionsError, match="no TorchFilter; use Local"):
        FedAvg(FedAvgOptions(rounds=2)).validate(job_inputs(plain, x, y, dataset=None))
    with pytest.raises(StrategyOptionsError, match="y is missing"):
        FedAvg(FedAvgOptions(rounds=2)).validate(job_inputs(graph(), x, None, dataset=None))
    with pytest.raises(StrategyOptionsError, match=r"x has 30 rows, too few .* 40 workers"):
        FedAvg(FedAvgOptions(rounds=2, workers=40)).validate(
            job_inputs(graph(), x, y, dataset=None)
        )
    FedAvg(FedAvgOptions(rounds=2)).validate(
        job_inputs(graph())
    )  # WorkerData: the labels are the workers' own


def test_the_selection_is_a_pure_function_of_seed_round_and_usable_workers():
    strategy = FedAvg(FedAvgOptions(rounds=1, fraction=0.3, min_workers=2, seed=9))
    workers = _Workers([f"w{i}" for i in range(10)], lost={3: DroppedWorker("w3", None, "gone")})
    picks = [strategy._select(r, workers) for r in (1, 2, 1)]
    assert picks[0] == picks[2] and all(len(p) == 3 for p in picks)  # ceil(0.3 * 9) = 3
    assert all(3 not in p and p == sorted(p) for p in picks)
    assert len(strategy._select(1, _Workers(["a", "b", "c"]))) == 2  # min_workers over C K = 1
