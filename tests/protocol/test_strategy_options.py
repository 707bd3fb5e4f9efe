"""The strategy options models: one set of rules, worded for the SDK or for the wire."""

from __future__ import annotations

import pytest

import somatize as sz
from coordinator.strategies import STRATEGIES, StrategyOptionsError, strategy_from_spec
from protocol.daemon import GetStateRequest, StageRequest, command_fields, request_fields
from protocol.strategy_options import (
    DataParallelOptions,
    Dialect,
    FedAvgOptions,
    LocalOptions,
    ModelParallelOptions,
    parse,
    server_options,
)


@pytest.mark.parametrize(
    ("model", "data", "sdk", "wire"),
    [
        (LocalOptions, {"tag": 3}, "Local: tag must be a non-empty string or None, not 3",
         "local: tag must be a non-empty string, not 3"),
        (DataParallelOptions, {"workers": 2, "elastic": "yes"},
         "DataParallel: elastic must be True or False, not 'yes'",
         "data_parallel: elastic must be a boolean, not 'yes'"),
        (FedAvgOptions, {"rounds": 0}, "FedAvg: rounds must be a positive integer, not 0",
         "fedavg: rounds must be a positive integer, not 0"),
    ],
)  # fmt: skip
def test_one_rule_is_worded_for_each_side(model, data, sdk, wire):
    with pytest.raises(ValueError) as on_sdk:
        parse(model, data, Dialect.SDK)
    with pytest.raises(ValueError) as on_wire:
        parse(model, data, Dialect.WIRE)
    assert str(on_sdk.value) == sdk and str(on_wire.value) == wire


def test_the_wire_refuses_options_a_strategy_does_not_take():
    with pytest.raises(ValueError, match=r"strategy 'local' takes no option \['x'\]"):
        parse(LocalOptions, {"x": 1}, Dialect.WIRE)


@pytest.mark.parametrize(
    "strategy",
    [
        sz.Local(tag="gpu"),
        sz.DataParallel(3, elastic=True, elastic_timeout=2),
        sz.FedAvg(4, fraction=0.5, server=sz.FedAdam(lr=0.1)),
        sz.FedProx(0.1, 2, workers=3, tag="edge"),
        sz.ModelParallel([sz.Partition(["a"], tag="s0"), sz.Partition(["b"], worker="w")], 2),
    ],
)
def test_what_the_sdk_sends_the_coordinator_accepts(strategy):
    spec = strategy.spec()
    assert isinstance(strategy_from_spec(spec.name, spec.options), STRATEGIES[spec.name])


def test_server_optimizers_are_checked_by_name():
    assert server_options("fedavgm", {}, Dialect.WIRE).hyperparameters() == {
        "lr": 1.0,
        "momentum": 0.9,
    }
    with pytest.raises(ValueError, match="fedyogi: tau must be > 0, got 0"):
        server_options("fedyogi", {"tau": 0}, Dialect.WIRE)
    with pytest.raises(StrategyOptionsError, match="fedavg: server: unknown server optimizer"):
        strategy_from_spec("fedavg", {"rounds": 1, "server": {"name": "sgd"}})


def test_partitions_are_checked_in_place_with_their_index():
    bad = {"partitions": [{"node_ids": ["a"], "tag": "t"}, {"node_ids": ["b"]}]}
    with pytest.raises(ValueError, match=r"partition 1 \['b'\] must be pinned"):
        parse(ModelParallelOptions, bad, Dialect.WIRE)


def test_a_command_travels_without_id_and_with_only_the_fields_set():
    request = StageRequest(name="train", x=[1, 2])
    assert command_fields(request) == {"cmd": "stage", "name": "train", "x": [1, 2]}
    assert request_fields(GetStateRequest())["cmd"] == "get_state"
