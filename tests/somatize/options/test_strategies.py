"""The SDK's strategy objects: their arguments, what they send, what they refuse."""

from __future__ import annotations

import pytest

import somatize as sz


def test_local_spec_leaves_out_unset_options():
    assert sz.Local().spec().model_dump() == {"name": "local", "options": {}}
    assert sz.Local(worker="w1").spec().options == {"worker": "w1"}
    assert sz.Local(tag="gpu").spec().options == {"tag": "gpu"}
    assert isinstance(sz.Local(), sz.Strategy)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"worker": ""}, "worker must be a non-empty string"),
        ({"worker": 3}, "worker must be a non-empty string or None, not 3"),
        ({"tag": "  "}, "tag must be a non-empty string"),
        ({"worker": "w1", "tag": "gpu"}, "not both"),
    ],
)
def test_local_refuses_bad_arguments(kwargs, text):
    with pytest.raises(ValueError, match=text):
        sz.Local(**kwargs)


def test_data_parallel_sends_the_elastic_options_only_when_elastic():
    assert sz.DataParallel(2).spec().options == {"workers": 2}
    elastic = sz.DataParallel(2, tag="cpu", elastic=True, elastic_timeout=5)
    assert elastic.spec().options == {
        "workers": 2,
        "tag": "cpu",
        "elastic": True,
        "elastic_timeout": 5.0,
    }
    with pytest.raises(ValueError, match="elastic must be True or False, not 'yes'"):
        sz.DataParallel(2, elastic="yes")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="elastic_timeout must be a positive number of seconds, not 0"
    ):
        sz.DataParallel(2, elastic=True, elastic_timeout=0)


def test_every_strategy_takes_a_device_keyword_after_its_old_arguments():
    assert sz.Local(device="cuda").spec().options == {"device": "cuda"}
    assert sz.Local("w1", None, "cpu").spec().options == {"worker": "w1", "device": "cpu"}
    assert sz.DataParallel(2, "gpu", True, 5, "cuda:0").spec().options == {
        "workers": 2,
        "tag": "gpu",
        "elastic": True,
        "elastic_timeout": 5.0,
        "device": "cuda:0",
    }
    assert sz.FedAvg(3, device="mps").spec().options["device"] == "mps"
    assert sz.FedProx(0.1, 3, device="cpu").spec().options["device"] == "cpu"
    assert "device" not in sz.FedAvg(3).spec().options
    pipeline = sz.ModelParallel(
        [sz.Partition(["a"], tag="s0", device="cuda:1"), sz.Partition(["b"], "w2")],
        2,
        "1f1b",
        "cuda",
    ).spec()
    assert pipeline.options == {
        "partitions": [
            {"node_ids": ["a"], "tag": "s0", "device": "cuda:1"},
            {"node_ids": ["b"], "worker": "w2"},
        ],
        "micro_batches": 2,
        "schedule": "1f1b",
        "device": "cuda",
    }


@pytest.mark.parametrize(
    ("build", "owner"),
    [
        (lambda: sz.Local(device="gpu"), "Local"),
        (lambda: sz.DataParallel(2, device="gpu"), "DataParallel"),
        (lambda: sz.FedAvg(2, device="gpu"), "FedAvg"),
        (lambda: sz.FedProx(0.1, 2, device="gpu"), "FedProx"),
        (lambda: sz.ModelParallel([sz.Partition(["a"], tag="t")], device="gpu"), "ModelParallel"),
    ],
)
def test_a_bad_device_is_a_value_error_when_the_strategy_is_built(build, owner):
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value) == (
        f"{owner}: device must be None (any device), 'cpu', 'cuda' (any CUDA device), "
        "'cuda:N' or 'mps', not 'gpu'"
    )


def test_a_bad_partition_device_is_refused_by_the_partition():
    with pytest.raises(ValueError, match=r"^Partition: partition: device must be None .*'xla'"):
        sz.Partition(["a"], tag="t", device="xla")


def test_local_is_frozen():
    strategy = sz.Local(worker="w1")
    with pytest.raises(AttributeError):
        strategy.worker = "w2"  # type: ignore[misc]
