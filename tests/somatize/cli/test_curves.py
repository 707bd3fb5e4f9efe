"""A history where people look at it: TensorBoard event files read back with tensorboard's own
event reader, the plot's axes, the table."""

from __future__ import annotations

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import somatize as sz
from somatize.cli.curves import HistoryWriter, history_table, plot_history, row_of
from tests.somatize.test_validation import net
from tests.training_reference import classes


def _history():
    x, y = classes()
    return sz.Graph([net(scheduler="cosine")]).fit(x, y, validation=classes(n=61, seed=2)).history


def test_tensorboard_files_hold_every_figure_of_every_epoch(tmp_path):
    history = _history()
    board = HistoryWriter(str(tmp_path))
    board.add_all(history)
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["accuracy", "loss", "lr", "val_loss"]
    for tag in ("loss", "val_loss", "accuracy", "lr"):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([row[tag] for row in history])


def test_the_plot_has_epochs_or_rounds_on_its_x_axis(tmp_path):
    history = _history()
    drawn = plot_history(history, str(tmp_path / "curves.png"), "job")
    assert drawn == ["epoch: training loss, validation loss", "epoch: accuracy"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rounds = [{"round": r, "loss": 1.0 / r} for r in (1, 2)]
    assert plot_history(rounds, str(tmp_path / "rounds.png"), "job") == ["round: training loss"]
    steps = [(float(k), 1.0 / k) for k in range(1, 10)]
    drawn = plot_history(history, str(tmp_path / "steps.png"), "job", steps=steps)
    assert drawn == [
        "step: training loss",
        "epoch: training loss, validation loss",
        "epoch: accuracy",
    ]


def test_validations_between_epochs_join_the_step_panel_and_tensorboard(tmp_path):
    x, y = classes()
    fitted = sz.Graph([net(validate_every=5)]).fit(x, y, validation=classes(n=61, seed=2))
    assert [row["step"] for row in fitted.validations] == [5, 10, 15, 20, 25, 30, 35]
    steps = [(float(k), 1.0 / k) for k in range(1, 40)]
    drawn = plot_history(
        fitted.history,
        str(tmp_path / "steps.png"),
        "job",
        steps=steps,
        validations=fitted.validations,
    )
    assert drawn[0] == "step: training loss, validation loss"
    board = HistoryWriter(str(tmp_path / "board"))
    board.add_validations(fitted.validations)
    board.close()
    events = EventAccumulator(str(tmp_path / "board"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["step/accuracy", "step/val_loss"]
    scalars = events.Scalars("step/val_loss")
    assert [s.step for s in scalars] == [5, 10, 15, 20, 25, 30, 35]
    assert [s.value for s in scalars] == pytest.approx(
        [row["val_loss"] for row in fitted.validations]
    )


def test_the_table_and_the_rows_of_events():
    history = _history()
    console = Console(record=True, width=120)
    console.print(history_table(history, "job: history"))
    text = console.export_text()
    assert "val_loss" in text and "accuracy" in text and f"{history[-1]['val_loss']:.4f}" in text
    event = {
        "phase": "round",
        "round": 2,
        "rounds": 5,
        "loss": 0.5,
        "workers": ["w1"],
        "evaluation": {"w1": {"val_loss": 1.0}},
        "val_loss": 0.7,
    }
    assert row_of(event) == {"round": 2, "loss": 0.5, "val_loss": 0.7}
    assert row_of({"phase": "training", "step": 3, "loss": 0.1}) is None
    # A metric named by a filter prints as text: no markup, no escape sequence reaches the
    # terminal (issue 32).
    hostile = [{"epoch": 1, "loss": 0.5, "[red]x\x1b[2J": 0.25}]
    console = Console(record=True, width=120)
    console.print(history_table(hostile, "job: history"))
    text = console.export_text()
    assert "[red]x\\x1b[2J" in text and "\x1b" not in text


def test_the_validations_table_says_each_validations_step():
    """``somatize result`` prints validate_every's rows under the history: each one's epoch,
    its step (a whole number) and its figures."""
    validations = [
        {"epoch": 1, "step": 5, "val_loss": 0.71234, "accuracy": 0.5},
        {"epoch": 2, "step": 10, "val_loss": 0.5, "accuracy": 0.75},
    ]
    console = Console(record=True, width=120)
    console.print(history_table(validations, "job: validations"))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "val_loss" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "epoch",
        "step",
        "val_loss",
        "accuracy",
    ]
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines if "│" in line]
    assert rows == [["1", "5", "0.7123", "0.5000"], ["2", "10", "0.5000", "0.7500"]]
