"""Files one call left on its worker's disk (:meth:`StrategyContext.call_keeping
<coordinator.context.StrategyContext.call_keeping>`), as the coordinator reads them a piece at
a time (:class:`~coordinator.storage.kept_files.KeptFileSource`), and how many and how large they
may be (:class:`KeptLimit`).

What a replica keeps is what its daemon — the job's code — wrote: a hostile one once kept
20,000 files and 860 MB for a checkpoint of a 2.5 KB model, all read into the store. So every
replica's kept files are held, before one byte is read, to what a checkpoint of the model can
be: torch.distributed.checkpoint writes one file of a replica's shards (a few with more writer
threads) and replica 0 the ``.metadata``; what it writes of a tensor is its values, in at most
8 bytes each, for the parameter and each of an optimizer's moments, with a header of each."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.storage.kept_files import fetch
from protocol.errors import ErrorCode

__all__ = ["KeptLimit", "KeptOnWorker"]

FILES_PER_REPLICA = 4
"""Files one replica's checkpoint may hold (DCP's writer threads', and replica 0's
``.metadata``)."""
COPIES = 4
"""Copies of each parameter's values a checkpoint may hold: itself and an optimizer's moments
(Adam: two), with room to spare."""
HEADER_BYTES = 64 << 10
"""Bytes a checkpoint's file may spend on each tensor beside its values (torch.save's record of
it; ~1.6 KB measured), and on each file."""
VALUE_BYTES = 8
"""The most bytes a value takes (float64)."""


@dataclass(frozen=True)
class KeptLimit:
    """The most files and bytes a run's replicas may keep for one checkpoint, together (module
    docstring): what the model's size allows."""

    files: int
    nbytes: int

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[Sequence[int]]] | None, replicas: int) -> Self:
        """The limit for a model of trainable parameters of ``shapes`` (by node, as its client
        declared them; ``None``: none declared, only the files' count and headers are held)
        sharded over ``replicas``."""
        tensors = sum(len(of_node) for of_node in (shapes or {}).values())
        values = sum(math.prod(s) for of_node in (shapes or {}).values() for s in of_node)
        files = FILES_PER_REPLICA * replicas + 1
        headers = HEADER_BYTES * (COPIES * tensors + files)
        return cls(files, COPIES * VALUE_BYTES * values + headers)

    def check(self, kept: Sequence[KeptOnWorker], what: str) -> None:
        """Refuse ``kept`` when there are more files or bytes than the limit.

        Raises:
            StrategyFailed: ``RESOURCE_LIMIT`` naming the replica that kept the most.
        """
        files = sum(len(k.files) for k in kept)
        nbytes = sum(sum(k.files.values()) for k in kept)
        if files <= self.files and nbytes <= self.nbytes:
            return
        most = max(kept, key=lambda k: sum(k.files.values()) + len(k.files))
        raise StrategyFailed(
            ErrorCode.RESOURCE_LIMIT,
            f"the replicas kept {files} files of {nbytes} bytes for {what} (replica "
            f"{most.worker}: {len(most.files)} of {sum(most.files.values())}), where a checkpoint "
            f"of the model holds at most {self.files} files of {self.nbytes} bytes: none of it "
            "was read",
            files=files,
            nbytes=nbytes,
            limit_files=self.files,
            limit_bytes=self.nbytes,
        )


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

    async def whole(self, name: str, piece_bytes: int) -> bytearray:
        """File ``name`` read whole, in pieces of at most ``piece_bytes``.

        Raises:
            OSError: it ended short of its size.
            WorkerCallError: a piece could not be read.
        """
        data = bytearray()
        await fetch(self, name, data.extend, piece_bytes)
        return data

    async def release(self) -> None:
        with contextlib.suppress(WorkerCallError):  # gone with its worker, or its job
            await self.ctx.drop_kept(self.worker, self.kept)
