"""Which ended jobs go: a coordinator's retention (``--retain-age``, ``--retain-jobs``,
``--retain-bytes``) and a client's ``somatize prune``.

An ended job holds its record and event log, its result and its checkpoints in the state
directory, which otherwise only grows. :func:`expired` says which ended jobs are past a
:class:`Retention`: older than its age, beyond its count (the newest kept), or — oldest first —
until the rest fit its bytes. No I/O: :class:`~coordinator.jobs.manager.JobManager` reads the
ended jobs and removes what this says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Ended", "Retention", "expired"]


@dataclass(frozen=True)
class Retention:
    """What of the ended jobs is kept: those that ended less than ``age`` seconds ago, the
    ``jobs`` newest, and what is left once the oldest went until the rest hold at most
    ``bytes`` (``None``: no limit)."""

    age: float | None = None
    jobs: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("age", "jobs", "bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"a retention's {name} must not be negative, not {value!r}")

    @property
    def limits(self) -> bool:
        """Whether it removes anything at all."""
        return any(v is not None for v in (self.age, self.jobs, self.bytes))

    def describe(self) -> str:
        """In words: ``older than 86400 s, beyond the 100 newest, beyond 10.0 GB``."""
        said = []
        if self.age is not None:
            said.append(f"older than {self.age:g} s")
        if self.jobs is not None:
            said.append(f"beyond the {self.jobs} newest")
        if self.bytes is not None:
            said.append(f"beyond {self.bytes / 1e9:.1f} GB")
        return ", ".join(said) or "none"


@dataclass(frozen=True)
class Ended:
    """An ended job: when it ended and the bytes it holds (result and checkpoints)."""

    job_id: str
    finished: float
    bytes: int


def expired(ended: Sequence[Ended], now: float, retention: Retention) -> list[str]:
    """The ids of the ``ended`` jobs past ``retention`` at ``now``, oldest first."""
    newest_first = sorted(ended, key=lambda e: e.finished, reverse=True)
    gone: set[str] = set()
    if retention.age is not None:
        gone |= {e.job_id for e in newest_first if now - e.finished > retention.age}
    if retention.jobs is not None:
        gone |= {e.job_id for e in newest_first[retention.jobs :]}
    if retention.bytes is not None:  # the oldest go until the rest fit
        held = sum(e.bytes for e in newest_first if e.job_id not in gone)
        for e in reversed(newest_first):
            if held <= retention.bytes:
                break
            if e.job_id not in gone:
                gone.add(e.job_id)
                held -= e.bytes
    return [e.job_id for e in reversed(newest_first) if e.job_id in gone]
