"""What runs for workers far apart, on live workers: DiLoCo gives a plain-torch DiLoCo loop's
answer, and DataParallel's when it synchronises every step with an outer SGD of lr 1 and no
momentum; DataParallel's compressed gradients (torch's DDP communication hooks) train to within
their error of graph.fit's; a worker killed between synchronisations is dropped and replaced;
workers in network namespaces that cannot reach each other train through the coordinator."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    model,
    reference_training,
)
from tests.coordinator.strategies.data_parallel.test_diloco import diloco_by_hand
from tests.coordinator.strategies.data_parallel.test_star_compression import (
    float64_dataset,
    star_by_hand,
)
from tests.integration.cluster import Cluster, cluster, wait_for
from tests.integration.netns import Netns, NetnsUnavailable
from tests.integration.strategies.test_data_parallel_live import daemons_of
from tests.utils import UNIT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[Cluster, sz.Client]]:
    """One cluster of two workers for the module (its start is most of a test's time)."""
    directory = tmp_path_factory.mktemp("far-apart")
    with cluster(directory, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as connected:
        yield c, connected


@pytest.fixture
def client(live) -> sz.Client:
    return live[1]


@pytest.mark.parametrize("collective", ["torch", "coordinator"])
def test_diloco_equals_a_plain_torch_diloco_loop_and_data_parallel_when_it_syncs_every_step(
    client, collective
):
    """203 rows in shuffled batches of 32 (uneven slices), 3 epochs over 2 replicas: Adam
    inner steps with a sync every 3 steps (and at each epoch's end, every 7th step) equal the
    loop above; SGD with momentum synchronised every step by an outer SGD of lr 1 and no
    momentum equals DataParallel's answer, graph.fit's. Over a torch group the replicas take
    the outer step themselves; through the coordinator (workers that cannot reach each other)
    the coordinator averages their weights and takes it: the same answer."""
    x, y = dataset()
    x_val, y_val = dataset(n=50, seed=9)
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, collective=collective)
    graph = graph_for("adam", shuffle=True)
    job = client.submit(graph, x, y, strategy=strategy, validation=(x_val, y_val))
    fitted = job.result(timeout=120 * UNIT)
    record = job.status()
    placed = placed_event(job)
    every_step = sz.DiLoCo(2, 1, 1.0, 0.0, collective=collective)
    as_dp = client.submit(graph_for("sgd", shuffle=True), x, y, strategy=every_step)
    synced = as_dp.result(timeout=120 * UNIT)
    expected, val_losses = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        sync_every=3,
        outer_lr=0.7,
        outer_momentum=0.9,
        validation=(x_val - x.mean(0), y_val),  # the Center fitted on the training rows
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert [row["epoch"] for row in fitted.history] == [1, 2, 3]
    for row, val_loss in zip(fitted.history, val_losses, strict=True):
        assert row["val_loss"] == pytest.approx(val_loss, abs=1e-5)
    assert record["strategy"] == "diloco"
    assert record["progress"]["step"] == record["progress"]["steps"] == 21
    assert placed.data["collective"] == collective
    values = 6 * 16 + 16 + 16 * 3 + 3  # the MLP's trainable parameters
    assert (placed.data["sync_bytes"], placed.data["sync_every"]) == (4 * values, 3)
    data_parallel = reference_training(x, y, "sgd", shuffle=True)
    for key, value in data_parallel.items():
        torch.testing.assert_close(synced.states["mlp"][key], value, rtol=0, atol=1e-5)
    # Not DataParallel's: the same job synchronised every 3 steps gives another model.
    apart, _ = diloco_by_hand(x, y, "adam", 2, sync_every=1, outer_lr=0.7, outer_momentum=0.9)
    assert not torch.allclose(apart["2.weight"], expected["2.weight"], atol=1e-4)


def test_diloco_validates_the_global_model_every_n_steps_on_the_torch_group(client):
    """validate_every=5 with H = 3 on the replicas' group: they also synchronise after steps
    5, 10, 15 and 20, and each validation is the global model's loss there, as the hand loop
    that synchronises and evaluates alike."""
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, validate_every=5)
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, collective="torch")
    job = client.submit(graph, x, y, strategy=strategy, validation=(x[:64], y[:64]))
    fitted = job.result(timeout=120 * UNIT)
    validations: list = []
    centred = (x[:64] - x.mean(0), y[:64])  # the Center filter's fitted mean
    expected, _ = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        3,
        outer_lr=0.7,
        outer_momentum=0.9,
        validation=centred,
        validate_every=5,
        validations=validations,
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert [v["step"] for v in fitted.validations] == [5, 10, 15, 20]
    assert [v["val_loss"] for v in fitted.validations] == pytest.approx(
        [loss for _, loss in validations], abs=1e-5
    )
    assert placed_event(job).data["collective"] == "torch"


def placed_event(job: sz.Job):
    return next(e for e in job.events(timeout=30 * UNIT) if e.event == "placed")


@pytest.mark.parametrize(
    ("compression", "atol"), [("fp16", 2e-3), ("int8", 2e-2), ("powersgd:1", 0.1)]
)
def test_compressed_gradients_train_to_within_their_error_of_graph_fit(client, compression, atol):
    """SGD with momentum, 21 steps over 2 replicas: fp16 rounds each gradient (2⁻¹¹
    relative), int8 quantises it (within 1/254 of its largest) with error feedback, PowerSGD
    sends a rank-1 factorisation with error feedback: each ends close to graph.fit's model,
    none equal to it, and the placed event says what ran."""
    x, y = dataset()
    strategy = sz.DataParallel(2, collective="torch", compression=compression)
    job = client.submit(graph_for("sgd"), x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    expected = reference_training(x, y, "sgd")
    differences = [
        float((torch.as_tensor(fitted.states["mlp"][key]) - value).abs().max())
        for key, value in expected.items()
    ]
    assert 0 < max(differences) <= atol, differences
    placed = placed_event(job)
    assert (placed.data["collective"], placed.data["compression"]) == ("torch", compression)
    # fp16: 2 bytes a gradient. PowerSGD rank 1: the 16x6 and 3x16 matrices as their factors,
    # 16 + 6 and 3 + 16 values (under half of 96 and 48), the biases whole; 4 bytes a value.
    values = 6 * 16 + 16 + 16 * 3 + 3
    by_hand = {
        "fp16": 2 * values,
        "int8": values + 4,  # a byte a value, a 4-byte scale for its one chunk
        "powersgd:1": 4 * (22 + 16 + 19 + 3),
    }
    assert placed.data["step_bytes"] == by_hand[compression]


@pytest.mark.parametrize("compression", ["fp16", "int8"])
def test_diloco_compressed_pseudo_gradients_equal_the_hand_loop_compressing_alike(
    client, compression
):
    """DiLoCo's pseudo-gradients in fp16, or in int8 with error feedback, over the torch
    group: the hand-written loop that rounds and quantises alike gives the same model, and the
    placed event says the bytes a synchronisation sends."""
    x, y = dataset()
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, collective="torch", compression=compression)
    job = client.submit(graph_for("adam", shuffle=True), x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    expected, _ = diloco_by_hand(
        x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, compression=compression
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    plain, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    assert not torch.allclose(plain["2.weight"], expected["2.weight"], rtol=0, atol=1e-7)
    values = 6 * 16 + 16 + 16 * 3 + 3
    placed = placed_event(job)
    assert placed.data["compression"] == compression
    assert placed.data["sync_bytes"] == {"fp16": 2 * values, "int8": values + 4}[compression]


def test_through_the_coordinator_both_legs_compressed_equal_the_hand_loops(client):
    """int8 through the coordinator, on live workers: DataParallel's gradients and means (a
    float64 model, so no int8 code flips on rounding noise) equal the DoubleSqueeze hand loop,
    and DiLoCo's pseudo-gradients and outer updates the hand loop compressing both legs; the
    placed events say what travels."""
    x64, y = float64_dataset()
    graph = graph_for("sgd", module=model().double())
    strategy = sz.DataParallel(2, collective="coordinator", compression="int8")
    star = client.submit(graph, x64, y, strategy=strategy)
    x, _ = dataset()
    diloco = sz.DiLoCo(2, 3, 0.7, 0.9, collective="coordinator", compression="int8")
    synced = client.submit(graph_for("adam", shuffle=True), x, y, strategy=diloco)
    for key, value in star_by_hand(x64, y, "sgd", 2, "int8").items():
        fitted = star.result(timeout=120 * UNIT).states["mlp"][key]
        torch.testing.assert_close(torch.as_tensor(fitted), value, rtol=0, atol=1e-7)
    expected, _ = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        3,
        outer_lr=0.7,
        outer_momentum=0.9,
        compression="int8",
        through="coordinator",
    )
    for key, value in expected.items():
        fitted = synced.result(timeout=120 * UNIT).states["mlp"][key]
        torch.testing.assert_close(fitted, value, rtol=0, atol=1e-5)
    values = 6 * 16 + 16 + 16 * 3 + 3
    for job, counted in ((star, "step_bytes"), (synced, "sync_bytes")):
        placed = placed_event(job)
        assert (placed.data["collective"], placed.data["compression"]) == ("coordinator", "int8")
        assert placed.data[counted] == values + 4


def test_auto_falls_back_to_the_coordinator_when_the_replicas_group_cannot_form(live):
    """Two workers that reach the rendezvous but one of whose gloo cannot connect (it is told
    to use an interface that does not exist): ``auto`` tries the group, trains through the
    coordinator and says why; so does DiLoCo, which then takes its outer steps there."""
    c, client = live
    c.start_worker("w3", "apart")
    c.start_worker("w4", "apart", prefix=["env", "GLOO_SOCKET_IFNAME=nowhere0"])
    x, y = dataset(n=64)
    graph = graph_for("sgd", epochs=1)
    # The trial group waits for w4 at most collective_timeout (10 s by default).
    strategy = sz.DataParallel(2, tag="apart", collective_timeout=3 * UNIT)
    job = client.submit(graph, x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    placed = placed_event(job)
    assert placed.data["collective"] == "coordinator"
    reason = placed.data["collective_reason"]
    assert "every replica reached the rendezvous" in reason
    # Which replica's failure it names depends on which came first: w4's (no such interface)
    # or w3's (w4 never connected).
    assert "but their group did not form: worker " in reason, reason
    expected = reference_training(x, y, "sgd", epochs=1)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    strategy = sz.DiLoCo(2, 1, 1.0, 0.0, tag="apart", collective_timeout=3 * UNIT)
    diloco = client.submit(graph, x, y, strategy=strategy)
    synced = diloco.result(timeout=120 * UNIT)
    assert placed_event(diloco).data["collective"] == "coordinator"
    for key, value in expected.items():  # H = 1, an outer SGD of lr 1: DataParallel's
        torch.testing.assert_close(synced.states["mlp"][key], value, rtol=0, atol=1e-5)


class Slow(torch.nn.Sequential):
    """The tests' MLP (same parameters, same maths), slowed down: a worker can be killed while
    a round of inner steps runs."""

    def forward(self, x):
        time.sleep(0.08)
        return super().forward(x)


@pytest.mark.parametrize("collective", ["auto", "coordinator"])
def test_a_worker_killed_between_syncs_is_dropped_and_a_spare_joins_at_the_next(
    tmp_path, collective
):
    """Elastic DiLoCo on two replicas and a spare: replica w2's agent SIGKILLed during a round
    is dropped from that round's average while w1 goes on without waiting; at the round's
    synchronisation the spare takes its place with the global model, w1's inner Adam state
    (and, on the torch group, w1's outer momentum). The result is the hand-written loop's
    with w2 missing from that round — on the replicas' torch group (``auto``: re-formed with
    the survivor for the round's synchronisation, then with the spare) as through the
    coordinator."""
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, module=Slow(*model()))
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, elastic=True, collective=collective)
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 3, 60 * UNIT, "3")
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events(timeout=30 * UNIT))
    placed = next(e for e in events if e.event == "placed")
    assert placed.data["collective"] == ("torch" if collective == "auto" else "coordinator")
    lost = next(e for e in events if e.event == "worker_lost")
    dropped = next(e for e in events if e.event == "worker_dropped")
    joined = next(e for e in events if e.event == "worker_joined")
    assert (lost.data["worker"], dropped.data["worker"], dropped.data["replicas"]) == (
        "w2",
    ) * 2 + (1,)
    assert (joined.data["lost"], joined.data["worker"], joined.data["from"]) == ("w2", "w3", "w1")
    syncs = [3, 6, 9, 12, 15, 18, 21]  # every 3 steps of the run (3 epochs of 7)
    round_ = next(r for r, end in enumerate(syncs) if lost.data["step"] <= end)
    assert round_ >= 1 and joined.data["step"] == lost.data["step"]
    _as_one_of(
        fitted.states["mlp"],
        diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, absent={round_: {1}})[
            0
        ],
        # killed just after its part in that round's synchronisation, it is missing from none:
        # the spare takes its place as the next round begins
        diloco_by_hand(
            x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, replaced={round_ + 1: {1}}
        )[0],
    )
    training = [e for e in events if e.event == "progress" and e.data["phase"] == "training"]
    assert [e.data["step"] for e in training] == syncs  # each round once, none waited for


def _as_one_of(states: dict, expected: dict, *made_it: dict) -> None:
    """``states`` are ``expected`` (1e-5), or one of ``made_it``: a replica is killed once it
    is seen past a synchronisation, within a round of three short steps; on a loaded machine
    the kill can come after its part in the round's synchronisation, and then it is missing
    from the round after (the synchronisation it made counts it) — as the hand loop has it."""
    for candidate in (expected, *made_it):
        if all(torch.allclose(states[k], v, rtol=0, atol=1e-5) for k, v in candidate.items()):
            return
    for key, value in expected.items():  # (the first one's difference, said)
        torch.testing.assert_close(states[key], value, rtol=0, atol=1e-5)


def _kill_with_its_daemons(c: Cluster, worker: str) -> None:
    """SIGKILL a worker's agent and its filter daemons (which would otherwise see it gone only
    at their watchdog's next look, and might take part in one more synchronisation)."""
    daemons = daemons_of(c.workers[worker])
    c.send_signal(c.workers[worker], signal.SIGKILL)
    for pid in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_on_the_torch_group_a_crashed_daemon_rejoins_and_a_place_nobody_takes_stays_empty(
    tmp_path,
):
    """Elastic DiLoCo on the replicas' torch group, two workers and no spare: one replica's
    daemon SIGKILLed mid-round is dropped from that round's synchronisation (the group formed
    again with the survivor to make it) and its own worker, with a fresh daemon, takes its
    place after it with the survivor's global model, inner Adam state and outer momentum;
    later the other replica's worker is SIGKILLed (with its daemon) and nobody can take its
    place: the survivor trains alone to the end. The hand loop with those replicas missing
    from those rounds gives the same model."""
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, module=Slow(*model()))
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, elastic=True, collective="torch")
    syncs = [3, 6, 9, 12, 15, 18, 21]
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 3, 60 * UNIT, "3")
        for pid in daemons_of(c.workers["w2"]):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 12, 60 * UNIT, "12")
        _kill_with_its_daemons(c, "w1")
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events(timeout=30 * UNIT))
    assert next(e for e in events if e.event == "placed").data["collective"] == "torch"
    crashed, lost = [e for e in events if e.event == "worker_lost"]
    assert (crashed.data["worker"], crashed.data["code"]) == ("w2", "daemon_crashed")
    assert (lost.data["worker"], lost.data["code"]) == ("w1", "worker_lost")
    joined = [e for e in events if e.event == "worker_joined"]
    assert [(e.data["lost"], e.data["worker"], e.data["from"]) for e in joined] == [
        ("w2", "w2", "w1")
    ]
    dropped = [e.data["replicas"] for e in events if e.event == "worker_dropped"]
    assert dropped == [1, 1]
    first = next(r for r, end in enumerate(syncs) if crashed.data["step"] <= end)
    last = next(r for r, end in enumerate(syncs) if lost.data["step"] <= end)
    r1, r2 = lost.data["replica"], crashed.data["replica"]
    candidates = [
        diloco_by_hand(
            x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, absent=absent, replaced=replaced
        )[0]
        for replaced, crash in (({}, {first: {r2}}), ({first + 1: {r2}}, {}))
        for end in (last, last + 1)
        for absent in [crash | {r: {r1} for r in range(end, len(syncs))}]
    ]
    _as_one_of(fitted.states["mlp"], *candidates)
    training = [e for e in events if e.event == "progress" and e.data["phase"] == "training"]
    assert [e.data["step"] for e in training] == syncs  # each round once


def test_four_replicas_go_on_at_once_when_one_dies_in_their_ring(tmp_path):
    """Four replicas on the torch group, the fourth's worker SIGKILLed (its daemon too) during
    a round: in gloo's ring only its two neighbours see it die, and the replica across from
    it would wait out the collective timeout (60 s) in a receive; the members that saw it
    close their group at once, so that one fails too and the round's synchronisation is made
    by the three survivors within seconds — none is stopped as hung. As the hand loop with
    the fourth missing from that round on."""
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, module=Slow(*model()))
    strategy = sz.DiLoCo(4, 3, 0.7, 0.9, elastic=True, collective="torch")
    syncs = [3, 6, 9, 12, 15, 18, 21]
    with (
        cluster(tmp_path, {"w1": (), "w2": (), "w3": (), "w4": ()}) as c,
        sz.connect(c.url) as client,
    ):
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 3, 60 * UNIT, "3")
        _kill_with_its_daemons(c, "w4")
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events(timeout=30 * UNIT))
    lost = [e for e in events if e.event == "worker_lost"]
    assert [(e.data["worker"], e.data["code"]) for e in lost] == [("w4", "worker_lost")]
    dropped = next(e for e in events if e.event == "worker_dropped")
    after = next(e for e in events if e.event == "progress" and e.time > dropped.time)
    assert after.time - lost[0].time < 20 * UNIT  # not the collective timeout
    first = next(r for r, end in enumerate(syncs) if lost[0].data["step"] <= end)
    gone = lost[0].data["replica"]
    _as_one_of(
        fitted.states["mlp"],
        *(
            diloco_by_hand(x, y, "adam", 4, 3, outer_lr=0.7, outer_momentum=0.9, absent=absent)[0]
            for start in (first, first + 1)
            for absent in [{r: {gone} for r in range(start, len(syncs))}]
        ),
    )


def test_auto_trains_through_the_coordinator_for_workers_in_namespaces_that_cannot_meet(
    tmp_path,
):
    """Two workers in network namespaces of their own, each reaching the coordinator's address
    and nothing of the other (as two sites behind NAT): ``auto`` finds the rendezvous out of
    reach, trains DiLoCo through the coordinator and says why, to the hand loop's answer."""
    sites = [Netns.numbered(os.getpid() * 2 + k) for k in range(2)]
    try:
        for ns in sites:
            ns.create()
        # The second site reaches the coordinator (on the first site's host end) through its
        # own host end; neither has a route to the other site.
        route = ["ip", "route", "add", f"{sites[0].host_ip}/32", "via", sites[1].host_ip]
        subprocess.run([*sites[1].prefix, *route], check=True, capture_output=True, timeout=30)
    except NetnsUnavailable as exc:
        pytest.fail(f"this test puts workers in network namespaces and cannot: {exc}")
    x, y = dataset()
    tokens = {"worker_token": "apart-worker-token-0123", "client_token": "apart-client-token-3210"}
    try:
        with cluster(tmp_path, {}, host=sites[0].host_ip, **tokens) as c:
            for k, ns in enumerate(sites):
                c.start_worker(f"site{k}", prefix=ns.prefix)
            with c.client(timeout=10 * UNIT) as client:
                strategy = sz.DiLoCo(2, 3, 0.7, 0.9, collective_timeout=5 * UNIT)
                job = client.submit(graph_for("adam", shuffle=True), x, y, strategy=strategy)
                fitted = job.result(timeout=120 * UNIT)
                placed = placed_event(job)
    finally:
        for ns in sites:
            ns.delete()
    assert placed.data["collective"] == "coordinator", placed.data
    assert "rendezvous" in placed.data["collective_reason"], placed.data
    expected, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
