"""Arrays and tensors in a frame: the dtypes that travel, and a buffer spec each way.

:mod:`protocol.codec` replaces every numpy array, numpy scalar and torch tensor by a spec
``{"$buf": i, "dtype": d, "shape": [..], "lib": l}`` whose buffer ``i`` holds the C-order,
little-endian elements (:func:`ndarray_spec`, :func:`tensor_spec`), and turns a spec back into a
view over the received frame (:func:`array_from`). dtype names are numpy's, plus ``bfloat16``
for torch; torch is imported only by a process that already holds a tensor or receives one.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from protocol.errors import Located

if TYPE_CHECKING:
    import torch

__all__ = [
    "ITEMSIZE",
    "LIBS",
    "NP_DTYPES",
    "TORCH_DTYPE_NAMES",
    "Outline",
    "RelayedTensor",
    "array_from",
    "data_nbytes",
    "holds_relayed",
    "loaded_torch",
    "materialize",
    "ndarray_spec",
    "preview",
    "tensor_spec",
    "torch_dtypes",
    "tree_map",
]

MAX_RANK: Final = 64
MAX_NBYTES: Final = 2**63 - 1

COMMON_DTYPES: Final = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
NP_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name).newbyteorder("<") for name in COMMON_DTYPES
}
"""Little-endian numpy dtypes by name."""
TORCH_DTYPE_NAMES: Final = frozenset((*COMMON_DTYPES, "bfloat16"))
ITEMSIZE: Final[dict[str, int]] = {name: dt.itemsize for name, dt in NP_DTYPES.items()} | {
    "bfloat16": 2
}
LIBS: Final = ("np", "np_scalar", "torch")

AddBuffer = Callable[[memoryview], int]
"""Appends a raw buffer to the frame being encoded; returns its index."""


def preview(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (it goes into an error message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def data_nbytes(value: Any) -> int:
    """Bytes of a numpy array or torch tensor (0 for anything else: it is small)."""
    torch_ = loaded_torch()
    if torch_ is not None and isinstance(value, torch_.Tensor):
        return int(value.element_size() * value.nelement())
    nbytes = getattr(value, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) else 0


def loaded_torch() -> ModuleType | None:
    """torch if this process imported it (no value can hold a tensor otherwise), else ``None``.

    A torch still being imported (by another thread: the coordinator imports it off its event
    loop when a job starts) is in ``sys.modules`` before it has ``Tensor``; no value can hold
    a tensor yet then either, so it counts as not imported.
    """
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "Tensor") else None


@functools.cache
def torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """torch's dtypes by name, both ways (importing torch now if need be)."""
    import torch

    by_name = {name: getattr(torch, name) for name in TORCH_DTYPE_NAMES}
    return by_name, {dtype: name for name, dtype in by_name.items()}


def ndarray_spec(array: np.ndarray[Any, Any], add: AddBuffer) -> dict[str, Any]:
    """The spec of a numpy array, its bytes added as a buffer (little-endian, C order).

    Raises:
        Located: a dtype that does not travel.
    """
    name = array.dtype.name
    target = NP_DTYPES.get(name)
    if target is None:
        raise Located(f"unsupported numpy dtype {array.dtype.str!r} ({name})")
    shape = list(array.shape)
    if array.dtype != target:  # big-endian: swap into a little-endian copy
        array = array.astype(target)
    # reshape(-1) of a C-contiguous array is a view; ascontiguousarray copies only if needed.
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return {"$buf": add(raw.data), "dtype": name, "shape": shape, "lib": "np"}


def tensor_spec(tensor: torch.Tensor, add: AddBuffer) -> dict[str, Any]:
    """The spec of a dense torch tensor, its bytes (on the CPU, detached) added as a buffer.

    Raises:
        Located: a layout, kind or dtype that does not travel.
    """
    import torch  # loaded already: the value holds a tensor

    _, names = torch_dtypes()
    if tensor.layout != torch.strided:
        raise Located(f"unsupported tensor layout {tensor.layout} (only dense tensors)")
    if tensor.is_quantized or tensor.is_nested or tensor.is_meta:
        kind = "quantized" if tensor.is_quantized else "nested" if tensor.is_nested else "meta"
        raise Located(f"unsupported {kind} tensor")
    name = names.get(tensor.dtype)
    if name is None:
        raise Located(f"unsupported tensor dtype {tensor.dtype}")
    shape = list(tensor.shape)
    try:
        flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        if flat.numel() <= 1:
            # torch calls a tensor of 0 or 1 elements contiguous whatever its stride
            # (t[::5][:1]), and .view() to another element size needs stride 1.
            flat = flat.as_strided(flat.shape, (1,))
        # Viewing as bytes works for every dtype, bfloat16 included (.numpy() refuses it).
        raw = flat.view(torch.uint8).numpy()
    except RuntimeError as e:  # exotic tensors (functorch wrappers, subclasses) refuse
        raise Located(f"cannot read the bytes of a {tensor.dtype} tensor: {e}") from None
    return {"$buf": add(raw.data), "dtype": name, "shape": shape, "lib": "torch"}


@dataclass(frozen=True)
class Outline:
    """A buffer of a frame as :func:`~protocol.codec.decode` outlines it (``outline=True``):
    what it holds, not read — ``lib`` ``"np"``, ``"np_scalar"`` or ``"torch"`` for an array
    (``dtype`` its name, ``shape``), ``"bytes"`` for bytes (``uint8``, ``(length,)``)."""

    lib: str
    dtype: str
    shape: tuple[int, ...]


class RelayedTensor:
    """A torch tensor of a frame that this process only passes on (``decode(..., relay=True)``):
    its dtype's name, its shape and its bytes, a view over the frame, encoded again as the same
    tensor. A worker agent relays every tensor between the coordinator and its daemons and
    computes on none: so it never imports torch (220 MiB) for them. (Not a dataclass: pydantic
    would dump one into a dict on the way out, as it leaves a tensor as it is.)"""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: memoryview) -> None:
        self.dtype = dtype
        self.shape = shape
        self.data = data

    def __repr__(self) -> str:
        return f"RelayedTensor({self.dtype}, {list(self.shape)})"

    @property
    def nbytes(self) -> int:
        """Its bytes (as :func:`data_nbytes` counts an array's)."""
        return self.data.nbytes

    def __getitem__(self, rows: slice | np.ndarray[Any, Any] | list[int]) -> RelayedTensor:
        """Rows ``rows`` (a slice, or an index array or list) of its first dimension, as a
        tensor's ``t[rows]`` gives them, relayed too: a coordinator cuts a client's data into
        each worker's rows (:func:`protocol.rules.rows.take_rows`) without torch. A slice of
        step 1 is a view, any other slice or an index array a copy.

        Raises:
            TypeError: anything else (an integer, a tuple of indices): only rows are cut here.
        """
        if not self.shape:
            raise TypeError("a 0-d relayed tensor has no rows")
        if not isinstance(rows, slice | np.ndarray | list):
            raise TypeError(f"a relayed tensor's rows are a slice or an index array, not {rows!r}")
        row_bytes = math.prod(self.shape[1:]) * ITEMSIZE[self.dtype]
        table = np.frombuffer(self.data, dtype=np.uint8).reshape(self.shape[0], row_bytes)
        taken = np.ascontiguousarray(table[rows])
        return RelayedTensor(self.dtype, (taken.shape[0], *self.shape[1:]), taken.reshape(-1).data)


def holds_relayed(tree: Any) -> bool:
    """Whether ``tree`` (dicts, lists and tuples of leaves) holds a :class:`RelayedTensor`."""
    if isinstance(tree, RelayedTensor):
        return True
    if isinstance(tree, dict):
        return any(holds_relayed(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return any(holds_relayed(value) for value in tree)
    return False


def materialize(tree: Any) -> Any:
    """``tree`` with each :class:`RelayedTensor` made the torch tensor it stands for (over its
    bytes, as :func:`~protocol.codec.decode` would have made it): for a process that computes on
    what it was relayed. Imports torch where the tree holds one: a second or more, so call it
    off an event loop."""
    return tree_map(_materialized, tree)


def _materialized(leaf: Any) -> Any:
    if not isinstance(leaf, RelayedTensor):
        return leaf
    count = math.prod(leaf.shape)
    return _tensor_from(leaf.data, leaf.dtype, list(leaf.shape), count, 0, leaf.data.nbytes)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples of leaves, as a message decodes) with ``fn`` applied to
    every leaf; mappings become dicts, lists and tuples stay."""
    if isinstance(tree, Mapping):
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, value) for value in tree)
    if isinstance(tree, list):
        return [tree_map(fn, value) for value in tree]
    return fn(tree)


def array_from(
    frame: memoryview,
    index: int,
    spec: dict[str, Any],
    offset: int,
    length: int,
    *,
    outline: bool = False,
    relay: bool = False,
) -> Any:
    """The array, numpy scalar or tensor ``spec`` describes, over buffer ``index`` of ``frame``
    (``length`` bytes at ``offset``); with ``outline``, its :class:`Outline` (checked all the
    same, its bytes not read); with ``relay``, a tensor as its :class:`RelayedTensor`.

    Raises:
        Located: a spec that is malformed or does not match its buffer.
    """
    lib, name, shape = spec["lib"], spec["dtype"], spec["shape"]
    if lib not in LIBS:
        raise Located(f"buffer {index}: unknown lib {preview(lib)}")
    known = TORCH_DTYPE_NAMES if lib == "torch" else NP_DTYPES
    if type(name) is not str or name not in known:
        raise Located(f"buffer {index}: unsupported {lib} dtype {preview(name)}")
    if (
        type(shape) is not list
        or len(shape) > MAX_RANK
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise Located(f"buffer {index}: malformed shape {preview(shape)}")
    if lib == "np_scalar" and shape:
        raise Located(f"buffer {index}: a numpy scalar has shape [], not {shape}")
    itemsize = ITEMSIZE[name]
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_NBYTES:
        raise Located(f"buffer {index}: shape {shape} is too large")
    count = math.prod(shape)
    if count * itemsize != length:
        raise Located(
            f"buffer {index}: dtype {name!r} shape {shape} needs {count * itemsize} bytes, "
            f"buffer has {length}"
        )
    if outline:
        return Outline(lib, name, tuple(shape))
    if lib == "torch" and relay:
        return RelayedTensor(name, tuple(shape), frame[offset : offset + length])
    if lib == "torch":
        return _tensor_from(frame, name, shape, count, offset, length)
    array = np.frombuffer(frame, dtype=NP_DTYPES[name], count=count, offset=offset)
    array = array.reshape(shape)
    return array[()] if lib == "np_scalar" else array


def _tensor_from(
    frame: memoryview, name: str, shape: list[int], count: int, offset: int, length: int
) -> torch.Tensor:
    import torch  # the first torch buffer of this process imports it

    dtype = torch_dtypes()[0][name]
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    if frame.readonly:
        # torch tensors are always writable: never alias an immutable buffer (and
        # torch.frombuffer warns on one). Copy this tensor's bytes instead.
        source: bytearray | memoryview = bytearray(frame[offset : offset + length])
        offset = 0
    else:
        source = frame
    return torch.frombuffer(source, dtype=dtype, count=count, offset=offset).reshape(shape)
