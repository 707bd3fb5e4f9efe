"""A filter's bytes travel as a uint8 array: a frame gives them back as a view over itself, so
a daemon unpickles the model over the memory its request landed in (no copy), where bytes would
be copied out of the frame and the tensors again out of those."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch

from protocol.codec import decode, encode_frame
from protocol.daemon import LoadRequest
from protocol.filter_buffers import as_buffer
from protocol.filters import dump_filter, load_filter
from protocol.messages import OpenJob


def test_a_filter_sent_as_a_buffer_loads_over_the_frame_it_landed_in():
    module = torch.nn.Linear(256, 256)  # 256 KiB of weight: carried apart from the pickle
    data = dump_filter(module)
    sent = LoadRequest(filters={"lin": as_buffer(data)})
    assert np.shares_memory(sent.filters["lin"], np.frombuffer(data, np.uint8))  # no copy
    landed = bytearray(encode_frame(sent.model_dump()))  # a daemon's writable frame
    got = LoadRequest.model_validate(decode(landed))
    loaded = load_filter(got.filters["lin"])
    torch.testing.assert_close(loaded.weight, module.weight, rtol=0, atol=0)
    frame = np.frombuffer(landed, np.uint8)
    weight = loaded.weight.detach().numpy()
    assert np.shares_memory(weight, frame)  # the weight is the frame's memory
    # Bytes are still taken (an older sender), and load as they always did.
    old = LoadRequest.model_validate(decode(bytearray(encode_frame({"filters": {"lin": data}}))))
    torch.testing.assert_close(load_filter(old.filters["lin"]).weight, module.weight)


@pytest.mark.parametrize(
    "value",
    [np.zeros(4, np.float32), np.zeros((2, 2), np.uint8), np.zeros(8, np.uint8)[::2], "text"],
    ids=["float32", "2-d", "strided", "str"],
)
def test_a_filter_is_its_bytes_or_a_flat_uint8_array_of_them(value):
    with pytest.raises(pydantic.ValidationError, match="a filter travels as its bytes"):
        OpenJob(job_id="j", filters={"lin": value})
    if isinstance(value, np.ndarray):
        with pytest.raises(ValueError, match="a filter travels as its bytes"):
            as_buffer(value)
