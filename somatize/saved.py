"""A fitted graph's states on disk, without pickle: :func:`save` and :func:`read`, behind
:meth:`FittedGraph.save <somatize.graph.FittedGraph.save>` and :func:`somatize.graph.load`.

A file is what ``torch.save`` writes of plain containers and tensors, so
``torch.load(path, weights_only=True)`` reads it: torch's restricted unpickler, which builds
tensors, dicts, lists, tuples, numbers and strings and nothing else, so opening someone else's
file runs no code of theirs. Its layout::

    {"format": "somatize.fitted", "version": 1,
     "node_ids": ["standardize", "hidden", "head"],      # graph order
     "states": {node_id: state},   # a TorchFilter's state_dict; a plain filter's own state,
                                   # its numpy arrays stored as tensors
     "numpy": [[kind, path], ...], # which leaves were numpy: "array" or "scalar", at the path
                                   # of keys and indices from "states"
     "epoch_losses": [...],        # the training's mean loss per epoch, when it trained one
     "history": [{...}, ...]}      # its rows per epoch (round): loss, lr, val_loss, metrics

:func:`read` gives the states back as they were (numpy leaves as numpy again);
:func:`somatize.graph.load` makes, with the graph that made them, the
:class:`~somatize.graph.FittedGraph` itself. The graph is code, so it
is not in the file: build it again as you built it to train, then ``sz.load(path, graph)``.

A state may hold tensors, numpy arrays and scalars (of a dtype torch has), numbers, strings,
booleans, ``None``, and lists, tuples and dicts (keys strings or integers) of them; anything
else is refused by :func:`save`, naming the node and key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from somatize.errors import GraphError

__all__ = ["FORMAT", "VERSION", "Saved", "read", "save"]

FORMAT = "somatize.fitted"
VERSION = 1

Path = list[str | int]
"""Where a leaf is in the states: the keys and indices that lead to it."""

_PLAIN = (str, int, float, bool, type(None))


def save(
    path: str | os.PathLike[str],
    states: Mapping[str, Any],
    node_ids: Sequence[str],
    epoch_losses: Sequence[float] = (),
    history: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Write ``states`` (by node id, for the nodes ``node_ids`` in graph order) to ``path``,
    with the training's ``epoch_losses`` and ``history`` rows (numbers and strings only).

    Raises:
        GraphError: a node has no state, or a state holds something that cannot be saved
            without pickle (the node and key named).
    """
    missing = [n for n in node_ids if n not in states]
    if missing:
        raise GraphError(f"cannot save: no state for the nodes {missing}")
    numpy: list[list[Any]] = []
    stored = {n: _to_torch(states[n], [n], numpy) for n in node_ids}
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "node_ids": list(node_ids),
            "states": stored,
            "numpy": numpy,
            "epoch_losses": [float(v) for v in epoch_losses],
            "history": [{str(k): _plain_figure(v) for k, v in row.items()} for row in history],
        },
        os.fspath(path),
    )


@dataclass(frozen=True)
class Saved:
    """What a file :func:`save` wrote holds."""

    states: dict[str, Any]
    """The states by node id, numpy leaves numpy again."""
    node_ids: list[str]
    """The nodes they are for, in graph order."""
    history: list[dict[str, Any]]
    """The training's rows per epoch (round)."""


def read(path: str | os.PathLike[str]) -> Saved:
    """Read a file :meth:`FittedGraph.save` (or ``somatize result --save``) wrote.

    Raises:
        GraphError: the file is not one of these.
    """
    try:
        saved = torch.load(os.fspath(path), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises what its unpickler met: say what the file is not
        raise GraphError(f"{os.fspath(path)} is not a saved fitted graph: {exc}") from exc
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise GraphError(
            f"{os.fspath(path)} is not a saved fitted graph (FittedGraph.save writes one)"
        )
    if saved.get("version") != VERSION:
        raise GraphError(
            f"{os.fspath(path)} is a saved fitted graph of version {saved.get('version')!r}; "
            f"this somatize reads version {VERSION}"
        )
    states = saved["states"]
    for kind, where in saved["numpy"]:
        _put(states, where, _to_numpy(_get(states, where), kind))
    history = saved.get("history")
    if history is None:  # written before histories: its losses are all there is
        history = [{"epoch": e, "loss": v} for e, v in enumerate(saved["epoch_losses"], 1)]
    return Saved(states, list(saved["node_ids"]), history)


def _plain_figure(value: Any) -> Any:
    """A history row's value as the restricted unpickler reads it: a number or a string."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return float(value)


def _to_torch(value: Any, where: Path, numpy: list[list[Any]]) -> Any:
    """``value`` with its numpy leaves as tensors (their paths noted in ``numpy``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray | np.generic):
        kind = "array" if isinstance(value, np.ndarray) else "scalar"
        try:
            tensor = torch.from_numpy(np.array(value, copy=True))
        except TypeError as exc:
            raise GraphError(
                f"cannot save node {where[0]!r}, key {_key(where)}: a numpy {kind} of dtype "
                f"{value.dtype} has no torch dtype, and it is not saved with pickle"
            ) from exc
        numpy.append([kind, list(where)])
        return tensor
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str | int) or isinstance(k, bool)]
        if bad:
            raise GraphError(
                f"cannot save node {where[0]!r}, key {_key(where)}: dict keys must be strings "
                f"or integers, not {bad[0]!r}"
            )
        return {k: _to_torch(v, [*where, k], numpy) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_to_torch(v, [*where, i], numpy) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise GraphError(
        f"cannot save node {where[0]!r}, key {_key(where)}: a {type(value).__name__} is not "
        "saved without pickle (a state holds tensors, numpy arrays, numbers, strings, and "
        "lists, tuples and dicts of them)"
    )


def _to_numpy(tensor: torch.Tensor, kind: str) -> Any:
    array = tensor.numpy()
    return array if kind == "array" else array[()]


def _get(states: Any, where: Sequence[str | int]) -> Any:
    for key in where:
        states = states[key]
    return states


def _put(states: Any, where: Sequence[str | int], value: Any) -> None:
    """Set the leaf at ``where``; a tuple on the way is rebuilt around it."""
    *parents, last = where
    holder = _get(states, parents)
    if isinstance(holder, tuple):
        rebuilt = list(holder)
        rebuilt[int(last)] = value
        _put(states, parents, tuple(rebuilt))
    else:
        holder[last] = value


def _key(where: Path) -> str:
    """The path below the node, as a reader finds it: ``'mean'``, ``'layers'[0]``."""
    parts = [repr(k) if isinstance(k, str) else f"[{k}]" for k in where[1:]]
    return "".join(parts) or "(the state itself)"
