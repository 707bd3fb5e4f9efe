"""Tests of the binary frame codec: round trips, zero copy, layout, and garbage in."""

from __future__ import annotations

import enum
import math
import struct
import subprocess
import sys
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.arrays import RelayedTensor, holds_relayed, materialize
from protocol.codec import ALIGNMENT, Joined, decode, encode, encode_frame, frame_nbytes
from protocol.errors import FrameError
from tests.protocol.codec_frames import (
    NP_DTYPES,
    SETTINGS,
    TORCH_DTYPES,
    build,
    split,
)

# ------------------------------------------------------------------------------------- helpers


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1)
    return bytes(flat.clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy())


def assert_same(got: Any, want: Any, where: str = "value") -> None:
    """Equal type, dtype, shape and bits, recursively (NaN equals NaN, -0.0 differs from 0.0)."""
    assert type(got) is type(want), f"{where}: {type(got)} is not {type(want)}"
    if isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), where
        else:
            assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert len(got) == len(want), where
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            assert_same(gk, wk, f"{where} key")
            assert_same(gv, wv, f"{where}[{wk!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype, f"{where}: {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, where
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), where
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, where
        assert got.device.type == "cpu" and not got.requires_grad, where
        assert tensor_bytes(got) == tensor_bytes(want), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def round_trip(obj: Any) -> tuple[Any, Any]:
    """Decode ``obj``'s frame both as bytes and as a bytearray; check the parts on the way."""
    parts = encode(obj)
    frame = encode_frame(obj)
    assert frame == b"".join(parts)
    assert frame_nbytes(parts) == len(frame)
    return decode(frame), decode(bytearray(frame))


def address_range(buffer: bytes | bytearray) -> tuple[int, int]:
    start = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    return start, start + len(buffer)


# ---------------------------------------------------------------------------------- strategies

special_floats = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.8e308])
edge_ints = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1])
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**300), max_value=2**300)
    | edge_ints
    | st.floats()
    | special_floats
    | st.text(max_size=8)
    | st.binary(max_size=16)
)
hashables = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.text(max_size=6)
    | st.text(max_size=4).map(lambda s: "$" + s)
    | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=4,
)
trees = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        | st.dictionaries(hashables, inner, max_size=4)
    ),
    max_leaves=25,
)
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
layouts = st.sampled_from(["contiguous", "transposed", "stepped", "broadcast", "reversed"])


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    """Arrays of every supported dtype and byte order, with arbitrary bits, in any layout."""
    name = draw(st.sampled_from(NP_DTYPES))
    dtype = np.dtype(name).newbyteorder(draw(st.sampled_from("<>")))
    shape = draw(shapes)
    if name == "bool":
        array = draw(hnp.arrays(dtype, shape))
    elif draw(st.booleans()):  # every bit pattern, NaN payloads included
        raw = draw(hnp.arrays(np.uint8, math.prod(shape) * dtype.itemsize))
        array = raw.view(dtype).reshape(shape)
    else:
        array = draw(hnp.arrays(dtype, shape))
    return apply_layout(array, draw(layouts))


def apply_layout(array: Any, layout: str) -> Any:
    if array.ndim == 0 or layout == "contiguous":
        return array
    if layout == "transposed":
        return array.transpose(0, -1) if isinstance(array, torch.Tensor) else array.T
    if layout == "stepped":
        return array[::2]
    if layout == "broadcast":  # stride 0
        first = array[:1]
        return (
            first.expand(array.shape)
            if isinstance(array, torch.Tensor)
            else np.broadcast_to(first, array.shape)
        )
    return array[::-1]  # numpy only


@st.composite
def torch_tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(TORCH_DTYPES))
    dtype = getattr(torch, name)
    shape = draw(shapes)
    raw = draw(hnp.arrays(np.uint8, math.prod(shape) * dtype.itemsize))
    if name == "bool":
        raw = raw % 2
    # Strides mean nothing when there are 0 or 1 elements; torch keeps odd ones (t[::5][:1]).
    strides = draw(st.lists(st.integers(0, 7), min_size=len(shape), max_size=len(shape)))
    if math.prod(shape) == 0:
        tensor = torch.empty_strided(shape, strides, dtype=dtype)
    else:
        tensor = torch.from_numpy(raw.copy()).view(dtype).reshape(shape)
        if tensor.numel() == 1:
            tensor = tensor.as_strided(shape, strides)
    tensor = apply_layout(tensor, draw(layouts.filter(lambda layout: layout != "reversed")))
    if dtype.is_floating_point and draw(st.booleans()):
        tensor = tensor.detach().requires_grad_()
    return tensor


# --------------------------------------------------------------------------------- round trips


@SETTINGS
@given(trees)
def test_round_trip_of_trees(tree: Any) -> None:
    for got in round_trip(tree):
        assert_same(got, tree)


@SETTINGS
@given(numpy_arrays())
def test_round_trip_of_numpy_arrays(array: np.ndarray[Any, Any]) -> None:
    want = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).reshape(array.shape)
    for got in round_trip(array):
        assert type(got) is np.ndarray
        assert got.dtype == np.dtype(array.dtype.name)
        assert_same(got, want)


@SETTINGS
@given(st.sampled_from(NP_DTYPES).flatmap(lambda name: hnp.arrays(np.dtype(name), ())))
def test_round_trip_of_numpy_scalars(zero_d: np.ndarray[Any, Any]) -> None:
    scalar = zero_d[()]
    assert isinstance(scalar, np.generic)
    for got in round_trip(scalar):
        assert_same(got, scalar)
    for got in round_trip(zero_d):  # a 0-d array stays a 0-d array
        assert_same(got, zero_d)


@SETTINGS
@given(torch_tensors())
def test_round_trip_of_torch_tensors(tensor: torch.Tensor) -> None:
    for got in round_trip(tensor):
        assert type(got) is torch.Tensor
        assert_same(got, tensor)


@SETTINGS
@given(st.dictionaries(st.text(max_size=5), numpy_arrays() | torch_tensors() | trees, max_size=5))
def test_relayed_tensors_are_encoded_again_to_the_same_frame(tree: dict[str, Any]) -> None:
    """A relay (a worker agent) reads tensors as RelayedTensor and writes them back: the frame
    it sends on is byte for byte the one it got, and decodes to the tensors sent."""
    frame = bytes(encode_frame(tree))
    for source in (frame, bytearray(frame)):
        relayed = decode(source, relay=True)
        assert bytes(encode_frame(relayed)) == frame
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            assert type(relayed[key]) is RelayedTensor
            assert relayed[key].shape == tuple(value.shape)
    for key, value in decode(frame).items():
        if isinstance(value, torch.Tensor):
            assert_same(value, tree[key].detach().cpu())


@SETTINGS
@given(
    st.dictionaries(
        st.text(max_size=5),
        numpy_arrays() | torch_tensors() | trees | st.lists(torch_tensors(), max_size=3),
        max_size=5,
    )
)
def test_relayed_tensors_materialize_as_the_tensors_decode_makes(tree: dict[str, Any]) -> None:
    """A coordinator reads a worker's tensors relayed and makes torch tensors of those it
    computes on: the same tensors a plain decode gives, everything else as decoded."""
    frame = bytearray(encode_frame(tree))
    relayed = decode(bytearray(frame), relay=True)
    tensors = [v for v in tree.values() if isinstance(v, torch.Tensor)]
    tensors += [t for v in tree.values() if isinstance(v, list) for t in v]
    assert holds_relayed(relayed) == any(isinstance(t, torch.Tensor) for t in tensors)
    made = materialize(relayed)
    assert not holds_relayed(made)
    assert_same(made, decode(frame))


@SETTINGS
@given(torch_tensors().filter(lambda t: t.dim() > 0), st.data())
def test_a_relayed_tensors_rows_are_the_tensors_rows(tensor: torch.Tensor, data: Any) -> None:
    """A coordinator cuts a client's data into each worker's rows as bytes: the rows ``t[rows]``
    gives, for a slice or an index array."""
    n = tensor.shape[0]
    bounds = st.integers(-n - 2, n + 2) | st.none()
    slices = st.builds(slice, bounds, bounds, st.integers(1, 3))  # (torch has no negative step)
    index = data.draw(slices | st.lists(st.integers(0, n - 1), max_size=6) if n else slices)
    relayed = decode(bytearray(encode_frame({"t": tensor})), relay=True)["t"]
    rows = relayed[np.asarray(index, dtype=np.int64) if isinstance(index, list) else index]
    want = tensor.detach()[
        torch.as_tensor(index, dtype=torch.int64) if isinstance(index, list) else index
    ]
    assert rows.nbytes == want.numel() * want.element_size()
    assert_same(decode(bytearray(encode_frame({"t": rows})))["t"], want.contiguous())


@SETTINGS
@given(st.dictionaries(st.text(max_size=5), numpy_arrays() | torch_tensors() | trees, max_size=5))
def test_round_trip_of_mixed_trees(tree: dict[str, Any]) -> None:
    want = {
        k: np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")).reshape(v.shape)
        if isinstance(v, np.ndarray)
        else v
        for k, v in tree.items()
    }
    for got in round_trip(tree):
        assert_same(got, want)


def test_values_that_change_type_on_the_way() -> None:
    class Color(enum.IntEnum):
        RED = 1

    class Name(enum.StrEnum):
        ADA = "ada"

    obj = {
        "bytearray": bytearray(b"ab"),
        "memoryview": memoryview(b"cd"),
        "strided memoryview": memoryview(b"abcdef")[::2],
        "float memoryview": memoryview(np.array([1.5], dtype=np.float32)),
        "enums": [Color.RED, Name.ADA],
        "ordered": OrderedDict(a=1),
        "size": torch.Size([2, 3]),
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "np str": np.str_("s"),
        "np float64": np.float64(0.5),
    }
    got = decode(encode_frame(obj))
    assert got["bytearray"] == b"ab" and type(got["bytearray"]) is bytes
    assert got["memoryview"] == b"cd" and type(got["memoryview"]) is bytes
    assert got["strided memoryview"] == b"ace"
    assert got["float memoryview"] == np.float32(1.5).tobytes()
    assert_same(got["enums"], [1, "ada"])
    assert_same(got["ordered"], {"a": 1})
    assert_same(got["size"], (2, 3))
    assert type(got["parameter"]) is torch.Tensor and not got["parameter"].requires_grad
    assert_same(got["np str"], "s")
    assert_same(got["np float64"], np.float64(0.5))  # not a plain float


def test_tensors_are_detached_and_on_the_cpu() -> None:
    leaf = torch.ones(3, requires_grad=True)
    got = decode(encode_frame({"grad": leaf * 2, "conj": torch.tensor([1 + 2j]).conj()}))
    assert not got["grad"].requires_grad and got["grad"].device.type == "cpu"
    assert got["conj"].tolist() == [1 - 2j]


def test_empty_and_zero_d_values() -> None:
    obj = [
        np.zeros((3, 0, 2), np.float32),
        np.zeros((0,), np.int64),
        np.array(7, np.int16),
        torch.zeros(3, 0, 2, dtype=torch.bfloat16),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.zeros(0, dtype=torch.uint64),
        b"",
        [],
        (),
        {},
        "",
    ]
    for got in round_trip(obj):
        assert_same(got, obj)


# ---------------------------------------------------------------------------------- the layout


def test_frame_layout_is_the_documented_one() -> None:
    a, t = np.arange(3, dtype=np.float64), torch.arange(5, dtype=torch.int32)
    frame = encode_frame({"a": a, "t": t, "b": b"xyz"})
    header, buffers = split(frame)
    assert header == {
        "v": 1,
        "bufs": [24, 20, 3],
        "body": {
            "a": {"$buf": 0, "dtype": "float64", "shape": [3], "lib": "np"},
            "t": {"$buf": 1, "dtype": "int32", "shape": [5], "lib": "torch"},
            "b": {"$bytes": 2},
        },
    }
    assert buffers == [a.tobytes(), t.numpy().tobytes(), b"xyz"]
    assert build(header, buffers) == frame  # offsets at multiples of 64, zero padding, no tail


def test_dicts_are_plain_json_unless_they_have_to_be_tagged() -> None:
    for obj, body in [
        ({"a": 1}, {"a": 1}),
        ({"$a": 1}, {"$dict": [["$a", 1]]}),
        ({1: 2, "a": 3}, {"$dict": [[1, 2], ["a", 3]]}),
        ({(1, "x"): None}, {"$dict": [[{"$tuple": [1, "x"]}, None]]}),
        (
            [math.nan, -math.inf, 2**64],
            [{"$float": "nan"}, {"$float": "-inf"}, {"$int": "1" + "0" * 16}],
        ),
    ]:
        header, _ = split(encode_frame(obj))
        assert header["body"] == body


def test_frame_without_buffers_ends_after_the_header() -> None:
    frame = encode_frame("hi")
    assert len(encode("hi")) == 1
    assert frame == struct.pack("<I", len(frame) - 4) + b'{"v":1,"bufs":[],"body":"hi"}'


# ------------------------------------------------------------------------------------ zero copy


def test_encode_does_not_copy_contiguous_buffers() -> None:
    array = np.arange(1000, dtype=np.float32)
    tensor = torch.arange(1000, dtype=torch.bfloat16)
    blob = b"x" * 1000
    parts = encode([array, tensor, blob])
    views = [p for p in parts if isinstance(p, memoryview) and p.nbytes >= 1000]
    assert len(views) == 3
    assert np.shares_memory(np.frombuffer(views[0], np.uint8), array)
    assert np.frombuffer(views[1], np.uint8).ctypes.data == tensor.data_ptr()
    assert np.frombuffer(views[2], np.uint8).ctypes.data == address_range(blob)[0]


@SETTINGS
@given(st.lists(numpy_arrays() | torch_tensors(), min_size=1, max_size=4))
def test_decode_of_a_writable_frame_is_zero_copy_and_aligned(values: list[Any]) -> None:
    frame = bytearray(encode_frame(values))
    start, end = address_range(frame)
    for got in decode(frame):
        if isinstance(got, np.ndarray):
            pointer, nbytes = got.ctypes.data, got.nbytes
            assert got.flags.writeable
        else:
            pointer, nbytes = got.data_ptr(), got.numel() * got.element_size()
        if nbytes:
            assert start <= pointer and pointer + nbytes <= end
            assert (pointer - start) % ALIGNMENT == 0


def test_decode_of_bytes_gives_read_only_numpy_views_and_copied_tensors() -> None:
    frame = encode_frame({"a": np.arange(4.0), "t": torch.arange(4.0), "e": torch.zeros(0, 3)})
    start, end = address_range(frame)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = decode(frame)
        got_from_view = decode(memoryview(frame))
    assert not got["a"].flags.writeable
    assert start <= got["a"].ctypes.data < end
    assert not start <= got["t"].data_ptr() < end
    got["t"].add_(1)  # the tensor is its own memory: the frame is untouched
    assert decode(frame)["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert got_from_view["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert got["e"].shape == (0, 3)


def test_decoded_views_keep_the_frame_alive() -> None:
    got = decode(bytearray(encode_frame([np.arange(3), torch.arange(3)])))
    assert got[0].tolist() == [0, 1, 2] and got[1].tolist() == [0, 1, 2]


def test_decode_accepts_any_contiguous_buffer_view() -> None:
    frame = encode_frame({"x": np.arange(3.0)})
    padded = np.frombuffer(frame + bytes(-len(frame) % 8), np.float64)
    view = memoryview(padded)[: len(frame) // 8]
    if len(frame) % 8 == 0:
        assert decode(view)["x"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(FrameError, match="non-contiguous"):
        decode(memoryview(frame)[::2])
    with pytest.raises(FrameError, match="expected bytes"):
        decode("not a frame")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- errors on encode


class Opaque:
    pass


def released_memoryview() -> memoryview:
    view = memoryview(b"x")
    view.release()
    return view


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: {1, 2}, "set"),
        (lambda: frozenset(), "frozenset"),
        (lambda: Opaque(), "Opaque"),
        (lambda: 1 + 2j, "complex"),
        (lambda: lambda: None, "function"),
        (lambda: np.array([object()]), "object"),
        (lambda: np.zeros(2, dtype="i4,f8"), "void"),
        (lambda: np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64"),
        (lambda: np.array(["ab"]), "str"),
        (lambda: np.zeros(2, dtype=np.longdouble), "float128"),
        (lambda: np.datetime64("2024-01-01"), "datetime64"),
        (lambda: np.ma.masked_array([1, 2], mask=[0, 1]), "MaskedArray"),
        (lambda: torch.zeros(2, dtype=torch.complex32), "complex32"),
        (lambda: torch.zeros(2, dtype=torch.float8_e4m3fn), "float8"),
        (lambda: torch.sparse_coo_tensor([[0]], [1.0], (2,)), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized"),
        (lambda: torch.zeros(2, device="meta"), "meta"),
        (lambda: "\ud800", "surrogates"),
        (released_memoryview, "memoryview"),
    ],
)
def test_unsupported_values_raise_frame_error_naming_them(make: Any, named: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch calls complex32 experimental
        value = make()
    with pytest.raises(FrameError, match=named):
        encode({"outer": [1, value]})


def test_encode_errors_say_where() -> None:
    with pytest.raises(FrameError, match=r"body\['a'\]\[1\]\[2\]: unsupported type set"):
        encode({"a": [0, (1, 2, {3})]})


def test_deep_and_cyclic_values_raise_frame_error() -> None:
    deep: list[Any] = []
    for _ in range(400):
        deep = [deep]
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for value in (deep, cyclic):
        with pytest.raises(FrameError, match="nested"):
            encode(value)
    almost: Any = 0
    for _ in range(200):
        almost = (almost,)  # each tuple is two JSON levels: over orjson's limit
    with pytest.raises(FrameError):
        encode(almost)


# -- torch is imported lazily -------------------------------------------------------------------

_NO_TORCH_CHILD = """
import sys
import numpy as np
import coordinator.server.app  # the whole coordinator: it must start without torch
from coordinator.strategies.aggregate import weighted_mean
from protocol.codec import decode, encode_frame
state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
back = decode(bytearray(encode_frame(state)))
mean = weighted_mean([("a", 1, back), ("b", 3, {"w": back["w"] + 4})])
assert np.array_equal(mean["w"], np.arange(6, dtype=np.float32).reshape(2, 3) + 3)
assert "torch" not in sys.modules, "torch was imported"
frame = open(sys.argv[1], "rb").read()
relayed = decode(bytearray(frame), relay=True)  # an agent passes it on: still no torch
assert encode_frame(relayed) == frame and "torch" not in sys.modules, "torch was imported"
tensor = decode(bytearray(frame))["t"]  # the first torch buffer imports torch now
import torch
assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16
print(tensor.float().tolist())
"""


def test_torch_is_imported_at_the_first_tensor_only(tmp_path: Any, unit: float) -> None:
    """A process that handles numpy values only (the coordinator averaging numpy states) never
    imports torch; the first torch buffer it decodes does, and comes back as a tensor."""
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    path = tmp_path / "frame"
    path.write_bytes(encode_frame({"t": values}))
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=60 * unit,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout) == [1.5, -2.0, 3.25]


def test_small_plain_values_and_their_look_alikes_decode_exactly() -> None:
    """Plain trees are written and read by orjson alone; anything that looks like a tag, has no
    JSON form of its own (big ints, non-finite floats, tuples, numpy scalars) or nests deeper
    than the limit takes the full walk both ways and comes back exactly."""
    for value in (
        {"kind": "ping", "id": 3, "reply_to": None, "worker_id": "w1", "ok": True, "x": 1.5},
        {"text": "$not a tag", "quoted": 'say "$hi"', "list": [1, [2, [3]]]},
        {"$key": 1, "k": ("a", 2)},
        [[[[]]]],
        {"big": 2**70, "small": -(2**63) - 1, "inf": float("inf"), "f": np.float64(0.5)},
    ):
        assert decode(encode_frame(value)) == value
    for depth, fine in ((252, True), (260, False)):
        nested = ("[" * depth + "]" * depth).encode()
        header = b'{"v":1,"bufs":[],"body":{"a":' + nested + b"}}"
        frame = struct.pack("<I", len(header)) + header
        if fine:
            assert decode(frame) == {"a": orjson.loads(nested)}
        else:
            with pytest.raises(FrameError, match="nested more than"):
                decode(frame)


def test_a_torch_still_being_imported_by_another_thread_does_not_break_encoding(monkeypatch):
    # The coordinator imports torch off its event loop while the loop keeps encoding: for a
    # moment sys.modules holds a torch without its attributes.
    half_imported = type(sys)("torch")
    monkeypatch.setitem(sys.modules, "torch", half_imported)
    tree = {"error": {"detail": {"rows": np.arange(3), "scale": np.float32(0.5)}}}
    back = decode(encode_frame(tree))
    np.testing.assert_array_equal(back["error"]["detail"]["rows"], np.arange(3))
    assert back["error"]["detail"]["scale"] == np.float32(0.5)


def test_joined_parts_travel_as_one_uint8_array_without_being_joined() -> None:
    """A :class:`Joined` is one buffer of the frame, its parts one after another: the frame's
    parts are the very buffers given (no copy), and it decodes as the array of their bytes."""
    big = np.arange(1 << 16, dtype=np.uint8)
    joined = Joined([b"head", memoryview(big), bytearray(b"tail")])
    assert len(joined) == 4 + big.nbytes + 4
    parts = encode({"filter": joined, "after": np.ones(3)})
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), big) for p in parts)
    back = decode(b"".join(parts))
    assert back["filter"].dtype == np.uint8 and back["filter"].shape == (len(joined),)
    assert back["filter"].tobytes() == b"head" + big.tobytes() + b"tail" == joined.tobytes()
    np.testing.assert_array_equal(back["after"], np.ones(3))
    empty = decode(encode_frame(Joined([])))
    assert empty.shape == (0,) and empty.dtype == np.uint8
