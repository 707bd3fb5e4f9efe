"""Weighted means of trees, against numbers worked out by hand in each test."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coordinator.errors import CoordinatorError
from coordinator.strategies.aggregate import (
    Accumulator,
    AggregationError,
    numel,
    tree_leaves,
    weighted_mean,
)
from protocol.arrays import tree_map


def refused(message: str):
    """Expect an AggregationError whose message is exactly ``message``."""
    return pytest.raises(AggregationError, match=f"^{re.escape(message)}$")


# Means ----------------------------------------------------------------------------------------


def test_two_contributors_weighted():
    # (1·[1, 2, 3] + 3·[5, 6, 7]) / 4 = [16, 20, 24] / 4
    mean = weighted_mean(
        [
            ("w1", 1, {"n": {"p": np.array([1.0, 2.0, 3.0])}}),
            ("w2", 3, {"n": {"p": np.array([5.0, 6.0, 7.0])}}),
        ]
    )
    np.testing.assert_array_equal(mean["n"]["p"], [4.0, 5.0, 6.0])


def test_three_contributors_weighted_1_2_5():
    # Σw = 8; first column (1·0 + 2·4 + 5·8) / 8 = 48 / 8; second (1·8 + 2·0 + 5·16) / 8 = 88 / 8
    mean = weighted_mean(
        [
            ("a", 1, {"n": {"p": np.array([0.0, 8.0])}}),
            ("b", 2, {"n": {"p": np.array([4.0, 0.0])}}),
            ("c", 5, {"n": {"p": np.array([8.0, 16.0])}}),
        ]
    )
    np.testing.assert_array_equal(mean["n"]["p"], [6.0, 11.0])


def test_shards_weighted_by_count_give_the_mean_of_all():
    # 0..8 split as 0..3 (mean 1.5, 4 rows) and 4..8 (mean 6.0, 5 rows): (4·1.5 + 5·6) / 9 = 4.0,
    # the mean of 0..8, where the unweighted mean of the shard means would be 3.75.
    shards = [np.arange(0, 4, dtype=np.float64), np.arange(4, 9, dtype=np.float64)]
    mean = weighted_mean(
        [(f"w{i}", len(s), {"f": {"mean": np.float64(s.mean())}}) for i, s in enumerate(shards)]
    )
    assert mean["f"]["mean"] == 4.0
    assert mean["f"]["mean"] != (1.5 + 6.0) / 2


def test_mixed_numpy_and_torch_leaves_keep_their_type_and_dtype():
    # Weights 1 and 3: (1·a + 3·b) / 4.
    first = {
        "mlp": {
            "w": torch.tensor([[1.0, 2.0]], dtype=torch.float32),
            "h": torch.tensor([0.0], dtype=torch.float64),
            "half": torch.tensor([2.0], dtype=torch.float16),
            "bf": torch.tensor([4.0], dtype=torch.bfloat16),
        },
        "scaler": {
            "mu": np.array([0.0, 4.0], dtype=np.float32),
            "sd": np.float32(1.0),
            "x64": np.array([8.0]),
            "ratio": 0.5,
        },
    }
    second = {
        "mlp": {
            "w": torch.tensor([[5.0, 6.0]], dtype=torch.float32),
            "h": torch.tensor([4.0], dtype=torch.float64),
            "half": torch.tensor([6.0], dtype=torch.float16),
            "bf": torch.tensor([8.0], dtype=torch.bfloat16),
        },
        "scaler": {
            "mu": np.array([4.0, 8.0], dtype=np.float32),
            "sd": np.float32(5.0),
            "x64": np.array([0.0]),
            "ratio": 2.5,
        },
    }
    mean = weighted_mean([("w1", 1, first), ("w2", 3, second)])

    assert list(mean) == ["mlp", "scaler"]
    mlp, scaler = mean["mlp"], mean["scaler"]
    for key, dtype, expected in [
        ("w", torch.float32, [[4.0, 5.0]]),
        ("h", torch.float64, [3.0]),
        ("half", torch.float16, [5.0]),
        ("bf", torch.bfloat16, [7.0]),
    ]:
        assert isinstance(mlp[key], torch.Tensor) and mlp[key].dtype == dtype, key
        assert mlp[key].tolist() == expected, key
    assert isinstance(scaler["mu"], np.ndarray) and scaler["mu"].dtype == np.float32
    np.testing.assert_array_equal(scaler["mu"], [3.0, 7.0])
    assert type(scaler["sd"]) is np.float32 and scaler["sd"] == 4.0
    assert scaler["x64"].dtype == np.float64 and scaler["x64"].tolist() == [2.0]
    assert type(scaler["ratio"]) is float and scaler["ratio"] == 2.0


def test_plain_filter_state_with_agreeing_int_and_str():
    # Weights 2 and 6: mean (2·[1, 1] + 6·[5, 9]) / 8 = [32, 56] / 8.
    mean = weighted_mean(
        [
            ("w1", 2, {"f": {"mean": np.array([1.0, 1.0]), "count": 3, "name": "x", "on": True}}),
            ("w2", 6, {"f": {"mean": np.array([5.0, 9.0]), "count": 3, "name": "x", "on": True}}),
        ]
    )
    np.testing.assert_array_equal(mean["f"]["mean"], [4.0, 7.0])
    assert type(mean["f"]["count"]) is int and mean["f"]["count"] == 3
    assert mean["f"]["name"] == "x"
    assert mean["f"]["on"] is True


def test_integer_tensors_that_agree_are_kept():
    bn = {"bn": {"num_batches_tracked": torch.tensor(7), "running_mean": torch.tensor([0.0])}}
    other = {"bn": {"num_batches_tracked": torch.tensor(7), "running_mean": torch.tensor([2.0])}}
    mean = weighted_mean([("w1", 1, bn), ("w2", 1, other)])
    assert mean["bn"]["num_batches_tracked"].dtype == torch.int64
    assert mean["bn"]["num_batches_tracked"].item() == 7
    assert mean["bn"]["running_mean"].tolist() == [1.0]


def test_non_str_keys_lists_and_tuples():
    # Weights 1 and 1: plain means, position by position.
    a = {0: {("a", 1): np.array([2.0]), "xs": [1.0, 3], "pair": (2.0, "k")}}
    b = {0: {("a", 1): np.array([4.0]), "xs": [3.0, 3], "pair": (6.0, "k")}}
    mean = weighted_mean([("w1", 1.0, a), ("w2", 1.0, b)])
    assert mean[0][("a", 1)].tolist() == [3.0]
    assert mean[0]["xs"] == [2.0, 3]
    assert mean[0]["pair"] == (4.0, "k")


def test_one_contributor_is_an_exact_copy():
    values = np.array([0.1, 1 / 3, 1e-300, 2.0**60 + 1], dtype=np.float64)
    values.flags.writeable = False  # as decoded from a frame over bytes
    tensor = torch.tensor([0.1, 0.7], dtype=torch.float32)
    tree = {"n": {"v": values, "t": tensor, "k": 5, "s": "x", "f": 0.1}}

    mean = weighted_mean([("only", 3.0, tree)])

    assert mean == {"n": {"v": mean["n"]["v"], "t": mean["n"]["t"], "k": 5, "s": "x", "f": 0.1}}
    assert mean["n"]["v"].tobytes() == values.tobytes()
    assert torch.equal(mean["n"]["t"], tensor)
    # A copy: writable, and changing it leaves the contribution alone.
    assert mean["n"]["v"] is not values and mean["n"]["v"].flags.writeable
    mean["n"]["t"][0] = 9.0
    assert tensor[0].item() == pytest.approx(0.1)


def test_read_only_inputs_are_read_not_written():
    a = np.array([1.0, 3.0])
    b = np.array([3.0, 5.0])
    a.flags.writeable = b.flags.writeable = False
    mean = weighted_mean([("w1", 1, {"n": a}), ("w2", 1, {"n": b})])
    assert mean["n"].tolist() == [2.0, 4.0]
    assert a.tolist() == [1.0, 3.0] and b.tolist() == [3.0, 5.0]


def test_float32_mean_is_exact_where_float32_accumulation_is_not():
    # Weights 2**24, 1, 1 on 1.0, 3.0, 3.0: the exact mean is (2**24 + 6) / (2**24 + 2)
    # = 1 + 4 / (2**24 + 2). In float32 2**24 + 3 is not representable (spacing 2 there), so
    # summing w·x in float32 rounds twice, and the result is off by more than 1e-7.
    big = 2.0**24
    contributions = [
        ("w1", big, {"n": np.array([1.0], dtype=np.float32)}),
        ("w2", 1.0, {"n": np.array([3.0], dtype=np.float32)}),
        ("w3", 1.0, {"n": np.array([3.0], dtype=np.float32)}),
    ]
    exact = 1 + 4 / (big + 2)

    naive = np.float32(0.0)
    for _, w, tree in contributions:
        naive = np.float32(naive + np.float32(w) * tree["n"][0])
    naive = np.float32(naive / np.float32(big + 2))
    assert abs(float(naive) - exact) / exact > 1e-7

    mean = weighted_mean(contributions)["n"]
    assert mean.dtype == np.float32
    assert abs(float(mean[0]) - exact) / exact < 1e-7
    assert mean[0] == np.float32(exact)


def test_large_leaves_fold_in_chunks():
    # Larger than one folding chunk: (1·i + 1·2i) / 2 = 1.5·i, exact in float64.
    n = 100_003
    index = np.arange(n, dtype=np.float64)
    mean = weighted_mean(
        [
            ("w1", 1, {"n": torch.from_numpy(index.copy())}),
            ("w2", 1, {"n": torch.from_numpy(2 * index)}),
        ]
    )
    np.testing.assert_array_equal(mean["n"].numpy(), 1.5 * index)


def test_complex_leaves_are_averaged():
    # (1·(1+1j) + 1·(3-1j)) / 2 = 2
    mean = weighted_mean(
        [
            ("w1", 1, {"z": np.array([1 + 1j], dtype=np.complex64)}),
            ("w2", 1, {"z": np.array([3 - 1j], dtype=np.complex64)}),
        ]
    )
    assert mean["z"].dtype == np.complex64 and mean["z"].tolist() == [2 + 0j]


# The accumulator ------------------------------------------------------------------------------


def test_accumulator_folding_equals_weighted_mean():
    rng = np.random.default_rng(0)
    trees = [
        {
            "mlp": {
                "w": torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32)),
                "b": rng.normal(size=3),
            },
            "f": {"mu": float(rng.normal()), "n": 2},
        }
        for _ in range(3)
    ]
    weights = [3, 1, 7]
    acc = Accumulator()
    for i, (w, tree) in enumerate(zip(weights, trees, strict=True)):
        acc.add(f"w{i}", w, tree)
    assert acc.count == 3 and acc.total_weight == 11.0
    folded = acc.result()
    at_once = weighted_mean(
        [(f"w{i}", w, t) for i, (w, t) in enumerate(zip(weights, trees, strict=True))]
    )
    assert torch.equal(folded["mlp"]["w"], at_once["mlp"]["w"])
    np.testing.assert_array_equal(folded["mlp"]["b"], at_once["mlp"]["b"])
    assert folded["f"] == at_once["f"]
    # And against the definition, in float64.
    expected_b = sum(w * t["mlp"]["b"] for w, t in zip(weights, trees, strict=True)) / 11
    np.testing.assert_allclose(folded["mlp"]["b"], expected_b, rtol=1e-15)


def test_a_refused_contribution_leaves_the_accumulator_unchanged():
    acc = Accumulator()
    acc.add("w1", 1, {"n": {"a": np.array([1.0]), "b": np.array([1.0])}})
    # "a" would fold fine; "b" is refused, so nothing of w2 may be counted.
    with pytest.raises(AggregationError):
        acc.add("w2", 1, {"n": {"a": np.array([100.0]), "b": np.array([1.0, 2.0])}})
    acc.add("w3", 1, {"n": {"a": np.array([3.0]), "b": np.array([3.0])}})
    assert acc.count == 2
    mean = acc.result()
    assert mean["n"]["a"].tolist() == [2.0] and mean["n"]["b"].tolist() == [2.0]


def test_result_can_be_taken_twice_and_more_added():
    acc = Accumulator()
    acc.add("w1", 1, {"n": np.array([0.0])})
    acc.add("w2", 1, {"n": np.array([4.0])})
    assert acc.result()["n"].tolist() == [2.0]
    assert acc.result()["n"].tolist() == [2.0]
    acc.add("w3", 2, {"n": np.array([8.0])})  # (0 + 4 + 16) / 4
    assert acc.result()["n"].tolist() == [5.0]


# Refusals -------------------------------------------------------------------------------------


def test_errors_are_coordinator_errors():
    assert issubclass(AggregationError, CoordinatorError)


def test_zero_contributors():
    with refused("zero contributors to average"):
        weighted_mean([])
    with refused("zero contributors to average"):
        Accumulator().result()


@pytest.mark.parametrize(
    ("weight", "shown"),
    [(0, "0"), (-1.5, "-1.5"), (float("nan"), "nan"), (float("inf"), "inf"), ("3", "'3'")],
)
def test_weights_must_be_positive_and_finite(weight, shown):
    tree = {"n": np.array([1.0])}
    with refused(f"weights must be positive and finite; contributor 'w2' has {shown}"):
        weighted_mean([("w1", 1, tree), ("w2", weight, tree)])


def test_shape_mismatch_names_both_shapes():
    with refused(
        "node 'mlp', key '0.weight': contributor 'w2' has shape [4, 3], contributor 'w1' has [3, 3]"
    ):
        weighted_mean(
            [
                ("w1", 1, {"mlp": {"0.weight": torch.zeros(3, 3)}}),
                ("w2", 1, {"mlp": {"0.weight": torch.zeros(4, 3)}}),
            ]
        )


def test_missing_key_names_key_and_contributors():
    full = {"mlp": {"weight": np.zeros(2), "bias": np.zeros(1)}}
    partial = {"mlp": {"weight": np.zeros(2)}}
    with refused("node 'mlp': key 'bias' is missing from contributor 'w3' (present in 'w1')"):
        weighted_mean([("w1", 1, full), ("w2", 1, full), ("w3", 1, partial)])


def test_extra_key_names_key_and_contributors():
    full = {"mlp": {"weight": np.zeros(2), "bias": np.zeros(1)}}
    partial = {"mlp": {"weight": np.zeros(2)}}
    with refused("node 'mlp': contributor 'w2' has key 'bias', which 'w1' lacks"):
        weighted_mean([("w1", 1, partial), ("w2", 1, full)])


def test_missing_and_extra_nodes():
    with refused("node 'b' is missing from contributor 'w2' (present in 'w1')"):
        weighted_mean([("w1", 1, {"a": 1.0, "b": 1.0}), ("w2", 1, {"a": 1.0})])
    with refused("contributor 'w2' has node 'c', which 'w1' lacks"):
        weighted_mean([("w1", 1, {"a": 1.0}), ("w2", 1, {"a": 1.0, "c": 1.0})])


def test_nested_key_path():
    with refused(
        "node 'f', key 'stats'['sd']: contributor 'w2' has shape [2], contributor 'w1' has [1]"
    ):
        weighted_mean(
            [
                ("w1", 1, {"f": {"stats": {"sd": np.ones(1)}}}),
                ("w2", 1, {"f": {"stats": {"sd": np.ones(2)}}}),
            ]
        )


def test_integer_leaves_that_disagree_are_refused_not_averaged():
    def bn(batches):
        return {"bn": {"num_batches_tracked": torch.tensor(batches), "w": torch.ones(1)}}

    with refused(
        "node 'bn', key 'num_batches_tracked': integer leaves are not averaged, they must agree; "
        "contributor 'w2' has 12, contributor 'w1' has 10"
    ):
        weighted_mean([("w1", 1, bn(10)), ("w2", 1, bn(12))])
    with refused(
        "node 'f', key 'count': integer leaves are not averaged, they must agree; "
        "contributor 'w2' has 4, contributor 'w1' has 3"
    ):
        weighted_mean([("w1", 1, {"f": {"count": 3}}), ("w2", 1, {"f": {"count": 4}})])
    with refused(
        "node 'f', key 'ids': integer leaves are not averaged, they must agree; "
        "contributor 'w2' has 9 at [1, 0], contributor 'w1' has 2"
    ):
        weighted_mean(
            [
                ("w1", 1, {"f": {"ids": np.array([[0, 1], [2, 3]])}}),
                ("w2", 1, {"f": {"ids": np.array([[0, 1], [9, 3]])}}),
            ]
        )
    with refused(
        "node 'f', key 'on': bool leaves are not averaged, they must agree; "
        "contributor 'w2' has False, contributor 'w1' has True"
    ):
        weighted_mean([("w1", 1, {"f": {"on": True}}), ("w2", 1, {"f": {"on": False}})])


def test_an_integer_where_the_first_has_a_float_is_refused():
    with refused("node 'f', key 'mu': contributor 'w2' has int 2, contributor 'w1' has float 1.5"):
        weighted_mean([("w1", 1, {"f": {"mu": 1.5}}), ("w2", 1, {"f": {"mu": 2}})])
    with refused(
        "node 'f', key 'n': contributor 'w2' has a float32 array of shape [2], "
        "contributor 'w1' has an int64 array of shape [2]"
    ):
        weighted_mean(
            [
                ("w1", 1, {"f": {"n": np.array([1, 2])}}),
                ("w2", 1, {"f": {"n": np.array([1, 2], dtype=np.float32)}}),
            ]
        )


def test_non_numeric_leaves_that_disagree():
    with refused(
        "node 'f', key 'name': non-numeric leaves have no mean, they must agree; "
        "contributor 'w2' has 'y', contributor 'w1' has 'x'"
    ):
        weighted_mean([("w1", 1, {"f": {"name": "x"}}), ("w2", 1, {"f": {"name": "y"}})])
    with refused(
        "node 'f', key 'tag': non-numeric leaves have no mean, they must agree; "
        "contributor 'w2' has 'x', contributor 'w1' has None"
    ):
        weighted_mean([("w1", 1, {"f": {"tag": None}}), ("w2", 1, {"f": {"tag": "x"}})])


def test_container_mismatches():
    with refused(
        "node 'f', key 'xs': contributor 'w2' has a list of 3 items, "
        "contributor 'w1' has a list of 2 items"
    ):
        weighted_mean([("w1", 1, {"f": {"xs": [1.0, 2.0]}}), ("w2", 1, {"f": {"xs": [1.0] * 3}})])
    with refused(
        "node 'f': contributor 'w2' has a float32 array of shape [1], "
        "contributor 'w1' has a dict with keys ['mu']"
    ):
        weighted_mean(
            [("w1", 1, {"f": {"mu": 1.0}}), ("w2", 1, {"f": np.zeros(1, dtype=np.float32)})]
        )


def test_a_contributor_added_twice():
    acc = Accumulator()
    acc.add("w1", 1, {"n": 1.0})
    with refused("contributor 'w1' was added twice"):
        acc.add("w1", 1, {"n": 1.0})


# Helpers --------------------------------------------------------------------------------------


def test_tree_helpers():
    tree = {
        "mlp": {"w": torch.zeros(2, 3), "b": np.zeros(3, dtype=np.float32)},
        "f": {"mu": 1.5, "n": 4, "name": "x", "pair": (np.float32(1.0), None)},
    }
    # 6 + 3 tensor/array elements, mu, n, the numpy scalar; "name" and None hold no numbers.
    assert numel(tree) == 12
    assert len(tree_leaves(tree)) == 7
    doubled = tree_map(lambda leaf: leaf * 2 if isinstance(leaf, float) else leaf, tree)
    assert doubled["f"]["mu"] == 3.0 and doubled["f"]["name"] == "x"
    assert isinstance(doubled["f"]["pair"], tuple)


def test_the_fast_native_dtype_mean_agrees_with_the_precise_one_to_float32_resolution():
    rng = np.random.default_rng(3)
    trees = [
        (
            f"w{i}",
            float(w),
            {
                "m": {
                    "a": torch.from_numpy(rng.normal(size=(300, 7)).astype(np.float32)),
                    "b": rng.normal(size=5),
                }
            },
        )
        for i, w in enumerate((3, 5, 8))
    ]
    frozen = trees[1][2]["m"]["b"].copy()
    frozen.flags.writeable = False  # as decoded from a read-only frame: the slow path folds it
    trees[1][2]["m"]["b"] = frozen
    fast = weighted_mean(trees, precise=False)
    exact = weighted_mean(trees)
    assert isinstance(fast["m"]["a"], torch.Tensor) and fast["m"]["a"].dtype == torch.float32
    assert fast["m"]["b"].dtype == np.float64
    torch.testing.assert_close(fast["m"]["a"], exact["m"]["a"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fast["m"]["b"], exact["m"]["b"], rtol=1e-12)
    by_hand = (
        3 * trees[0][2]["m"]["a"] + 5 * trees[1][2]["m"]["a"] + 8 * trees[2][2]["m"]["a"]
    ) / 16
    torch.testing.assert_close(fast["m"]["a"], by_hand, rtol=1e-6, atol=1e-6)
