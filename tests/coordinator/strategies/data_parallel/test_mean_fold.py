"""coordinator.strategies.data_parallel.mean_fold: the gradient mean folded from replies as their
bytes arrive, fed the frames the wire carries, cut anywhere."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from coordinator.strategies.aggregate import weighted_mean
from coordinator.strategies.data_parallel.mean_fold import FoldBuffers, FoldDeclined, StreamedMean
from protocol.codec import decode, encode, encode_frame, frame_nbytes
from protocol.daemon import GradientsRequest, command_fields
from protocol.messages import Call

SHAPES = {"net": {"0.weight": (300, 97), "0.bias": (300,), "2.weight": (7, 300), "2.bias": (7,)}}


BIG = {"net": {"w": (1000, 400), "b": (1000,)}}  # 1.6 MB: ranges fold before the end


def gradients(
    seed: int, dtype: torch.dtype = torch.float32, shapes: dict = SHAPES
) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        node: {name: torch.randn(shape, generator=g).to(dtype) for name, shape in params.items()}
        for node, params in shapes.items()
    }


def reply_frame(grads: dict, loss: float = 0.25, reply_to: int = 7) -> bytes:
    """A ``result`` message as the coordinator receives it from an agent."""
    body = {"v": 1, "kind": "result", "id": 3, "reply_to": reply_to}
    return encode_frame(body | {"result": {"loss": loss, "gradients": grads}})


def cuts(total: int, rng: random.Random) -> list[int]:
    """Random chunk ends of a frame of ``total`` bytes: odd sizes, some tiny, some large."""
    ends, at = [], 0
    while at < total:
        at = min(total, at + rng.choice([1, 3, 64, 999, 4096, 65_537, 300_000]))
        ends.append(at)
    return ends


def feed(fold: StreamedMean, frames: dict[int, bytes], rng: random.Random) -> None:
    """Every frame into its replica's sink, in randomly interleaved pieces."""
    sinks = {i: fold.sink(i) for i in frames}
    buffers = {i: sinks[i].buffer(len(frame)) for i, frame in frames.items()}
    pending = {i: cuts(len(frame), rng) for i, frame in frames.items()}
    at = dict.fromkeys(frames, 0)
    while pending:
        i = rng.choice(sorted(pending))
        end = pending[i].pop(0)
        buffers[i][at[i] : end] = frames[i][at[i] : end]
        at[i] = end
        sinks[i].received(end)
        if not pending[i]:
            del pending[i]


def leaves(tree: dict) -> dict[str, np.ndarray]:
    return {f"{n}/{p}": np.asarray(v) for n, params in tree.items() for p, v in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weights", [{0: 5, 1: 3}, {0: 1, 1: 1, 2: 7}, {1: 4, 3: 2, 0: 9}])
def test_the_fold_is_the_weighted_mean_however_the_replies_are_cut(weights, dtype):
    trees = {i: gradients(seed=i, dtype=dtype) for i in weights}
    for seed in range(3):
        fold = StreamedMean(weights, FoldBuffers())
        feed(fold, {i: reply_frame(trees[i]) for i in weights}, random.Random(seed))
        assert fold.complete and fold.declined is None
        got = leaves(fold.result())
        # The same bits as averaging the whole replies, in the same contributor order...
        whole = leaves(
            weighted_mean([(str(i), w, trees[i]) for i, w in weights.items()], precise=False)
        )
        for key, value in whole.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape
            np.testing.assert_array_equal(got[key], value)
        # ...and the mean a hand computation in float64 gives.
        total = sum(weights.values())
        for key in got:
            node, param = key.split("/")
            expected = sum(w * trees[i][node][param].double().numpy() for i, w in weights.items())
            tolerance = 1e-6 if dtype == torch.float32 else 1e-13
            np.testing.assert_allclose(got[key], expected / total, rtol=tolerance, atol=tolerance)


def test_a_range_is_folded_only_once_every_reply_holds_it():
    frames = {0: reply_frame(gradients(0, shapes=BIG)), 1: reply_frame(gradients(1, shapes=BIG))}
    fold = StreamedMean({0: 1, 1: 1}, FoldBuffers())
    sinks = {i: fold.sink(i) for i in frames}
    buffers = {i: sinks[i].buffer(len(f)) for i, f in frames.items()}
    half = len(frames[0]) // 2
    buffers[0][:] = frames[0]
    sinks[0].received(len(frames[0]))  # one reply whole: nothing is final yet
    assert fold.leaves is not None and fold.done == [0] * len(fold.leaves)
    buffers[1][:half] = frames[1][:half]
    sinks[1].received(half)
    assert sum(fold.done) > 0 and not fold.complete
    buffers[1][half:] = frames[1][half:]
    sinks[1].received(len(frames[1]))
    assert fold.complete


def test_one_contributor_gives_its_gradients_exactly():
    tree = gradients(3)
    fold = StreamedMean({2: 17}, FoldBuffers())
    feed(fold, {2: reply_frame(tree)}, random.Random(0))
    for key, value in leaves(fold.result()).items():
        node, param = key.split("/")
        np.testing.assert_array_equal(value, tree[node][param].numpy())


def paced_request(mean: dict) -> list:
    """The parts of a next step's request carrying ``mean``, as the coordinator encodes it."""
    request = GradientsRequest(node_ids=["net"], data="train", rows=[0, 1], apply=mean)
    call = Call(job_id="j", request=command_fields(request), timeout=60)
    return encode(call.model_dump() | {"id": 11})


def test_paced_bytes_of_the_next_request_wait_for_the_fold():
    async def scenario() -> None:
        trees = [gradients(0, shapes=BIG), gradients(1, shapes=BIG)]
        frames = {i: reply_frame(tree) for i, tree in enumerate(trees)}
        fold = StreamedMean({0: 2, 1: 1}, FoldBuffers())
        sinks = {i: fold.sink(i) for i in frames}
        buffers = {i: sinks[i].buffer(len(f)) for i, f in frames.items()}
        taking = asyncio.ensure_future(fold.take())
        await asyncio.sleep(0)
        assert not taking.done()  # no header yet: no tree to send
        for i, frame in frames.items():
            head = 4 + int.from_bytes(frame[:4], "little")
            buffers[i][:] = frame  # in the buffer, but only the header said received
            sinks[i].received(head)
        mean, pace = await asyncio.wait_for(taking, 1)
        assert pace is fold
        parts = paced_request(mean)
        until = fold.bind(parts)
        header = len(parts[0])
        await asyncio.wait_for(until(header), 1)  # the header and padding are final at once
        waiting = asyncio.ensure_future(until(frame_nbytes(parts)))
        for i, frame in frames.items():
            sinks[i].received(len(frame) // 2)
        await asyncio.sleep(0)
        assert not waiting.done()
        for i, frame in frames.items():
            sinks[i].received(len(frame))
        await asyncio.wait_for(waiting, 1)
        sent = decode(bytearray().join(parts))["request"]["apply"]
        expected = weighted_mean([("0", 2, trees[0]), ("1", 1, trees[1])], precise=False)
        for key, value in leaves(expected).items():
            node, param = key.split("/")
            np.testing.assert_array_equal(np.asarray(sent[node][param]), value)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (reply_frame(gradients(1, torch.float16)), "float16 leaf"),
        (reply_frame({"net": {"0.weight": torch.zeros(300, 97)}}), "not laid out alike"),
        (encode_frame({"v": 1, "kind": "error", "id": 4, "reply_to": 7, "error": {}}), "gradients"),
    ],
)
def test_replies_it_cannot_fold_are_declined_and_the_whole_mean_settles(second, why):
    async def scenario() -> None:
        fold = StreamedMean({0: 1, 1: 1}, FoldBuffers())
        first = reply_frame(gradients(0))
        sink = fold.sink(0)
        sink.buffer(len(first))[:] = first
        sink.received(len(first))
        mean, pace = await fold.take()  # the first reply's tree: requests may be built on it
        until = pace.bind(paced_request(mean))
        waiting = asyncio.ensure_future(until(1 << 20))
        other = fold.sink(1)
        other.buffer(len(second))[:] = second
        other.received(len(second))
        with pytest.raises(FoldDeclined, match=why):
            await asyncio.wait_for(waiting, 1)  # nothing of the mean was sent
        with pytest.raises(FoldDeclined):
            fold.result()
        taking = asyncio.ensure_future(fold.take())
        await asyncio.sleep(0)
        assert not taking.done()  # waits for the mean made from the whole replies
        fold.settle({"made": "whole"})
        assert await asyncio.wait_for(taking, 1) == ({"made": "whole"}, None)

    asyncio.run(scenario())


def test_released_buffers_serve_the_next_steps():
    pool = FoldBuffers()
    frames = {0: reply_frame(gradients(0)), 1: reply_frame(gradients(1))}
    first = StreamedMean({0: 1, 1: 1}, pool)
    feed(first, frames, random.Random(1))
    kept = {id(b) for b in (first._mean, *(r.buffer for r in first._replies.values()))}
    first.release()
    second = StreamedMean({0: 1, 1: 1}, pool)
    feed(second, frames, random.Random(2))
    reused = {id(b) for b in (second._mean, *(r.buffer for r in second._replies.values()))}
    assert reused == kept
    np.testing.assert_array_equal(
        leaves(second.result())["net/0.weight"],
        leaves(weighted_mean([("0", 1, gradients(0)), ("1", 1, gradients(1))], precise=False))[
            "net/0.weight"
        ],
    )
