"""The strategy options models: one set of rules, worded for the SDK or for the wire."""

from __future__ import annotations

import re

import pytest

import somatize as sz
from coordinator.strategies import STRATEGIES, StrategyOptionsError, strategy_from_spec
from protocol.daemon import (
    DiLoCoGroupSpec,
    DistPlanRequest,
    GetStateRequest,
    OuterStepSpec,
    StageRequest,
    command_fields,
    request_fields,
)
from protocol.options.strategies import (
    DEVICES,
    Caller,
    DataParallelOptions,
    FedAvgOptions,
    FedProxOptions,
    LocalOptions,
    ModelParallelOptions,
    device_fits,
    is_device,
    parse,
    server_options,
)


@pytest.mark.parametrize(
    ("model", "data", "sdk", "wire"),
    [
        (LocalOptions, {"tag": 3}, "Local: tag must be a non-empty string or None, not 3",
         "local: tag must be a non-empty string or None, not 3"),
        (DataParallelOptions, {"workers": 2, "elastic": "yes"},
         "DataParallel: elastic must be True or False, not 'yes'",
         "data_parallel: elastic must be True or False, not 'yes'"),
        (FedAvgOptions, {"rounds": 0}, "FedAvg: rounds must be a positive integer, not 0",
         "fedavg: rounds must be a positive integer, not 0"),
    ],
)  # fmt: skip
def test_one_rule_is_worded_for_each_side(model, data, sdk, wire):
    with pytest.raises(ValueError) as on_sdk:
        parse(model, data, Caller.SDK)
    with pytest.raises(ValueError) as on_wire:
        parse(model, data, Caller.WIRE)
    assert str(on_sdk.value) == sdk and str(on_wire.value) == wire


def test_the_wire_refuses_options_a_strategy_does_not_take():
    with pytest.raises(ValueError, match=r"strategy 'local' takes no option \['x'\]"):
        parse(LocalOptions, {"x": 1}, Caller.WIRE)


@pytest.mark.parametrize(
    "strategy",
    [
        sz.Local(tag="gpu"),
        sz.DataParallel(3, elastic=True, elastic_timeout=2),
        sz.FedAvg(4, fraction=0.5, server=sz.FedAdam(lr=0.1)),
        sz.FedProx(0.1, 2, workers=3, tag="edge"),
        sz.ModelParallel([sz.Partition(["a"], tag="s0"), sz.Partition(["b"], worker="w")], 2),
        sz.Local(tag="gpu", device="cuda"),
        sz.DataParallel(2, device="cuda:1"),
        sz.DataParallel(2, collective="torch", collective_timeout=5),
        sz.DataParallel(2, collective="coordinator"),
        sz.FedAvg(2, device="mps"),
        sz.FedProx(0.1, 2, device="cpu"),
        sz.ModelParallel(
            [sz.Partition(["a"], tag="s0", device="cpu"), sz.Partition(["b"], worker="w")],
            device="cuda",
        ),
    ],
)
def test_what_the_sdk_sends_the_coordinator_accepts(strategy):
    spec = strategy.spec()
    assert isinstance(strategy_from_spec(spec.name, spec.options), STRATEGIES[spec.name])


def test_the_collective_is_one_of_three_and_its_timeout_positive():
    assert sz.DataParallel(2).options() == {"workers": 2}  # auto, 60 s: the defaults
    assert sz.DataParallel(2, collective="torch").options()["collective"] == "torch"
    with pytest.raises(ValueError, match="collective must be one of 'auto', 'torch', 'coord"):
        sz.DataParallel(2, collective="nccl")
    with pytest.raises(ValueError, match="collective_timeout must be a positive number of seconds"):
        sz.DataParallel(2, collective_timeout=0)
    with pytest.raises(StrategyOptionsError, match="collective must be one of"):
        strategy_from_spec("data_parallel", {"workers": 2, "collective": "mpi"})
    parsed = strategy_from_spec("data_parallel", {"workers": 2, "collective_timeout": 7})
    assert parsed.options.collective == "auto" and parsed.options.collective_timeout == 7


def test_a_pipeline_transport_is_one_of_three():
    stage = [sz.Partition(["a"], tag="s0")]
    assert "transport" not in sz.ModelParallel(stage).options()  # auto: the default
    assert sz.ModelParallel(stage, transport="websocket").options()["transport"] == "websocket"
    with pytest.raises(ValueError, match="transport must be one of 'auto', 'torch', 'websocket'"):
        sz.ModelParallel(stage, transport="grpc")
    with pytest.raises(ValueError, match="collective_timeout must be a positive number of seconds"):
        sz.ModelParallel(stage, collective_timeout=-1)
    options = {"partitions": [{"node_ids": ["a"], "tag": "s0"}], "transport": "torch"}
    assert strategy_from_spec("model_parallel", options).options.transport == "torch"


def test_server_optimizers_are_checked_by_name():
    assert server_options("fedavgm", {}, Caller.WIRE).hyperparameters() == {
        "lr": 1.0,
        "momentum": 0.9,
        "nesterov": False,
    }
    with pytest.raises(ValueError, match="fedyogi: tau must be > 0, got 0"):
        server_options("fedyogi", {"tau": 0}, Caller.WIRE)
    with pytest.raises(StrategyOptionsError, match="fedavg: server: unknown server optimizer"):
        strategy_from_spec("fedavg", {"rounds": 1, "server": {"name": "sgd"}})


def test_partitions_are_checked_in_place_with_their_index():
    bad = {"partitions": [{"node_ids": ["a"], "tag": "t"}, {"node_ids": ["b"]}]}
    with pytest.raises(ValueError, match=r"partition 1 \['b'\] must be pinned"):
        parse(ModelParallelOptions, bad, Caller.WIRE)


def test_a_command_travels_without_id_and_with_only_the_fields_set():
    request = StageRequest(name="train", x=[1, 2])
    assert command_fields(request) == {"cmd": "stage", "name": "train", "x": [1, 2]}
    assert request_fields(GetStateRequest())["cmd"] == "get_state"
    # A field that is a model (DiLoCo's outer step) travels as its dict, and is read back.
    outer = OuterStepSpec(sync_every=5, lr=0.7, momentum=0.9, nesterov=True)
    mode = DiLoCoGroupSpec(outer=outer)
    plan = DistPlanRequest(node_ids=["n"], data="t", held=[0], rows=1, epochs=1, mode=mode)
    sent = command_fields(plan)
    assert sent["mode"]["outer"] == {
        "sync_every": 5,
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
        "inner_state": "keep",
        "also": [],
        "fragments": 1,
        "overlap": 0,
        "mixing": 0.0,
    }
    assert request_fields(plan)["mode"] == sent["mode"]
    assert DistPlanRequest.model_validate(sent).mode == mode


# -- devices -----------------------------------------------------------------------------------

FORMS = "'cpu', 'cuda' (any CUDA device), 'cuda:N' or 'mps'"


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (LocalOptions, {}),
        (DataParallelOptions, {"workers": 2}),
        (FedAvgOptions, {"rounds": 1}),
        (FedProxOptions, {"mu": 0.1, "rounds": 1}),
        (ModelParallelOptions, {"partitions": [{"node_ids": ["a"], "tag": "t"}]}),
    ],
)
@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:01", "CPU", "", 0, True])
def test_a_bad_device_is_refused_naming_the_forms_on_both_sides(model, data, device):
    with pytest.raises(ValueError) as on_sdk:
        parse(model, {**data, "device": device}, Caller.SDK)
    with pytest.raises(ValueError) as on_wire:
        parse(model, {**data, "device": device}, Caller.WIRE)
    assert str(on_sdk.value) == (
        f"{model.sdk_name}: device must be None (any device), {FORMS}, not {device!r}"
    )
    assert str(on_wire.value) == (
        f"{model.wire_name}: device must be None (any device), {FORMS}, not {device!r}"
    )


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12", "mps", None])
def test_every_device_form_is_accepted_and_travels_only_when_set(device):
    for model, data in [
        (LocalOptions, {}),
        (DataParallelOptions, {"workers": 2}),
        (FedAvgOptions, {"rounds": 1}),
        (FedProxOptions, {"mu": 0.1, "rounds": 1}),
    ]:
        wire = parse(model, {**data, "device": device}, Caller.SDK).to_wire()
        assert wire.get("device", "unset") == (device if device is not None else "unset"), model
        assert parse(model, wire, Caller.WIRE).device == device


def test_a_partition_device_is_checked_with_its_index_and_defaults_to_the_pipelines():
    tpu = {"node_ids": ["b"], "tag": "u", "device": "tpu"}
    bad = {"partitions": [{"node_ids": ["a"], "tag": "t"}, tpu]}
    with pytest.raises(ValueError) as refused:
        parse(ModelParallelOptions, bad, Caller.WIRE)
    assert str(refused.value) == (
        f"model_parallel: partition 1: device must be None (any device), {FORMS}, not 'tpu'"
    )
    parts = [{"node_ids": ["a"], "tag": "t"}, {"node_ids": ["b"], "tag": "u", "device": "cpu"}]
    options = parse(ModelParallelOptions, {"partitions": parts, "device": "cuda"}, Caller.WIRE)
    assert [options.device_of(0), options.device_of(1)] == ["cuda", "cpu"]
    assert options.to_wire()["device"] == "cuda"
    assert [p.get("device") for p in options.to_wire()["partitions"]] == [None, "cpu"]
    plain = parse(ModelParallelOptions, {"partitions": parts[:1]}, Caller.WIRE)
    assert plain.device_of(0) is None and "device" not in plain.to_wire()


@pytest.mark.parametrize(
    ("wanted", "device", "fits"),
    [
        (None, "cpu", True),
        (None, "cuda:3", True),
        ("cpu", "cpu", True),
        ("cpu", "cuda:0", False),
        ("cuda", "cuda:0", True),
        ("cuda", "cuda:7", True),
        ("cuda", "cpu", False),
        ("cuda", "mps", False),
        ("cuda:1", "cuda:1", True),
        ("cuda:1", "cuda:0", False),
        ("mps", "mps", True),
        ("mps", "cpu", False),
    ],
)
def test_a_device_fits_when_equal_or_any_cuda_device_for_cuda(wanted, device, fits):
    assert device_fits(wanted, device) is fits


def test_the_device_forms_are_exactly_the_documented_ones():
    assert DEVICES == ("cpu", "cuda", "cuda:N", "mps")
    assert all(is_device(d) for d in ["cpu", "cuda", "cuda:0", "cuda:10", "mps"])
    assert not any(is_device(d) for d in ["cuda:N", "cuda:1:2", " cpu", "xla", None, 1])


def test_the_device_the_sdk_asks_for_is_the_coordinators_placement():
    for strategy in [
        sz.Local(device="cuda"),
        sz.DataParallel(2, device="cuda"),
        sz.FedAvg(2, device="cuda"),
        sz.FedProx(0.1, 2, device="cuda"),
    ]:
        spec = strategy.spec()
        assert strategy_from_spec(spec.name, spec.options).placement().device == "cuda", spec
    pipeline = sz.ModelParallel(
        [sz.Partition(["a"], tag="s0", device="cpu"), sz.Partition(["b"], worker="w")],
        device="cuda:1",
    ).spec()
    placement = strategy_from_spec(pipeline.name, pipeline.options).placement()
    assert [(s.tag, s.id, s.device) for s in placement.slots] == [
        ("s0", None, "cpu"),
        (None, "w", "cuda:1"),
    ]
    assert placement.devices() == ["cpu", "cuda:1"]


def test_the_coordinator_refuses_a_bad_device_as_a_strategy_options_error():
    with pytest.raises(StrategyOptionsError) as refused:
        strategy_from_spec("data_parallel", {"workers": 2, "device": "gpu"})
    assert str(refused.value) == (
        f"data_parallel: device must be None (any device), {FORMS}, not 'gpu'"
    )
    strategy = strategy_from_spec("fedprox", {"mu": 0.1, "rounds": 1, "device": "cuda:0"})
    assert strategy.placement().device == "cuda:0"


RESUMABLE = [
    (lambda **kw: sz.DataParallel(2, **kw), "data_parallel"),
    (lambda **kw: sz.FedAvg(3, **kw), "fedavg"),
    (lambda **kw: sz.FedProx(0.1, 3, **kw), "fedprox"),
    (lambda **kw: sz.ModelParallel([sz.Partition(["a"], tag="s0")], **kw), "model_parallel"),
]
"""The strategies that take the checkpoint and restart options: a maker and the wire name."""


@pytest.mark.parametrize(("make", "wire_name"), RESUMABLE)
def test_checkpoint_options_travel_when_set_and_bad_ones_are_refused_on_both_sides(make, wire_name):
    assert "checkpoint_every" not in make().options()  # None: every epoch / round, or 60 s
    assert "keep_checkpoints" not in make().options()  # 2
    spec = make(checkpoint_every=0, keep_checkpoints=5).spec()
    assert (spec.options["checkpoint_every"], spec.options["keep_checkpoints"]) == (0, 5)
    parsed = strategy_from_spec(spec.name, spec.options)
    assert (parsed.checkpoint_every, parsed.keep_checkpoints) == (0, 5)
    assert parsed.saves_checkpoints
    with pytest.raises(ValueError, match=r"checkpoint_every must be None or an integer >= 0"):
        make(checkpoint_every=-1)
    with pytest.raises(ValueError, match=r"keep_checkpoints must be a positive integer, not 0"):
        make(keep_checkpoints=0)
    options = spec.options | {"checkpoint_every": 2.5}
    with pytest.raises(
        StrategyOptionsError, match=rf"{wire_name}: checkpoint_every must be None or an"
    ):
        strategy_from_spec(spec.name, options)


@pytest.mark.parametrize(("make", "wire_name"), [*RESUMABLE, (sz.Local, "local")])
def test_restart_options_travel_when_set_and_bad_ones_are_refused_on_both_sides(make, wire_name):
    assert not {"max_restarts", "restart_timeout"} & set(make().options())  # 0: never
    assert strategy_from_spec(wire_name, make().options()).max_restarts == 0
    spec = make(max_restarts=3, restart_timeout=7.5).spec()
    assert (spec.options["max_restarts"], spec.options["restart_timeout"]) == (3, 7.5)
    parsed = strategy_from_spec(spec.name, spec.options)
    assert (parsed.max_restarts, parsed.restart_timeout) == (3, 7.5)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"max_restarts must be an integer >= 0 \(0: never\)"):
            make(max_restarts=bad)
    with pytest.raises(
        ValueError, match=r"restart_timeout must be a positive number of seconds, not 0"
    ):
        make(max_restarts=1, restart_timeout=0)
    options = spec.options | {"restart_timeout": "soon"}
    with pytest.raises(
        StrategyOptionsError,
        match=rf"{wire_name}: restart_timeout must be a positive number of seconds, not 'soon'",
    ):
        strategy_from_spec(spec.name, options)


def test_strategies_without_checkpoints_say_so():
    strategy = strategy_from_spec("local", sz.Local().spec().options)
    assert not strategy.saves_checkpoints


def test_a_pipelines_spares_travel_and_are_placed_after_its_stages():
    partitions = [sz.Partition(["a"], tag="s0"), sz.Partition(["b"], worker="w9")]
    assert "spares" not in sz.ModelParallel(partitions).options()
    spec = sz.ModelParallel(partitions, spares=2, spare_tag="spare", device="cpu").spec()
    assert (spec.options["spares"], spec.options["spare_tag"]) == (2, "spare")
    placement = strategy_from_spec(spec.name, spec.options).placement()
    assert [str(slot) for slot in placement.slots] == [
        "tag 's0' on cpu",
        "worker 'w9' on cpu",
        "tag 'spare' on cpu",
        "tag 'spare' on cpu",
    ]
    anyone = strategy_from_spec(spec.name, spec.options | {"spare_tag": None}).placement()
    assert str(anyone.slots[-1]) == "any worker on cpu" and anyone.workers == 4
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"spares must be an integer >= 0"):
            sz.ModelParallel(partitions, spares=bad)
    with pytest.raises(ValueError, match=r"spare_tag names the spares' tag: give spares=N"):
        sz.ModelParallel(partitions, spare_tag="spare")


def test_diloco_takes_its_outer_step_and_keeps_state_on_either_path():
    d = sz.DiLoCo(2, 10, outer_lr=0.5)
    assert (d.workers, d.sync_every, d.outer_lr, d.outer_momentum, d.nesterov) == (
        2,
        10,
        0.5,
        0.9,
        True,
    )
    assert d.to_wire() == {"workers": 2, "checkpoint_every": 0, "sync_every": 10, "outer_lr": 0.5}
    again = strategy_from_spec("diloco", d.to_wire()).options
    assert again.outer_step().model_dump() == {
        "sync_every": 10,
        "lr": 0.5,
        "momentum": 0.9,
        "nesterov": True,
        "inner_state": "keep",
        "also": [],
        "fragments": 1,
        "overlap": 0,
        "mixing": 0.0,
    }
    refusals = {
        "sync_every must be a positive integer, not 0": {"sync_every": 0},
        "outer_lr must be a finite number > 0, not 0": {"outer_lr": 0},
        r"outer_momentum must be a number in \[0, 1\), not 1": {"outer_momentum": 1},
        "nesterov must be True or False, not 'yes'": {"nesterov": "yes"},
        "inner_state must be one of 'keep', 'reset', not 'fresh'": {"inner_state": "fresh"},
        r"fragments must be at most sync_every \(50\)": {"fragments": 51},
        "fragments must be a positive integer, not 0": {"fragments": 0},
        r"overlap must be a whole number of steps from 0 to sync_every - 1 \(49\)": {"overlap": 50},
        r"mixing must be a number in \[0, 1\), not 1": {"mixing": 1},
        r"Streaming DiLoCo \(fragments=2\) runs on the torch collective": {
            "fragments": 2,
            "collective": "coordinator",
        },
        r"Streaming DiLoCo \(overlap=1\) keeps .* it does not take elastic=True, checkpoints": {
            "overlap": 1,
            "elastic": True,
            "checkpoint_every": 5,
        },
    }
    for words, bad in refusals.items():
        with pytest.raises(ValueError, match=f"^DiLoCo: {words}"):
            sz.DiLoCo(2, **bad)
    for collective in ("torch", "auto", "coordinator"):  # either path keeps what outlives one
        sz.DiLoCo(2, elastic=True, checkpoint_every=5, max_restarts=1, collective=collective)
    kept = sz.DiLoCo(2, elastic=True, checkpoint_every=10, max_restarts=1)
    assert kept.keeps_state() == "elastic=True, checkpoints, max_restarts"
    assert sz.DiLoCo(2).keeps_state() == ""
    assert sz.DiLoCo(2, 8, fragments=4, overlap=2).streaming() == "fragments=4, overlap=2"
    assert sz.DiLoCo(2).streaming() == "" and "fragments" not in sz.DiLoCo(2).to_wire()
    with pytest.raises(StrategyOptionsError, match=r"^diloco: sync_every must be"):
        strategy_from_spec("diloco", {"workers": 2, "sync_every": -1})


def test_compression_is_one_of_torchs_hooks_on_the_torch_collective_or_travels_the_star():
    assert sz.DataParallel(2, compression="powersgd:4").to_wire() == {
        "workers": 2,
        "compression": "powersgd:4",
    }
    assert sz.DataParallel(2, compression="bf16", device="cuda").compression == "bf16"
    assert strategy_from_spec("data_parallel", {"workers": 2, "compression": "fp16"})
    refusals = {
        "compression must be None, 'fp16', 'bf16', 'int8' or 'powersgd:RANK'": [
            {"compression": "gzip"},
            {"compression": "powersgd:0"},
            {"compression": "powersgd:x"},
            {"compression": 16},
        ],
        "compression='bf16' needs device='cuda' (or 'cuda:N') on the torch collective": [
            {"compression": "bf16"},
            {"compression": "bf16", "collective": "torch"},
        ],
        "compression='powersgd:2' runs on the torch collective": [
            {"compression": "powersgd:2", "collective": "coordinator"}
        ],
    }
    for words, cases in refusals.items():
        for bad in cases:
            with pytest.raises(ValueError, match=f"^DataParallel: {re.escape(words)}"):
                sz.DataParallel(2, **bad)
    assert sz.DataParallel(2, compression="int8").to_wire()["compression"] == "int8"
    for compression in ("fp16", "bf16", "int8"):  # both legs of the star, on any device
        star = sz.DataParallel(2, compression=compression, collective="coordinator")
        assert star.compression == compression
        assert sz.DiLoCo(2, compression=compression, collective="coordinator", elastic=True)
    assert sz.DiLoCo(2, compression="int8").compression == "int8"
    with pytest.raises(ValueError, match=r"^DiLoCo: compression='powersgd:2' factorises"):
        sz.DiLoCo(2, compression="powersgd:2")


def test_sharding_shards_on_the_torch_collective_and_names_its_units():
    import torch

    sharded = sz.DataParallel(2, sharding="full", shard_units=[torch.nn.TransformerEncoderLayer])
    assert sharded.to_wire() == {
        "workers": 2,
        "sharding": "full",
        "shard_units": ["torch.nn.modules.transformer.TransformerEncoderLayer"],
    }
    again = strategy_from_spec("data_parallel", sharded.to_wire()).options
    assert again.shard_units == ("torch.nn.modules.transformer.TransformerEncoderLayer",)
    assert sz.DataParallel(2, sharding="gradients", shard_units=["my.Block"]).shard_units == (
        "my.Block",
    )
    assert "sharding" not in sz.DataParallel(2).to_wire()
    refusals = {
        "sharding must be one of 'none', 'full', 'gradients', not 'zero3'": [{"sharding": "zero3"}],
        "sharding='full' does not go with collective='coordinator'": [
            {"sharding": "full", "collective": "coordinator"}
        ],
        "sharding='full' does not go with elastic=True": [{"sharding": "full", "elastic": True}],
        "sharding='gradients' does not go with compression": [
            {"sharding": "gradients", "compression": "fp16"}
        ],
        "shard_units is for sharding='full' or 'gradients'": [{"shard_units": ["a.B"]}],
        "shard_units must be a non-empty list": [
            {"sharding": "full", "shard_units": "torch.nn.Linear"},
            {"sharding": "full", "shard_units": []},
        ],
        "shard_units takes torch.nn.Module classes, not <class 'int'>": [
            {"sharding": "full", "shard_units": [int]}
        ],
        "shard_units takes module classes or their qualified names": [
            {"sharding": "full", "shard_units": ["Linear"]}
        ],
    }
    for words, cases in refusals.items():
        for bad in cases:
            with pytest.raises(ValueError, match=f"^DataParallel: {re.escape(words)}"):
                sz.DataParallel(2, **bad)
    with pytest.raises(ValueError, match=r"^DiLoCo: DiLoCo's replicas each keep a whole model"):
        sz.DiLoCo(2, sharding="full")
    with pytest.raises(StrategyOptionsError, match="sharding='full' does not go with"):
        strategy_from_spec("data_parallel", {"workers": 2, "sharding": "full", "elastic": True})
