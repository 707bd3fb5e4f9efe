"""Why a DataParallel run will not equal ``graph.fit`` exactly, said before it runs.

DataParallel equals single-process training on the same global batches when the model's
forward depends on nothing but its weights and the rows (Goyal et al. 2017, §2). Two kinds of
layer break that, and the client says which its TorchFilters hold (``NodeInfo``):

* *normalisation with batch statistics* (BatchNorm): each replica normalises its slice with the
  slice's statistics, not the global batch's. The running statistics follow one rule on every
  replica, DistributedDataParallel's ``broadcast_buffers``: replica 0's buffers are broadcast to
  every replica each step (before its forward, and after the last), so the model's are replica
  0's. ``sync_batchnorm=True`` (the torch collective on CUDA) normalises with the global batch's
  statistics instead (``torch.nn.SyncBatchNorm``).
* *randomness* (Dropout): each replica draws its own masks, from torch's generator seeded with
  the filter's seed, the replica and the step (:func:`protocol.rules.batching.replica_seed`), so a
  rerun gives the same result, but not ``graph.fit``'s, which draws them over the whole batch.

The same notes go to the client when it submits (the SDK and ``somatize submit``) and into the
job's ``placed`` event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from protocol.messages import NodeInfo

__all__ = ["data_parallel_notes"]


def data_parallel_notes(
    nodes: Mapping[str, NodeInfo], torch_nodes: Iterable[str], sync_batchnorm: bool = False
) -> list[str]:
    """What a DataParallel run of ``torch_nodes`` will not match ``graph.fit`` in, and why;
    empty when it will match it."""
    infos = [nodes.get(n, NodeInfo()) for n in torch_nodes]
    normalization = sorted({c for info in infos for c in info.normalization})
    randomness = sorted({c for info in infos for c in info.randomness})
    notes = []
    if normalization and not sync_batchnorm:
        notes.append(
            f"DataParallel will not equal graph.fit exactly: {', '.join(normalization)} "
            "normalise each replica's slice with the slice's own statistics (graph.fit: the "
            "whole batch's); the running statistics are replica 0's, broadcast to every replica "
            "each step (as DistributedDataParallel's broadcast_buffers). "
            "sync_batchnorm=True on CUDA workers uses the global batch's statistics."
        )
    if randomness:
        notes.append(
            f"DataParallel will not equal graph.fit exactly: {', '.join(randomness)} draw "
            "their random masks on each replica, seeded by the filter's seed, the replica and "
            "the step (a rerun gives the same result; graph.fit draws them over the whole batch)."
        )
    return notes
