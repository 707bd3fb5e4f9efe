"""A sharded run's model made whole from its replicas' pieces, on the client.

Each replica of a run sharded by FSDP2 holds, of every parameter, its rows of dim 0: replica
``r`` of ``N`` the ``r``-th of ``torch.chunk``'s ``N`` chunks (the last replicas' may be
empty). At the run's end it answers ``dist_pieces`` with its states shaped as an unsharded
replica's, each sharded parameter replaced by its rows, and the key paths of those tensors
(``split``); what it holds whole (buffers) every replica holds alike. They travel as one codec
frame, a file (:data:`PIECES_FILE`) its worker keeps and the coordinator reads a piece at a
time into a file of its own, a replica's each, checked to stack onto replica 0's
(:class:`Layout`; :func:`check` for all at once); the client that asks for the result reads
them a piece at a time too and puts the rows back together, in rank order (:func:`joined`):
the states an unsharded replica would have given — while no replica, and not the coordinator,
ever held them whole. The optimizer state never travels for it (checkpoints keep theirs as the
replicas' own files).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.errors import PiecesMismatch

__all__ = ["KEPT_AT", "PIECES_FILE", "Layout", "PiecesMismatch", "check", "joined"]

PIECES_FILE = "pieces"
"""The name of the file a replica's ``dist_pieces`` answer holds its pieces in (one frame)."""
KEPT_AT = ("files",)
"""Where that file lies in the answer (:attr:`protocol.messages.Call.keep`)."""


@dataclass(frozen=True)
class Layout:
    """What must agree between the replicas' pieces of one model, read from one replica's:
    the paths of the split tensors (``split``), and of each its rows' shape past dim 0 and
    their dtype (``rows``; ``None`` for a value that is not rows of a tensor)."""

    split: list[list[Any]]
    rows: list[tuple[tuple[int, ...], str] | None]

    @classmethod
    def of(cls, piece: Mapping[str, Any]) -> Layout:
        split = [list(path) for path in piece["split"]]
        return cls(split, [_rows_kind(_at(piece, path)) for path in split])

    def fits(self, other: Layout, replica: int) -> None:
        """That replica ``replica``'s pieces, laid out as ``other``, stack onto this one's
        (replica 0's).

        Raises:
            PiecesMismatch: which replica or tensor does not fit.
        """
        if other.split != self.split:
            raise PiecesMismatch(f"replica {replica} split other tensors than replica 0")
        for path, mine, theirs in zip(self.split, self.rows, other.rows, strict=True):
            if mine is None or theirs is None or mine != theirs:
                raise PiecesMismatch(
                    f"the replicas' rows of {_where(path)} do not stack: replica 0's are "
                    f"{mine}, replica {replica}'s {theirs} (shape past dim 0, dtype)"
                )


def check(pieces: Sequence[Mapping[str, Any]]) -> None:
    """That every replica's ``dist_pieces`` answer (``pieces[r]``: replica ``r``'s) is of one
    model, without joining them (:class:`Layout`): the same split paths, and rows of one
    dtype whose shapes differ in dim 0 alone.

    Raises:
        PiecesMismatch: which replica or tensor does not fit.
    """
    first = Layout.of(pieces[0])
    for replica, piece in enumerate(pieces):
        first.fits(Layout.of(piece), replica)


def joined(pieces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole states by node from every replica's ``dist_pieces`` answer (``pieces[r]``:
    replica ``r``'s); what is not split is taken from replica 0.

    Raises:
        PiecesMismatch: the replicas name other split paths, or their rows cannot be stacked.
    """
    check(pieces)
    whole = {"states": _copied(pieces[0]["states"])}
    for path in Layout.of(pieces[0]).split:
        rows = [_at(piece, path) for piece in pieces]
        _put(whole, path, _stacked(rows))
    states: dict[str, Any] = whole["states"]
    return states


def _rows_kind(value: Any) -> tuple[tuple[int, ...], str] | None:
    """Rows' shape past dim 0 and dtype (an array's or a tensor's); ``None`` for a value that
    is not rows."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return tuple(int(d) for d in shape[1:]), str(value.dtype)


def _where(path: Sequence[Any]) -> str:
    return "/".join(str(k) for k in path)


def _copied(value: Any) -> Any:
    """``value``'s mappings and lists copied (its leaves shared): a frame to put rows in."""
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _at(tree: Mapping[str, Any], path: Sequence[Any]) -> Any:
    value: Any = tree
    for key in path:
        value = value[key]
    return value


def _put(tree: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    _at(tree, path[:-1])[path[-1]] = value


def _stacked(rows: Sequence[Any]) -> Any:
    """The replicas' ``rows`` of one tensor (checked to stack: :class:`Layout`), in rank order,
    as the whole tensor; rows that came as torch tensors are joined as tensors."""
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(r, torch.Tensor) for r in rows):
        return torch.cat(list(rows), dim=0)
    return np.concatenate([np.asarray(r) for r in rows], axis=0)
