"""A job's life in the coordinator's log (issue 18, item 7): a line for each event that changes
where it stands, at INFO; its steps at DEBUG."""

from __future__ import annotations

import logging

from coordinator.jobs.log import life_line


def test_each_change_of_a_job_is_one_line_at_info():
    queued = {"placement": "2 workers tagged 'dp'", "name": "digits_job", "wait_for_workers": 60.0}
    assert life_line("3f2a", "queued", queued, None) == (
        logging.INFO,
        "job 3f2a (digits_job) queued: waiting for 2 workers tagged 'dp' (at most 60 s)",
    )
    requeued = {"placement": "1 worker", "requeued": "the coordinator restarted"}
    assert life_line("3f2a", "queued", requeued, None)[1] == (
        "job 3f2a queued: waiting for 1 worker; requeued: the coordinator restarted"
    )
    placed = {"workers": ["box-1", "box-2"], "collective": "torch", "collective_reason": "why"}
    assert life_line("3f2a", "placed", placed, None) == (
        logging.INFO,
        "job 3f2a placed on box-1, box-2; gradients by torch (why)",
    )
    assert life_line("3f2a", "succeeded", {"nodes": ["a"]}, 12.34) == (
        logging.INFO,
        "job 3f2a succeeded after 12.3 s running",
    )
    failed = {"code": "worker_lost", "message": "worker 'box-2' was lost", "detail": {}}
    assert life_line("3f2a", "failed", failed, 3.0)[1] == (
        "job 3f2a failed after 3.0 s running [worker_lost]: worker 'box-2' was lost"
    )
    cancelled = {"code": "cancelled", "message": "cancelled by the client"}
    assert life_line("3f2a", "cancelled", cancelled, None)[1] == (
        "job 3f2a cancelled [cancelled]: cancelled by the client"
    )
    restarting = {"attempt": 1, "of": 2, "code": "worker_lost", "workers": ["x"]}
    assert life_line("3f2a", "restarting", restarting, None) == (
        logging.INFO,
        "job 3f2a restarting: attempt=1 of=2 code=worker_lost",
    )


def test_steps_and_checkpoints_go_at_debug_and_a_failed_checkpoint_warns():
    step = {"phase": "training", "step": 3, "loss": 0.5, "losses": [0.5]}
    assert life_line("j", "progress", step, None) == (
        logging.DEBUG,
        "job j progress: phase=training step=3 loss=0.5",
    )
    assert life_line("j", "checkpoint", {"step": 4}, None)[0] == logging.DEBUG
    assert life_line("j", "checkpoint_failed", {"error": "disk full"}, None) == (
        logging.WARNING,
        "job j checkpoint_failed: error=disk full",
    )
