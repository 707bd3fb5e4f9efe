"""What ``somatize submit`` does when it is stopped while it follows its job.

Ctrl-C stops the following, not the job: a job runs on the coordinator whether anyone watches
it or not. So ``somatize submit``, stopped, asks whether to cancel the job too when it has a
terminal to ask on (``Cancel job ID too? [y/N]``: anything but yes, a second Ctrl-C or the
end of input leaves it running). With ``--cancel-on-exit`` it cancels without asking, and on
SIGTERM and SIGHUP (a closed terminal) as well as on Ctrl-C. Whichever way, it says what
became of the job and how to reach it (``somatize cancel ID``, ``somatize result ID``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from somatize.remote.jobs import Job

__all__ = ["Stopped", "exit_signals", "wants_cancel", "when_stopped"]

EXIT_SIGNALS = ("SIGTERM", "SIGHUP")
"""Signals that, besides Ctrl-C, end a ``somatize submit --cancel-on-exit`` with its job."""


class Stopped(KeyboardInterrupt):
    """The command was told to stop by a signal other than Ctrl-C (its name in ``args[0]``)."""


@contextlib.contextmanager
def exit_signals(enabled: bool) -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`Stopped` (when ``enabled``), so that
    they end the command the way Ctrl-C does; the previous handlers come back after."""
    if not enabled:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    previous = {}
    for name in EXIT_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            previous[number] = signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def wants_cancel(answer: str | None) -> bool:
    """Whether an answer to ``Cancel job ID too? [y/N]`` says yes (``None``: no answer)."""
    return answer is not None and answer.strip().lower() in ("y", "yes")


def when_stopped(job: Job, stop: KeyboardInterrupt, cancel_on_exit: bool, err: Console) -> None:
    """Cancel ``job`` or leave it running, as :mod:`this module <somatize.cli.interrupt>` says,
    after ``stop`` interrupted the following; tells ``err`` which."""
    how = f"stopped by {stop.args[0]}" if isinstance(stop, Stopped) else "interrupted"
    if cancel_on_exit:
        cancel = True
    elif isinstance(stop, Stopped) or not sys.stdin.isatty():
        cancel = False
    else:
        cancel = wants_cancel(_ask(f"{how}: cancel job {job.id} too? [y/N] ", err))
    if cancel:
        job.cancel()
        _say(err, f"{how}: job {job.id} cancelled")
        return
    _say(
        err,
        f"{how}: job {job.id} goes on on the coordinator (somatize result {job.id} --wait "
        f"SECONDS for its result, somatize cancel {job.id} to stop it)",
    )


def _ask(question: str, err: Console) -> str | None:
    """The line typed in answer to ``question``; ``None`` on end of input or a second Ctrl-C."""
    err.print(question, end="", markup=False, soft_wrap=True)
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        err.print()
        return None
    return line if line else None


def _say(err: Console, text: str) -> None:
    err.print(text, markup=False, soft_wrap=True)
