"""A running job's record keeps its last epoch's (round's) figures beside its last step's
progress: what the status page shows of it."""

from __future__ import annotations

import asyncio

from coordinator.jobs.events import JobEvents
from coordinator.storage.store import JobStore
from tests.coordinator.storage.store_utils import running_job


def test_the_progress_of_a_running_job_keeps_its_last_epochs_figures(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    job = running_job(store)
    events = JobEvents(store)

    async def run():
        await events.emit(job.id, "progress", {"phase": "training", "step": 1, "loss": 0.9})
        assert "metrics" not in store.get(job.id).progress  # no epoch has ended yet
        row = {"phase": "epoch", "epoch": 1, "loss": 0.8, "val_loss": 0.7, "accuracy": 0.6}
        await events.emit(job.id, "progress", row | {"lr": 0.1})
        await events.emit(job.id, "progress", {"phase": "training", "step": 8, "loss": 0.5})

    asyncio.run(run())
    progress = store.get(job.id).progress
    assert progress["step"] == 8 and progress["loss"] == 0.5
    assert progress["metrics"] == {
        "epoch": 1,
        "loss": 0.8,
        "val_loss": 0.7,
        "accuracy": 0.6,
        "lr": 0.1,
    }
