"""graph.fit with learning-rate schedules, gradient clipping and accumulation, against the
independent plain torch loop of :mod:`tests.training_reference`."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from tests.training_reference import FILTER, classes, mlp, reference_fit


def _net(**options) -> sz.TorchFilter:
    return sz.TorchFilter(mlp(), **(FILTER | options)).named("mlp")


def _close(states, expected, atol=1e-5):
    assert states.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states[key]), value, rtol=0, atol=atol)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_cosine_schedule_clipping_and_accumulation_equal_a_plain_torch_loop(interval):
    x, y = classes()
    net = _net(scheduler="cosine", scheduler_interval=interval, clip_grad_norm=0.5, accumulate=3)
    fitted = sz.Graph([net]).fit(x, y)
    expected = reference_fit(mlp(), x, y, accumulate=3, clip=0.5, cosine=True, interval=interval)
    _close(fitted.states["mlp"], expected.state())
    assert fitted.epoch_losses == pytest.approx(expected.epoch_losses, abs=1e-5)
    # 203 rows, batches of 16: 13 batches an epoch, 5 steps of 3 batches (the last of 1).
    assert len(expected.lrs) == 15
    assert len(set(expected.lrs)) >= 3  # the schedule moved: the test can fail


def test_clipping_changes_the_result_and_accumulation_is_a_larger_batch():
    x, y = classes()
    clipped = sz.Graph([_net(clip_grad_norm=0.05)]).fit(x, y).states["mlp"]
    free = sz.Graph([_net()]).fit(x, y).states["mlp"]
    assert float((clipped["0.weight"] - free["0.weight"]).abs().max()) > 1e-3
    _close(clipped, reference_fit(mlp(), x, y, clip=0.05).state())
    accumulated = sz.Graph([_net(accumulate=4)]).fit(x, y).states["mlp"]
    larger = sz.Graph([_net(batch_size=64)]).fit(x, y).states["mlp"]
    _close(accumulated, larger)


def test_a_callable_scheduler_and_linear_warmup_step_as_torch_does():
    x, y = classes()

    def step_lr(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    def warmup(optimizer):
        return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=5)

    fitted = sz.Graph([_net(scheduler=step_lr, epochs=2)]).fit(x, y)
    _close(fitted.states["mlp"], reference_fit(mlp(), x, y, epochs=2, scheduler=step_lr).state())
    options = {"warmup": 5, "start_factor": 0.2}
    warm = sz.Graph([_net(scheduler="linear_warmup", scheduler_options=options)]).fit(x, y)
    _close(warm.states["mlp"], reference_fit(mlp(), x, y, scheduler=warmup).state())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scheduler": "exponential"}, "unknown scheduler 'exponential'"),
        ({"scheduler": "cosine", "scheduler_interval": "batch"}, "scheduler_interval must be"),
        ({"scheduler": "cosine", "scheduler_options": {"gamma": 2}}, "takes"),
        ({"scheduler_options": {"t_max": 2}}, "arguments of a named scheduler"),
        ({"clip_grad_norm": 0}, "clip_grad_norm must be a positive number"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm must be a positive number"),
        ({"accumulate": 0}, "accumulate must be"),
        ({"accumulate": 1.5}, "accumulate must be"),
    ],
)
def test_bad_training_options_are_refused_when_the_filter_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        sz.TorchFilter(mlp(), **options)


def test_a_scheduler_callable_that_returns_something_else_fails_naming_it():
    with pytest.raises(TypeError, match=r"not a torch\.optim\.lr_scheduler\.LRScheduler"):
        sz.Graph([_net(scheduler=lambda opt: 3)]).fit(*classes())
