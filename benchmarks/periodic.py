"""A sample taken every few milliseconds on a thread of its own, while a ``with`` block runs:
what a benchmark watches a process (its memory, its CPU time) with."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Periodic"]


class Periodic:
    """Call ``sample`` at once and then every ``every`` seconds on a thread named ``name``,
    from the ``with`` block's start to its end; a ``sample`` that returns ``False`` (what it
    watches is gone) stops it early."""

    def __init__(self, sample: Callable[[], bool | None], every: float, name: str) -> None:
        self._sample = sample
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Periodic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while self._sample() is not False and not self._stop.wait(self._every):
            pass
