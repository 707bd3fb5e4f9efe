"""Compressed gradients (:mod:`engine.compression`) against their documented bounds, in a
one-rank gloo group: fp16 is each gradient rounded to half precision and back; PowerSGD sends a
matrix's gradient exactly when its rank is at most the factorisation's, and with error feedback
what it leaves out of one step is sent with the next."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from engine.compression import bucketing, compress


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gradients(compression: str, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Per batch, the weight's gradient as DDP left it under ``compression``, and as plain
    autograd computes it (from the same weights)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, **bucketing(compression))
    compress(ddp, compression, seed=0)
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
