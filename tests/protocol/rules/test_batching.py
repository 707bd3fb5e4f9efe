"""The batching rules of data-parallel runs: over the replicas' own datasets."""

from __future__ import annotations

import numpy as np


def test_replica_batches_take_each_replicas_next_rows_of_its_own_until_all_are_used():
    from protocol.rules.batching import replica_batches

    steps = list(replica_batches([3, 5, 0], epochs=2, batch_size=2, shuffle=False, seed=0))
    assert [(e, s) for e, s, _ in steps] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    first = [[p.tolist() for p in slices] for _, _, slices in steps[:3]]
    assert first == [[[0, 1], [0, 1], []], [[2], [2, 3], []], [[], [4], []]]
    shuffled = list(replica_batches([4, 6], epochs=2, batch_size=None, shuffle=True, seed=7))
    for epoch, _, slices in shuffled:  # one step an epoch: every row of each replica
        for place, part in enumerate(slices):
            n = (4, 6)[place]
            expected = np.random.default_rng([7, epoch, place]).permutation(n)
            np.testing.assert_array_equal(part, expected)
