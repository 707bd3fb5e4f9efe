"""Weighted means of states and gradients: the shared maths of DataParallel and FedAvg.

Both strategies reduce several contributions of the same tree to one, weighted by how many
examples stood behind each:

* FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", Algorithm 1): "w_{t+1} ← Σ_{k=1}^{K} (n_k / n) w^k_{t+1}", each client's
  model weighted by its example count n_k.
* DataParallel: with a mean-reduced loss, the gradient of a global batch of n rows split into
  slices of n_k rows is Σ_k (n_k / n) g_k, the slice gradients weighted by slice size.

A *tree* is a state or a gradient set: dicts (node id → param name → ...; keys of any hashable
type), lists and tuples, down to leaves. A leaf is one of:

* a float or complex leaf (numpy array or scalar, torch tensor, Python ``float``): averaged as
  Σ wᵢ xᵢ / Σ wᵢ, accumulated in float64 (complex128 for complex) and cast back to the first
  contributor's type, dtype, shape and device;
* an integer or bool leaf (numpy, torch, Python ``int``/``bool`` — e.g. BatchNorm's
  ``num_batches_tracked``, a filter's row count): never averaged into a float. It is taken as it
  is when every contributor has the same value, and refused otherwise;
* anything else (``str``, ``None``, ``bytes``, ...): has no mean, so it too must be equal
  everywhere.

Aggregation refuses instead of guessing: zero contributors, a weight that is not positive and
finite, a key missing from or added by one contributor, a shape that disagrees, a leaf of
another kind (an integer where the first contributor has a float, a dict where it has an array)
and disagreeing integer or non-numeric leaves each raise :class:`AggregationError` naming the
key path, the contributors and the values. Averaging over whoever has a key would quietly
weight the others. One contributor gives an exact copy of its tree, not a float64 round trip.

:class:`Accumulator` folds contributions in as they arrive, so a strategy can average while it
is still receiving; :func:`weighted_mean` is an accumulator fed a list. Folding is in place into
one preallocated float64 buffer per leaf, through a small scratch buffer that stays in cache,
so a large state averages at memory speed.
"""

from __future__ import annotations

import cmath
import copy
import math
import reprlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeGuard

import numpy as np

if TYPE_CHECKING:  # imported only where a tensor is at hand: see _is_tensor
    import torch

from coordinator.errors import CoordinatorError

Tree: TypeAlias = Any
"""A state or gradient tree: dicts, lists and tuples of leaves (see the module docstring)."""

Path: TypeAlias = tuple[Hashable, ...]
"""Where a leaf sits: the keys (and list positions) from the root, node id first."""

LeafKind: TypeAlias = Literal["float", "complex", "integer", "bool"]

_CHUNK = 1 << 15
"""Elements folded per step of a large leaf: the float64 scratch (256 KiB) stays in cache."""

_NUMPY_OF_TORCH: dict[str, np.dtype[Any]] = {
    "torch.float16": np.dtype(np.float16),
    "torch.float32": np.dtype(np.float32),
    "torch.float64": np.dtype(np.float64),
    "torch.complex64": np.dtype(np.complex64),
    "torch.complex128": np.dtype(np.complex128),
}
"""numpy dtypes of torch's, by ``str(tensor.dtype)``."""

_KIND_OF_NUMPY: dict[str, LeafKind] = {
    "f": "float",
    "c": "complex",
    "i": "integer",
    "u": "integer",
    "b": "bool",
}


class AggregationError(CoordinatorError):
    """Contributions that cannot be averaged; the message names the key path, contributors and
    values that disagree."""

    @classmethod
    def at(cls, path: Path, message: str) -> AggregationError:
        """The error ``message`` about the leaf or container at ``path``."""
        where = format_path(path)
        return cls(f"{where}: {message}" if where else message)


def _is_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a torch tensor, without importing torch: no value can be one unless
    this process imported it (a coordinator averaging numpy states never does)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def leaf_kind(leaf: Any) -> LeafKind | None:
    """The numeric kind of a leaf, or ``None`` for a non-numeric leaf (or a container)."""
    if _is_tensor(leaf):
        if leaf.dtype is sys.modules["torch"].bool:
            return "bool"
        if leaf.is_complex():
            return "complex"
        return "float" if leaf.is_floating_point() else "integer"
    if isinstance(leaf, np.ndarray | np.generic):
        return _KIND_OF_NUMPY.get(leaf.dtype.kind)
    # bool before int (a subclass of it); numpy scalars were handled above (np.float64 is a float).
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "integer"
    if isinstance(leaf, float):
        return "float"
    return None


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """The shape of a numeric leaf; ``()`` for scalars."""
    if _is_tensor(leaf) or isinstance(leaf, np.ndarray | np.generic):
        return tuple(leaf.shape)
    return ()


def to_numpy(leaf: Any) -> np.ndarray[Any, Any]:
    """A numeric leaf as a numpy array, without copying where possible (never written to).

    torch tensors are viewed through ``Tensor.numpy(force=True)``; ``bfloat16``, which numpy
    lacks, is widened to float32 (exactly). Python ints too large for int64 become object arrays.
    """
    if _is_tensor(leaf):
        import torch

        tensor: torch.Tensor = leaf
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.detach().to(torch.float32)
        return tensor.numpy(force=True)
    try:
        return np.asarray(leaf)
    except OverflowError:
        return np.asarray(leaf, dtype=object)


def numpy_dtype(template: Any) -> np.dtype[Any]:
    """The numpy dtype that holds a float or complex leaf's values (float32 for bfloat16)."""
    if _is_tensor(template):
        return _NUMPY_OF_TORCH.get(str(template.dtype), np.dtype(np.float32))
    if isinstance(template, np.ndarray | np.generic):
        return template.dtype
    return np.dtype(np.float64)


def like(template: Any, array: np.ndarray[Any, Any]) -> Any:
    """``array``'s values as a leaf of the same type, dtype, shape and device as ``template``.

    Args:
        template: a float or complex leaf (numpy array or scalar, torch tensor, Python float).
        array: values of ``template``'s shape, any float dtype; used without a copy when it is
            already of ``numpy_dtype(template)``, so the caller must not keep it.
    """
    shape = leaf_shape(template)
    dtype = numpy_dtype(template)
    if array.dtype != dtype or array.shape != shape:
        out = np.empty(shape, dtype=dtype)
        np.copyto(out, array.reshape(shape), casting="same_kind")
        array = out
    if _is_tensor(template):
        import torch

        tensor = torch.from_numpy(array)
        if tensor.dtype != template.dtype:  # bfloat16, by way of float32
            tensor = tensor.to(template.dtype)
        return tensor if template.device.type == "cpu" else tensor.to(template.device)
    if isinstance(template, np.ndarray):
        return array
    if isinstance(template, np.generic):
        return array[()]
    return float(array[()])


def copy_leaf(leaf: Any) -> Any:
    """An independent copy of a leaf (arrays and tensors copied, immutables shared)."""
    if _is_tensor(leaf):
        return leaf.detach().clone()
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    if isinstance(leaf, np.generic | str | bytes | int | float | complex | type(None)):
        return leaf
    return copy.deepcopy(leaf)


def tree_leaves(tree: Tree) -> list[Any]:
    """The leaves of ``tree``, depth first in key order."""
    return [leaf for _, leaf in iter_leaves(tree)]


def iter_leaves(tree: Tree, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """``(path, leaf)`` for every leaf of ``tree``, depth first in key order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from iter_leaves(value, (*path, key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from iter_leaves(value, (*path, index))
    else:
        yield path, tree


def numel(tree: Tree) -> int:
    """How many numbers ``tree`` holds: array and tensor sizes, 1 per numeric scalar."""
    total = 0
    for leaf in tree_leaves(tree):
        if _is_tensor(leaf):
            total += leaf.numel()
        elif isinstance(leaf, np.ndarray | np.generic):
            total += leaf.size
        elif leaf_kind(leaf) is not None:
            total += 1
    return total


def non_finite(tree: Tree) -> Path | None:
    """Where ``tree`` first holds a NaN or an infinity (a float or complex leaf whose sum is not
    finite: one pass, no temporary the leaf's size; half precision summed in float32), or
    ``None`` where it holds none. A finite float32 leaf sums to infinity only past ~1e38."""
    for path, leaf in iter_leaves(tree):
        kind = leaf_kind(leaf)
        if kind not in ("float", "complex"):
            continue
        if _is_tensor(leaf):  # half precision summed in float32: its own sum would overflow
            torch = sys.modules["torch"]
            half = leaf.dtype in (torch.float16, torch.bfloat16)
            total = complex((leaf.sum(dtype=torch.float32) if half else leaf.sum()).item())
        else:
            array = np.asarray(leaf)
            total = complex(np.sum(array, dtype=np.float32 if array.dtype == np.float16 else None))
        if not cmath.isfinite(total):
            return path
    return None


def format_path(path: Path) -> str:
    """``node 'mlp', key '0.weight'``: where a leaf sits, for messages (``''`` for the root)."""
    if not path:
        return ""
    text = f"node {path[0]!r}"
    if len(path) > 1:
        text += f", key {path[1]!r}" + "".join(f"[{key!r}]" for key in path[2:])
    return text


def describe(value: Any) -> str:
    """A short description of a leaf or container, for messages."""
    if _is_tensor(value):
        return f"a torch {str(value.dtype).removeprefix('torch.')} tensor of shape {_shape(value)}"
    if isinstance(value, np.ndarray):
        article = "an" if value.dtype.name.startswith("i") else "a"  # an int64, a uint8
        return f"{article} {value.dtype} array of shape {_shape(value)}"
    if isinstance(value, np.generic):
        return f"a numpy {value.dtype} scalar ({value.item()!r})"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {reprlib.repr(list(value))}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, bool | int | float):
        return f"{type(value).__name__} {value!r}"
    return reprlib.repr(value)


def _shape(leaf: Any) -> list[int]:
    return list(leaf_shape(leaf))


class Accumulator:
    """A weighted mean folded in one contribution at a time.

    ``add`` checks a contribution against the first one (keys, shapes, kinds, agreeing integer
    and non-numeric leaves) before folding any of it, so a refused contribution leaves the
    accumulator as it was: the caller may report it and go on with the others. The first
    contribution's leaves are kept (by reference, not copied): they give the result its types,
    and must not be changed until :meth:`result` has been taken.

    Example::

        acc = Accumulator()
        for worker, count, state in replies:   # as they arrive
            acc.add(worker, count, state)
        average = acc.result()
    """

    def __init__(self, *, precise: bool = True) -> None:
        self.precise = precise
        """``True``: sums in float64 (complex128), exact far below float32 resolution.
        ``False``: sums in the leaves' own floating dtype — several times faster for float32,
        within a few ulps: enough for a gradient mean, not for a state compared to 1e-7. The
        sum then becomes the result in place, so :meth:`result` is taken once."""
        self._root: _Node | None = None
        self._first = ""
        self._labels: set[str] = set()
        self._total = 0.0
        self._scratch: dict[np.dtype[Any], np.ndarray[Any, Any]] = {}

    @property
    def count(self) -> int:
        """How many contributions have been folded in."""
        return len(self._labels)

    @property
    def total_weight(self) -> float:
        """Σ wᵢ over the contributions folded in."""
        return self._total

    def add(self, label: str, weight: float, tree: Tree) -> None:
        """Fold in one contribution.

        Args:
            label: who sent it (a worker id), named in errors.
            weight: its weight (an example count): positive and finite.
            tree: its state or gradients.

        Raises:
            AggregationError: the weight, the label or the tree is refused; nothing was folded.
        """
        w = _check_weight(label, weight)
        if label in self._labels:
            raise AggregationError(f"contributor {label!r} was added twice")
        if self._root is None:
            self._root = _build((), tree)
            self._first = label
        else:
            self._root.check((), label, tree, self._first)
        self._root.fold(tree, w, self)
        self._labels.add(label)
        self._total += w

    def result(self) -> Tree:
        """The weighted mean of what was added: a new tree shaped and typed like the first one.

        Raises:
            AggregationError: nothing was added.
        """
        if self._root is None:
            raise AggregationError("zero contributors to average")
        return self._root.result(self._total, single=self.count == 1)

    def _work_buffer(self, dtype: np.dtype[Any], size: int) -> np.ndarray[Any, Any]:
        """A reusable buffer of ``size`` (at most the chunk size) elements of ``dtype``."""
        buffer = self._scratch.get(dtype)
        if buffer is None:
            buffer = self._scratch[dtype] = np.empty(_CHUNK, dtype=dtype)
        return buffer[:size]


def weighted_mean(
    contributions: Sequence[tuple[str, float, Tree]], *, precise: bool = True
) -> Tree:
    """Σ wᵢ xᵢ / Σ wᵢ, leaf by leaf, over ``(label, weight, tree)`` triples.

    The result has the structure, leaf types and dtypes of the first contributor's tree; one
    contributor gives an exact copy of its tree. See the module docstring for the leaf rules.

    Raises:
        AggregationError: zero contributors, a bad weight, or trees that disagree (the message
            names the key path, the contributors and what differs).

    ``precise=False`` sums in the leaves' own dtype (see :class:`Accumulator`).
    """
    acc = Accumulator(precise=precise)
    for label, weight, tree in contributions:
        acc.add(label, weight, tree)
    return acc.result()


def _check_weight(label: str, weight: Any) -> float:
    """The weight as a float, or the error naming it (a number, not a bool, > 0, finite)."""
    real = isinstance(weight, int | float | np.integer | np.floating)
    if real and not isinstance(weight, bool | np.bool_):
        w = float(weight)
        if math.isfinite(w) and w > 0:
            return w
        shown = format(w, "g")
    else:
        shown = repr(weight)
    raise AggregationError(
        f"weights must be positive and finite; contributor {label!r} has {shown}"
    )


def _build(path: Path, first: Tree) -> _Node:
    """The accumulator node for ``first``, the first contribution at ``path``."""
    if isinstance(first, Mapping):
        return _MapNode(path, first)
    if isinstance(first, list | tuple):
        return _SeqNode(path, first)
    kind = leaf_kind(first)
    if kind in ("float", "complex"):
        return _MeanLeaf(first, kind)
    return _SameLeaf(first, kind)


class _Node(ABC):
    @abstractmethod
    def check(self, path: Path, label: str, value: Tree, first: str) -> None:
        """Raise if ``value`` cannot be folded into this node; change nothing."""

    @abstractmethod
    def fold(self, value: Tree, weight: float, acc: Accumulator) -> None:
        """Fold in a checked ``value``."""

    @abstractmethod
    def result(self, total: float, single: bool) -> Tree:
        """The mean so far (a copy of the first value when ``single``)."""


class _MapNode(_Node):
    def __init__(self, path: Path, first: Mapping[Any, Any]) -> None:
        self.children = {key: _build((*path, key), value) for key, value in first.items()}
        self.description = describe(first)

    def check(self, path: Path, label: str, value: Tree, first: str) -> None:
        if not isinstance(value, Mapping):
            raise _mismatch(path, label, describe(value), first, self.description)
        for key in self.children:
            if key not in value:
                if path:
                    message = f"key {key!r} is missing from contributor {label!r}"
                    raise AggregationError.at(path, f"{message} (present in {first!r})")
                raise AggregationError(
                    f"node {key!r} is missing from contributor {label!r} (present in {first!r})"
                )
        for key in value:
            if key not in self.children:
                what = f"key {key!r}" if path else f"node {key!r}"
                raise AggregationError.at(
                    path, f"contributor {label!r} has {what}, which {first!r} lacks"
                )
        for key, child in self.children.items():
            child.check((*path, key), label, value[key], first)

    def fold(self, value: Tree, weight: float, acc: Accumulator) -> None:
        for key, child in self.children.items():
            child.fold(value[key], weight, acc)

    def result(self, total: float, single: bool) -> Tree:
        return {key: child.result(total, single) for key, child in self.children.items()}


class _SeqNode(_Node):
    def __init__(self, path: Path, first: list[Any] | tuple[Any, ...]) -> None:
        self.children = [_build((*path, index), value) for index, value in enumerate(first)]
        self.tuple = isinstance(first, tuple)
        self.description = describe(first)

    def check(self, path: Path, label: str, value: Tree, first: str) -> None:
        if not isinstance(value, list | tuple) or len(value) != len(self.children):
            raise _mismatch(path, label, describe(value), first, self.description)
        for index, (child, item) in enumerate(zip(self.children, value, strict=True)):
            child.check((*path, index), label, item, first)

    def fold(self, value: Tree, weight: float, acc: Accumulator) -> None:
        for child, item in zip(self.children, value, strict=True):
            child.fold(item, weight, acc)

    def result(self, total: float, single: bool) -> Tree:
        items = [child.result(total, single) for child in self.children]
        return tuple(items) if self.tuple else items


class _MeanLeaf(_Node):
    """A float or complex leaf: Σ wᵢ xᵢ accumulated in place in one flat float64 buffer."""

    def __init__(self, first: Any, kind: LeafKind) -> None:
        self.first = first
        self.kind = kind
        self.shape = leaf_shape(first)
        self.sum: np.ndarray[Any, Any] | None = None
        self.native = False  # summing in the leaf's own dtype (an Accumulator not precise)

    def check(self, path: Path, label: str, value: Tree, first: str) -> None:
        _check_leaf(path, label, value, first, self.first, kind=self.kind, shape=self.shape)

    def fold(self, value: Tree, weight: float, acc: Accumulator) -> None:
        flat = to_numpy(value).reshape(-1)
        if self.sum is None:
            if not acc.precise and flat.dtype.kind == "f" and flat.dtype.itemsize >= 4:
                # Σ in the leaf's own dtype, with torch's fused multi-threaded kernels.
                import torch

                self.sum = torch.mul(torch.as_tensor(flat), weight).numpy()
                self.native = True
                return
            self.sum = np.multiply(flat, weight, dtype=np.promote_types(flat.dtype, np.float64))
            return
        total = self.sum
        if self.native and flat.dtype == total.dtype and flat.flags.writeable:
            # Σ += w·x in one fused, multi-threaded torch kernel over the same memory.
            import torch

            torch.from_numpy(total).add_(torch.from_numpy(flat), alpha=weight)
            return
        # Σ += w·x chunk by chunk through a cached scratch buffer: no full-size temporary.
        for start in range(0, flat.size, _CHUNK):
            stop = min(start + _CHUNK, flat.size)
            scratch = acc._work_buffer(total.dtype, stop - start)
            np.multiply(flat[start:stop], weight, out=scratch, dtype=total.dtype)
            np.add(total[start:stop], scratch, out=total[start:stop])

    def result(self, total: float, single: bool) -> Tree:
        if single or self.sum is None:
            return copy_leaf(self.first)
        # Divide straight into the output dtype: one pass, no float64 temporary.
        if self.native:  # summed in its own dtype (not precise)
            # The sum becomes the mean in place: no second full-size buffer to fault in.
            mean, self.sum = self.sum, None
            import torch

            torch.from_numpy(mean).div_(total)
            return like(self.first, mean.reshape(self.shape))
        out = np.empty(self.shape, dtype=numpy_dtype(self.first))
        np.divide(self.sum.reshape(self.shape), total, out=out, casting="same_kind")
        return like(self.first, out)


class _SameLeaf(_Node):
    """An integer, bool or non-numeric leaf: taken when every contributor agrees."""

    def __init__(self, first: Any, kind: LeafKind | None) -> None:
        self.first = first
        self.kind = kind
        self.shape = leaf_shape(first)

    def check(self, path: Path, label: str, value: Tree, first: str) -> None:
        _check_leaf(path, label, value, first, self.first, kind=self.kind, shape=self.shape)
        if self.kind is None:
            if not _equal(value, self.first):
                raise AggregationError.at(
                    path,
                    "non-numeric leaves have no mean, they must agree; contributor "
                    f"{label!r} has {describe(value)}, contributor {first!r} has "
                    f"{describe(self.first)}",
                )
            return
        mine, theirs = to_numpy(self.first), to_numpy(value)
        if not np.array_equal(mine, theirs):
            where = ""
            if self.shape:
                index = tuple(int(i[0]) for i in np.nonzero(mine != theirs))
                mine, theirs, where = mine[index], theirs[index], f" at {list(index)}"
            raise AggregationError.at(
                path,
                f"{self.kind} leaves are not averaged, they must agree; contributor {label!r} "
                f"has {theirs.item()!r}{where}, contributor {first!r} has {mine.item()!r}",
            )

    def fold(self, value: Tree, weight: float, acc: Accumulator) -> None:
        pass

    def result(self, total: float, single: bool) -> Tree:
        return copy_leaf(self.first)


def _check_leaf(
    path: Path,
    label: str,
    value: Any,
    first: str,
    first_value: Any,
    *,
    kind: LeafKind | None,
    shape: tuple[int, ...],
) -> None:
    """Refuse a leaf of another kind than the first contributor's, or of another shape."""
    if isinstance(value, Mapping | list | tuple) or leaf_kind(value) != kind:
        raise _mismatch(path, label, describe(value), first, describe(first_value))
    if kind is not None and leaf_shape(value) != shape:
        raise AggregationError.at(
            path,
            f"contributor {label!r} has shape {_shape(value)}, contributor {first!r} has "
            f"{list(shape)}",
        )


def _mismatch(path: Path, label: str, theirs: str, first: str, mine: str) -> AggregationError:
    return AggregationError.at(
        path, f"contributor {label!r} has {theirs}, contributor {first!r} has {mine}"
    )


def _equal(a: Any, b: Any) -> bool:
    """Equality of non-numeric leaves, robust to arrays and to ``==`` that raises."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(a, b))
        except (TypeError, ValueError):
            return False
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False
