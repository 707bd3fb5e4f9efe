"""The demo's closing hint runs the job it names (issue 18, item 6): the worker line it gives
carries the tag ``examples/digits_job.py`` asks for, and as many machines as it needs."""

from __future__ import annotations

import shlex
from pathlib import Path

from somatize.cli.demo import ELSEWHERE, EXAMPLE_JOB
from somatize.cli.job_files import load_job_file

ROOT = Path(__file__).resolve().parents[3]


def test_the_closing_hint_starts_workers_the_example_job_can_run_on():
    strategy = load_job_file(str(ROOT / EXAMPLE_JOB)).strategy
    assert strategy is not None
    options = strategy.spec().options
    worker = shlex.split(next(line for line in ELSEWHERE if "somatize-worker" in line))
    tags = [worker[i + 1] for i, word in enumerate(worker) if word == "--tag"]
    assert options["tag"] in tags
    assert f"trains on {options['workers']} workers tagged {options['tag']}" in ELSEWHERE[0]
    assert f"start the worker line on {['', 'one', 'two'][options['workers']]}" in ELSEWHERE[0]
    submit = shlex.split(next(line for line in ELSEWHERE if "somatize submit" in line))
    assert submit[submit.index("submit") + 1] == EXAMPLE_JOB
