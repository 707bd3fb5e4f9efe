"""Following a job on a console: a progress bar on a terminal, plain lines in a log.

What ``somatize submit`` and ``somatize demo`` show while a job runs: each event of the job
(:meth:`~somatize.remote.jobs.Job.events`) in the words of :mod:`somatize.cli.progress` and
:mod:`somatize.cli.tables`, each epoch's (round's) row handed to TensorBoard as it comes.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from somatize.cli.curves import HistoryWriter, loss_curve, row_of
from somatize.cli.progress import Progress as JobProgress
from somatize.cli.progress import bar_position
from somatize.cli.tables import placed_text, queued_text, replica_text

if TYPE_CHECKING:
    from rich.console import Console

    from somatize.remote.jobs import Job

__all__ = ["PLAIN_PROGRESS_EVERY", "follow", "follow_in_lines", "to_board"]


def follow(
    job: Job,
    err: Console,
    line: JobProgress | None = None,
    board: HistoryWriter | None = None,
    every: float = 10.0,
) -> Any:
    """Follow ``job``'s events with a progress bar, its progress in words (``line``'s, when
    given); its terminal event (``None``: no end). Each epoch's (round's) row goes to
    ``board`` as it comes. Without a terminal, plain lines instead (:func:`follow_in_lines`,
    at most one of progress each ``every`` seconds)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    line = JobProgress() if line is None else line
    if not err.is_terminal:  # a bar would show nothing until the job ended
        return follow_in_lines(job, err, line, board, every)

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task(f"job {job.id}", total=None, info="submitted")
        for event in job.events():
            if event.event == "queued":
                progress.update(task, info=queued_text(event.data))
            elif event.event == "placed":
                progress.update(task, info=placed_text(event.data))
            elif event.event == "progress":
                done, total = bar_position(event.data)
                if total:
                    progress.update(task, total=total, completed=min(done, total))
                progress.update(task, info=line.add(event.time, event.data))
                to_board(board, event)
            elif event.event in ("worker_lost", "worker_replaced"):
                progress.update(task, info=replica_text(event.event, event.data))
            elif event.terminal:
                if event.event == "succeeded":
                    end = progress.tasks[0].total or 1
                    progress.update(task, total=end, completed=end)
                progress.update(task, info=event.event)
                return event
    return None


PLAIN_PROGRESS_EVERY = 10.0
"""Seconds between two plain progress lines of ``somatize submit`` without a terminal."""


def follow_in_lines(
    job: Job, err: Console, line: JobProgress, board: HistoryWriter | None, every: float
) -> Any:
    """:func:`follow` for a log a person or CI reads: a line when the job is queued, placed,
    loses a worker or ends, and its progress in words at most once each ``every`` seconds
    (and the last one before it ends); its terminal event (``None``: no end)."""
    said, shown, last = "", "", -math.inf

    def say(text: str) -> None:
        err.print(f"job {job.id}: {text}", markup=False, soft_wrap=True)

    for event in job.events():
        if event.event == "progress":
            said = line.add(event.time, event.data)
            to_board(board, event)
            if said != shown and time.monotonic() - last >= every:
                say(said)
                shown, last = said, time.monotonic()
            continue
        if event.terminal and said != shown:
            say(said)  # where it stood as it ended
        if event.event == "queued":
            say(queued_text(event.data))
        elif event.event == "placed":
            say(placed_text(event.data))
        elif event.event in ("worker_lost", "worker_replaced"):
            say(replica_text(event.event, event.data))
        elif event.terminal:
            say(event.event)
            return event
    return None


def to_board(board: HistoryWriter | None, event: Any) -> None:
    """What TensorBoard takes of a progress event: an epoch's (round's) row, a validation,
    or a chunk's steps."""
    if board is None:
        return
    row = row_of(event.data)
    if row is not None:
        board.add(row)
    elif event.data.get("phase") == "validation":
        board.add_validations([event.data])
    elif isinstance(event.data.get("step"), int):
        board.add_steps(loss_curve([event]))
