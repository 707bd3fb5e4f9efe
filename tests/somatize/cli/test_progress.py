"""Progress in sentences with units (issue 18, item 7): each line checked against figures worked
out by hand here from the events' rows, losses and times."""

from __future__ import annotations

from somatize.cli.progress import Progress, bar_position, clock, event_text


def _step(step, epoch, loss, rows, steps=6, epochs=2):
    return {
        "phase": "training",
        "epoch": epoch,
        "epochs": epochs,
        "step": step,
        "steps": steps,
        "loss": loss,
        "rows": rows,
    }


def test_steps_read_as_epoch_step_epoch_mean_rate_and_time_left():
    p = Progress()
    assert p.add(10.0, _step(1, 1, 2.0, 64)) == "epoch 1/2 · step 1/3 · loss 2 (epoch mean)"
    # (2·64 + 1·64) / 128 = 1.5; 64 rows in the 2 s since the first step; 4 steps left at 2 s.
    assert p.add(12.0, _step(2, 1, 1.0, 64)) == (
        "epoch 1/2 · step 2/3 · loss 1.5 (epoch mean) · 32 rows/s · ETA 0:08"
    )
    # The short last batch weighs by its 12 rows: (128 + 64 + 48) / 140 = 1.714...; 76 rows in
    # 4 s; 2 steps in 4 s, 3 left.
    assert p.add(14.0, _step(3, 1, 4.0, 12)) == (
        "epoch 1/2 · step 3/3 · loss 1.714 (epoch mean) · 19 rows/s · ETA 0:06"
    )
    # A new epoch starts its own mean; 140 rows in 6 s; 3 steps in 6 s, 2 left.
    assert p.add(16.0, _step(4, 2, 0.5, 64)) == (
        "epoch 2/2 · step 1/3 · loss 0.5 (epoch mean) · 23 rows/s · ETA 0:04"
    )


def test_thousands_are_grouped_and_long_waits_read_as_hours():
    p = Progress()
    p.add(0.0, _step(1, 1, 1.0, 2500, steps=10_000, epochs=1))
    line = p.add(2.0, _step(2, 1, 1.0, 2500, steps=10_000, epochs=1))
    assert "1,250 rows/s" in line and line.endswith("ETA 5:33:16")  # 9,998 steps at 2 s
    assert clock(12) == "0:12" and clock(185) == "3:05" and clock(3723) == "1:02:03"


def test_a_chunk_of_steps_counts_each_step_in_its_own_epoch():
    p = Progress()
    chunk = {"phase": "training", "epochs": 2, "steps": 8, "rows": 40}
    first = chunk | {"epoch": 1, "step": 3, "losses": [1.0, 2.0, 3.0], "batch_rows": [10] * 3}
    assert p.add(0.0, first) == "epoch 1/2 · step 3/4 · loss 2 (epoch mean)"
    # Steps 4 (epoch 1) and 5, 6 (epoch 2): the epoch-2 mean is (10·1 + 30·3) / 40 = 2.5.
    crossing = chunk | {
        "epoch": 2,
        "step": 6,
        "losses": [9.0, 1.0, 3.0],
        "batch_rows": [10, 10, 30],
    }
    assert p.add(3.0, crossing) == (
        "epoch 2/2 · step 2/4 · loss 2.5 (epoch mean) · 17 rows/s · ETA 0:02"
    )


def test_federated_rounds_read_as_round_loss_rows_and_time_left():
    p = Progress()
    event = {"phase": "round", "rounds": 3, "workers": ["a", "b"], "dropped": {}, "rows": 1347}
    assert p.add(0.0, event | {"round": 1, "loss": 1.956}) == (
        "round 1/3 · loss 1.956 (mean of 2 workers) · 1,347 rows"
    )
    assert p.add(5.0, event | {"round": 2, "loss": 1.5}) == (
        "round 2/3 · loss 1.5 (mean of 2 workers) · 1,347 rows · ETA 0:05"
    )


def test_one_event_alone_says_its_loss_is_the_last_steps():
    assert event_text(_step(5, 2, 0.7356, 3)) == "epoch 2/2 · step 2/3 · loss 0.7356 (last step)"
    no_total = {"phase": "training", "epoch": 1, "epochs": 2, "step": 66, "loss": 0.5}
    assert event_text(no_total) == "epoch 1/2 · step 66 · loss 0.5 (last step)"
    trained = {"phase": "trained", "epochs": 3, "epoch_losses": [1.0, 0.25], "loss": 0.1}
    assert event_text(trained) == "trained 3 epochs · loss 0.25 (last epoch mean)"
    assert event_text({"phase": "loading", "replicas": 2}) == "loading the filters (2 replicas)"
    staged = {"phase": "staged", "rows": {"a": 1000, "b": 347}, "dropped": {}}
    assert event_text(staged) == "staged 1,347 rows on 2 workers"
    assert event_text({"phase": "checking", "shard": "s1", "ok": True}) == "checking · shard s1"
    sharded = {
        "phase": "sharded",
        "sharding": "full",
        "w1": {"units": 3, "parameter_bytes": 360},
        "w2": {"units": 3, "parameter_bytes": 2920},
    }
    most = "at most 2,920 bytes of parameters a replica"
    assert event_text(sharded) == f"model sharded (full): {most}"


def test_the_bar_goes_by_steps_else_rounds_else_epochs():
    assert bar_position(_step(4, 2, 0.5, 64)) == (4, 6)
    assert bar_position({"phase": "round", "round": 2, "rounds": 10}) == (2, 10)
    assert bar_position({"epoch": 1, "epochs": 5}) == (1, 5)
    assert bar_position({"phase": "loading"}) == (0, 0)


def test_an_epochs_history_row_adds_its_validation_figures_and_the_end_keeps_the_last_step():
    """Issue 17's rows: each epoch's (validation figures, lr) after its last step, and the run's
    last event with them all."""
    p = Progress()
    p.add(0.0, _step(5, 2, 1.0, 64))
    step = p.add(2.0, _step(6, 2, 0.5, 64))
    row = {"phase": "epoch", "epoch": 2, "loss": 0.75, "lr": 0.05, "val_loss": 0.38114}
    row |= {"accuracy": 0.9125}
    assert p.add(2.0, row) == step + " · val_loss 0.3811 · accuracy 0.9125"
    trained = {"phase": "trained", "epoch": 2, "epochs": 2, "step": 6, "steps": 6, "loss": 0.75}
    last = {k: v for k, v in row.items() if k != "phase"}
    trained |= {"history": [{"epoch": 1, "loss": 1.0}, last]}
    assert p.add(2.0, trained) == step + " · val_loss 0.3811 · accuracy 0.9125"
    # (64 · 1.0 + 64 · 0.5) / 128; 64 rows in the 2 s since the first step; no time left.
    assert p.final == (
        "epoch 2/2 · step 3/3 · loss 0.75 (epoch mean) · 32 rows/s · val_loss 0.3811 · "
        "accuracy 0.9125"
    )


def test_a_run_without_step_events_reads_its_rows_and_its_end_from_its_history():
    """Local trains in one call: its rows come at the end, and its last event has no epoch
    losses of its own but its history's."""
    p = Progress()
    p.add(0.0, {"phase": "training"})
    row = {"phase": "epoch", "epoch": 3, "loss": 0.25, "lr": 0.1, "val_loss": 0.5}
    assert p.add(1.0, row) == "epoch 3 · loss 0.25 (epoch mean) · val_loss 0.5"
    trained = {"phase": "trained", "epochs": 3, "loss": 0.25, "history": [row]}
    assert p.add(1.0, trained) == "trained 3 epochs · loss 0.25 (last epoch mean) · val_loss 0.5"
    assert event_text(trained) == p.text


def test_a_finished_jobs_last_event_says_where_it_ended():
    """What `somatize jobs` shows of a finished job: its last event, the run's end."""
    steps = {"phase": "trained", "epoch": 2, "epochs": 2, "step": 16, "steps": 16, "loss": 0.5}
    steps |= {"history": [{"epoch": 1, "loss": 0.9}, {"epoch": 2, "loss": 0.5, "lr": 0.1}]}
    assert event_text(steps) == "epoch 2/2 · step 8/8 · loss 0.5 (last epoch mean)"
    rounds = {"phase": "trained", "round": 10, "rounds": 10, "loss": 0.5}
    rounds |= {"history": [{"round": 10, "loss": 0.5, "val_loss": 0.61, "accuracy": 1.0}]}
    assert event_text(rounds) == (
        "round 10/10 · loss 0.5 (last round mean) · val_loss 0.61 · accuracy 1"
    )
