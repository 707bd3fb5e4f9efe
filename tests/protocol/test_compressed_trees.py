"""Trees as they travel compressed through the coordinator: each form keeps its documented error
bound and the tree's layout, int8's error feedback loses nothing over many messages, and what
cannot be a compressed tree is refused saying why."""

from __future__ import annotations

import pytest
import torch

from protocol import codec
from protocol.compressed_trees import (
    MARKER,
    TreeCompressor,
    decode,
    is_compressed,
)
from protocol.errors import BadCompressedTree
from protocol.options.compression import Compression


def tree(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "mlp": {
            "0.weight": torch.randn(300, 20, generator=g) * 3,  # 6,000 values: two chunks
            "0.bias": torch.randn(300, generator=g) * 1e-3,
        },
        "head": {"weight": torch.randn(2, 300, generator=g), "scalar": torch.tensor(0.25)},
    }


def flat(t: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for leaves in t.values() for v in leaves.values()])


def test_half_precision_keeps_each_value_within_its_relative_rounding():
    """fp16: 2⁻¹¹ of each value in its normal range, half its smallest step (2⁻²⁵) below it;
    bf16: 2⁻⁸ (float32's range)."""
    sent = tree()
    for compression, bound, floor in (("fp16", 2**-11, 2**-25), ("bf16", 2**-8, 0.0)):
        message = TreeCompressor(Compression(compression)).encode(sent)
        assert is_compressed(message) and message[MARKER] == compression
        assert message["values"].element_size() == 2
        back = decode(message)
        assert [(n, list(v)) for n, v in back.items()] == [(n, list(v)) for n, v in sent.items()]
        for node, leaves in sent.items():
            for name, value in leaves.items():
                assert back[node][name].shape == value.shape
                error = (back[node][name] - value).abs()
                allowed = torch.clamp(bound * value.abs(), min=floor)
                assert bool((error <= allowed).all()), (compression, node, name)


def test_int8_keeps_each_value_within_its_chunks_step_and_loses_nothing_over_messages():
    """Each value within max|chunk| / 254 of what was sent (chunks of 4,096 values across the
    tree's tensors laid end to end); over ten messages the decoded sum is the sent sum less the
    last residual, which is within one step."""
    compressor = TreeCompressor(Compression("int8"))
    first = tree()
    message = compressor.encode(first)
    assert message["values"].dtype == torch.int8 and message["scales"].numel() == 2
    values = flat(first)
    back = flat(decode(message))
    for start in range(0, values.numel(), 4096):
        chunk = values[start : start + 4096]
        step = float(chunk.abs().max()) / 254
        assert float((back[start : start + 4096] - chunk).abs().max()) <= step * (1 + 1e-6)
    sent_total, received_total = values.clone(), back.clone()
    for seed in range(1, 10):
        t = tree(seed)
        sent_total += flat(t)
        received_total += flat(decode(compressor.encode(t)))
    assert compressor.residual is not None
    torch.testing.assert_close(received_total + compressor.residual, sent_total, atol=1e-4, rtol=0)


def test_a_compressed_tree_crosses_the_codec():
    message = TreeCompressor(Compression("int8")).encode(tree())
    again = decode(codec.decode(codec.encode_frame(message)))
    torch.testing.assert_close(flat(again), flat(decode(message)), atol=0, rtol=0)


def good() -> dict:
    return TreeCompressor(Compression("fp16")).encode({"n": {"w": torch.ones(3, 2)}})


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        ([1, 2], "is a dict, not list"),
        ({MARKER: "fp8", "layout": [], "values": torch.zeros(0)}, "unknown compression 'fp8'"),
        (good() | {"values": torch.ones(6)}, "6 values of torch.float16, not 6 of torch.float32"),
        (good() | {"values": torch.ones(5, dtype=torch.float16)}, "not 5 of"),
        (good() | {"values": torch.ones(3, 2, dtype=torch.float16)}, "flat tensor"),
        (good() | {"layout": "n/w"}, "'layout' must be a list"),
        (good() | {"layout": [["n", "w", [3, -2]]]}, "must be [node, name, shape]"),
        (good() | {"layout": [["n", "w", [3, 2]], ["n", "w", [0]]]}, "in the layout twice"),
        (
            {
                MARKER: "int8",
                "layout": [["n", "w", [5]]],
                "values": torch.zeros(6, dtype=torch.int8),
            },
            "'values' must be 5 int8 codes, not 6 of torch.int8",
        ),
        (
            {
                MARKER: "int8",
                "layout": [["n", "w", [5]]],
                "values": torch.zeros(5, dtype=torch.int8),
                "scales": torch.ones(2),
            },
            "'scales' must be 1 float32 values",
        ),
    ],
)
def test_what_is_not_a_compressed_tree_is_refused_saying_why(broken, says):
    with pytest.raises(BadCompressedTree) as raised:
        decode(broken)
    assert says in str(raised.value)


def test_only_float_trees_are_compressed_and_only_in_the_forms_that_travel():
    with pytest.raises(ValueError, match=r"torch\.int64: only floats"):
        TreeCompressor(Compression("int8")).encode({"n": {"steps": torch.tensor([3])}})
    with pytest.raises(ValueError, match="not 'powersgd:4'"):
        TreeCompressor(Compression("powersgd:4"))
    assert not is_compressed({"mlp": {"w": torch.ones(1)}})


def test_a_layout_is_held_to_the_models_parameters_before_anything_is_decoded():
    """Issue 53: a worker's tree, consistent with itself, claiming 64M values for a model of
    40 is refused from its layout alone: the coordinator decodes at most the model's size."""
    model = {"mlp": [[4, 8], [8]], "head": [[8]]}
    sent = {"mlp": {"w": torch.ones(4, 8), "b": torch.ones(8)}, "head": {"b": torch.ones(8)}}
    message = TreeCompressor(Compression("int8")).encode(sent)
    assert sorted(decode(message, model)) == ["head", "mlp"]
    huge = dict(message)
    huge["layout"] = [*message["layout"], ["mlp", "planted", [1 << 26]]]  # values not even sent
    for forged, says in (
        (huge, r"'mlp'/'planted' of shape \[67108864\] is not a parameter of the model's node"),
        (message | {"layout": [["other", "w", [4, 8]]]}, "the model trains no node 'other'"),
        (  # each parameter once: 'head' has one bias of 8, not two
            message | {"layout": [*message["layout"], ["head", "b2", [8]]]},
            r"'head'/'b2' of shape \[8\] is not a parameter",
        ),
    ):
        with pytest.raises(BadCompressedTree, match=says):
            decode(forged, model)
