"""DiLoCo's checkpoints on the torch group: the outer momentum as a checkpoint holds it (the
replicas' torch SGD buffers saved as the coordinator's outer step keeps its momentum, so that a
checkpoint from either path resumes on the other), and the replicas' parts of a checkpoint read
from where they left them, each held to what a reply may be. (Live: test_far_apart_live.py,
test_resume.py, test_restarts.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from coordinator.errors import StrategyFailed
from coordinator.strategies.data_parallel.checkpoints import sync_payload
from coordinator.strategies.data_parallel.diloco_torch import (
    kept_snapshots,
    momentum_of,
    saved_momentum,
    snapshot_payload,
)
from coordinator.strategies.federated.server_optimizers import FedAvgM
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorCode
from protocol.files.shard_files import SNAPSHOT_FILE
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


class _Workers:
    """What each replica's worker kept (worker → kept id → name → bytes), read and dropped as
    a StrategyContext reads and drops them; every read and drop recorded."""

    def __init__(self, kept):
        self.kept = kept
        self.reads: list[tuple[int, str, int, int]] = []
        self.dropped: list[int] = []

    async def read_kept(self, worker, kept, name, offset, length):
        self.reads.append((worker, name, offset, length))
        return self.kept[worker][kept][name][offset : offset + length]

    async def drop_kept(self, worker, kept):
        self.dropped.append(worker)


def _left(files_by_replica):
    """Chunk results whose snapshots each replica's worker kept, and the workers."""
    workers = _Workers({i: {f"k{i}": files} for i, files in files_by_replica.items()})
    results = {
        i: {
            "losses": [1.0],
            "snapshot": {
                "shards": {"kept": f"k{i}", "files": {n: len(d) for n, d in files.items()}}
            },
        }
        for i, files in files_by_replica.items()
    }
    return workers, results


def _parts():
    """Two replicas' parts of a checkpoint: the first's whole, the second's inner state."""
    weights = {"mlp": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    first = {"exp_avg": torch.full((2, 3), 0.5)}
    second = {"exp_avg": torch.full((2, 3), -0.25)}
    outer = {"mlp": {"w": torch.full((2, 3), 2.0)}}
    whole = {"states": weights, "optimizers": {"mlp": first}, "outer": outer}
    inner = {"optimizers": {"mlp": second}}
    return whole, inner


def test_each_replicas_part_is_read_from_its_worker_in_pieces_into_one_checkpoint():
    """The first replica's frame holds the global model and the outer momentum, the second's
    its inner state alone; read a piece at a time and decoded, they make the checkpoint the
    replies once carried (:func:`sync_payload` of the same values, written here by hand), and
    every worker's files are released."""
    whole, inner = _parts()
    frames = {0: encode_frame(whole), 1: encode_frame(inner)}
    workers, results = _left({i: {SNAPSHOT_FILE: f} for i, f in frames.items()})

    async def go():
        kept = await kept_snapshots(workers, results, nbytes=1 << 20)
        read = [await k.whole(SNAPSHOT_FILE, 64) for k in kept]
        await asyncio.gather(*(k.release() for k in kept))
        return snapshot_payload({k.worker: decode(f) for k, f in zip(kept, read, strict=True)})

    payload = asyncio.run(go())
    assert max(length for *_, length in workers.reads) == 64
    assert sorted(workers.dropped) == [0, 1]
    expected = sync_payload(
        whole["states"],
        {0: whole["optimizers"], 1: inner["optimizers"]},
        saved_momentum(whole["outer"]),
    )
    assert payload.keys() == expected.keys() == {"states", "optimizers", "outer"}
    torch.testing.assert_close(payload["states"], expected["states"], rtol=0, atol=0)
    torch.testing.assert_close(payload["optimizers"], expected["optimizers"], rtol=0, atol=0)
    assert [p for p, _ in payload["outer"]] == [["mlp", "w"]]
    np.testing.assert_array_equal(payload["outer"][0][1][0], -np.full((2, 3), 2.0))


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ("larger than a reply", ErrorCode.RESOURCE_LIMIT),
        ("another file", ErrorCode.STATE_MISMATCH),
        ("not kept", ErrorCode.STATE_MISMATCH),
    ],
)
def test_a_part_left_otherwise_is_refused_unread_and_every_part_dropped(fault, code):
    whole, inner = _parts()
    files = {0: {SNAPSHOT_FILE: encode_frame(whole)}, 1: {SNAPSHOT_FILE: encode_frame(inner)}}
    if fault == "another file":
        files[1] = {"../shards": b"x" * 10}
    workers, results = _left(files)
    if fault == "not kept":
        results[1]["snapshot"] = {"shards": {SNAPSHOT_FILE: b"inline"}}
    nbytes = len(files[0][SNAPSHOT_FILE]) - 1 if fault == "larger than a reply" else 1 << 20
    with pytest.raises(StrategyFailed) as raised:
        asyncio.run(kept_snapshots(workers, results, nbytes=nbytes))
    assert raised.value.info.code is code
    assert workers.reads == []
    assert sorted(workers.dropped) == ([0] if fault == "not kept" else [0, 1])


def test_a_part_that_lacks_what_its_replica_holds_is_refused():
    whole, inner = _parts()
    with pytest.raises(StrategyFailed, match=r"replica 0's part .* states, optimizers, outer"):
        snapshot_payload({0: {k: v for k, v in whole.items() if k != "outer"}, 1: inner})
    with pytest.raises(StrategyFailed, match=r"replica 1's part .* optimizers"):
        snapshot_payload({0: whole, 1: [1, 2]})
