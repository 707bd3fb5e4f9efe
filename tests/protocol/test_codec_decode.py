"""The codec's decoder against broken frames: every error says what and where, and garbage,
flipped bytes and forged headers only ever raise FrameError."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocol.arrays import Outline
from protocol.codec import ALIGNMENT, decode, encode_frame
from protocol.errors import FrameError
from tests.protocol.codec_frames import FUZZ, TORCH_DTYPES, build, decode_or_frame_error, split

SAMPLE = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "bf16": torch.arange(4, dtype=torch.bfloat16),
    "scalar": np.int16(-3),
    "blob": b"abc",
    1: (math.nan, 2**70, {"$k": None}),
    "empty": torch.zeros(0),
}
SAMPLE_FRAME = encode_frame(SAMPLE)


def test_decode_error_messages_say_what_and_where() -> None:
    header, buffers = split(SAMPLE_FRAME)
    cases = [
        (SAMPLE_FRAME[:2], "frame truncated: 2 bytes"),
        (SAMPLE_FRAME[:10], "frame truncated: header length is"),
        (SAMPLE_FRAME[:-5], r"frame truncated: header declares 5 buffers totalling 37 bytes"),
        (SAMPLE_FRAME + b"\0", "1 trailing bytes"),
        (build({**header, "v": 2}, buffers), "unsupported frame version 2"),
        (build([1], []), "header is not an object"),
        (struct.pack("<I", 2) + b"{x", "header is not valid JSON"),
    ]
    bad_shape = orjson.loads(orjson.dumps(header))
    bad_shape["body"]["$dict"][0][1]["shape"] = [3, 3]
    cases.append(
        (
            build(bad_shape, buffers),
            r"body\[\$dict 0\]: buffer 0: dtype 'float32' shape \[3, 3\] needs 36 bytes, "
            "buffer has 24",
        )
    )
    for frame, message in cases:
        with pytest.raises(FrameError, match=message):
            decode(frame)


def test_padding_must_be_zero_and_buffers_used_once() -> None:
    frame = bytearray(SAMPLE_FRAME)
    (n,) = struct.unpack_from("<I", frame)
    if (4 + n) % ALIGNMENT:
        frame[4 + n] = 1
        with pytest.raises(FrameError, match="padding"):
            decode(frame)
    header, buffers = split(SAMPLE_FRAME)
    with pytest.raises(FrameError, match="not referenced"):
        decode(build({**header, "bufs": [*header["bufs"], 1]}, [*buffers, b"x"]))
    with pytest.raises(FrameError, match="referenced twice"):
        decode(build({"v": 1, "bufs": [1], "body": [{"$bytes": 0}, {"$bytes": 0}]}, [b"x"]))


def test_every_truncation_is_a_frame_error() -> None:
    for cut in range(len(SAMPLE_FRAME)):
        with pytest.raises(FrameError):
            decode(SAMPLE_FRAME[:cut])


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_frame_error(garbage: bytes) -> None:
    decode_or_frame_error(garbage)
    decode_or_frame_error(struct.pack("<I", len(garbage)) + garbage)


@FUZZ
@given(st.data())
def test_flipped_bytes_only_raise_frame_error(data: st.DataObject) -> None:
    frame = bytearray(SAMPLE_FRAME)
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    decode_or_frame_error(frame)
    decode_or_frame_error(bytes(frame))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "nan", "-inf", "ff", "-0x1", "float32", "bfloat16", "np", "torch"])
    | st.sampled_from(["object", "int128", "np_scalar", "1_0", " 1"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["$buf", "$bytes", "$tuple", "$dict", "$int", "$float", "$x"])
            | st.sampled_from(["dtype", "shape", "lib", "a"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
buffer_specs = st.fixed_dictionaries(
    {
        "$buf": st.integers(-1, 3),
        "dtype": st.sampled_from([*TORCH_DTYPES, "object", "float128", 3]),
        "shape": st.lists(st.integers(-1, 5) | st.just(2**62), max_size=3) | json_values,
        "lib": st.sampled_from(["np", "torch", "np_scalar", "jax"]),
    }
)


@FUZZ
@given(
    body=st.recursive(
        json_values | buffer_specs, lambda inner: st.lists(inner, max_size=3), max_leaves=6
    ),
    lengths=st.lists(st.integers(0, 40), max_size=4),
    writable=st.booleans(),
)
def test_forged_headers_only_raise_frame_error(
    body: Any, lengths: list[int], writable: bool
) -> None:
    frame = build({"v": 1, "bufs": lengths, "body": body}, [bytes(range(n)) for n in lengths])
    decode_or_frame_error(bytearray(frame) if writable else frame)


@FUZZ
@given(
    field=st.sampled_from(["v", "bufs", "$buf", "dtype", "shape", "lib"]),
    value=json_values,
)
def test_edited_headers_only_raise_frame_error(field: str, value: Any) -> None:
    header, buffers = split(SAMPLE_FRAME)
    if field in ("v", "bufs"):
        header[field] = value
    else:
        for _, spec in header["body"]["$dict"]:
            if isinstance(spec, dict) and "$buf" in spec:
                spec[field] = value
    decode_or_frame_error(build(header, buffers))


def test_deeply_nested_headers_raise_frame_error() -> None:
    for depth in (300, 1000, 2000):
        body = b"[" * depth + b"]" * depth
        header = b'{"v":1,"bufs":[],"body":' + body + b"}"
        with pytest.raises(FrameError):
            decode(struct.pack("<I", len(header)) + header)


def test_an_outline_says_what_each_buffer_holds_without_reading_it() -> None:
    outlined = decode(SAMPLE_FRAME, outline=True)
    assert outlined["f32"] == Outline("np", "float32", (2, 3))
    assert outlined["bf16"] == Outline("torch", "bfloat16", (4,))
    assert outlined["scalar"] == Outline("np_scalar", "int16", ())
    assert outlined["blob"] == Outline("bytes", "uint8", (3,))
    assert outlined["empty"] == Outline("torch", "float32", (0,))
    assert outlined[1][1] == 2**70  # what is not a buffer comes back as it is
    # Checked all the same: a spec that does not fit its buffer is refused.
    header, bufs = split(encode_frame({"f32": SAMPLE["f32"]}))
    header["body"]["f32"]["shape"] = [3, 3]
    with pytest.raises(FrameError, match=r"needs 36 bytes, buffer has 24"):
        decode(build(header, bufs), outline=True)
