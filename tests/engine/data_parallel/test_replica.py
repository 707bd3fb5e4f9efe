"""The torch collective's replica side that needs no group: the plan each replica walks, and the
reachability probe (the group itself is tested on live workers, tests/integration)."""

from __future__ import annotations

import fcntl
import socket
import struct
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from engine.data_parallel.modes.mode import Unplanned
from engine.data_parallel.modes.sharded import ShardsLeft
from engine.data_parallel.plan import ReplicaPlan
from engine.engine import Engine
from engine.errors import EngineError
from engine.group_member import GroupMember, interface_towards
from protocol.daemon import DdpSpec, DiLoCoGroupSpec, DistPlanRequest, OuterStepSpec
from protocol.errors import ErrorCode
from protocol.filters import dump_filter, load_filter, split_rows
from protocol.rules.batching import synchronises


def plan_of(
    data: str,
    node_ids: list[str],
    held: list[int],
    place: tuple[int, int],
    rows: int,
    batches: tuple[int, int, bool, int],
    *,
    outer: OuterStepSpec | None = None,
    sizes: list[int] | None = None,
) -> ReplicaPlan:
    """The plan of the replica at ``place`` (rank, world) over ``rows`` rows in ``batches``
    (epochs, batch_size, shuffle, seed): DDP's, or with ``outer`` DiLoCo's over the group."""
    epochs, batch_size, shuffle, seed = batches
    request = DistPlanRequest(
        node_ids=node_ids,
        data=data,
        held=held,
        rows=rows,
        epochs=epochs,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        sizes=sizes,
        mode=DdpSpec() if outer is None else DiLoCoGroupSpec(outer=outer),
    )
    rank, world = place
    return ReplicaPlan.of(request, rank=rank, world=world)


def test_each_replica_finds_its_slice_of_every_global_batch_among_the_rows_it_holds():
    # 10 rows, batches of 4 in order, 3 replicas: array_split gives slices of 2/1/1, then 1/1/0.
    held = {0: [0, 1, 4, 5, 8], 1: [2, 6, 9], 2: [3, 7]}
    plans = {
        rank: plan_of("train", ["net"], rows, (rank, 3), 10, (1, 4, False, 0))
        for rank, rows in held.items()
    }
    batches = [4, 4, 2]
    for plan in plans.values():
        assert [size for _, size in plan.steps] == batches
    assert [list(local) for local, _ in plans[0].steps] == [[0, 1], [2, 3], [4]]
    assert [list(local) for local, _ in plans[1].steps] == [[0], [1], [2]]
    assert [list(local) for local, _ in plans[2].steps] == [[0], [1], []]
    # Every row once an epoch, across the replicas, as graph.fit sees them.
    seen = sorted(
        held[rank][i] for rank, plan in plans.items() for local, _ in plan.steps for i in local
    )
    assert seen == list(range(10))


def test_a_plan_over_rows_that_were_not_staged_here_is_refused():
    with pytest.raises(EngineError) as refused:
        plan_of("train", ["net"], [0, 1], (1, 2), 8, (1, 4, False, 0))
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert "replica 1's slice of a step has rows that were not staged here" in str(refused.value)


def test_the_probe_says_whether_the_rendezvous_can_be_reached():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert GroupMember.probe("127.0.0.1", port, 2.0) == {"reachable": True, "error": None}
    closed = GroupMember.probe("127.0.0.1", port, 2.0)
    assert closed["reachable"] is False
    assert "ConnectionRefusedError" in closed["error"]


def test_training_before_joining_a_group_is_refused():
    with pytest.raises(EngineError, match="dist_train before dist_plan"):
        Engine().replica.train(0, 1)
    with pytest.raises(EngineError, match="not in a process group: dist_join first"):
        Engine().group.place()


def test_shuffled_plans_cover_each_epoch_once():
    rows = 23
    held = [list(range(rows))] * 2
    plans = [plan_of("t", ["n"], held[r], (r, 2), rows, (3, 5, True, 7)) for r in range(2)]
    for epoch in range(3):
        steps = range(epoch * 5, epoch * 5 + 5)
        seen = np.concatenate([plans[r].steps[s][0] for r in range(2) for s in steps])
        assert sorted(seen.tolist()) == list(range(rows))


def test_diloco_synchronises_every_h_steps_of_the_run_at_its_end_and_where_read():
    # 10 rows in batches of 3 over 2 replicas: 4 steps an epoch, 2 epochs; H = 3 over the run.
    outer = OuterStepSpec(sync_every=3, lr=0.7, momentum=0.9, nesterov=True)
    plan = plan_of("t", ["n"], list(range(10)), (0, 2), 10, (2, 3, True, 0), outer=outer)
    whole = (0,)  # the model: one fragment
    assert plan.syncs == [(), (), whole, (), (), whole, (), whole]
    read = outer.model_copy(update={"also": [4]})  # the model is read after the first epoch
    plan = plan_of("t", ["n"], list(range(10)), (0, 2), 10, (2, 3, True, 0), outer=read)
    assert plan.syncs == [(), (), whole, whole, (), whole, (), whole]
    # Streaming, two fragments: fragment 0 after steps 3, 6; fragment 1 (offset 1) after 1, 4,
    # 7; both after the last
    two = outer.model_copy(update={"fragments": 2})
    plan = plan_of("t", ["n"], list(range(10)), (0, 2), 10, (2, 3, True, 0), outer=two)
    assert plan.syncs == [(1,), (), (0,), (1,), (), (0,), (1,), (0, 1)]
    assert synchronises(5, 2) == [False, True, False, True, True]
    assert synchronises(3, 1) == [True, True, True]
    assert synchronises(4, 5, also=[2, 9]) == [False, True, False, True]
    # On the replicas' own datasets (WorkerData): 5 and 6 rows, batches of 2: 3 steps an epoch.
    own = plan_of("t", ["n"], [], (0, 2), 0, (1, 2, False, 0), sizes=[5, 6], outer=outer)
    assert own.syncs == [(), (), whole]
    assert plan_of("t", ["n"], list(range(10)), (0, 2), 10, (2, 3, True, 0)).syncs == []


def test_gloo_connects_through_the_interface_that_routes_to_the_rendezvous():
    assert interface_towards("127.0.0.1", 29500) == "lo"
    # A rendezvous at one of this machine's other addresses: the interface that holds it
    # (the kernel sends from that address), never lo.
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:
                continue  # no IPv4 address
        address = socket.inet_ntoa(reply[20:24])
        if not address.startswith("127."):
            assert interface_towards(address, 29500) == name


def test_a_checkpoints_files_must_be_plain_names_and_loading_needs_a_sharded_plan():
    replica = Engine().replica
    for bad in ("../x", "a/b", "..", "."):
        with pytest.raises(EngineError, match="is not a checkpoint file's name") as refused:
            replica.shard_file(bad, b"")
        assert refused.value.code is ErrorCode.BAD_REQUEST
    replica.shard_file(".metadata", b"kept until dist_load_shards")
    with pytest.raises(EngineError, match="dist_load_shards loads a sharded replica"):
        replica.load_shards({"split": []})


def test_a_checkpoints_file_comes_in_pieces_each_where_the_last_ended():
    replica = Engine().replica
    replica.shard_file("__0_0.distcp", b"stale", 0)
    replica.shard_file("__0_0.distcp", b"first ", 0)  # at 0: the file afresh
    replica.shard_file("__0_0.distcp", b"second", 6)
    for offset in (3, 13):  # not where it ends
        with pytest.raises(EngineError, match=f"at {offset}, where 12 bytes of it are here"):
            replica.shard_file("__0_0.distcp", b"x", offset)
    with pytest.raises(EngineError, match="at 4, where 0 bytes"):
        replica.shard_file(".metadata", b"x", 4)  # a file never started
    assert replica._incoming.folder is not None
    assert (Path(replica._incoming.folder.name) / "__0_0.distcp").read_bytes() == b"first second"
    replica._incoming.drop()


def test_nodes_left_sharded_take_no_new_plan_until_they_are_loaded_again():
    # A sharded run's nodes hold shards over its group; once the group is gone (the job ended
    # or broke) a new plan over them is refused: only filters loaded again can train.
    engine = Engine()
    engine.load({"net": sz.TorchFilter(torch.nn.Linear(2, 2), loss="mse")})
    replica = engine.replica
    # as a sharded mode leaves it:
    replica._mode = ShardsLeft(types.SimpleNamespace(run=engine.nodes.select(["net"])), None)
    plan = plan_of("train", ["net"], [0, 1], (0, 1), 2, (1, 2, False, 0))
    with pytest.raises(EngineError, match="sharded over a group that is gone") as refused:
        replica.set_plan(plan)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    engine.load({"net": sz.TorchFilter(torch.nn.Linear(2, 2), loss="mse")})
    with pytest.raises(EngineError) as past:  # past that check: the rows were never staged
        replica.set_plan(plan)
    assert "sharded" not in str(past.value)
    assert isinstance(replica._mode, Unplanned)


def test_a_filter_loaded_as_its_rows_alone_is_never_read_or_set_whole():
    """A sharded replica's filter arrives as its rows of each parameter (``split_rows``): it
    stays on the meta device until sharded, and reading or setting its state whole says so
    rather than give or take nothing."""
    big = sz.TorchFilter(torch.nn.Linear(4096, 8), loss="mse")
    engine = Engine()
    engine.load({"net": load_filter(split_rows(dump_filter(big), 1, 2).tobytes())})
    assert engine.nodes.node("net").filter.module.weight.is_meta
    for read in (
        lambda: engine.nodes.get_state(["net"]),
        lambda: engine.nodes.set_state({"net": big.module.state_dict()}),
    ):
        with pytest.raises(EngineError, match="holds only this replica's rows") as refused:
            read()
        assert refused.value.code is ErrorCode.BAD_REQUEST


def test_a_snapshot_read_live_is_the_modules_tensors_and_any_other_read_a_copy():
    """What a chunk's reply carries for a checkpoint (``live``: written out before the next
    request can step it) against a state read to be kept (copied)."""
    engine = Engine()
    engine.load({"net": sz.TorchFilter(torch.nn.Linear(3, 2), loss="mse")})
    module = engine.nodes.node("net").filter.module
    before = module.weight.detach().clone()
    live = engine.nodes.get_state(["net"], live=True)["net"]
    kept = engine.nodes.get_state(["net"])["net"]
    assert live["weight"].data_ptr() == module.weight.data_ptr()
    assert kept["weight"].data_ptr() != module.weight.data_ptr()
    assert not live["weight"].requires_grad and not kept["weight"].requires_grad
    with torch.no_grad():
        module.weight.add_(1.0)
    torch.testing.assert_close(live["weight"], before + 1.0)
    torch.testing.assert_close(kept["weight"], before)
