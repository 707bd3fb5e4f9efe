"""The one pair of functions that (un)pickles user filters.

User filters travel as bytes: opaque to the coordinator (which never calls :func:`load_filter`,
and cuts them for a sharded replica with :func:`split_rows` without unpickling them) and opened
only inside the filter daemon or the user's own process. Data never goes through here: rows,
states and gradients use :mod:`protocol.codec`.

The bytes are one :mod:`protocol.codec` frame: the filter pickled with cloudpickle, every CPU
tensor it holds — a module's parameters and buffers — taken out of the pickle
(``persistent_id``) and carried beside it as the frame's raw buffers (:data:`APART_BYTES` and
up). Unpickled, each is a tensor over those bytes: over a writable frame the very bytes, else
one copy. Pickled whole, a tensor went through ``torch.save`` into a bytes object of the pickle
stream, and came back through a copy of that and a ``torch.load`` of the copy: a model arrived
as three times its weights; now at most twice, and once over a writable buffer. Bytes pickled
whole (no tensor in the process, or by an earlier version) are read as they are. A sharded
replica gets its rows of each parameter alone (:func:`split_rows`) and the parameter on the
``meta`` device, its rows beside it (:data:`ROWS`), until it is sharded.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import types
from typing import Any, ClassVar

import cloudpickle

from protocol.arrays import loaded_torch, torch_dtypes
from protocol.codec import ALIGNMENT, Joined, decode, encode
from protocol.filter_buffers import FilterBuffer
from protocol.text.code_owners import is_user_module

__all__ = [
    "APART_BYTES",
    "MAGIC",
    "ROWS",
    "dump_filter",
    "load_filter",
    "split_rows",
    "user_modules",
]

APART_BYTES = 1 << 16
"""Tensors of this many bytes and more travel apart from the pickle (smaller ones within it)."""

ROWS = "somatize_rows"
"""The attribute of a ``meta`` parameter of which a replica got only its rows
(:func:`split_rows`): those rows, a tensor, until the replica shards the parameter and fills
its shard from them."""

MAGIC = b"somatize filter, tensors apart\n".ljust(ALIGNMENT, b"\0")
"""What the bytes of a filter whose tensors travel apart start with, then the frame: as long as
the frame's alignment, so that its buffers stay aligned as they are in the frame. A pickle
starts with ``0x80``: bytes pickled whole."""


def user_modules() -> list[types.ModuleType]:
    """Every module this process has loaded from the user's own files
    (:func:`~protocol.text.code_owners.is_user_module`): what a filter's code may reach — its
    class's module, the layers it holds, a helper module its forward calls, a function imported from
    one — travels by value with it, so a worker needs none of the user's files. Asked again
    with the same modules loaded (a graph's every filter), the same answer, not sought
    again."""
    loaded = list(sys.modules)
    if _USER_MODULES and _USER_MODULES[0] == loaded:
        return list(_USER_MODULES[1])
    found = [
        module
        for name, module in list(sys.modules.items())
        if isinstance(module, types.ModuleType)
        and getattr(module, "__name__", None) == name  # (cloudpickle finds it by its name)
        and is_user_module(name)
        and _in_user_package(name)
    ]
    _USER_MODULES[:] = [loaded, found]
    return list(found)


_USER_MODULES: list[Any] = []
"""The modules loaded when :func:`user_modules` last looked, and what it found then."""


def _in_user_package(name: str) -> bool:
    """Whether the package at the top of module ``name`` is the user's too (``torch.ops`` has
    a file of no path, but ``torch`` is installed), or has no file to say (a namespace
    package)."""
    top = name.split(".")[0]
    module = sys.modules.get(top)
    return top == name or getattr(module, "__file__", None) is None or is_user_module(top)


def _code_with_its_file(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    """cloudpickle's reduction of a code object with the file it came from kept: cloudpickle
    writes ``<dynamic-code>`` there, and a filter's traceback from a worker then named no file
    of the user's (``File "<dynamic-code>", line 15``)."""
    make, args = _CLOUDPICKLE_CODE_REDUCE(code)
    at = args.index(_DYNAMIC_CODE)
    return make, (*args[:at], code.co_filename, *args[at + 1 :])


_CLOUDPICKLE_CODE_REDUCE = cloudpickle.CloudPickler._dispatch_table[types.CodeType]
_DYNAMIC_CODE = "<dynamic-code>"


class _FilePickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    """cloudpickle, each code object pickled with its file's name (:func:`_code_with_its_file`)."""

    dispatch_table: ClassVar[collections.ChainMap[Any, Any]] = collections.ChainMap(
        {types.CodeType: _code_with_its_file}, cloudpickle.CloudPickler.dispatch_table
    )


class _Pickler(_FilePickler):
    """cloudpickle, each large plain CPU tensor (or parameter) it meets put apart
    (``apart``: its kind, dtype, shape and bytes) and pickled as its place: ``(kind, index,
    requires_grad)``, the same place for the same object (a tied weight stays one)."""

    def __init__(self, file: io.BytesIO, torch: Any) -> None:
        super().__init__(file, protocol=5)
        self.apart: list[dict[str, Any]] = []
        self._places: dict[int, tuple[str, int, bool]] = {}
        self._torch = torch
        self._dtypes = torch_dtypes()[1]
        self._kinds = {torch.Tensor: "tensor", torch.nn.Parameter: "parameter"}

    def persistent_id(self, obj: Any) -> tuple[str, int, bool] | None:
        torch = self._torch
        kind = self._kinds.get(type(obj))  # every object pickled is asked: a lookup alone
        if kind is None:
            return None
        place = self._places.get(id(obj))
        if place is not None:
            return place
        if (
            obj.device.type != "cpu"
            or obj.layout != torch.strided
            or obj.is_quantized
            or obj.dtype not in self._dtypes
            or obj.grad_fn is not None
            or obj.numel() * obj.element_size() < APART_BYTES
        ):
            return None
        place = (kind, len(self.apart), bool(obj.requires_grad))
        flat = obj.detach().contiguous().reshape(-1)
        self.apart.append(
            {
                "kind": kind,
                "dtype": self._dtypes[obj.dtype],
                "shape": list(obj.shape),
                "bytes": flat.view(torch.uint8).numpy(),  # any dtype, bfloat16 too
            }
        )
        self._places[id(obj)] = place
        return place


class _Unpickler(pickle.Unpickler):
    """Unpickles what :class:`_Pickler` pickled, each place given its tensor of ``apart``
    (the same object for the same place): over its bytes where they are writable, else a copy
    of them; a parameter of which only some rows came (:func:`split_rows`) a parameter of its
    whole shape on the ``meta`` device, the rows beside it (:data:`ROWS`)."""

    def __init__(self, file: io.BytesIO, apart: list[dict[str, Any]]) -> None:
        super().__init__(file)
        self._apart = apart
        self._made: dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind, index, requires_grad = pid
        made = self._made.get(index)
        if made is None:
            import torch  # a tensor was pickled: the filter's own unpickling needs it too

            entry = self._apart[index]
            raw = entry["bytes"]
            if not raw.flags.writeable:
                raw = raw.copy()
            dtype = torch_dtypes()[0][entry["dtype"]]
            if raw.size:
                tensor = torch.from_numpy(raw).view(dtype).reshape(entry["shape"])
            else:  # no rows for this replica (and no view of nothing to another dtype)
                tensor = torch.empty(entry["shape"], dtype=dtype)
            whole = entry.get("rows_of")
            if whole is not None:
                made = torch.nn.Parameter(
                    torch.empty(whole, dtype=dtype, device="meta"), requires_grad=requires_grad
                )
                setattr(made, ROWS, tensor)
            elif kind == "parameter":
                made = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            else:
                made = tensor.requires_grad_(requires_grad)
            self._made[index] = made
        return made


def dump_filter(obj: Any) -> bytes:
    """Pickle a filter so that a process without the user's source files can load it, its
    tensors beside the pickle (module docstring).

    Modules of the user's own (classes and functions defined in a script, a helper module it
    imports, a test file: :func:`user_modules`) are pickled by value, as far as the filter
    reaches them; installed packages, the standard library and somatize itself by reference.
    """
    shipped = user_modules()
    for module in shipped:
        cloudpickle.register_pickle_by_value(module)
    try:
        torch = loaded_torch()
        if torch is None:  # nothing can hold a tensor
            whole = io.BytesIO()
            _FilePickler(whole, protocol=5).dump(obj)
            return whole.getvalue()
        stream = io.BytesIO()
        pickler = _Pickler(stream, torch)
        pickler.dump(obj)
        parts = encode({"pickle": stream.getbuffer(), "apart": pickler.apart})
        return b"".join([MAGIC, *parts])
    finally:
        for module in shipped:
            cloudpickle.unregister_pickle_by_value(module)


def load_filter(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle a filter made by :func:`dump_filter`: its tensors over ``data`` where it is
    writable (then ``data`` must not be reused), else copies. Runs user code: filter daemon
    (or the user's own process) only."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        return cloudpickle.loads(view)
    frame = decode(view[len(MAGIC) :])
    return _Unpickler(io.BytesIO(frame["pickle"]), frame["apart"]).load()


def split_rows(data: FilterBuffer, rank: int, ranks: int) -> FilterBuffer:
    """``data``, a filter's bytes, as replica ``rank`` of ``ranks`` that shard its parameters
    by rows with FSDP2 needs them: each parameter apart from the pickle (of one dimension or
    more) cut to the rows FSDP2 gives that replica (``torch.chunk`` of dim 0: ``ceil(n /
    ranks)`` rows each, in rank order, the last ones fewer or none), its whole shape said
    beside (``rows_of``); every other tensor whole. :func:`load_filter` makes each such
    parameter a ``meta`` one of its whole shape, its rows beside it (:data:`ROWS`), and the
    replica fills its shard from them. No user code runs (the coordinator may call it), and
    nothing is copied: the answer is a :class:`~protocol.codec.Joined` of views over ``data``
    (the pickle, the replica's rows), which must not change until it is sent. Bytes pickled
    whole come back as they are.

    Raises:
        protocol.errors.FrameError: ``data`` is not a filter's bytes.
    """
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        return data  # pickled whole: as it is, not a copy of it per replica
    frame = decode(view[len(MAGIC) :])
    for entry in frame["apart"]:
        shape = entry["shape"]
        if entry["kind"] != "parameter" or not shape or shape[0] == 0:
            continue
        rows = -(-shape[0] // ranks)
        start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        width = entry["bytes"].nbytes // shape[0]
        entry["bytes"] = entry["bytes"][start * width : stop * width]
        entry["rows_of"], entry["shape"] = shape, [stop - start, *shape[1:]]
    return Joined([MAGIC, *encode(frame)])
