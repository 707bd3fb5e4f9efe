"""Your own model and training step, in process (``graph.fit``): dict and tuple batches, a
``step=`` function, a model that computes its own loss, sequence cross-entropy — each against
a plain torch loop written in :mod:`tests.somatize.own_models`; and what is refused, in words
that say what to do."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from engine.errors import EngineError
from protocol.errors import ErrorCode
from tests.somatize.own_models import (
    MaskedPool,
    SelfScoring,
    TokenTagger,
    masked_token_step,
    plain_loop,
    token_rows,
)

SETTINGS = {"optimizer": "sgd", "lr": 0.1, "optimizer_options": {"momentum": 0.9}}
SETTINGS |= {"batch_size": 16, "epochs": 2, "shuffle": True, "seed": 7}


def close(state: dict, model: torch.nn.Module, atol: float = 1e-5) -> None:
    expected = model.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(state[key]), value, atol=atol, rtol=0)


def cross_entropy(net, xb, yb):
    logits = net(**xb) if isinstance(xb, dict) else net(*xb)
    return F.cross_entropy(logits, yb), {}


def test_a_dict_batch_is_the_modules_keyword_arguments():
    x, y = token_rows()
    graph = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", **SETTINGS)])
    fitted = graph.fit(x, y)
    model, history = plain_loop(MaskedPool(), x, y, cross_entropy)
    close(fitted.states["masked_pool"], model)
    assert fitted.epoch_losses == pytest.approx([row["loss"] for row in history], abs=1e-6)
    # The fitted graph forwards a dict batch too, in eval mode: the plain model's logits.
    logits = fitted.forward({k: v[:5] for k, v in x.items()})
    with torch.no_grad():
        want = model(**{k: torch.as_tensor(v[:5]) for k, v in x.items()})
    torch.testing.assert_close(logits, want, atol=1e-6, rtol=0)


class TwoTensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(2, 3)

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return self.a(left) + self.b(right)


def two_inputs(n: int = 90):
    rng = np.random.default_rng(2)
    left = rng.normal(size=(n, 4)).astype(np.float32)
    right = rng.normal(size=(n, 2)).astype(np.float32)
    return (left, right), (left[:, 0] + right[:, 1] > 0).astype(np.int64)


def test_a_tuple_batch_is_the_modules_positional_arguments():
    x, y = two_inputs()
    fitted = sz.Graph([sz.TorchFilter(TwoTensors(), loss="cross_entropy", **SETTINGS)]).fit(x, y)
    model, _ = plain_loop(TwoTensors(), x, y, cross_entropy)
    close(fitted.states["two_tensors"], model)


def test_a_step_function_with_a_masked_loss_and_a_metric_equals_the_plain_loop():
    x, _ = token_rows()
    x_val, _ = token_rows(40, seed=9)
    step = sz.TorchFilter(TokenTagger(), step=masked_token_step, **SETTINGS)
    fitted = sz.Graph([step]).fit(x, validation=(x_val, None))
    model, history = plain_loop(TokenTagger(), x, None, lambda m, b, _: masked_token_step(m, b))
    close(fitted.states["token_tagger"], model)
    for row, want in zip(fitted.history, history, strict=True):
        assert row["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert row["token_accuracy"] == pytest.approx(want["token_accuracy"], abs=1e-6)
    # Validation with the step function, the model at the last epoch's end: batches of 16
    # rows, each figure their mean weighted by rows (a plain evaluation written here).
    model.eval()
    sums, n = {"val_loss": 0.0, "val_token_accuracy": 0.0}, 40
    with torch.no_grad():
        for start in range(0, n, 16):
            batch = {k: torch.as_tensor(v[start : start + 16]) for k, v in x_val.items()}
            loss, metrics = masked_token_step(model, batch)
            rows = len(batch["ids"])
            sums["val_loss"] += float(loss) * rows
            sums["val_token_accuracy"] += float(metrics["token_accuracy"]) * rows
    last = fitted.history[-1]
    assert last["val_loss"] == pytest.approx(sums["val_loss"] / n, abs=1e-6)
    assert last["val_token_accuracy"] == pytest.approx(sums["val_token_accuracy"] / n, abs=1e-6)


def test_a_model_that_computes_its_own_loss_trains_without_y():
    x, y = token_rows()
    batch = x | {"labels": y}
    fitted = sz.Graph([sz.TorchFilter(SelfScoring(), loss="model", **SETTINGS)]).fit(batch)
    model, history = plain_loop(MaskedPool(), x, y, cross_entropy)
    close({k.removeprefix("inner."): v for k, v in fitted.states["self_scoring"].items()}, model)
    assert fitted.epoch_losses == pytest.approx([row["loss"] for row in history], abs=1e-6)


def test_cross_entropy_takes_sequence_logits_against_token_targets():
    x, _ = token_rows()
    ids = x["ids"]
    inputs, targets = ids[:, :-1], ids[:, 1:]
    fitted = sz.Graph([sz.TorchFilter(TokenTagger(), loss="cross_entropy", **SETTINGS)]).fit(
        inputs, targets
    )

    def every_token(net, xb, yb):
        logits = net(*xb)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)), {}

    model, _ = plain_loop(TokenTagger(), (inputs,), targets, every_token)
    close(fitted.states["token_tagger"], model)


def test_what_a_step_or_a_batch_cannot_be_is_refused_saying_what_to_do():
    x, y = token_rows(20)
    with pytest.raises(ValueError, match="returns its metrics itself"):
        sz.TorchFilter(TokenTagger(), step=masked_token_step, metrics=("accuracy",))
    with pytest.raises(ValueError, match="did you mean 'cross_entropy'"):
        sz.TorchFilter(TokenTagger(), loss="cross_entropyy")
    with pytest.raises(ValueError, match="inputs is one of"):
        sz.TorchFilter(TokenTagger(), inputs="dict")
    model_loss = sz.Graph([sz.TorchFilter(SelfScoring(), loss="model", **SETTINGS)])
    with pytest.raises(EngineError, match="the labels belong in x"):
        model_loss.fit(x | {"labels": y}, y)
    with pytest.raises(EngineError, match=r"needs labels \(y\), unless its model computes"):
        sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy")]).fit(x)
    with pytest.raises(EngineError, match=r"with no loss: give it the labels in the batch"):
        model_loss.fit(x)  # no 'labels': the model returns logits only
    uneven = {"ids": x["ids"], "mask": x["mask"][:-1]}
    with pytest.raises(EngineError) as caught:
        sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy")]).fit(uneven, y)
    assert caught.value.code is ErrorCode.BAD_REQUEST


def test_a_step_that_returns_no_tensor_or_shares_its_run_fails_naming_the_node():
    x, _ = token_rows(20)
    floats = sz.TorchFilter(TokenTagger(), step=lambda model, batch: 1.0).named("tagger")
    with pytest.raises(EngineError, match="'tagger': step must return the batch's loss") as caught:
        sz.Graph([floats]).fit(x)
    assert caught.value.code is ErrorCode.FILTER_ERROR
    reserved = sz.TorchFilter(
        TokenTagger(), step=lambda m, b: (masked_token_step(m, b)[0], {"loss": 1.0})
    )
    with pytest.raises(EngineError, match=r"may not be named \['loss'\]"):
        sz.Graph([reserved]).fit(x)
    before = sz.TorchFilter(torch.nn.Linear(2, 2)).named("before")
    chained = sz.TorchFilter(TokenTagger(), step=masked_token_step).named("tagger")
    with pytest.raises(EngineError, match="a filter with a step trains alone"):
        (before >> chained).fit(x)


def test_a_module_that_takes_the_whole_dict_says_inputs_one():
    class WholeDict(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = MaskedPool()

        def forward(self, batch: dict) -> torch.Tensor:
            return self.inner(batch["ids"], batch["mask"])

    x, y = token_rows()
    fitted = sz.Graph(
        [sz.TorchFilter(WholeDict(), loss="cross_entropy", inputs="one", **SETTINGS)]
    ).fit(x, y)
    model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
    close({k.removeprefix("inner."): v for k, v in fitted.states["whole_dict"].items()}, model)


class TokenDataset(torch.utils.data.Dataset):
    """The token rows as a map-style dataset of ``({"ids", "mask"}, label)`` pairs."""

    def __init__(self, x: dict, y: np.ndarray) -> None:
        self.x, self.y = x, y
        self.reads = 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        self.reads += 1
        return {k: torch.as_tensor(v[i]) for k, v in self.x.items()}, int(self.y[i])


def test_a_map_style_dataset_trains_a_batch_at_a_time_as_its_arrays_do():
    x, y = token_rows()
    x_val, y_val = token_rows(40, seed=9)
    net = sz.TorchFilter(MaskedPool(), loss="cross_entropy", metrics=("accuracy",), **SETTINGS)
    data = TokenDataset(x, y)
    fitted = sz.Graph([net]).fit(data, validation=TokenDataset(x_val, y_val))
    model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
    close(fitted.states["masked_pool"], model)
    # Each item read once an epoch (the three columns of a batch share its read), plus the
    # first item to learn the columns' shapes: never the whole dataset at once.
    assert data.reads == 2 * 150 + 1
    arrays = sz.Graph([net]).fit(x, y, validation=(x_val, y_val))
    assert fitted.history == arrays.history


def stopped_run(validate_every: int | None = 5) -> tuple[sz.TorchFilter, Any, Any, Any, Any]:
    """An MLP filter stopped by ``max_steps=20`` mid-way through its second epoch of 13
    steps, validated every ``validate_every`` steps; its training rows and validation rows."""
    from tests.training_reference import classes, mlp

    x, y = classes()  # 203 rows: 13 steps of 16 rows an epoch
    x_val, y_val = classes(n=61, seed=2)
    net = sz.TorchFilter(
        mlp(),
        loss="cross_entropy",
        scheduler="cosine",
        max_steps=20,
        validate_every=validate_every,
        **(SETTINGS | {"epochs": 3}),
    ).named("mlp")
    return net, x, y, x_val, y_val


def stopped_loop(x: Any, y: Any, x_val: Any, y_val: Any) -> tuple[Any, list[float], dict]:
    """:func:`stopped_run` by hand: SGD with momentum, a cosine schedule over the 20 steps
    taken, stopped after the 7th batch of the second epoch; the model, each epoch's mean loss
    and the validation loss after every step."""
    from tests.training_reference import mlp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    order = torch.Generator().manual_seed(7)
    xt, yt, vx, vy = map(torch.as_tensor, (x, y, x_val, y_val))
    steps, scores, losses = 0, {}, []
    while steps < 20:
        perm = torch.randperm(len(xt), generator=order)
        total, rows = 0.0, 0
        for start in range(0, len(xt), 16):
            if steps == 20:
                break
            b = perm[start : start + 16]
            loss = F.cross_entropy(model(xt[b]), yt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            steps += 1
            total, rows = total + float(loss.detach()) * len(b), rows + len(b)
            with torch.no_grad():
                scores[steps] = float(F.cross_entropy(model(vx), vy))
        losses.append(total / rows)
    return model, losses, scores


def assert_stopped_like_the_loop(
    history: list[dict], validations: list[dict], losses: list[float], scores: dict
) -> None:
    """Rows for the two epochs trained (the second cut short), validations after steps 5, 10
    and 15 (13 and 20 close their epochs: their rows have it), as the loop gives them."""
    assert [row["epoch"] for row in history] == [1, 2]
    assert [row["loss"] for row in history] == pytest.approx(losses, abs=1e-6)
    assert [row["val_loss"] for row in history] == pytest.approx([scores[13], scores[20]], abs=1e-6)
    assert [(r["epoch"], r["step"]) for r in validations] == [(1, 5), (1, 10), (2, 15)]
    assert [r["val_loss"] for r in validations] == pytest.approx(
        [scores[5], scores[10], scores[15]], abs=1e-6
    )


def test_max_steps_stops_mid_epoch_and_validate_every_scores_between_epochs():
    from tests.training_reference import mlp

    net, x, y, x_val, y_val = stopped_run()
    fitted = sz.Graph([net]).fit(x, y, validation=(x_val, y_val))
    model, losses, scores = stopped_loop(x, y, x_val, y_val)
    assert_stopped_like_the_loop(fitted.history, fitted.validations, losses, scores)
    close(fitted.states["mlp"], model)
    with pytest.raises(ValueError, match="max_steps is a whole number of steps"):
        sz.TorchFilter(mlp(), max_steps=0)


def test_cross_entropy_takes_sequence_logits_in_either_layout():
    """(B, T, V) logits against (B, T) targets, every token a row; torch's own (B, V, T) as
    cross_entropy takes it (a char LM of benchmarks.slow_links.char_lm returns that). Equal to
    torch.nn.functional.cross_entropy by hand, each way."""
    gen = torch.Generator().manual_seed(0)
    b, t, v = 4, 5, 7
    logits = torch.randn(b, t, v, generator=gen)
    targets = torch.randint(0, v, (b, t), generator=gen)
    net = sz.TorchFilter(torch.nn.Identity(), loss="cross_entropy")
    by_hand = torch.nn.functional.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))
    torch.testing.assert_close(net.compute_loss(logits, targets), by_hand)
    channels_second = logits.transpose(1, 2)  # (B, V, T)
    torch.testing.assert_close(net.compute_loss(channels_second, targets), by_hand)
