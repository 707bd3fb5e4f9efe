"""Files one call left on its worker's disk (:meth:`StrategyContext.call_keeping
<coordinator.context.StrategyContext.call_keeping>`), as the coordinator reads them a piece at
a time (:class:`~coordinator.jobs.worker_files.WorkerFiles`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Self

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from protocol.errors import ErrorCode

__all__ = ["KeptOnWorker"]


@dataclass(frozen=True)
class KeptOnWorker:
    """The files worker ``worker`` (an index of ``ctx``) keeps under ``kept``, their sizes
    by name (``files``)."""

    ctx: StrategyContext
    worker: int
    kept: str
    files: dict[str, int]

    @classmethod
    def of(cls, ctx: StrategyContext, worker: int, said: Any, what: str) -> Self:
        """What worker ``worker`` said in place of the files it kept (``{"kept": id,
        "files": {name: size}}``), ``what`` they are (for the error).

        Raises:
            StrategyFailed: ``STATE_MISMATCH``: it did not say so.
        """
        said = said if isinstance(said, dict) else {}
        kept, files = said.get("kept"), said.get("files")
        if (
            not isinstance(kept, str)
            or not isinstance(files, dict)
            or not all(isinstance(n, str) and type(s) is int and s >= 0 for n, s in files.items())
        ):
            raise StrategyFailed(
                ErrorCode.STATE_MISMATCH, f"replica {worker}'s {what} were not kept on its worker"
            )
        return cls(ctx, worker, kept, dict(files))

    def sizes(self) -> dict[str, int]:
        return dict(self.files)

    async def read(self, name: str, offset: int, length: int) -> bytes:
        return await self.ctx.read_kept(self.worker, self.kept, name, offset, length)

    async def release(self) -> None:
        with contextlib.suppress(WorkerCallError):  # gone with its worker, or its job
            await self.ctx.drop_kept(self.worker, self.kept)
