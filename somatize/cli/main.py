"""The ``somatize`` command line.

Commands::

    somatize demo [--epochs N]                   train the digits demo in this process
    somatize submit FILE.py [--no-wait]          submit the job FILE.py defines, follow it
    somatize cancel ID                           cancel a queued or running job
    somatize status                              workers and jobs
    somatize jobs [--limit N]                    the newest jobs (a queued one: why it waits)
    somatize queue                               the jobs running and queued, in their order
    somatize result ID [--save PATH] [--wait S]  a finished job's states
    somatize prune [ID...] [--older-than AGE]    remove ended jobs (--keep N, --max-bytes SIZE)

The commands that talk to a coordinator take ``--coordinator URL`` (default
``$SOMATIZE_COORDINATOR``, else ``ws://127.0.0.1:8765``), ``--token`` (default
``$SOMATIZE_TOKEN``) and ``--timeout SECONDS`` (connection and replies, default 30).

Exit codes: 0 success; 1 the job failed, was cancelled or has no result yet; 2 a usage error or
a coordinator that cannot be reached (one line on stderr, no traceback); 130 interrupted.
Interrupted, ``somatize submit`` asks whether to cancel its job too (:mod:`somatize.cli.interrupt`).

A job file (:mod:`somatize.cli.job_files`) is a Python file that defines ``graph`` and ``x``, and
may define ``y``, ``strategy``, ``validation``, ``name`` and ``wait_for_workers``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from protocol.messages import SANDBOX_REQUIREMENTS
from protocol.security.token_file import token_file_problem
from protocol.text.quantities import byte_count, seconds
from protocol.text.user_tracebacks import with_source
from protocol.text.wording import visible
from somatize.cli.curves import (
    HistoryWriter,
    curve_unit,
    history_of,
    history_table,
    loss_curve,
    plot_history,
    plot_loss,
    unit_of,
    validations_of,
)
from somatize.cli.following import PLAIN_PROGRESS_EVERY, follow
from somatize.cli.interrupt import exit_signals, when_stopped
from somatize.cli.job_files import load_job_file
from somatize.cli.progress import Progress as JobProgress
from somatize.cli.tables import (
    cells,
    clients_table,
    describe_state,
    jobs_table,
    position_text,
    queue_table,
    states_summary,
    workers_table,
)
from somatize.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from somatize.remote.client import Client
    from somatize.remote.jobs import Job

DEFAULT_COORDINATOR = "ws://127.0.0.1:8765"

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize", description="Train graphs of filters, in-process or across machines."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train scikit-learn's digits in-process and on an embedded local cluster",
    )
    demo.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    demo.add_argument("--workers", type=int, default=2, help="local workers (default 2)")
    demo.add_argument(
        "--in-process", action="store_true", help="only train in this process (no cluster)"
    )

    remote = argparse.ArgumentParser(add_help=False)
    group = remote.add_argument_group("coordinator")
    group.add_argument(
        "--coordinator",
        metavar="URL",
        default=os.environ.get("SOMATIZE_COORDINATOR") or DEFAULT_COORDINATOR,
        help="the coordinator's URL (default: $SOMATIZE_COORDINATOR, else %(default)s)",
    )
    group.add_argument(
        "--token",
        default=os.environ.get("SOMATIZE_TOKEN") or None,
        help="the client token (default: $SOMATIZE_TOKEN); on the command line every user of "
        "this machine can read it (ps): prefer --token-file or $SOMATIZE_TOKEN",
    )
    group.add_argument(
        "--token-file",
        metavar="FILE",
        help="a file holding the client token (only you may read it: chmod 600), read once",
    )
    group.add_argument(
        "--ca-file",
        default=os.environ.get("SOMATIZE_CA_FILE") or None,
        help="certificate(s) to trust for wss:// (default: $SOMATIZE_CA_FILE, else the system's)",
    )
    group.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="most seconds to wait for the connection and each reply (default 30)",
    )

    submit = sub.add_parser(
        "submit",
        parents=[remote],
        help="submit the job a Python file defines and follow it",
        description="Run FILE (it defines graph and x, and may define y, strategy, "
        "validation, name and wait_for_workers), submit the job, print its id and follow its "
        "progress until it ends.",
    )
    submit.add_argument("file", metavar="FILE.py", help="the job file")
    submit.add_argument(
        "--no-wait", action="store_true", help="print the job id and return at once"
    )
    submit.add_argument(
        "--resume-from",
        metavar="JOB",
        help="continue job JOB (one that failed, was cancelled or succeeded, of the same graph "
        "and strategy) from its newest checkpoint",
    )
    submit.add_argument(
        "--progress-every",
        type=_positive_float,
        default=PLAIN_PROGRESS_EVERY,
        metavar="SECONDS",
        help="without a terminal (piped, redirected, CI), print the job's progress as a plain "
        f"line at most this often (default {PLAIN_PROGRESS_EVERY:g}); where it is placed, a "
        "worker lost and how it ends are printed as they come",
    )
    submit.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write each epoch's (round's) figures to TensorBoard event files in DIR as they come",
    )
    submit.add_argument(
        "--name", help="what the job list calls the job (default: the file's name, no .py)"
    )
    submit.add_argument(
        "--wait-for-workers",
        type=_positive_float,
        metavar="SECONDS",
        help="wait this long for workers that can take the job (a tag or worker id no worker "
        "has yet included), then fail; by default such a job is refused at once",
    )
    submit.add_argument(
        "--sandbox",
        choices=SANDBOX_REQUIREMENTS,
        help="required: place the job only on workers that run job code sandboxed (bwrap or "
        "uid, as status shows), refused at once where none does; any: on any worker "
        "(default: the job file's sandbox, else any)",
    )
    submit.add_argument(
        "--priority",
        type=int,
        default=0,
        metavar="N",
        help="among the jobs that can start, a higher priority goes first and may preempt a "
        "lower one (default 0; at most your client's max_priority)",
    )
    submit.add_argument(
        "--no-preempt",
        action="store_true",
        help="never stop this job to make room for another (it counts against your "
        "max_workers quota, which a preemptible job may borrow past)",
    )
    submit.add_argument(
        "--time-limit",
        type=_positive_float,
        metavar="SECONDS",
        help="fail the job if a run of it takes longer; a job that declares one may start "
        "early on workers held for a larger job (backfill)",
    )
    submit.add_argument(
        "--slots",
        type=_positive_int,
        default=1,
        metavar="N",
        help="the slots the job takes of each worker (somatize-worker --slots; default 1)",
    )
    submit.add_argument(
        "--save",
        metavar="PATH",
        help="once the job succeeded, write its states there (as somatize result --save)",
    )
    submit.add_argument(
        "--cancel-on-exit",
        action="store_true",
        help="cancel the job if this command stops before it ends (Ctrl-C, SIGTERM, SIGHUP) "
        "instead of asking",
    )

    cancel = sub.add_parser("cancel", parents=[remote], help="cancel a queued or running job")
    cancel.add_argument("job_id", metavar="ID", help="the job's id")

    sub.add_parser("status", parents=[remote], help="show workers and jobs")

    jobs = sub.add_parser("jobs", parents=[remote], help="list the newest jobs")
    jobs.add_argument("--limit", type=_positive_int, default=50, help="how many (default 50)")
    jobs.add_argument(
        "--watch", action="store_true", help="follow live (refreshed every second; Ctrl-C stops)"
    )

    sub.add_parser(
        "queue",
        parents=[remote],
        help="the jobs running and queued, in the order they go, and why each waits",
        description="Every job running or queued that you may see, in the order they go: "
        "each queued one's place, why it waits (priority, share, workers_busy, reservation, "
        "preempting, quota, no_worker) and when it is expected to start. An admin sees "
        "every client's jobs, and each client's share, what it holds and has held lately.",
    )

    prune = sub.add_parser(
        "prune",
        parents=[remote],
        help="remove ended jobs (record, events, result, checkpoints) from the coordinator",
        description="Remove your ended jobs (an admin: anyone's) from the coordinator's state "
        "directory: those named, those that ended longer ago than --older-than, all but the "
        "--keep newest, and the oldest until the rest hold --max-bytes. A running or queued "
        "job is never removed.",
    )
    prune.add_argument("job_ids", metavar="ID", nargs="*", help="jobs to remove")
    prune.add_argument(
        "--older-than",
        type=seconds,
        metavar="AGE",
        help="jobs that ended longer ago than this (seconds, or 30d, 12h, 90m)",
    )
    prune.add_argument("--keep", type=int, metavar="N", help="all but the N newest")
    prune.add_argument(
        "--max-bytes",
        type=byte_count,
        metavar="SIZE",
        help="the oldest until the rest hold at most SIZE (bytes, or 500M, 20G)",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="say what would be removed, remove nothing"
    )

    result = sub.add_parser("result", parents=[remote], help="show (and save) a job's states")
    result.add_argument("job_id", metavar="ID", help="the job's id")
    result.add_argument(
        "--save",
        metavar="PATH",
        help="write the states (no pickle: torch.load(PATH, weights_only=True) or "
        "somatize.load(PATH, graph) reads them)",
    )
    result.add_argument(
        "--states",
        action="store_true",
        help="list every tensor of the states (node, key, shape, dtype), not one line",
    )
    result.add_argument(
        "--checkpoint",
        metavar="latest|N",
        help="the states of the job's newest checkpoint (or checkpoint N) instead of its "
        "result: what a cancelled or failed job had learned",
    )
    result.add_argument(
        "--plot",
        metavar="PNG",
        help="save the job's training and validation curves, by epoch (or round)",
    )
    result.add_argument(
        "--tensorboard", metavar="DIR", help="write the job's history as TensorBoard event files"
    )
    result.add_argument(
        "--wait",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for a running job to finish (default 0: do not wait)",
    )
    return parser


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _checkpoint_number(text: str) -> int:
    """``--checkpoint N``: a checkpoint's number (``latest`` is taken before)."""
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--checkpoint takes 'latest' or a checkpoint's number, not {text!r}")
    return int(text)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the ``somatize`` command line; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from somatize.cli.demo import run, run_local

        try:
            if args.in_process:
                run_local(epochs=args.epochs)
            else:
                run(workers=args.workers, epochs=args.epochs)
        except KeyboardInterrupt:
            print("somatize demo: interrupted; every process it started was stopped")
            return EXIT_INTERRUPTED
        return EXIT_OK

    from somatize.cli.visible_console import VisibleConsole
    from somatize.errors import ClientError, JobFailed

    err = VisibleConsole(stderr=True, highlight=False)
    try:
        return _COMMANDS[args.command](args, VisibleConsole(highlight=False), err)
    except UsageError as exc:
        err.print(f"somatize: {exc}", markup=False, soft_wrap=True)
    except (ClientError, TimeoutError, ValueError) as exc:
        err.print(f"somatize {args.command}: {exc}", markup=False, soft_wrap=True)
    except JobFailed as exc:
        _print_failure(err, exc)
        return EXIT_JOB_FAILED
    except KeyboardInterrupt:
        err.print("somatize: interrupted", markup=False, soft_wrap=True)
        return EXIT_INTERRUPTED
    return EXIT_USAGE


def _connect(args: argparse.Namespace) -> Client:
    from somatize.remote.client import connect

    return connect(args.coordinator, _token(args), timeout=args.timeout, ca_file=args.ca_file)


def _token(args: argparse.Namespace) -> str | None:
    """The client token: ``--token-file``'s, else ``--token`` (or ``$SOMATIZE_TOKEN``).

    Raises:
        UsageError: the token file cannot be used (it says why).
    """
    if args.token_file is None:
        return str(args.token) if args.token else None
    try:
        with open(args.token_file, encoding="utf-8") as f:
            mode, text = os.fstat(f.fileno()).st_mode, f.read()
    except OSError as exc:
        raise UsageError(f"cannot read the token file: {exc}") from exc
    problem = token_file_problem(args.token_file, mode, text)
    if problem is not None:
        raise UsageError(problem)
    return text.strip()


# -- submit ------------------------------------------------------------------------------------


def _submit(args: argparse.Namespace, out: Console, err: Console) -> int:
    spec = load_job_file(args.file)
    for warning in spec.warnings:
        err.print(f"warning: {warning}", markup=False, soft_wrap=True)
    wait = args.wait_for_workers if args.wait_for_workers is not None else spec.wait_for_workers
    with _connect(args) as client:
        try:
            job = client.submit(
                spec.graph,
                spec.x,
                spec.y,
                strategy=spec.strategy,
                validation=spec.validation,
                wait_for_workers=wait,
                name=args.name or spec.name or Path(args.file).stem,
                file=args.file,
                sandbox=args.sandbox or spec.sandbox,  # argparse's choices: a requirement
                priority=args.priority,
                preemptible=not args.no_preempt,
                time_limit=args.time_limit,
                slots=args.slots,
                resume_from=args.resume_from,
            )
        except ValueError as exc:  # what the SDK refuses of the file's data, before sending
            raise UsageError(f"{args.file}: {exc}") from exc
        started, line = time.monotonic(), JobProgress()
        board = None
        # From here the job exists: a Ctrl-C at any point asks about it (one while its id is
        # being printed too, not only while it is followed).
        try:
            with exit_signals(args.cancel_on_exit):
                out.print(job.id, markup=False, soft_wrap=True)
                for note in job.notes:  # said up front: why it will not equal graph.fit
                    err.print(f"note: {note}", markup=False, soft_wrap=True)
                if args.no_wait:
                    return EXIT_OK
                board = HistoryWriter(args.tensorboard) if args.tensorboard else None
                end = follow(job, err, line, board, args.progress_every)
        except KeyboardInterrupt as stop:
            when_stopped(job, stop, args.cancel_on_exit, err)
            return EXIT_INTERRUPTED
        finally:
            if board is not None:
                board.close()
        if end is None:
            err.print(
                f"job {job.id}: the event stream ended before the job", markup=False, soft_wrap=True
            )
            return EXIT_USAGE
        if end.event != "succeeded":
            from somatize.remote.jobs import failure_of

            _print_failure(err, failure_of(job.id, end))
            _offer_checkpoint(err, job, f"somatize submit {args.file} --resume-from {job.id}")
            return EXIT_JOB_FAILED
        how = f": {line.final}" if line.final else ""
        err.print(
            f"job {job.id} succeeded in {time.monotonic() - started:.1f} s{how}",
            markup=False,
            soft_wrap=True,
        )
        if args.save:
            _save(job.states(timeout=0), args.save, err, history_of(job.status()))
        return EXIT_OK


def _offer_checkpoint(err: Console, job: Job, command: str) -> None:
    """Say a failed job's newest checkpoint and ``command``, which takes it up; nothing where
    it kept none."""
    from somatize.errors import ClientError

    with contextlib.suppress(ClientError):  # none kept: nothing to offer
        saved = job.checkpoint()
        err.print(
            f"its newest checkpoint is {saved.seq}, at {position_text(saved.position)}: {command}",
            markup=False,
            soft_wrap=True,
        )


def _print_failure(err: Console, exc: Any) -> None:
    err.print(str(exc), markup=False, soft_wrap=True)
    trace = exc.traceback
    if trace:  # the user's frames, with their source lines from the files here
        err.print(with_source(trace).rstrip(), markup=False, soft_wrap=True)


# -- cancel, status, jobs, result --------------------------------------------------------------


def _cancel(args: argparse.Namespace, out: Console, err: Console) -> int:
    with _connect(args) as client:
        client.job(args.job_id).cancel()
    out.print(f"job {visible(args.job_id)} cancelled", markup=False, soft_wrap=True)
    return EXIT_OK


def _status(args: argparse.Namespace, out: Console, err: Console) -> int:
    with _connect(args) as client:
        status = client.status()
    out.print(workers_table(status.get("workers", [])))
    out.print(jobs_table(status.get("jobs", [])))
    held = status.get("state_bytes")
    if isinstance(held, int):  # an admin's: the coordinator's state directory
        out.print(
            f"state directory: {held / 1e6:.1f} MB (somatize prune removes ended jobs)",
            markup=False,
        )
    return EXIT_OK


def _jobs(args: argparse.Namespace, out: Console, err: Console) -> int:
    with _connect(args) as client:
        if not args.watch:
            out.print(jobs_table(client.jobs(limit=args.limit)))
            return EXIT_OK
        from rich.live import Live

        with Live(jobs_table(client.jobs(limit=args.limit)), console=out) as live:
            while True:  # until Ctrl-C (the caller turns it into exit code 130)
                time.sleep(1.0)
                live.update(jobs_table(client.jobs(limit=args.limit)))


def _queue(args: argparse.Namespace, out: Console, err: Console) -> int:
    with _connect(args) as client:
        queue = client.queue()
    out.print(queue_table(queue.get("jobs", [])))
    if "clients" in queue:
        out.print(clients_table(queue["clients"]))
    return EXIT_OK


def _prune(args: argparse.Namespace, out: Console, err: Console) -> int:
    if not (args.job_ids or args.older_than is not None or args.keep is not None) and (
        args.max_bytes is None
    ):
        raise UsageError("somatize prune: name jobs, or give --older-than, --keep or --max-bytes")
    with _connect(args) as client:
        said = client.prune(
            args.job_ids,
            older_than=args.older_than,
            keep=args.keep,
            max_bytes=args.max_bytes,
            dry_run=args.dry_run,
        )
    verb = "would remove" if args.dry_run else "removed"
    jobs = said.get("jobs", [])
    out.print(
        f"{verb} {len(jobs)} ended jobs, {said.get('bytes', 0) / 1e6:.1f} MB"
        + (f": {' '.join(map(visible, jobs))}" if jobs else ""),
        markup=False,
        soft_wrap=True,
    )
    for job_id in said.get("kept", []):
        err.print(
            f"{visible(job_id)}: not an ended job of yours here: kept", markup=False, soft_wrap=True
        )
    return EXIT_OK


def _result(args: argparse.Namespace, out: Console, err: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from somatize.errors import JobFailed

    title = f"job {visible(args.job_id)}"
    with _connect(args) as client:
        job = client.job(args.job_id)
        try:
            if args.checkpoint is not None:
                seq = None if args.checkpoint == "latest" else _checkpoint_number(args.checkpoint)
                saved = job.checkpoint(seq)
                states = saved.states
                title += f", checkpoint {saved.seq} at {position_text(saved.position)}"
            else:
                states = job.states(timeout=args.wait)
            record = job.status()
            history, validations = history_of(record), validations_of(record)
        except TimeoutError as exc:
            err.print(f"somatize result: {exc}", markup=False, soft_wrap=True)
            return EXIT_JOB_FAILED
        except JobFailed as exc:
            _print_failure(err, exc)
            _offer_checkpoint(err, job, f"somatize result {args.job_id} --checkpoint latest")
            return EXIT_JOB_FAILED
    if args.states:
        table = Table(title=Text(title), title_justify="left")
        for column in ("node", "key", "shape", "dtype"):
            table.add_column(column, no_wrap=column != "dtype")
        for node_id, state in states.items():
            rows = list(describe_state(state)) or [("", "", "(empty)")]
            for key, shape, dtype in rows:
                table.add_row(*cells(node_id, key, shape, dtype))
                node_id = ""
        out.print(table)
    else:
        out.print(
            f"{title}: {visible(states_summary(states))} (--states lists them)",
            markup=False,
            soft_wrap=True,
        )
    if history:
        out.print(history_table(history, f"job {visible(args.job_id)}: history"))
    if validations:  # validate_every's, between epoch ends
        out.print(history_table(validations, f"job {visible(args.job_id)}: validations"))
    steps: list[tuple[float, float]] = []
    if args.plot or args.tensorboard:
        with _connect(args) as client:
            events = list(client.job(args.job_id).events(timeout=client.timeout))
        unit = curve_unit(events)
        steps = loss_curve(events) if unit == "step" else []
    if args.plot and history:
        plot_history(
            history, args.plot, title=f"job {args.job_id}", steps=steps, validations=validations
        )
        each = f"{len(steps)} steps and " if steps else ""
        err.print(
            f"saved the curves ({each}{len(history)} {unit_of(history)}s) to {args.plot}",
            markup=False,
        )
    elif args.plot:
        points = loss_curve(events)
        plot_loss(points, args.plot, title=f"job {args.job_id}", x_label=unit)
        err.print(f"saved the loss curve ({len(points)} points) to {args.plot}", markup=False)
    if args.tensorboard:
        board = HistoryWriter(args.tensorboard)
        board.add_all(history)
        board.add_validations(validations)
        board.add_steps(steps)
        board.close()
        err.print(
            f"wrote {board.written} rows of figures to {args.tensorboard}",
            markup=False,
            soft_wrap=True,
        )
    if args.save:
        kept = history if args.checkpoint is None else []  # a checkpoint's: not the whole run's
        _save(states, args.save, err, kept)
    return EXIT_OK


def _save(states: dict[str, Any], path: str, err: Console, history: list[dict[str, Any]]) -> None:
    """Write a job's states where ``--save`` says (:mod:`somatize.saved`: no pickle), with its
    ``history``."""
    from somatize.saved import save

    save(path, states, list(states), [r["loss"] for r in history if "loss" in r], history)
    err.print(f"saved the states of {len(states)} nodes to {path}", markup=False, soft_wrap=True)


_COMMANDS = {
    "submit": _submit,
    "cancel": _cancel,
    "status": _status,
    "jobs": _jobs,
    "queue": _queue,
    "prune": _prune,
    "result": _result,
}


def run() -> NoReturn:
    """The ``somatize`` command: :func:`main`, then out at once — with what is written flushed,
    and without the interpreter's teardown of torch and the user's libraries (a second or more
    after a job with transformers loaded, spent after the job's end was said)."""
    try:
        code = main()
    except SystemExit as stop:  # (argparse's usage errors and --help)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
