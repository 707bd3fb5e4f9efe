"""What a DataParallel replica's gradients travel as on the torch collective: torch's own DDP
communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``), never a hand-rolled
codec.

* ``"fp16"`` / ``"bf16"`` — ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: each
  bucket is cast to half precision, all-reduced, divided by the world and cast back; every value
  keeps a relative error of at most 2⁻¹¹ (fp16, within its range) or 2⁻⁸ (bf16), and half the
  bytes travel. torch's bf16 hook runs on NCCL only (CUDA workers).
* ``"powersgd:RANK"`` — ``powerSGD_hook`` (Vogels et al. 2019, "PowerSGD: Practical Low-Rank
  Gradient Compression"): each matrix's gradient travels as a rank-RANK factorisation P Qᵀ from
  one power iteration, warm-started from the last step's Q, with error feedback (what the
  factorisation left out is added to the next step's gradient); vectors, and matrices too
  small to gain, travel uncompressed. The first two steps all-reduce uncompressed (torch
  requires them with error feedback: ``start_powerSGD_iter=2``). All of the model is one
  bucket: PowerSGD over gloo fails with DDP's default buckets
  (``op.preamble.length <= op.nbytes``).
* ``"int8"`` — :class:`CompressedMean` as a communication hook (torch's own
  ``quantization_pertensor_hook`` fails inside its callback on torch 2.13, ``invalid index of a
  0-dim tensor``): symmetric 8-bit quantisation in chunks of 4,096 values
  (:func:`protocol.compressed_trees.quantize_int8`), each value within max|chunk| / 254 of what
  was sent, all-gathered (a quarter of the bytes go out; W − 1 replicas' come in) and averaged,
  with *error feedback* — what quantisation left out of one step is added to the next (Seide et
  al. 2014; Karimireddy et al. 2019), so nothing is lost, only delayed. The hook runs the
  exchange in the backward's thread: no overlap.

DiLoCo's pseudo-gradients (no DDP) travel the same ways through :class:`CompressedMean`:
``"fp16"``/``"bf16"`` (cast, all-reduced, cast back) or ``"int8"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from protocol.compressed_trees import dequantize_int8, quantize_int8
from protocol.options.compression import Compression

__all__ = ["ONE_BUCKET_MB", "CompressedMean", "bucketing", "compress"]


ONE_BUCKET_MB = 1 << 20
"""DDP's ``bucket_cap_mb`` that puts every gradient in one bucket (1 TiB)."""


def bucketing(compression: Compression | None) -> dict[str, Any]:
    """The DDP arguments ``compression`` needs: one bucket for PowerSGD, else DDP's own."""
    powersgd = compression is not None and compression.kind == "powersgd"
    return {"bucket_cap_mb": ONE_BUCKET_MB} if powersgd else {}


def compress(ddp: DistributedDataParallel, compression: Compression, seed: int) -> None:
    """Register the communication hook of ``compression`` on ``ddp`` (its random projections,
    for PowerSGD, drawn from ``seed``: the same on every replica)."""
    if compression.kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    if compression.kind == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return
    if compression.kind == "int8":
        ddp.register_comm_hook(CompressedMean(compression), _mean_hook)
        return
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=compression.rank,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _mean_hook(mean, bucket):  # type: ignore[no-untyped-def]  # (DDP checks the annotations)
    """DDP's communication hook (a ``dist.GradBucket`` in, a done future of its mean out) that
    averages a bucket through ``mean``, a :class:`CompressedMean`."""
    buffer = bucket.buffer()
    mean.mean(buffer, bucket.index())
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


class CompressedMean:
    """The mean over the default group of a replica's flat gradients or pseudo-gradients, as
    ``compression`` has them travel (module docstring); the int8 residuals (error feedback) by
    bucket."""

    def __init__(self, compression: Compression | None) -> None:
        if compression is not None and not compression.travels_as_tree:
            raise ValueError(f"no compressed mean is {compression!r}")
        self.compression = compression
        self.residuals: dict[int, torch.Tensor] = {}

    def mean(self, flat: torch.Tensor, bucket: int) -> None:
        """Replace ``flat`` (bucket number ``bucket`` of this replica's values) by the group's
        mean of it.

        Raises:
            RuntimeError: the group broke (torch.distributed's own error).
        """
        world = dist.get_world_size()
        if self.compression is None:
            dist.all_reduce(flat)
            flat.div_(world)
        elif self.compression.half:
            half = (flat / world).to(
                torch.float16 if self.compression.kind == "fp16" else torch.bfloat16
            )
            dist.all_reduce(half)
            flat.copy_(half)
        else:
            self._int8(flat, bucket, world)

    def _int8(self, flat: torch.Tensor, bucket: int, world: int) -> None:
        residual = self.residuals.get(bucket)
        if residual is not None and residual.shape != flat.shape:
            residual = None  # DDP rebuilt its buckets after the first step: that one's is lost
        sent = flat + residual if residual is not None else flat.clone()
        codes, scales = quantize_int8(sent)
        self.residuals[bucket] = sent - dequantize_int8(codes, scales)
        all_codes = [torch.empty_like(codes) for _ in range(world)]
        all_scales = [torch.empty_like(scales) for _ in range(world)]
        dist.all_gather(all_scales, scales)
        dist.all_gather(all_codes, codes)
        flat.zero_()
        for c, s in zip(all_codes, all_scales, strict=True):
            flat.add_(dequantize_int8(c, s))
        flat.div_(world)
