"""TorchFilter(precision=...) and graph.fit(device=...) against plain torch loops written here."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from engine.engine import Engine


def _data(n: int = 101, d: int = 5, seed: int = 2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=(d, 2))).astype(np.float32) + 0.1
    return x, y


def _mlp(seed: int = 4) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _reference_loop(module, x, y, dtype, *, scaler=None, epochs=3, size=16, seed=9):
    """Plain torch: the documented batching rule, SGD with momentum, autocast on the CPU."""
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=order)
        for start in range(0, len(xt), size):
            idx = perm[start : start + size]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(module(xt[idx]), yt[idx])
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return module.state_dict()


def _filter(module, precision: str) -> sz.TorchFilter:
    return sz.TorchFilter(
        module,
        lr=0.05,
        optimizer_options={"momentum": 0.9},
        batch_size=16,
        epochs=3,
        seed=9,
        precision=precision,
    ).named("mlp")


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_bf16_trains_on_the_cpu_like_a_plain_autocast_loop():
    x, y = _data()
    module = _mlp()
    expected = _reference_loop(copy.deepcopy(module), x, y, torch.bfloat16)

    fitted = sz.Graph([_filter(module, "bf16")]).fit(x, y, device="cpu")

    states = fitted.states["mlp"]
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in states.values())
    assert _max_diff(states, expected) <= 1e-6
    # bf16 really ran: fp32 training from the same start ends elsewhere.
    fp32 = sz.Graph([_filter(copy.deepcopy(_mlp()), "fp32")]).fit(x, y)
    assert _max_diff(fp32.states["mlp"], expected) > 1e-4


def test_fp16_steps_through_a_grad_scaler_like_a_plain_loop():
    # CPU autocast supports float16 in this torch (2.x), and GradScaler("cpu") exists.
    x, y = _data()
    module = _mlp()
    scaler = torch.amp.GradScaler("cpu")
    expected = _reference_loop(copy.deepcopy(module), x, y, torch.float16, scaler=scaler)
    # The first scale (2**16) overflowed and its step was skipped: a loop without the scaler
    # would end elsewhere, so matching this one needs the scaler.
    assert scaler.get_scale() < 2.0**16

    fitted = sz.Graph([_filter(module, "fp16")]).fit(x, y)

    assert _max_diff(fitted.states["mlp"], expected) <= 1e-6
    assert all(t.dtype == torch.float32 for t in fitted.states["mlp"].values())


def test_the_data_parallel_gradient_pass_hands_out_true_fp16_gradients():
    x, y = _data()
    module = _mlp()
    reference = copy.deepcopy(module)
    engine = Engine(device="cpu")
    engine.load({"mlp": _filter(module, "fp16")})

    result = engine.fitting.gradient_pass(["mlp"], x, y)

    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(reference(torch.as_tensor(x)), torch.as_tensor(y))
    loss.backward()  # unscaled: the true gradient
    grads = engine.gradients.get_gradients(["mlp"])["mlp"]
    assert result.loss == pytest.approx(float(loss.detach()), abs=1e-6)
    for name, p in reference.named_parameters():
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6)


def test_a_bf16_pipeline_stage_runs_forward_and_loss_under_autocast():
    x, y = _data(n=12)
    first, last = _mlp(), torch.nn.Linear(2, 2)
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    a, b = Engine(), Engine()
    a.load({"a": sz.TorchFilter(first, precision="bf16")})
    b.load({"b": sz.TorchFilter(last, precision="bf16")})

    act = a.stage.stage_forward(["a"], 0, x, first=True)
    out = b.stage.stage_forward(["b"], 0, act, y, scale=1.0, last=True)
    grad_in = b.stage.stage_backward(0)
    a.stage.stage_backward(0, grad_in)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = ref_first(torch.as_tensor(x))
        loss = F.mse_loss(ref_last(h), torch.as_tensor(y))
    loss.backward()
    assert act.dtype == torch.bfloat16  # the activation crossed as autocast produced it
    assert out["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    for engine, node, ref in ((a, "a", ref_first), (b, "b", ref_last)):
        grads = dict(engine.nodes.filter(node).module.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=1e-6)


def test_graph_fit_on_the_cpu_device_equals_the_default():
    x, y = _data()
    graph = sz.Graph([_filter(_mlp(), "fp32")])
    default, on_cpu = graph.fit(x, y), graph.fit(x, y, device="cpu")
    assert _max_diff(default.states["mlp"], on_cpu.states["mlp"]) == 0.0
    assert default.epoch_losses == on_cpu.epoch_losses


def test_a_bad_precision_or_device_is_refused_naming_what_exists():
    with pytest.raises(ValueError, match=r"'fp8'.*\['fp32', 'bf16', 'fp16'\]"):
        sz.TorchFilter(torch.nn.Linear(2, 1), precision="fp8")
    x, y = _data()
    graph = sz.Graph([_filter(_mlp(), "fp32")])
    with pytest.raises(ValueError, match=r"not a device: 'gpu'.*cuda:N"):
        graph.fit(x, y, device="gpu")
