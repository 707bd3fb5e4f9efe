"""A tree of gradients (or pseudo-gradients, or updates) as it travels compressed through the
coordinator, and the int8 quantisation that the torch collective's hook uses too.

On the coordinator path a replica's gradients go up to the coordinator and their mean comes back
down; with ``compression`` both legs carry fewer bytes. A tree (node id → parameter name →
tensor) travels as one message dict, its tensors laid end to end in one flat vector::

    {"$compressed": "fp16" | "bf16" | "int8",
     "layout": [[node, name, shape], ...],     # in the tree's order
     "values": <flat tensor>,                  # float16 / bfloat16, or int8 codes
     "scales": <float32 tensor>}               # int8 only: one per INT8_CHUNK values

* ``"fp16"`` / ``"bf16"``: each value cast to half precision (relative error ≤ 2⁻¹¹ for fp16
  within its range, 2⁻⁸ for bf16); half the bytes.
* ``"int8"``: symmetric 8-bit codes in chunks of :data:`INT8_CHUNK` values, each chunk with
  its scale max|chunk| / 127, so every value is within max|chunk| / 254 of what was sent; a
  quarter of the bytes, plus 4 a chunk. A :class:`TreeCompressor` keeps what quantisation left
  out of one message and adds it to the next (*error feedback*: Seide et al. 2014, Karimireddy
  et al. 2019), so nothing is lost, only delayed; on both legs of the star that is DoubleSqueeze
  (Tang et al. 2019): each replica compensates its own error and the coordinator its mean's.

:func:`decode` checks what it is given: a hostile or broken peer's message is a
:class:`~protocol.errors.BadCompressedTree` saying what is wrong, never a tensor of the wrong
size. torch is imported only when a tree is encoded or decoded: whoever does either holds
tensors already.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from protocol.errors import BadCompressedTree
from protocol.options.compression import TREE_KINDS, Compression

if TYPE_CHECKING:
    import torch

__all__ = [
    "INT8_CHUNK",
    "MARKER",
    "TreeCompressor",
    "decode",
    "dequantize_int8",
    "is_compressed",
    "quantize_int8",
]

INT8_CHUNK = 4096
"""Values that share one scale when int8 compresses them."""

MARKER = "$compressed"
"""The key that makes a message dict a compressed tree (node ids never start with ``$``)."""

Tree = dict[str, dict[str, Any]]
"""Node id → parameter name → tensor."""


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (flat) as int8 codes, one a value, in chunks of :data:`INT8_CHUNK` that each
    share the scale max|chunk| / 127: ``(codes, scales)``."""
    import torch
    import torch.nn.functional as F

    padded = F.pad(values, (0, -values.numel() % INT8_CHUNK)).view(-1, INT8_CHUNK)
    scales = padded.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[: values.numel()], scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values that ``codes`` and ``scales`` (:func:`quantize_int8`) stand for."""
    import torch.nn.functional as F

    n = codes.numel()
    padded = F.pad(codes, (0, -n % INT8_CHUNK)).view(-1, INT8_CHUNK)
    return (padded.to(scales.dtype) * scales[:, None]).view(-1)[:n]


def is_compressed(message: object) -> bool:
    """Whether ``message`` is a compressed tree (module docstring), not a plain one."""
    return isinstance(message, Mapping) and MARKER in message


class TreeCompressor:
    """Encodes trees as ``compression`` has them travel, keeping the int8 residual from one
    tree to the next (module docstring). One per sender and stream of like trees: a replica's
    gradients, the coordinator's means.

    Raises:
        ValueError: a compression no tree travels as (PowerSGD).
    """

    def __init__(self, compression: Compression) -> None:
        self.compression = compression.as_tree()
        self.residual: torch.Tensor | None = None

    def encode(self, tree: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """``tree`` as it travels; with int8, what the last tree's quantisation left out is
        added first, and what this one's leaves out is kept."""
        import torch

        layout: list[list[Any]] = []
        flats: list[torch.Tensor] = []
        for node, leaves in tree.items():
            for name, leaf in leaves.items():
                tensor = torch.as_tensor(leaf).detach()
                if not tensor.is_floating_point():
                    raise ValueError(
                        f"{node!r}/{name!r} is {tensor.dtype}: only floats are compressed"
                    )
                layout.append([node, name, list(tensor.shape)])
                flats.append(tensor.reshape(-1).to("cpu", torch.float32))
        flat = torch.cat(flats) if flats else torch.zeros(0)
        kind = self.compression.kind
        wire: dict[str, Any] = {MARKER: kind, "layout": layout}
        if kind == "fp16":
            return wire | {"values": flat.to(torch.float16)}
        if kind == "bf16":
            return wire | {"values": flat.to(torch.bfloat16)}
        if self.residual is not None and self.residual.shape == flat.shape:
            flat = flat + self.residual
        codes, scales = quantize_int8(flat)
        self.residual = flat - dequantize_int8(codes, scales)
        return wire | {"values": codes, "scales": scales}


def decode(message: object, model: Mapping[str, Sequence[Sequence[int]]] | None = None) -> Tree:
    """The tree (float32 tensors) a compressed ``message`` stands for.

    Args:
        message: the tree as it travelled.
        model: the trainable parameters' shapes of each node it may hold (the model's, as its
            client declared them): its layout is checked against them before anything is
            decoded, so a tree decodes to at most the model's size whatever it claims.
            ``None``: any layout.

    Raises:
        BadCompressedTree: an unknown compression, a layout that is not a list of
            ``[node, name, shape]`` or holds what is not a parameter of ``model``, or values
            (or scales) that do not match it.
    """
    import torch

    if not isinstance(message, Mapping):
        raise BadCompressedTree(f"a compressed tree is a dict, not {type(message).__name__}")
    kind = message.get(MARKER)
    if kind not in TREE_KINDS:
        raise BadCompressedTree(f"unknown compression {kind!r}")
    layout, values = message.get("layout"), message.get("values")
    shapes = _layout(layout)
    if model is not None:
        _of_model(shapes, model)
    n = sum(math.prod(shape) for _, _, shape in shapes)
    if not isinstance(values, torch.Tensor) or values.dim() != 1:
        raise BadCompressedTree("'values' must be a flat tensor")
    if kind == "int8":
        scales, chunks = message.get("scales"), -(-n // INT8_CHUNK)
        if values.dtype != torch.int8 or values.numel() != n:
            raise BadCompressedTree(
                f"'values' must be {n} int8 codes, not {values.numel()} of {values.dtype}"
            )
        if (
            not isinstance(scales, torch.Tensor)
            or scales.dtype != torch.float32
            or tuple(scales.shape) != (chunks,)
        ):
            raise BadCompressedTree(f"'scales' must be {chunks} float32 values")
        flat = dequantize_int8(values, scales)
    else:
        expected = torch.float16 if kind == "fp16" else torch.bfloat16
        if values.dtype != expected or values.numel() != n:
            raise BadCompressedTree(
                f"'values' must be {n} values of {expected}, not {values.numel()} of {values.dtype}"
            )
        flat = values.to(torch.float32)
    tree: Tree = {}
    offset = 0
    for node, name, shape in shapes:
        size = math.prod(shape)
        tree.setdefault(node, {})[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return tree


def _of_model(
    shapes: list[tuple[str, str, list[int]]], model: Mapping[str, Sequence[Sequence[int]]]
) -> None:
    """Refuse a layout with an entry that is not a parameter of ``model``: a node it does not
    train, or a shape none of that node's parameters left has (each parameter once)."""
    left = {node: Counter(tuple(shape) for shape in of_node) for node, of_node in model.items()}
    for node, name, shape in shapes:
        if node not in left:
            raise BadCompressedTree(f"{node!r}/{name!r}: the model trains no node {node!r}")
        if left[node][tuple(shape)] <= 0:
            raise BadCompressedTree(
                f"{node!r}/{name!r} of shape {shape} is not a parameter of the model's node "
                f"{node!r} (each of its trainable parameters counted once)"
            )
        left[node][tuple(shape)] -= 1


def _layout(layout: object) -> list[tuple[str, str, list[int]]]:
    """``layout`` checked: ``[node, name, shape]`` entries, names strings, shapes of
    non-negative ints, no parameter twice."""
    if not isinstance(layout, list):
        raise BadCompressedTree("'layout' must be a list of [node, name, shape]")
    out: list[tuple[str, str, list[int]]] = []
    seen: set[tuple[str, str]] = set()
    for entry in layout:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], str)
            or not isinstance(entry[2], list | tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])
        ):
            raise BadCompressedTree(f"a layout entry must be [node, name, shape], not {entry!r}")
        if (entry[0], entry[1]) in seen:
            raise BadCompressedTree(f"{entry[0]!r}/{entry[1]!r} is in the layout twice")
        seen.add((entry[0], entry[1]))
        out.append((entry[0], entry[1], list(entry[2])))
    return out
