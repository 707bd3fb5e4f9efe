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
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from protocol.options.strategies import powersgd_rank

__all__ = ["ONE_BUCKET_MB", "bucketing", "compress"]

ONE_BUCKET_MB = 1 << 20
"""DDP's ``bucket_cap_mb`` that puts every gradient in one bucket (1 TiB)."""


def bucketing(compression: str | None) -> dict[str, Any]:
    """The DDP arguments ``compression`` needs: one bucket for PowerSGD, else DDP's own."""
    return {"bucket_cap_mb": ONE_BUCKET_MB} if powersgd_rank(compression) else {}


def compress(ddp: DistributedDataParallel, compression: str, seed: int) -> None:
    """Register the communication hook of ``compression`` on ``ddp`` (its random projections,
    for PowerSGD, drawn from ``seed``: the same on every replica).

    Raises:
        ValueError: a compression that is not one of the forms above.
    """
    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    if compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return
    rank = powersgd_rank(compression)
    if rank is None:
        raise ValueError(f"no such compression: {compression!r}")
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
