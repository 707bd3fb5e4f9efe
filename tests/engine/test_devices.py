"""The worker's device: resolving ``--device``, the agent's config and CLI, the hello's
capabilities, the daemons it starts, and an engine on ``device="cpu"`` against plain torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from engine import devices
from engine.engine import Engine
from engine.errors import EngineError
from protocol.errors import ErrorCode
from tests.utils import Center
from worker import cli
from worker.capabilities import detect
from worker.config import AgentConfig
from worker.supervision.pool import DaemonPool

URL = "ws://127.0.0.1:1"


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (none by default, whatever it really has)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(devices, "_cuda_count", lambda: n)

    set_count(0)
    monkeypatch.setattr(devices, "_has_mps", lambda: False)
    return set_count


# -- resolving ----------------------------------------------------------------------------------


def test_auto_is_the_first_cuda_device_else_the_cpu(gpus):
    assert devices.resolve_device("auto") == "cpu"
    assert devices.resolve_device("cpu") == "cpu"
    gpus(2)
    assert devices.resolve_device("auto") == "cuda:0"
    assert devices.resolve_device("cuda") == "cuda:0"
    assert devices.resolve_device("cuda:1") == "cuda:1"
    assert devices.available_devices() == ["cpu", "cuda:0", "cuda:1"]


def test_a_device_that_is_not_here_is_refused_naming_those_that_are(gpus):
    with pytest.raises(ValueError, match=r"device 'cuda' is not on this machine; it has cpu$"):
        devices.resolve_device("cuda")
    with pytest.raises(ValueError, match=r"'mps' is not on this machine; it has cpu$"):
        devices.resolve_device("mps")
    gpus(2)
    with pytest.raises(ValueError, match=r"'cuda:3' is not on this machine; it has cpu, cuda:0, "):
        devices.resolve_device("cuda:3")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cuda0", "", "cpu:0"])
def test_strings_that_are_no_device_are_refused(gpus, spec):
    with pytest.raises(ValueError, match=r"not a device: .*auto, cpu, cuda, cuda:N or mps"):
        devices.resolve_device(spec)


def test_auto_here_is_what_torch_finds():
    # No monkeypatch: the real machine (the CPU on one without CUDA).
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert devices.resolve_device("auto") == expected


# -- the agent's config, CLI, capabilities and daemons -----------------------------------------


def test_the_config_holds_the_resolved_device(gpus):
    assert AgentConfig(URL).device == "cpu"  # auto, with no CUDA
    assert AgentConfig(URL, device="cpu").device == "cpu"
    gpus(1)
    assert AgentConfig(URL).device == "cuda:0"
    with pytest.raises(ValueError, match="'cuda:1' is not on this machine; it has cpu, cuda:0"):
        AgentConfig(URL, device="cuda:1")
    with pytest.raises(ValueError, match="not a device: 'tpu'"):
        AgentConfig(URL, device="tpu")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cuda", "device 'cuda' is not on this machine; it has cpu"),
        ("cuda:1", "device 'cuda:1' is not on this machine; it has cpu"),
        ("bogus", "not a device: 'bogus'"),
    ],
)
def test_the_cli_refuses_a_device_at_startup_as_a_usage_error(gpus, capsys, spec, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["--connect", URL, "--device", spec])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_passes_the_device_to_the_config(gpus, monkeypatch):
    made: list[AgentConfig] = []

    class Stop(Exception):
        pass

    def agent(config):
        made.append(config)
        raise Stop

    monkeypatch.setattr(cli, "Agent", agent)
    for argv, expected in (
        (["--device", "cpu"], "cpu"),
        ([], "cpu"),
        (["--device", "auto"], "cpu"),
    ):
        with pytest.raises(Stop):
            cli.main(["--connect", URL, *argv])
        assert made[-1].device == expected


def test_the_capabilities_announce_the_cpu():
    caps = detect("cpu")
    assert (caps.device, caps.device_name, caps.device_memory_bytes) == ("cpu", "", 0)
    assert caps.cpus >= 1


def test_every_daemon_of_the_pool_gets_the_agents_device(gpus):
    gpus(1)
    pool = DaemonPool(AgentConfig(URL, device="cuda", spare=False), accepting=lambda: True)
    assert pool.new(None).device == "cuda:0"  # the job's and the spare's: both come from new()
    assert pool.new(2).device == "cuda:0"


# -- the engine on device="cpu" -----------------------------------------------------------------


def _data(n: int = 70, d: int = 4, seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x, (x @ rng.normal(size=(d, 2))).astype(np.float32)


def _linear(seed: int = 1) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def test_an_engine_on_the_cpu_trains_like_a_plain_torch_loop():
    x, y = _data()
    module = _linear()
    reference = copy.deepcopy(module)
    engine = Engine(device="cpu")
    engine.load(
        {
            "center": Center(),
            "lin": sz.TorchFilter(module, optimizer="adam", lr=0.01, batch_size=16, epochs=2),
        }
    )
    result = engine.fitting.batched_fit(["center", "lin"], x, y)

    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    order = torch.Generator().manual_seed(0)
    for _ in range(2):
        perm = torch.randperm(len(xt), generator=order)
        for start in range(0, len(xt), 16):
            idx = perm[start : start + 16]
            opt.zero_grad()
            F.mse_loss(reference(xt[idx]), yt[idx]).backward()
            opt.step()
    for key, value in reference.state_dict().items():
        assert result.states["lin"][key].device.type == "cpu"
        torch.testing.assert_close(result.states["lin"][key], value, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(result.output, reference(xt), rtol=0, atol=1e-6)


def test_an_engine_on_the_cpu_equals_the_default_engine_on_every_path():
    x, y = _data()
    engines = [Engine(), Engine(device="cpu")]
    for engine in engines:
        engine.load({"lin": sz.TorchFilter(_linear(), optimizer="sgd", lr=0.1)})
    grads = [
        e.fitting.gradient_pass(["lin"], x, y) and e.gradients.get_gradients(["lin"])
        for e in engines
    ]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    for engine in engines:
        engine.gradients.apply_gradients(
            {"lin": {k: v.clone() for k, v in grads[0]["lin"].items()}}
        )
        engine.stage.stage_forward(["lin"], 0, x, y, scale=1.0, last=True, first=True)
        engine.stage.stage_backward(0)
        engine.stage.stage_step(["lin"])
    torch.testing.assert_close(
        engines[0].nodes.get_state(), engines[1].nodes.get_state(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        engines[0].optimizers.get_optimizer_state(["lin"]),
        engines[1].optimizers.get_optimizer_state(["lin"]),
    )
    torch.testing.assert_close(
        engines[0].fitting.forward("lin", x), engines[1].fitting.forward("lin", x)
    )


def test_an_engine_refuses_a_string_that_is_no_device():
    with pytest.raises(EngineError) as info:
        Engine(device="gpu0")
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "not a device: 'gpu0'" in str(info.value)
