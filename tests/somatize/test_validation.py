"""graph.fit(validation=...) and metrics: each epoch's row of FittedGraph.history against the
independent plain torch loop's own evaluation of its model at that epoch's end."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from tests.training_reference import FILTER, classes, evaluation, mlp, reference_fit
from tests.utils import Center


def net(**options) -> sz.TorchFilter:
    settings = FILTER | {"metrics": ("accuracy",)}
    return sz.TorchFilter(mlp(), **(settings | options)).named("mlp")


def check_history(history, expected, figures, atol=1e-5):
    assert [row["epoch"] for row in history] == [1, 2, 3]
    for row, loss, lr, scores in zip(
        history, expected.epoch_losses, expected.lrs[4::5], figures, strict=True
    ):
        assert row["loss"] == pytest.approx(loss, abs=atol)
        assert row["lr"] == pytest.approx(lr, abs=1e-12)
        assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=atol)
        # The reference's float32 mean over the whole set; ours the mean of its batches' in
        # float64: one row's share is 1/61, so 1e-6 still tells every row apart.
        assert row["accuracy"] == pytest.approx(scores["accuracy"], abs=1e-6)


def test_each_epochs_row_holds_the_models_validation_figures_at_that_epochs_end():
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    fitted = sz.Graph([net(scheduler="cosine", accumulate=3)]).fit(x, y, validation=(x_val, y_val))
    figures: list[dict[str, float]] = []
    expected = reference_fit(
        mlp(), x, y, accumulate=3, cosine=True, at_epoch_end=evaluation(x_val, y_val, figures)
    )
    check_history(fitted.history, expected, figures)
    assert fitted.epoch_losses == [row["loss"] for row in fitted.history]
    assert len({row["accuracy"] for row in fitted.history}) > 1  # it moved: the test can fail


def test_plain_filters_in_front_apply_their_fitted_state_to_the_validation_rows():
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    graph = Center().named("center") >> net(metrics=("accuracy", top_logit))
    fitted = graph.fit(x, y, validation=(x_val, y_val))
    mean = x.mean(0)
    figures: list[dict[str, float]] = []
    reference_fit(
        mlp(), x - mean, y, accumulate=1, at_epoch_end=evaluation(x_val - mean, y_val, figures)
    )
    for row, scores in zip(fitted.history, figures, strict=True):
        assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=1e-5)
        # The reference's float32 mean over the whole set; ours the mean of its batches' in
        # float64: one row's share is 1/61, so 1e-6 still tells every row apart.
        assert row["accuracy"] == pytest.approx(scores["accuracy"], abs=1e-6)
        assert isinstance(row["top_logit"], float)


def top_logit(output: torch.Tensor, y: torch.Tensor) -> float:
    return float(output.max())


def test_without_validation_the_history_still_has_each_epochs_loss_and_lr():
    x, y = classes()
    fitted = sz.Graph([net()]).fit(x, y)
    assert [sorted(row) for row in fitted.history] == [["epoch", "loss", "lr"]] * 3


@pytest.mark.parametrize(
    ("validation", "message"),
    [((1, 2, 3), "a pair"), ((torch.zeros(3, 6), torch.zeros(2)), "as many rows")],
)
def test_bad_validation_data_is_refused(validation, message):
    with pytest.raises(ValueError, match=message):
        sz.Graph([net()]).fit(*classes(), validation=validation)


@pytest.mark.parametrize(
    ("metrics", "message"),
    [(("f1",), "unknown metric 'f1'"), (("accuracy", "accuracy"), "unique"), ((3,), "a name")],
)
def test_bad_metrics_are_refused_when_the_filter_is_made(metrics, message):
    with pytest.raises(ValueError, match=message):
        sz.TorchFilter(mlp(), metrics=metrics)
