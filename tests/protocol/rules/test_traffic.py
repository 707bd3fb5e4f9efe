"""The bytes a replica exchanges, counted by hand, and PowerSGD's count against what torch's own
hook reports having compressed."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from protocol.options.compression import Compression
from protocol.rules.traffic import buckets, step_bytes, sync_bytes
from tests.gloo_group import one_rank_gloo_group

# An MLP 784-2048-10: two matrices and two bias vectors.
SHAPES = [[2048, 784], [2048], [10, 2048], [10]]
VALUES = 2048 * 784 + 2048 + 10 * 2048 + 10
FP16, BF16, INT8 = (Compression(kind) for kind in ("fp16", "bf16", "int8"))


def test_uncompressed_and_half_precision_steps_are_four_and_two_bytes_a_value():
    assert step_bytes(SHAPES, None) == 4 * VALUES == sync_bytes(SHAPES)
    assert step_bytes(SHAPES, FP16) == step_bytes(SHAPES, BF16) == 2 * VALUES


def test_powersgd_sends_the_factors_of_the_matrices_worth_compressing():
    # Rank 4: the 2048x784 matrix as (2048 + 784) * 4 values; the 10x2048 one as
    # (10 + 2048) * 4 = 8232 values, under half of its 20480; the vectors (n x 1) whole.
    expected = 4 * ((2048 + 784) * 4 + 2048 + (10 + 2048) * 4 + 10)
    assert step_bytes(SHAPES, Compression("powersgd:4")) == expected
    # Rank 8: the second matrix is no longer worth it ((10 + 2048) * 8 * 2 > 20480).
    assert step_bytes(SHAPES, Compression("powersgd:8")) == 4 * (
        (2048 + 784) * 8 + 2048 + 10 * 2048 + 10
    )


def test_the_powersgd_count_is_the_one_torchs_hook_reports():
    with one_rank_gloo_group():
        model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.Linear(2048, 10))
        ddp = DistributedDataParallel(model, bucket_cap_mb=1 << 20)
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        for _ in range(3):
            ddp.zero_grad()
            ddp(torch.randn(2, 784)).sum().backward()
        shapes = [list(p.shape) for p in model.parameters()]
        assert sorted(shapes) == sorted(SHAPES)
        assert 4 * state.total_numel_after_compression == step_bytes(
            shapes, Compression("powersgd:4")
        )


def test_buckets_cut_runs_of_whole_tensors_a_larger_one_alone():
    mib = 1024 * 1024
    assert buckets([10 * mib, 10 * mib, 10 * mib, 30 * mib, 1]) == [[0, 1], [2], [3], [4]]
    assert buckets([]) == []


def test_int8_counts_a_byte_a_value_and_a_scale_a_chunk_of_each_bucket():
    # 10,000 values: chunks of 4,096 -> 3 scales; a step's gradients and a sync's alike.
    assert step_bytes([[100, 100]], INT8) == sync_bytes([[100, 100]], INT8) == 10_000 + 12
    # Two tensors of 4 MiB (fp32) and one of 24 MiB: buckets of 25 MiB cut after the first two.
    big = [[1 << 20], [1 << 20], [6 << 20]]
    assert sync_bytes(big, INT8) == (2 << 20) + 4 * 512 + (6 << 20) + 4 * 1536
