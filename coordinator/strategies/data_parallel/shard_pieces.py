"""A sharded DataParallel run's model made whole from its replicas' pieces, for the job's result.

Each replica of a run sharded by FSDP2 holds, of every parameter, its rows of dim 0: replica
``r`` of ``N`` the ``r``-th of ``torch.chunk``'s ``N`` chunks (the last replicas' may be
empty). It answers ``dist_pieces`` with its states shaped as an unsharded replica's, each
sharded parameter replaced by its rows, and the key paths of those tensors (``split``); what
it holds whole (buffers) every replica holds alike. :func:`joined` puts the rows back
together, in rank order: the states an unsharded replica would have given, which the job
returns — while no replica ever held them whole. The optimizer state never travels for it
(checkpoints keep theirs as the replicas' own files: :mod:`.checkpoints`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["PiecesMismatch", "joined"]


class PiecesMismatch(ValueError):
    """The replicas' pieces are not of one model: their split paths or their shapes differ."""


def joined(pieces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole states by node from every replica's ``dist_pieces`` answer (``pieces[r]``:
    replica ``r``'s); what is not split is taken from replica 0.

    Raises:
        PiecesMismatch: the replicas name other split paths, or their rows cannot be stacked.
    """
    first = pieces[0]
    split = [list(path) for path in first["split"]]
    for r, piece in enumerate(pieces[1:], start=1):
        if [list(path) for path in piece["split"]] != split:
            raise PiecesMismatch(f"replica {r} split other tensors than replica 0")
    whole = {"states": _copied(first["states"])}
    for path in split:
        rows = [_at(piece, path) for piece in pieces]
        _put(whole, path, _stacked(rows, path))
    states: dict[str, Any] = whole["states"]
    return states


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


def _stacked(rows: Sequence[Any], path: Sequence[Any]) -> Any:
    """The replicas' ``rows`` of one tensor, in rank order, as the whole tensor. Rows that
    came as torch tensors (the codec imported torch to decode them: the coordinator does not
    import it for itself) are joined as tensors."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and all(isinstance(r, torch.Tensor) for r in rows):
            return torch.cat(list(rows), dim=0)
        return np.concatenate([np.asarray(r) for r in rows], axis=0)
    except (RuntimeError, ValueError) as exc:
        where = "/".join(str(k) for k in path)
        raise PiecesMismatch(f"the replicas' rows of {where} do not stack: {exc}") from exc
