"""The engine's gradient and state primitives, against autograd and hand computations."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import somatize as sz
from engine.engine import Engine
from engine.errors import EngineError
from protocol.errors import ErrorCode
from tests.utils import Center


def _engine(*filters: tuple[str, object]) -> Engine:
    engine = Engine()
    engine.load(dict(filters))
    return engine


def _data(n: int = 24, d: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return x, y


def _linear(seed: int = 0, d: int = 4) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(d, 2)


def test_composite_fit_leaves_autograd_gradients_and_does_not_step():
    x, y = _data()
    module = _linear()
    reference = copy.deepcopy(module)
    engine = _engine(("center", Center()), ("lin", sz.TorchFilter(module, lr=0.5)))

    result = engine.fitting.composite_fit(["center", "lin"], x, y)

    loss = torch.nn.functional.mse_loss(
        reference(torch.as_tensor(x - x.mean(0))), torch.as_tensor(y)
    )
    loss.backward()
    assert result.loss == pytest.approx(float(loss.detach()), abs=1e-6)
    assert result.rows == 24
    grads = engine.gradients.get_gradients(["lin"])["lin"]
    torch.testing.assert_close(grads["weight"], reference.weight.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(grads["bias"], reference.bias.grad, rtol=0, atol=1e-6)
    # No step: the weights are still the initial ones.
    torch.testing.assert_close(result.states["lin"]["weight"], reference.weight.detach())


def test_apply_gradients_steps_sgd_by_hand():
    module = _linear()
    w0, b0 = module.weight.detach().clone(), module.bias.detach().clone()
    engine = _engine(("lin", sz.TorchFilter(module, lr=0.1)))
    gw, gb = torch.full_like(w0, 2.0), torch.arange(2, dtype=torch.float32)

    assert engine.gradients.apply_gradients({"lin": {"weight": gw, "bias": gb.numpy()}}) == {
        "lin": 2
    }

    state = engine.nodes.get_state(["lin"])["lin"]
    torch.testing.assert_close(state["weight"], w0 - 0.1 * gw, rtol=0, atol=1e-7)
    torch.testing.assert_close(state["bias"], b0 - 0.1 * gb, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("name", "options", "make"),
    [
        ("sgd", {"momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        ("adam", {}, lambda p: torch.optim.Adam(p, lr=0.05)),
    ],
)
def test_optimizer_state_persists_across_apply_calls(name, options, make):
    module = _linear(seed=3)
    reference = copy.deepcopy(module)
    engine = _engine(
        ("lin", sz.TorchFilter(module, optimizer=name, lr=0.05, optimizer_options=options))
    )
    opt = make(list(reference.parameters()))
    rng = np.random.default_rng(5)
    for _ in range(3):
        grads = {
            k: rng.normal(size=tuple(v.shape)).astype(np.float32)
            for k, v in reference.named_parameters()
        }
        engine.gradients.apply_gradients({"lin": grads})
        for k, p in reference.named_parameters():
            p.grad = torch.as_tensor(grads[k])
        opt.step()
    state = engine.nodes.get_state(["lin"])["lin"]
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-7)


def test_split_gradients_weighted_by_rows_equal_the_full_batch_gradient():
    """The data-parallel identity the strategies rely on, with uneven shards."""
    x, y = _data(n=30)
    module = _linear(seed=9)
    replicas = [_engine(("lin", sz.TorchFilter(copy.deepcopy(module), lr=0.2))) for _ in range(2)]
    shards = [(x[:11], y[:11]), (x[11:], y[11:])]
    grads = []
    for engine, (xs, ys) in zip(replicas, shards, strict=True):
        engine.fitting.composite_fit(["lin"], xs, ys)
        grads.append(engine.gradients.get_gradients(["lin"])["lin"])
    mean = {k: (11 * grads[0][k] + 19 * grads[1][k]) / 30 for k in grads[0]}
    for engine in replicas:
        engine.gradients.apply_gradients({"lin": mean})

    reference = copy.deepcopy(module)
    opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    torch.nn.functional.mse_loss(reference(torch.as_tensor(x)), torch.as_tensor(y)).backward()
    opt.step()
    for engine in replicas:
        for k, v in engine.nodes.get_state(["lin"])["lin"].items():
            torch.testing.assert_close(v, reference.state_dict()[k], rtol=0, atol=1e-6)


def test_no_gradients_is_an_error_with_the_reason():
    engine = _engine(
        ("center", Center()),
        ("lin", sz.TorchFilter(_linear())),
        ("relu", sz.TorchFilter(torch.nn.ReLU())),
    )
    with pytest.raises(EngineError, match=r"no gradient on \['weight', 'bias'\]") as err:
        engine.gradients.get_gradients(["lin"])
    assert err.value.code is ErrorCode.NO_GRADIENTS
    with pytest.raises(EngineError, match="'center' is not differentiable"):
        engine.gradients.get_gradients(["center"])
    with pytest.raises(EngineError, match="'relu' has no trainable parameters"):
        engine.gradients.get_gradients(["relu"])
    with pytest.raises(EngineError, match="given no gradients"):
        engine.gradients.apply_gradients({})


def test_mismatched_gradients_are_refused_and_leave_the_model_untouched():
    module = _linear()
    engine = _engine(("lin", sz.TorchFilter(module, lr=1.0)))
    before = engine.nodes.get_state()["lin"]
    with pytest.raises(EngineError, match=r"missing \['bias'\], unexpected \['b'\]") as err:
        engine.gradients.apply_gradients(
            {"lin": {"weight": torch.zeros(2, 4), "b": torch.zeros(2)}}
        )
    assert err.value.code is ErrorCode.GRADIENT_MISMATCH
    with pytest.raises(
        EngineError, match=r"'weight': gradient has shape \[4, 2\], parameter has \[2, 4\]"
    ):
        engine.gradients.apply_gradients(
            {"lin": {"weight": torch.zeros(4, 2), "bias": torch.zeros(2)}}
        )
    after = engine.nodes.get_state()["lin"]
    for k in before:
        assert torch.equal(before[k], after[k])


def test_set_state_takes_what_get_state_gave_for_torch_and_plain_filters():
    x, y = _data()
    trained = _engine(("center", Center()), ("lin", sz.TorchFilter(_linear(1), lr=0.3, epochs=2)))
    trained.fitting.batched_fit(["center", "lin"], x, y)
    fresh = _engine(("center", Center()), ("lin", sz.TorchFilter(_linear(2))))
    fresh.nodes.set_state(trained.nodes.get_state())
    torch.testing.assert_close(
        fresh.fitting.composite_forward(["center", "lin"], x),
        trained.fitting.composite_forward(["center", "lin"], x),
    )
    # numpy arrays (what an aggregator may produce) load as well.
    as_numpy = {k: v.numpy() for k, v in trained.nodes.get_state(["lin"])["lin"].items()}
    fresh.nodes.set_state({"lin": as_numpy})


def test_bad_states_unknown_nodes_and_missing_states_are_typed_errors():
    engine = _engine(("center", Center()), ("lin", sz.TorchFilter(_linear())))
    with pytest.raises(
        EngineError, match=r"'weight': state has shape \[3\], module has \[2, 4\]"
    ) as err:
        engine.nodes.set_state({"lin": {"weight": torch.zeros(3), "bias": torch.zeros(2)}})
    assert err.value.code is ErrorCode.STATE_MISMATCH
    with pytest.raises(EngineError, match="state keys are not for the same model"):
        engine.nodes.set_state({"lin": {"weight": torch.zeros(2, 4)}})
    with pytest.raises(EngineError, match="a mapping of tensors, not int"):
        engine.nodes.set_state({"lin": 3})
    with pytest.raises(
        EngineError, match=r"'nope' is not loaded \(loaded: \['center', 'lin'\]\)"
    ) as err:
        engine.nodes.get_state(["nope"])
    assert err.value.code is ErrorCode.UNKNOWN_NODE
    with pytest.raises(EngineError, match="'center' has no state") as err:
        engine.fitting.forward("center", np.zeros((2, 4)))
    assert err.value.code is ErrorCode.NOT_FITTED
    with pytest.raises(EngineError, match="needs labels"):
        engine.fitting.composite_fit(["lin"], np.zeros((2, 4), dtype=np.float32))


@pytest.mark.parametrize(
    ("name", "options"),
    [("sgd", {"momentum": 0.9}), ("adam", {}), ("adamw", {"weight_decay": 0.1})],
)
def test_a_fresh_engine_given_the_state_and_optimizer_state_steps_exactly_like_the_original(
    name, options
):
    """What an elastic replacement relies on: weights plus optimizer state, sent through the
    codec, make a fresh replica indistinguishable from the one they were read from."""
    from protocol.codec import decode, encode_frame

    def make(seed):
        return sz.TorchFilter(_linear(seed), optimizer=name, lr=0.05, optimizer_options=options)

    original, fresh = _engine(("lin", make(3))), _engine(("lin", make(4)))
    rng = np.random.default_rng(6)

    def grads():
        return {"lin": {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}}

    for _ in range(3):
        original.gradients.apply_gradients(grads())
    wire = decode(
        bytearray(
            encode_frame(
                {
                    "states": original.nodes.get_state(),
                    "opt": original.optimizers.get_optimizer_state(["lin"]),
                }
            )
        )
    )
    fresh.nodes.set_state(wire["states"])
    fresh.optimizers.set_optimizer_state(wire["opt"])
    for _ in range(3):
        step = grads()
        original.gradients.apply_gradients(step)
        fresh.gradients.apply_gradients(step)
    for k, v in original.nodes.get_state(["lin"])["lin"].items():
        torch.testing.assert_close(fresh.nodes.get_state(["lin"])["lin"][k], v, rtol=0, atol=0)
    # Without the optimizer state the same steps give another model (the test can fail).
    weights_only = _engine(("lin", make(4)))
    weights_only.nodes.set_state(wire["states"])
    original_again = _engine(("lin", make(3)))
    original_again.nodes.set_state(wire["states"])
    original_again.optimizers.set_optimizer_state(wire["opt"])
    step = grads()
    weights_only.gradients.apply_gradients(step)
    original_again.gradients.apply_gradients(step)
    assert not torch.equal(
        weights_only.nodes.get_state(["lin"])["lin"]["weight"],
        original_again.nodes.get_state(["lin"])["lin"]["weight"],
    )


SHAPES = {"weight": (2, 4), "bias": (2,)}


def test_optimizer_state_before_a_step_is_none_and_bad_optimizer_states_are_typed_errors():
    engine = _engine(("center", Center()), ("lin", sz.TorchFilter(_linear(), optimizer="adam")))
    assert engine.optimizers.get_optimizer_state(["lin"]) == {"lin": None}
    engine.optimizers.set_optimizer_state(
        {"lin": None}
    )  # no optimizer yet: the next step makes one
    with pytest.raises(EngineError, match="'center' is not differentiable") as err:
        engine.optimizers.get_optimizer_state(["center"])
    assert err.value.code is ErrorCode.BAD_REQUEST
    engine.gradients.apply_gradients(
        {"lin": {"weight": np.ones((2, 4), "f4"), "bias": np.ones(2, "f4")}}
    )
    state = engine.optimizers.get_optimizer_state(["lin"])["lin"]
    other = _engine(("lin", sz.TorchFilter(torch.nn.Linear(4, 3), optimizer="adam")))
    with pytest.raises(EngineError, match="does not fit its Adam") as err:
        other.optimizers.set_optimizer_state({"lin": {"state": state["state"], "param_groups": []}})
    assert err.value.code is ErrorCode.STATE_MISMATCH
    with pytest.raises(EngineError, match=r"'exp_avg' has shape \[2, 4\], parameter has \[3, 4\]"):
        other.optimizers.set_optimizer_state({"lin": state})
    assert other.optimizers.get_optimizer_state(["lin"]) == {"lin": None}  # left as it was
