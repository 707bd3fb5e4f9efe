"""DiLoCo through the coordinator in memory, against a plain-torch DiLoCo loop: checkpoints
taken after synchronisations, a run resumed from any of them ending as the undisturbed run, and
elastic rounds — a replica lost between two synchronisations dropped from that average, its place
taken at the synchronisation by a spare (or left empty). Live: test_far_apart_live.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
import pytest
import torch

from coordinator.context import InMemoryContext
from coordinator.storage.checkpoints import CheckpointStore, JobCheckpoints
from coordinator.strategies.data_parallel.diloco import DiLoCo
from protocol.options.strategies import DiLoCoOptions
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    OPTIMIZERS,
    dataset,
    graph_for,
    inputs,
    model,
)
from worker.daemon.main import Daemon

STEPS = 3 * 7  # 3 epochs of ceil(203 / 32) steps; with sync_every=3: syncs after 3, 6, 9, 12...


# A keyword of its own for each of DiLoCo's options and the faults a test plays.
def diloco_by_hand(  # noqa: PLR0913
    x,
    y,
    optimizer: str,
    replicas: int,
    sync_every: int,
    *,
    outer_lr: float,
    outer_momentum: float,
    epochs: int = 3,
    batch_size: int = 32,
    shuffle: bool = True,
    validation=None,
    absent: dict[int, set[int]] | None = None,
    replaced: dict[int, set[int]] | None = None,
    compression: str | None = None,
    through: str = "torch",
    max_steps: int | None = None,
    sync_at_epoch_end: bool = False,
    validate_every: int | None = None,
    validations: list | None = None,
):
    """DiLoCo (Douillard et al. 2023, Algorithm 1) in plain torch, on the global batches
    ``graph.fit`` takes: each replica steps on its ``numpy.array_split`` slice with an inner
    optimizer of its own (kept), its loss weighted by its share of the global batch; after every
    ``sync_every`` steps counted over the run (an epoch's end does not restart the count) and
    after the run's last, the mean of θ_global − θ_local is the gradient of one outer
    Nesterov-SGD step, and every replica starts again from θ_global. With ``validation``
    (centred as the training rows), also a synchronisation at each epoch's end and the global
    model's loss on it there; with ``sync_at_epoch_end``, the synchronisation alone.

    ``absent``: by round (from 0), the replicas that take no part in it (lost: no steps, not in
    the average). One that is back in the next round starts it from θ_global with a copy of the
    first present replica's inner optimizer state, as a worker joining at a synchronisation.
    ``replaced``: by round, the replicas whose worker is replaced as it begins (lost just after
    its part in the synchronisation before): the same copy, though they took part in that one.

    ``compression``: the pseudo-gradients travel as ``"fp16"`` (each replica's share rounded
    to half precision, summed in it) or ``"int8"`` (:func:`int8_by_hand`). ``through=
    "coordinator"``: each replica's pseudo-gradient travels up as :func:`travelled` has it, the
    coordinator averages them (in float64) into Δ̄, takes the Nesterov step on −Δ̄ alone in
    float64 (m ← βm − Δ̄, u = η(−Δ̄ + βm)) and sends ``u`` down as :func:`travelled` has it, with
    an error feedback of its own; each replica adds it to θ_global (DoubleSqueeze's two legs).
    A replica that joins starts with no residual. ``max_steps``: the run stops after that many
    steps, mid-epoch, with a synchronisation (its epoch's end). ``validate_every``: also a
    synchronisation after every that many steps of the run, the global model's loss on
    ``validation`` appended there to ``validations`` as ``(step, loss)``."""
    absent = absent or {}
    residuals: dict[object, torch.Tensor] = {}
    momentum = None
    _, make = OPTIMIZERS[optimizer]
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    global_net = copy.deepcopy(model())
    outer = torch.optim.SGD(
        global_net.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True
    )
    nets = [copy.deepcopy(global_net) for _ in range(replicas)]
    inner = [make(net.parameters()) for net in nets]
    order = torch.Generator().manual_seed(11)
    steps = -(-len(xt) // batch_size)
    total = epochs * steps if max_steps is None else min(epochs * steps, max_steps)
    at_ends = validation is not None or sync_at_epoch_end
    val_losses = []
    round_, taken = 0, 0
    for _ in range(epochs):
        rows = torch.randperm(len(xt), generator=order) if shuffle else torch.arange(len(xt))
        for step in range(steps):
            if taken == max_steps:
                break
            taken += 1
            batch = rows[step * batch_size : (step + 1) * batch_size].numpy()
            here = [r for r in range(replicas) if r not in absent.get(round_, set())]
            for r, part in enumerate(np.array_split(batch, replicas)):
                if r not in here:
                    continue
                inner[r].zero_grad()
                loss = torch.nn.functional.cross_entropy(nets[r](xt[part]), yt[part])
                (loss * (len(part) * replicas / len(batch))).backward()
                inner[r].step()
            validates = validate_every is not None and taken % validate_every == 0
            ends = at_ends and step + 1 == steps
            if taken % sync_every and taken != total and not ends and not validates:
                continue
            with torch.no_grad():
                flat_global = torch.cat([g.reshape(-1) for g in global_net.parameters()])
                deltas = {
                    r: flat_global - torch.cat([p.reshape(-1) for p in nets[r].parameters()])
                    for r in here
                }
                if through == "coordinator" and compression is not None:
                    sent = [travelled(deltas[r], compression, residuals, r) for r in here]
                    mean64 = torch.stack(sent).double().mean(0).float().double()
                    momentum = -mean64 if momentum is None else outer_momentum * momentum - mean64
                    update = (outer_lr * (-mean64 + outer_momentum * momentum)).float()
                    update = travelled(update, compression, residuals, "coordinator")
                    offset = 0
                    for g in global_net.parameters():
                        g.add_(update[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
                    mean = None
                elif compression == "fp16":
                    mean = sum((d / len(here)).half() for d in deltas.values()).float()
                elif compression == "int8":
                    mean = int8_by_hand(deltas, residuals) / len(here)
                else:
                    mean = torch.stack(list(deltas.values())).mean(0)
                offset = 0
                for g in global_net.parameters():
                    if mean is not None:
                        g.grad = mean[offset : offset + g.numel()].view_as(g).clone()
                    offset += g.numel()
            if mean is not None:
                outer.step()
            round_ += 1
            back = [r for r in range(replicas) if r not in here and r not in absent.get(round_, ())]
            back += [r for r in (replaced or {}).get(round_, ()) if r in here]
            for r in back:  # joins: the first present replica's inner state, copied
                inner[r].load_state_dict(copy.deepcopy(inner[here[0]].state_dict()))
                residuals.pop(r, None)
            for net in nets:
                net.load_state_dict(global_net.state_dict())
            if validates and validations is not None:
                xv, yv = (torch.as_tensor(a) for a in validation)
                with torch.no_grad():
                    loss = torch.nn.functional.cross_entropy(global_net(xv), yv)
                validations.append((taken, float(loss)))
        if validation is not None:
            xv, yv = (torch.as_tensor(a) for a in validation)
            with torch.no_grad():
                val_losses.append(float(torch.nn.functional.cross_entropy(global_net(xv), yv)))
    return global_net.state_dict(), val_losses


def int8_by_hand(deltas: dict[int, torch.Tensor], residuals: dict[int, torch.Tensor]):
    """The sum over replicas of each one's ``deltas`` plus its residual, quantised to int8 in
    chunks of 4096 values (scale max|chunk| / 127, rounded to nearest) and back; each replica's
    residual becomes what quantisation left out (error feedback)."""
    total = 0
    for r, delta in deltas.items():
        sent = delta + residuals.get(r, torch.zeros_like(delta))
        back = torch.empty_like(sent)
        for start in range(0, len(sent), 4096):
            chunk = sent[start : start + 4096]
            scale = chunk.abs().max() / 127
            codes = torch.round(chunk / scale).clamp(-127, 127) if scale > 0 else chunk * 0
            back[start : start + 4096] = codes * scale
        residuals[r] = sent - back
        total = total + back
    return total


def travelled(values: torch.Tensor, compression: str, residuals: dict, key: object):
    """``values`` as they arrive after travelling as ``compression``: rounded to half
    precision, or (``"int8"``) quantised with ``key``'s residual (:func:`int8_by_hand`)."""
    if compression == "fp16":
        return values.half().float()
    if compression == "bf16":
        return values.bfloat16().float()
    return int8_by_hand({key: values}, residuals)


def _run(
    options: DiLoCoOptions,
    optimizer: str,
    *,
    spares=0,
    losing=None,
    store=None,
    resume=None,
    max_steps=None,
    validation=None,
    validate_every=None,
):
    """Train ``graph_for(optimizer, shuffle=True)`` with DiLoCo in memory (2 workers); lose the
    replicas ``losing[step]`` right after the progress event of that step (their next call
    fails with ``worker_lost``)."""
    x, y = dataset()
    settings = {"validate_every": validate_every} if validate_every else {}
    job = inputs(graph_for(optimizer, shuffle=True, max_steps=max_steps, **settings), x, y)
    if validation is not None:
        job = dataclasses.replace(job, x_val=validation[0], y_val=validation[1])
    ctx = InMemoryContext(2, Daemon, spares=spares)
    losing = dict(losing or {})
    events: list[tuple[str, dict]] = []
    strategy = DiLoCo(options)

    async def emit(event, data):
        events.append((event, data))
        if event == "progress":
            for i in losing.pop(data.get("step"), []):
                ctx.lose(i, "killed by the test")

    if store is not None:
        saves = JobCheckpoints("job", store, strategy.keep_checkpoints, emit, resume)
        job = dataclasses.replace(job, checkpoints=saves)
    states = asyncio.run(strategy.run(ctx, job, emit))
    assert not losing, f"never reached: {losing}"
    return states, events


def _assert_states(states, expected, atol=1e-5):
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=atol)


def test_checkpoints_fall_on_synchronisations_and_a_resumed_run_ends_as_the_undisturbed_one(
    tmp_path,
):
    x, y = dataset()
    store = CheckpointStore(tmp_path)
    options = DiLoCoOptions(
        workers=2, sync_every=3, checkpoint_every=5, keep_checkpoints=10, collective="auto"
    )
    straight, events = _run(options, "adam", store=store)
    saved = [data for event, data in events if event == "checkpoint"]
    # The first synchronisation at or after each multiple of 5 (syncs: 3 6 9 12 15 18 21: H
    # counts over the run, and the run's end).
    assert [c["step"] for c in saved] == [6, 12, 15, 21]
    expected, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    _assert_states(straight, expected)

    for seq, position in store.positions("job")[:3]:  # from steps 6, 12 and 15
        checkpoint = store.read("job", seq)
        resumed, events = _run(
            DiLoCoOptions(workers=2, sync_every=3, checkpoint_every=5),
            "adam",
            store=CheckpointStore(tmp_path / f"from-{seq}"),
            resume=checkpoint,
        )
        assert ("resumed", position | {"checkpoint": seq}) in events
        steps = [d["step"] for e, d in events if e == "progress" and "step" in d]
        assert steps[0] > position["step"] and steps[-1] == STEPS
        for key, value in straight["mlp"].items():
            torch.testing.assert_close(resumed["mlp"][key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spares", [1, 0])
def test_a_replica_lost_between_syncs_is_dropped_from_that_average_and_its_place_taken_after(
    spares,
):
    """Replica 1 is lost after the sync of step 3: the round of steps 4-6 averages replica 0
    alone; at that round's sync a spare takes its place (the global model, replica 0's inner
    Adam state) — or, with none, the job ends on one replica. Either way as the hand loop."""
    x, y = dataset()
    options = DiLoCoOptions(workers=2, sync_every=3, elastic=True)
    states, events = _run(options, "adam", spares=spares, losing={3: [1]})
    rounds = 7  # syncs after 3 6 9 12 15 18 21
    absent = {1: {1}} if spares else {r: {1} for r in range(1, rounds)}
    expected, _ = diloco_by_hand(
        x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, absent=absent
    )
    _assert_states(states, expected)
    kinds = [kind for kind, _ in events]
    lost = events[kinds.index("worker_lost")][1]
    dropped = events[kinds.index("worker_dropped")][1]
    assert (lost["worker"], lost["step"]) == ("mem-1", 4)
    assert (dropped["replica"], dropped["worker"], dropped["replicas"]) == (1, "mem-1", 1)
    steps = [d["step"] for k, d in events if k == "progress" and d["phase"] == "training"]
    assert steps == [3, 6, 9, 12, 15, 18, 21]  # every round once, none waited for
    if spares:
        joined = events[kinds.index("worker_joined")][1]
        assert (joined["replica"], joined["lost"], joined["worker"], joined["from"]) == (
            1,
            "mem-1",
            "mem-2",
            "mem-0",
        )
        assert kinds.index("worker_joined") < kinds.index("progress", kinds.index("worker_dropped"))
    else:
        assert "worker_joined" not in kinds


def test_every_replica_lost_fails_the_job_naming_them():
    from coordinator.strategies import StrategyFailed

    with pytest.raises(StrategyFailed, match="every replica was lost"):
        _run(DiLoCoOptions(workers=2, sync_every=3, elastic=True), "sgd", losing={6: [0, 1]})


@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
def test_through_the_coordinator_compressed_pseudo_gradients_and_updates_equal_the_hand_loop(
    compression,
):
    """The replicas send their pseudo-gradients compressed and the coordinator its outer
    update (int8: error feedback on both legs): the hand loop that compresses both alike gives
    the same model, and one that does not gives another."""
    x, y = dataset()
    options = DiLoCoOptions(
        workers=2, sync_every=3, compression=compression, collective="coordinator"
    )
    states, _ = _run(options, "adam")
    expected, _ = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        3,
        outer_lr=0.7,
        outer_momentum=0.9,
        compression=compression,
        through="coordinator",
    )
    _assert_states(states, expected)
    plain, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    assert not torch.allclose(plain["2.weight"], expected["2.weight"], rtol=0, atol=1e-7)


def test_compressed_and_elastic_a_joining_replica_starts_with_no_residual():
    """int8 with ``elastic``: replica 1 lost after step 3 is dropped from the next average and a
    spare joins at its sync with the global model and no residual: as the hand loop."""
    x, y = dataset()
    options = DiLoCoOptions(workers=2, sync_every=3, elastic=True, compression="int8")
    states, events = _run(options, "adam", spares=1, losing={3: [1]})
    expected, _ = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        3,
        outer_lr=0.7,
        outer_momentum=0.9,
        absent={1: {1}},
        compression="int8",
        through="coordinator",
    )
    _assert_states(states, expected)
    assert "worker_joined" in [kind for kind, _ in events]


def test_max_steps_stops_mid_epoch_after_a_synchronisation_as_the_hand_loop():
    """Stopped after 16 steps (the second of the third epoch, no sync_every boundary): the
    replicas synchronise there, as at an epoch's end, and the model is the hand loop's."""
    x, y = dataset()
    options = DiLoCoOptions(workers=2, sync_every=3, collective="coordinator")
    states, events = _run(options, "adam", max_steps=16)
    expected, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, max_steps=16)
    _assert_states(states, expected)
    trained = next(d for e, d in events if e == "progress" and d.get("phase") == "trained")
    assert (trained["step"], trained["epochs"], len(trained["history"])) == (16, 3, 3)


def test_h_counts_over_the_run_and_epoch_ends_sync_only_when_asked():
    """7 steps an epoch, H = 3: the synchronisations fall after steps 3, 6, 9, ... of the run
    (as the paper and torchft count H), not after 3, 6, 7, 10: the hand loop on that schedule.
    ``sync_at_epoch_end`` adds each epoch's end (the schedule before), which the hand loop
    with it equals, and which is another model. (In memory, through the coordinator; the
    torch group's schedule is the same list, sent in the replicas' plan: test_far_apart_live.)"""
    x, y = dataset()
    collective = "coordinator"
    over_run, events = _run(DiLoCoOptions(workers=2, sync_every=3, collective=collective), "adam")
    _assert_states(
        over_run, diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)[0]
    )
    at_ends, _ = _run(
        DiLoCoOptions(workers=2, sync_every=3, collective=collective, sync_at_epoch_end=True),
        "adam",
    )
    expected, _ = diloco_by_hand(
        x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, sync_at_epoch_end=True
    )
    _assert_states(at_ends, expected)
    assert not torch.allclose(
        torch.as_tensor(over_run["mlp"]["2.weight"]), expected["2.weight"], rtol=0, atol=1e-6
    )
    history = next(d for e, d in events if e == "progress" and d.get("phase") == "trained")
    assert len(history["history"]) == 3  # a row an epoch, synchronised there or not


def test_validate_every_synchronises_there_and_validates_the_global_model():
    """validate_every=5 with H = 3: the replicas also synchronise after steps 5, 10, 15 and
    20 (and each epoch's end, where the model is validated too), and each validation is the
    global model's loss there: the hand loop that synchronises and evaluates alike gives the
    same losses and the same model."""
    x, y = dataset()
    xv, yv = x[:64], y[:64]
    options = DiLoCoOptions(workers=2, sync_every=3, collective="coordinator")  # (live: torch)
    states, events = _run(options, "adam", validation=(xv, yv), validate_every=5)
    trained = next(d for e, d in events if e == "progress" and d.get("phase") == "trained")
    centred = (xv - x.mean(0), yv)  # the Center filter's fitted mean
    validations: list = []
    expected, at_ends = diloco_by_hand(
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
    _assert_states(states, expected)
    said = trained["validations"]
    assert [v["step"] for v in said] == [step for step, _ in validations] == [5, 10, 15, 20]
    assert [v["val_loss"] for v in said] == pytest.approx(
        [loss for _, loss in validations], abs=1e-5
    )
    assert [row["val_loss"] for row in trained["history"]] == pytest.approx(at_ends, abs=1e-5)
