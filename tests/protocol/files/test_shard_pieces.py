"""A sharded run's pieces joined into its whole states: rows of dim 0, in rank order, as
FSDP2 lays them out (``torch.chunk``'s chunks, the last replicas' maybe empty)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.files.shard_pieces import PiecesMismatch, check, joined


def _rows(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Replica ``r``'s rows of ``tensor`` as FSDP2 shards it over ``world`` replicas, by hand:
    ceil(n / world) rows each, from the top, the rest empty."""
    each = -(-tensor.shape[0] // world)
    return [tensor[r * each : (r + 1) * each] for r in range(world)]


def _pieces(weight, bias, world):
    out = []
    for r in range(world):
        out.append(
            {
                "states": {
                    "net": {
                        "weight": _rows(weight, world)[r],
                        "bias": _rows(bias, world)[r],
                        "running": torch.full((2,), float(r)),  # a buffer: replica 0's is kept
                    }
                },
                "split": [["states", "net", "weight"], ["states", "net", "bias"]],
            }
        )
    return out


def test_joined_rows_are_the_whole_tensors_and_the_rest_is_replica_0s():
    weight = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    bias = torch.arange(5, dtype=torch.float32)
    # 5 rows over 4 replicas: 2, 2, 1 and none.
    pieces = _pieces(weight, bias, world=4)
    assert [p["states"]["net"]["weight"].shape[0] for p in pieces] == [2, 2, 1, 0]
    whole = joined(pieces)
    assert sorted(whole) == ["net"] and sorted(whole["net"]) == ["bias", "running", "weight"]
    assert torch.equal(whole["net"]["weight"], weight)
    assert torch.equal(whole["net"]["bias"], bias)
    assert torch.equal(whole["net"]["running"], torch.zeros(2))
    # Replica 0's answer is left as it came (the whole is a frame of its own).
    assert pieces[0]["states"]["net"]["weight"].shape == (2, 3)


def test_rows_that_arrive_as_arrays_are_joined_too():
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)
    pieces = [
        {"states": {"n": {"w": weight[:2]}}, "split": [["states", "n", "w"]]},
        {"states": {"n": {"w": weight[2:]}}, "split": [["states", "n", "w"]]},
    ]
    np.testing.assert_array_equal(joined(pieces)["n"]["w"], weight)


def test_replicas_that_split_other_tensors_or_rows_that_do_not_stack_are_refused():
    # check() says it without joining (the coordinator's look), joined() while joining.
    weight = torch.ones(4, 3)
    pieces = _pieces(weight, torch.ones(4), world=2)
    check(pieces)
    pieces[1]["split"] = pieces[1]["split"][:1]
    for look in (check, joined):
        with pytest.raises(PiecesMismatch, match="replica 1 split other tensors"):
            look(pieces)
    pieces = _pieces(weight, torch.ones(4), world=2)
    pieces[1]["states"]["net"]["weight"] = torch.ones(2, 5)
    for look in (check, joined):
        with pytest.raises(PiecesMismatch, match="states/net/weight do not stack"):
            look(pieces)
    pieces = _pieces(weight, torch.ones(4), world=2)
    pieces[1]["states"]["net"]["weight"] = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(PiecesMismatch, match="states/net/weight do not stack"):
        check(pieces)  # (torch.cat would promote the dtype rather than refuse)
    pieces[1]["states"]["net"]["weight"] = 1.0  # not rows at all
    with pytest.raises(PiecesMismatch, match="states/net/weight do not stack"):
        check(pieces)
