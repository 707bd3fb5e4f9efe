"""A replica alone's synchronisation point (DiLoCo through the coordinator, compressed): its
pseudo-gradients are the weights of the last synchronisation minus its weights now, and the
coordinator's update lands on those weights; an update of another model is refused whole.
A replica's outer step on a group (one-rank gloo): its outer momentum read and set as torch
SGD's buffers, and a synchronisation whose exchange breaks leaves it as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from engine.data_parallel.outer_step import OuterStep, SyncPoint
from engine.engine import Engine
from engine.errors import EngineError
from protocol.compressed_trees import TreeCompressor, decode
from protocol.daemon import OuterStepSpec
from protocol.errors import ErrorCode
from protocol.options.compression import Compression
from tests.gloo_group import one_rank_gloo_group

SPEC = OuterStepSpec(sync_every=2, lr=0.7, momentum=0.9, nesterov=True)
FP16 = Compression("fp16")


@pytest.fixture
def group() -> Iterator[None]:
    with one_rank_gloo_group():
        yield


def point() -> tuple[torch.nn.Linear, SyncPoint]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    return net, SyncPoint({"net": dict(net.named_parameters())})


def test_pseudo_gradients_are_the_synchronised_weights_less_the_weights_now():
    net, sync = point()
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    with torch.no_grad():
        net.weight.sub_(0.25)
        net.bias.add_(0.5)
    sent = decode(sync.pseudo_gradients(FP16))
    torch.testing.assert_close(sent["net"]["weight"], torch.full((2, 3), 0.25))
    torch.testing.assert_close(sent["net"]["bias"], torch.full((2,), -0.5))
    update = {"net": {"weight": torch.ones(2, 3), "bias": torch.full((2,), 2.0)}}
    sync.update(TreeCompressor(FP16).encode(update))
    torch.testing.assert_close(net.weight.detach(), before["weight"] + 1)
    torch.testing.assert_close(net.bias.detach(), before["bias"] + 2)
    assert not decode(sync.pseudo_gradients(FP16))["net"]["weight"].any()  # synchronised


def test_an_update_of_another_model_is_refused_and_changes_nothing():
    net, sync = point()
    before = net.weight.detach().clone()
    wrong = TreeCompressor(Compression("int8")).encode({"net": {"weight": torch.ones(3, 2)}})
    with pytest.raises(EngineError) as refused:
        sync.update(wrong)
    assert refused.value.code is ErrorCode.GRADIENT_MISMATCH
    assert "every trainable parameter of the replica, in its shape" in str(refused.value)
    torch.testing.assert_close(net.weight.detach(), before)
    with pytest.raises(EngineError) as broken:
        sync.update({"$compressed": "int8", "layout": [], "values": torch.zeros(3)})
    assert broken.value.code is ErrorCode.BAD_REQUEST


def test_a_replica_not_planned_alone_has_no_pseudo_gradients_to_give():
    with pytest.raises(EngineError) as refused:
        Engine().replica.pseudo_gradients(Compression("int8"))
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert "for a replica planned alone, with compression" in str(refused.value)


def _stepped(net: torch.nn.Linear, by: float) -> None:
    """An inner step stand-in: every weight moved by ``by``."""
    with torch.no_grad():
        for p in net.parameters():
            p.sub_(by)


def _joiner(
    net: torch.nn.Linear, outer: OuterStep, spec: OuterStepSpec, steps: int
) -> tuple[torch.nn.Linear, OuterStep]:
    """A replica joining at a synchronisation: ``net``'s weights, and a fresh outer step set
    to ``outer``'s momentum."""
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(net.state_dict())
    again = OuterStep(list(twin.parameters()), spec, steps=steps)
    again.load_momenta(outer.momenta())
    return twin, again


def test_outer_momentum_is_torch_sgds_buffer_and_setting_it_resumes_the_outer_step(group):
    """One rank: the mean pseudo-gradient is the replica's own (θ_global − θ_local = 0.25
    everywhere after the inner steps), so the first outer step's buffer is 0.25; a fresh outer
    step given that buffer (a joiner, a resumed run) takes the next step as the first one."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    outer = OuterStep(list(net.parameters()), SPEC, steps=4)
    assert outer.momenta() == [None, None]  # none before the first synchronisation
    _stepped(net, 0.25)
    outer.after(1, (0,), [])  # after step 2: sync_every=2
    for momentum in outer.momenta():
        torch.testing.assert_close(momentum, torch.full_like(momentum, 0.25))
    twin, again = _joiner(net, outer, SPEC, steps=4)
    for stepped in (net, twin):
        _stepped(stepped, 0.5)
    outer.after(3, (0,), [])
    again.after(3, (0,), [])
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Nesterov by hand: buffer 0.9·0.25 + 0.5; the weights move by −0.7·(0.5 + 0.9·buffer)
    for momentum in again.momenta():
        torch.testing.assert_close(momentum, torch.full_like(momentum, 0.9 * 0.25 + 0.5))


def test_a_parameter_cut_between_fragments_steps_each_piece_with_its_fragment(group):
    """Linear(3, 2): 6 + 2 values, two fragments of 4: the weight is cut in the middle. After
    fragment 0 synchronises alone, only the weight's first 4 values are global again and have
    a momentum (0.25; zeros for the rest). Once fragment 1 has too, the momentum, read whole
    and set on a fresh outer step (a joiner), steps both fragments as the first one does."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    spec = SPEC.model_copy(update={"fragments": 2})
    outer = OuterStep(list(net.parameters()), spec, steps=8)
    start = [p.detach().clone() for p in net.parameters()]
    _stepped(net, 0.25)
    outer.after(0, (0,), [])  # fragment 0: the weight's values 0..3
    weight, bias = (p.detach() for p in net.parameters())
    # Nesterov by hand on the first 4 values: θ − 0.7·(0.25 + 0.9·0.25) from θ = start
    moved = start[0].reshape(-1)[:4] - 0.7 * (0.25 + 0.9 * 0.25)
    torch.testing.assert_close(weight.reshape(-1)[:4], moved)
    torch.testing.assert_close(weight.reshape(-1)[4:], start[0].reshape(-1)[4:] - 0.25)
    torch.testing.assert_close(bias, start[1] - 0.25)
    momentum, none = outer.momenta()
    assert none is None and momentum.shape == (2, 3)
    torch.testing.assert_close(momentum.reshape(-1), torch.tensor([0.25] * 4 + [0.0] * 2))
    outer.after(1, (1,), [])  # fragment 1: the weight's values 4, 5 and the bias
    for momentum in outer.momenta():
        torch.testing.assert_close(momentum, torch.full_like(momentum, 0.25))
    twin, again = _joiner(net, outer, spec, steps=8)
    for stepped in (net, twin):
        _stepped(stepped, 0.5)
    for step in (2, 3):  # fragment 0, then fragment 1
        outer.after(step, (step % 2,), [])
        again.after(step, (step % 2,), [])
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_global_weights_stand_in_for_the_local_ones_while_the_model_is_read(group):
    """Two fragments, fragment 0 synchronised: inside the block the model holds the global
    weights (fragment 0's stepped, fragment 1's as they started), after it its local ones."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    spec = SPEC.model_copy(update={"fragments": 2, "mixing": 0.5})
    outer = OuterStep(list(net.parameters()), spec, steps=8)
    start = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    _stepped(net, 0.25)
    outer.after(0, (0,), [])
    local = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    stepped = start[:4] - 0.7 * (0.25 + 0.9 * 0.25)  # fragment 0's global, Nesterov by hand
    with outer.global_weights():
        read = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        torch.testing.assert_close(read, torch.cat([stepped, start[4:]]))
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in net.parameters()]), local)
    # (mixing 0.5: the local weights are halfway between what they were and the global ones)
    torch.testing.assert_close(local[:4], 0.5 * (start[:4] - 0.25) + 0.5 * stepped)


def test_a_synchronisation_whose_exchange_breaks_leaves_the_replica_as_it_was(group, monkeypatch):
    """int8 pseudo-gradients: the gather breaks (as when a peer is lost) after the residual
    was computed; the local and global weights, the momentum and the residual are as before,
    and making the synchronisation again gives what an unbroken one gives."""
    torch.manual_seed(0)
    net = torch.nn.Linear(40, 30)
    twin = torch.nn.Linear(40, 30)
    twin.load_state_dict(net.state_dict())
    outers = [
        OuterStep(list(m.parameters()), SPEC, compression=Compression("int8"), steps=4)
        for m in (net, twin)
    ]
    for m, outer in zip((net, twin), outers, strict=True):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.97)
        outer.after(1, (0,), [])
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.013)
    broken, unbroken = outers
    before = [p.detach().clone() for p in net.parameters()]
    residuals = dict(broken.fragments[0].pseudo_gradients.residuals)
    assert residuals  # the first synchronisation left one
    real_gather = dist.all_gather

    def gather_breaks(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")

    monkeypatch.setattr(dist, "all_gather", gather_breaks)
    with pytest.raises(RuntimeError, match="Connection closed"):
        broken.after(3, (0,), [])
    assert broken.fragments[0].pseudo_gradients.residuals == residuals
    for p, was in zip(net.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), was, rtol=0, atol=0)
    monkeypatch.setattr(dist, "all_gather", real_gather)
    broken.after(3, (0,), [])
    unbroken.after(3, (0,), [])
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(broken.momenta(), unbroken.momenta(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
