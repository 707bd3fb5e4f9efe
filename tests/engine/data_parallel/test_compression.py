"""Compressed gradients (:mod:`engine.data_parallel.compression`) against their documented bounds,
in a one-rank gloo group: fp16 is each gradient rounded to half precision and back; PowerSGD sends a
matrix's gradient exactly when its rank is at most the factorisation's, and with error feedback
what it leaves out of one step is sent with the next; int8 keeps every value within half its
quantisation step; DiLoCo's pseudo-gradients lose nothing over synchronisations."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from engine.data_parallel.compression import CompressedMean, bucketing, compress
from protocol.compressed_trees import INT8_CHUNK, dequantize_int8, quantize_int8
from protocol.options.compression import Compression
from tests.gloo_group import one_rank_gloo_group


@pytest.fixture
def group() -> Iterator[None]:
    with one_rank_gloo_group():
        yield


def gradients(compression: str, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Per batch, the weight's gradient as DDP left it under ``compression``, and as plain
    autograd computes it (from the same weights)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, **bucketing(Compression(compression)))
    compress(ddp, Compression(compression), seed=0)
    out = []
    for x in batches:
        ddp.zero_grad()
        plain.zero_grad()
        ddp(x).pow(2).sum().backward()
        plain(x).pow(2).sum().backward()
        out.append((model.weight.grad.clone(), plain.weight.grad.clone()))
    return out


def test_fp16_is_each_gradient_rounded_to_half_precision_and_back(group):
    (sent, true), *_ = gradients("fp16", [torch.randn(8, 64)])
    assert torch.equal(sent, true.half().float())
    assert ((sent - true).abs() <= true.abs() * 2**-11).all()
    assert not torch.equal(sent, true)


def test_powersgd_is_exact_on_a_gradient_of_its_rank(group):
    one_row = torch.randn(1, 64)  # a rank-1 gradient: x^T (2 W x) is an outer product
    first, _, third, fourth = gradients("powersgd:1", [one_row] * 3 + [torch.randn(8, 64)])
    assert torch.equal(first[0], first[1])  # the first steps travel uncompressed
    assert torch.linalg.matrix_rank(third[0]) == 1
    torch.testing.assert_close(third[0], third[1], rtol=1e-4, atol=1e-5)
    sent, true = fourth  # rank 8: a rank-1 factorisation cannot hold it
    assert torch.linalg.matrix_rank(sent) == 1
    assert not torch.allclose(sent, true, atol=1e-3)


def test_powersgd_sends_what_it_left_out_with_the_next_steps(group):
    """Error feedback: over many steps of the same rank-8 gradient, the mean of what was sent
    comes to the gradient, where one step's factorisation stays a rank-1 guess."""
    batch = torch.randn(8, 64)
    steps = gradients("powersgd:1", [batch] * 40)[2:]  # the first two travel uncompressed
    true = steps[0][1]
    one = (steps[0][0] - true).norm() / true.norm()
    mean = (torch.stack([sent for sent, _ in steps]).mean(0) - true).norm() / true.norm()
    assert mean < one / 4, (float(mean), float(one))


def test_int8_is_each_gradient_within_half_a_step_and_sends_the_rest_with_the_next(group):
    batch = torch.randn(8, 64)
    steps = gradients("int8", [batch] * 3)
    (sent, true), (second, _), (third, _) = steps
    assert (sent - true).abs().max() <= true.abs().max() / 254 * (1 + 1e-6)
    assert not torch.equal(sent, true)
    # Error feedback: what the first step left out travels with the second.
    left_out = true - sent
    assert (second - (true + left_out)).abs().max() <= (true + left_out).abs().max() / 254 + 1e-6
    # Over the steps only the last residual is missing: within one step of the gradient's max.
    missing = (sent + second + third - 3 * true).abs().max()
    assert missing <= true.abs().max() * 1.01 / 254 < (sent - true).abs().max() * 3


def test_quantize_int8_keeps_each_value_within_its_chunks_step():
    torch.manual_seed(0)
    values = torch.cat([torch.randn(INT8_CHUNK) * 100, torch.randn(1000) * 1e-3, torch.zeros(5)])
    codes, scales = quantize_int8(values)
    assert codes.dtype == torch.int8 and codes.shape == (values.numel(),) and scales.shape == (2,)
    back = dequantize_int8(codes, scales)
    for chunk in (slice(0, INT8_CHUNK), slice(INT8_CHUNK, None)):
        bound = values[chunk].abs().max() / 254
        assert (back[chunk] - values[chunk]).abs().max() <= bound * (1 + 1e-6)
    assert torch.equal(back[-5:], torch.zeros(5))  # (the small chunk keeps its own scale)
    assert float((back[INT8_CHUNK:-5] - values[INT8_CHUNK:-5]).abs().max()) < 1e-4


@pytest.mark.parametrize("compression", ["fp16", "int8"])
def test_pseudo_gradients_lose_nothing_over_synchronisations(group, compression):
    """fp16: the mean is each value rounded to half precision. int8 with error feedback: what a
    synchronisation left out is sent with the next, so the sum of what was sent is the sum of
    the pseudo-gradients less the last residual, which stays within one step."""
    torch.manual_seed(1)
    codec = CompressedMean(Compression(compression))
    deltas = [torch.randn(5000) * 0.01 for _ in range(6)]
    sent = []
    for delta in deltas:
        flat = delta.clone()
        codec.mean(flat, 0)
        sent.append(flat)
    if compression == "fp16":
        for delta, out in zip(deltas, sent, strict=True):
            assert torch.equal(out, delta.half().float())
        return
    residual = codec.residuals[0]
    torch.testing.assert_close(sum(sent) + residual, sum(deltas), rtol=0, atol=1e-6)
    assert residual.abs().max() <= (deltas[-1] + residual).abs().max() / 254 + 1e-6
    assert not torch.equal(sent[0], deltas[0])
    with pytest.raises(ValueError, match="no compressed mean is 'powersgd:2'"):
        CompressedMean(Compression("powersgd:2"))


def test_int8_takes_ddps_buckets_rebuilt_after_the_first_step(group):
    """DDP cuts its buckets again after the first step (in the order the gradients came): the
    residuals of the first buckets do not fit the new ones and are let go, not added."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # a bucket or so a layer
    compress(ddp, Compression("int8"), seed=0)
    for _ in range(3):
        x = torch.randn(8, 64)
        ddp.zero_grad()
        plain.zero_grad()
        ddp(x).pow(2).sum().backward()
        plain(x).pow(2).sum().backward()
        for sent, true in zip(model.parameters(), plain.parameters(), strict=True):
            assert (sent.grad - true.grad).abs().max() <= true.grad.abs().max() / 50
