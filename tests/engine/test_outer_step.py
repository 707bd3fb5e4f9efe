"""A replica alone's synchronisation point (DiLoCo through the coordinator, compressed): its
pseudo-gradients are the weights of the last synchronisation minus its weights now, and the
coordinator's update lands on those weights; an update of another model is refused whole."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.errors import EngineError
from engine.outer_step import SyncPoint
from protocol.compressed_trees import TreeCompressor, decode
from protocol.errors import ErrorCode


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
    sent = decode(sync.pseudo_gradients("fp16"))
    torch.testing.assert_close(sent["net"]["weight"], torch.full((2, 3), 0.25))
    torch.testing.assert_close(sent["net"]["bias"], torch.full((2,), -0.5))
    update = {"net": {"weight": torch.ones(2, 3), "bias": torch.full((2,), 2.0)}}
    sync.update(TreeCompressor("fp16").encode(update))
    torch.testing.assert_close(net.weight.detach(), before["weight"] + 1)
    torch.testing.assert_close(net.bias.detach(), before["bias"] + 2)
    assert not decode(sync.pseudo_gradients("fp16"))["net"]["weight"].any()  # synchronised


def test_an_update_of_another_model_is_refused_and_changes_nothing():
    net, sync = point()
    before = net.weight.detach().clone()
    wrong = TreeCompressor("int8").encode({"net": {"weight": torch.ones(3, 2)}})
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
        Engine().replica.pseudo_gradients("int8")
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert "for a replica planned alone, with compression" in str(refused.value)
