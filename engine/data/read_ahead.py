"""The rows of the next batch, read while the current one trains.

A training loop over rows read from disk (:class:`~engine.data.npy_rows.Rows`) would otherwise wait,
every step, for its batch's ``pread`` calls (or for a loader's items) between two steps.
:func:`read_ahead` reads batch ``k + 1`` (up to ``depth`` ahead) in one background thread while
the loop trains on batch ``k``: ``os.preadv`` and a loader's own I/O release the GIL, so the
read overlaps the step's compute and its all-reduce waits. Only one thread ever reads, in the
order of the keys, so a loader's dataset never sees two reads at once.

Memory: ``depth`` batches more than the loop holds anyway (one, by default).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["NextRead", "read_ahead"]

K = TypeVar("K")
T = TypeVar("T")


def read_ahead(read: Callable[[K], T], keys: Iterable[K], depth: int = 1) -> Iterator[T]:
    """``read(key)`` for each of ``keys``, in order, each read started while the reads before
    it are consumed (``depth`` of them ahead; ``0`` reads each when it is asked for, inline).

    An exception of ``read`` is raised where its result would have been yielded; a loop that
    stops early (``break``, an exception) waits for the read under way and drops the rest.
    """
    if depth <= 0:
        yield from (read(key) for key in keys)
        return
    pending: deque[Future[T]] = deque()
    upcoming = iter(keys)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
        try:
            for key in upcoming:
                pending.append(pool.submit(read, key))
                if len(pending) > depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class NextRead(Generic[K, T]):
    """One read started before the request that will want it: a data-parallel replica told the
    rows of its next step reads them while the coordinator averages this step's gradients.

    Never two reads at once: a request for other rows than those read ahead waits for that
    read to end (and drops it) before it reads its own.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[K, Future[T]] | None = None

    def start(self, key: K, read: Callable[[], T]) -> None:
        """Read ``read()`` in the background for the :meth:`take` of ``key`` (one at a time:
        a read started before is dropped)."""
        self.drop()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-next")
        self._pending = (key, self._pool.submit(read))

    def take(self, key: K) -> Future[T] | None:
        """The read started for ``key`` (its ``result()`` waits for it, and raises what the read
        raised), or ``None`` when none was: then no read is under way any more."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending[0] == key:
            return pending[1]
        _wait_out(pending[1])
        return None

    def drop(self) -> None:
        """Drop the read started, once it has stopped."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _wait_out(pending[1])


def _wait_out(future: Future[Any]) -> None:
    if not future.cancel():
        future.exception()  # waits; what it raised belongs to a read nobody wants
