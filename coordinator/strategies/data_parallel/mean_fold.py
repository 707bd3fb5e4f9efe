"""The gradient mean of a step folded in as the replicas' replies arrive: the star path streamed.

On the coordinator collective every step's gradients go replica → coordinator → mean → replica.
Stored and forwarded, the mean waits for every reply whole, and the replicas wait for the mean
whole. Here each reply lands in a buffer of the fold's own (a
:class:`~protocol.chunking.StreamSink`, claimed from its first chunk), and every range of every
gradient tensor is averaged as soon as all the replies' bytes of it are in::

    mean[r] = (w₀·g₀[r] + w₁·g₁[r] + …) / Σ wᵢ

with the same torch kernels, in the same contributor order and dtype, as
:func:`~coordinator.strategies.aggregate.weighted_mean` with ``precise=False`` applies to whole
tensors: elementwise, so the bits are the same. The next step's requests carry that mean and are
sent *paced* (the fold is their :class:`~protocol.asyncio.channel.Pacer`): each chunk of them
leaves once the mean bytes it carries are final, while later ranges are still arriving. The
buffers come from a :class:`FoldBuffers` the run keeps, so a step faults in no fresh pages.

The fold reads a reply's header as :mod:`protocol.codec` lays frames out, and takes gradient
trees of plain dicts down to float32 or float64 arrays, the same in every reply. Anything else
(an error reply, another dtype, trees that differ) it *declines*: nothing of it is folded, a
paced request waiting on it raises :class:`FoldDeclined` before any of its mean bytes went out,
and the strategy averages the replies as before (:meth:`StreamedMean.settle`), which names whatever
disagrees. The sink callbacks run on the event loop, a chunk's worth of work at a time.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from protocol.codec import ALIGNMENT, FRAME_VERSION, Part

__all__ = ["FoldBuffers", "FoldDeclined", "StreamedMean"]

MIN_FOLD_BYTES = 256 << 10
"""A range is folded once this many of its bytes are in from every reply (or its tensor ends):
small enough to overlap the transfer, large enough that the kernels' overhead does not show."""

_PREFIX = struct.Struct("<I")
_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
_LIBS = frozenset({"torch", "np"})


class FoldDeclined(Exception):
    """The replies of a step cannot be folded as they arrive (why is the message); the step's
    mean is made from the whole replies instead."""


@dataclass(frozen=True)
class _Leaf:
    """One gradient tensor as a reply's header describes it."""

    path: tuple[str, ...]
    lib: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    buf: int  # its buffer's index in the frame

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def same(self, other: _Leaf) -> bool:
        return (self.path, self.lib, self.dtype, self.shape) == (
            other.path,
            other.lib,
            other.dtype,
            other.shape,
        )


class FoldBuffers:
    """Buffers kept from step to step by one run: a fold takes what it needs and gives it back
    when the step's mean has reached every replica (:meth:`StreamedMean.release`)."""

    def __init__(self) -> None:
        self._free: dict[Any, list[np.ndarray[Any, Any]]] = {}

    def take(self, key: Any, nbytes: int) -> np.ndarray[Any, Any]:
        """A uint8 buffer of at least ``nbytes`` bytes for ``key``; one given back if it fits."""
        free = self._free.get(key, [])
        for k, buffer in enumerate(free):
            if buffer.nbytes >= nbytes:
                return free.pop(k)
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, key: Any, buffer: np.ndarray[Any, Any]) -> None:
        self._free.setdefault(key, []).append(buffer)


@dataclass
class _Reply:
    """One contributor's reply as it arrives (the :class:`~protocol.chunking.StreamSink`)."""

    fold: StreamedMean
    place: int  # its position among the contributors
    weight: float
    buffer: np.ndarray[Any, Any] | None = None
    received: int = 0
    offsets: list[int] | None = None  # each leaf's byte offset in the frame, once read
    claimed: bool = False

    def buffer_for(self, nbytes: int) -> memoryview:
        if self.buffer is not None:  # a second message for one request: not ours to fold
            self.fold.decline("a reply arrived twice")
            return np.empty(nbytes, dtype=np.uint8).data
        self.claimed = True
        self.buffer = self.fold.pool.take(("reply", self.place), nbytes)
        return self.buffer[:nbytes].data

    def received_bytes(self, nbytes: int) -> None:
        self.received = nbytes
        if self.fold.declined is None:
            self.fold.advance(self)


class _Sink:
    """The :class:`~protocol.chunking.StreamSink` of one reply."""

    def __init__(self, reply: _Reply) -> None:
        self._reply = reply

    def buffer(self, nbytes: int) -> memoryview:
        return self._reply.buffer_for(nbytes)

    def received(self, nbytes: int) -> None:
        self._reply.received_bytes(nbytes)


@dataclass
class StreamedMean:
    """One step's gradient mean, folded from the replies as they arrive (module docstring).

    Args:
        weights: each contributing replica's weight (its rows in the step), in the order their
            gradients are summed.
        pool: the run's buffers.
    """

    weights: Mapping[int, float]
    pool: FoldBuffers
    declined: str | None = None
    finished: float | None = None  # when its last range was folded (time.monotonic)
    leaves: list[_Leaf] | None = None
    done: list[int] = field(default_factory=list)  # elements of each leaf folded
    _replies: dict[int, _Reply] = field(default_factory=dict)
    _mean: np.ndarray[Any, Any] | None = None
    _views: list[np.ndarray[Any, Any]] = field(default_factory=list)  # the mean, by leaf
    _tree: Any = None
    _settled: asyncio.Future[Any] | None = None
    _progress: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a mean of no contributors")
        self.total = math.fsum(float(w) for w in self.weights.values())
        for place, (replica, weight) in enumerate(self.weights.items()):
            self._replies[replica] = _Reply(self, place, float(weight))

    # -- receiving ----------------------------------------------------------------------------

    def sink(self, replica: int) -> _Sink:
        """Where ``replica``'s reply lands (pass it to the call as its sink)."""
        return _Sink(self._replies[replica])

    @property
    def complete(self) -> bool:
        """Every element of the mean is final."""
        leaves = self.leaves
        return leaves is not None and all(
            d == leaf.numel for d, leaf in zip(self.done, leaves, strict=True)
        )

    def decline(self, why: str) -> None:
        """Fold no more of this step (``why``); whoever waits on it is told."""
        if self.declined is None:
            self.declined = why
            self._wake()

    def advance(self, reply: _Reply) -> None:
        """``reply`` has more bytes in: read its header when it is whole, then fold every range
        that all replies now hold."""
        if reply.offsets is None and not self._read_header(reply):
            return
        leaves, offsets = self.leaves, [r.offsets for r in self._replies.values()]
        if leaves is None or any(o is None for o in offsets):
            return
        replies = list(self._replies.values())
        moved = False
        for k, leaf in enumerate(leaves):
            start = self.done[k]
            if start == leaf.numel:
                continue
            size = leaf.dtype.itemsize
            upto = leaf.numel
            for r in replies:
                assert r.offsets is not None
                upto = min(upto, max(0, (r.received - r.offsets[k]) // size))
            if upto < leaf.numel:
                upto -= upto % (ALIGNMENT // size)  # whole vectors: the tails fall where they would
                if (upto - start) * size < MIN_FOLD_BYTES:
                    break
            if upto > start:
                self._fold(k, start, upto, replies)
                self.done[k] = upto
                moved = True
            if upto < leaf.numel:
                break
        if moved:
            if self.complete:
                self.finished = time.monotonic()
            self._wake()

    def _read_header(self, reply: _Reply) -> bool:
        """Read ``reply``'s header once it is in; ``False`` while it is not (or when declined)."""
        buffer = reply.buffer
        if buffer is None or reply.received < _PREFIX.size:
            return False
        (length,) = _PREFIX.unpack_from(buffer.data)
        if reply.received < _PREFIX.size + length:
            return False
        try:
            leaves, offsets = _layout(bytes(buffer[_PREFIX.size : _PREFIX.size + length]))
        except FoldDeclined as exc:
            self.decline(str(exc))
            return False
        if any(
            o + leaf.numel * leaf.dtype.itemsize > buffer.nbytes
            for o, leaf in zip(offsets, leaves, strict=True)
        ):
            self.decline("a reply's buffers run past its frame")
            return False
        if self.leaves is None:
            self.leaves = leaves
            self.done = [0] * len(leaves)
            self._allocate(leaves)
        elif len(leaves) != len(self.leaves) or not all(
            a.same(b) for a, b in zip(leaves, self.leaves, strict=True)
        ):
            self.decline("the replies' gradients are not laid out alike")
            return False
        reply.offsets = offsets
        return True

    def _allocate(self, leaves: list[_Leaf]) -> None:
        starts, end = [], 0
        for leaf in leaves:
            starts.append(end)
            end = -(-(end + leaf.numel * leaf.dtype.itemsize) // ALIGNMENT) * ALIGNMENT
        self._mean = self.pool.take("mean", end)
        self._views = [
            self._mean[s : s + leaf.numel * leaf.dtype.itemsize].view(leaf.dtype)
            for s, leaf in zip(starts, leaves, strict=True)
        ]
        self._tree = _tree(leaves, self._views)
        self._wake()

    def _fold(self, k: int, start: int, stop: int, replies: list[_Reply]) -> None:
        """mean[k][start:stop] = Σ wᵢ gᵢ[k][start:stop] / Σ wᵢ, in contributor order."""
        import torch  # imported by StarTraining.train, in a thread

        leaf = self.leaves[k] if self.leaves else None
        assert leaf is not None
        size = leaf.dtype.itemsize

        def part(r: _Reply) -> torch.Tensor:
            assert r.buffer is not None and r.offsets is not None
            at = r.offsets[k] + start * size
            return torch.from_numpy(r.buffer[at : at + (stop - start) * size].view(leaf.dtype))

        out = torch.from_numpy(self._views[k][start:stop])
        if len(replies) == 1:  # one contributor: its gradient itself, as weighted_mean gives
            out.copy_(part(replies[0]))
            return
        torch.mul(part(replies[0]), replies[0].weight, out=out)
        for r in replies[1:]:
            out.add_(part(r), alpha=r.weight)
        out.div_(self.total)

    # -- the mean -----------------------------------------------------------------------------

    async def take(self) -> tuple[Any, StreamedMean | None]:
        """The mean's tree for the next step's requests, and the pacer to send them with
        (``None`` once the mean is whole). Waits for the first reply's header.

        Raises:
            FoldDeclined: never; a declined fold gives the mean :meth:`settle` was given.
        """
        while self._tree is None and self.declined is None:
            await self._changed()
        if self.declined is not None:
            return await self._settled_mean(), None
        return self._tree, (None if self.complete else self)

    def result(self) -> Any:
        """The whole mean (its leaves are the fold's buffers, until :meth:`release`).

        Raises:
            FoldDeclined: it was declined, or is not whole (a reply is missing).
        """
        if self.declined is not None:
            raise FoldDeclined(self.declined)
        if not self.complete:
            raise FoldDeclined("not every reply was folded")
        return self._tree

    def settle(self, mean: Any) -> None:
        """Give a declined fold the mean made from the whole replies."""
        self._settled_future().set_result(mean)

    def release(self) -> None:
        """The mean has reached every replica: give the buffers back for later steps."""
        for r in self._replies.values():
            if r.buffer is not None:
                self.pool.give(("reply", r.place), r.buffer)
                r.buffer = None
        if self._mean is not None:
            self.pool.give("mean", self._mean)
            self._mean, self._views, self._tree = None, [], None

    def _settled_future(self) -> asyncio.Future[Any]:
        if self._settled is None:
            self._settled = asyncio.get_running_loop().create_future()
        return self._settled

    async def _settled_mean(self) -> Any:
        return await self._settled_future()

    # -- pacing (protocol.asyncio.channel.Pacer) ----------------------------------------------

    def bind(self, parts: Sequence[Part]) -> Callable[[int], Awaitable[None]]:
        """For a frame made of ``parts`` that carries this mean: wait until its first ``n``
        bytes are final.

        Raises (from the wait):
            FoldDeclined: the fold was declined (no byte of the mean was final yet).
        """
        where: list[tuple[int, int]] = []  # (frame offset, leaf) of each part that is a leaf
        address = {v.ctypes.data: k for k, v in enumerate(self._views) if v.nbytes}
        offset = 0
        for part in parts:
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            if isinstance(part, memoryview) and size:
                k = address.get(np.frombuffer(part, dtype=np.uint8).ctypes.data)
                if k is not None and self._views[k].nbytes == size:
                    where.append((offset, k))
            offset += size

        async def until(n: int) -> None:
            while True:
                if self.declined is not None:
                    raise FoldDeclined(self.declined)
                if all(self._final(k, n - at) for at, k in where if at < n):
                    return
                await self._changed()

        return until

    def _final(self, k: int, nbytes: int) -> bool:
        """Whether leaf ``k``'s first ``nbytes`` bytes are final."""
        assert self.leaves is not None
        size = self.leaves[k].dtype.itemsize
        return self.done[k] >= min(self.leaves[k].numel, -(-nbytes // size))

    def _changed(self) -> asyncio.Future[None]:
        if self._progress is None:
            self._progress = asyncio.get_running_loop().create_future()
        return self._progress

    def _wake(self) -> None:
        if self._progress is not None:
            if not self._progress.done():
                self._progress.set_result(None)
            self._progress = None


def _layout(header: bytes) -> tuple[list[_Leaf], list[int]]:
    """The gradient leaves a reply's header describes and each one's offset in its frame.

    Raises:
        FoldDeclined: not a frame of gradients the fold takes.
    """
    try:
        head = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise FoldDeclined(f"unreadable header: {exc}") from None
    if not isinstance(head, dict) or head.get("v") != FRAME_VERSION:
        raise FoldDeclined("not a frame header")
    sizes, body = head.get("bufs"), head.get("body")
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise FoldDeclined("no buffer table")
    result = body.get("result") if isinstance(body, dict) else None
    gradients = result.get("gradients") if isinstance(result, dict) else None
    if not isinstance(gradients, dict) or not gradients:
        raise FoldDeclined("not a reply of gradients")
    leaves: list[_Leaf] = []
    _walk(gradients, (), leaves)
    # Where each buffer starts: the codec's layout (protocol.codec, the module docstring).
    starts, end = [], _PREFIX.size + len(header)
    for n in sizes:
        end = -(-end // ALIGNMENT) * ALIGNMENT
        starts.append(end)
        end += n
    offsets = []
    for leaf in leaves:
        if not 0 <= leaf.buf < len(sizes) or sizes[leaf.buf] != leaf.numel * leaf.dtype.itemsize:
            raise FoldDeclined(f"gradient {'/'.join(leaf.path)}: its buffer does not match")
        offsets.append(starts[leaf.buf])
    return leaves, offsets


def _walk(tree: Any, path: tuple[str, ...], leaves: list[_Leaf]) -> None:
    if "$buf" in tree:
        if not path:
            raise FoldDeclined("the gradients are one array, not a tree of them")
        lib, dtype, shape, buf = tree.get("lib"), tree.get("dtype"), tree.get("shape"), tree["$buf"]
        if lib not in _LIBS or dtype not in _DTYPES or type(buf) is not int:
            raise FoldDeclined(f"gradient {'/'.join(path)}: a {lib} {dtype} leaf")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FoldDeclined(f"gradient {'/'.join(path)}: a malformed shape")
        leaves.append(_Leaf(path, lib, _DTYPES[dtype], tuple(shape), buf))
        return
    for key, value in tree.items():
        if key.startswith("$") or not isinstance(value, dict):
            raise FoldDeclined(f"gradient {'/'.join((*path, key))}: not a plain tree of arrays")
        _walk(value, (*path, key), leaves)


def _tree(leaves: list[_Leaf], views: list[np.ndarray[Any, Any]]) -> dict[str, Any]:
    """The mean as the replies' tree: dicts down to tensors (or arrays) over ``views``."""
    import torch

    root: dict[str, Any] = {}
    for leaf, view in zip(leaves, views, strict=True):
        node = root
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        shaped = view.reshape(leaf.shape)
        node[leaf.path[-1]] = torch.from_numpy(shaped) if leaf.lib == "torch" else shaped
    return root
