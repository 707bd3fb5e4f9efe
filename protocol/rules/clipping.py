"""The gradient-clipping rule shared by the engine and the coordinator's pipelines.

``torch.nn.utils.clip_grad_norm_`` multiplies every gradient by ``min(1, max_norm /
(total_norm + 1e-6))``, ``total_norm`` the 2-norm of all of them together. A pipeline's
gradient is spread over its stages: each gives its part of the squared norm, and whoever adds
them (the coordinator, or an all-reduce of the stages) takes the coefficient here, so the
pipeline clips as one process holding the whole model would.
"""

from __future__ import annotations

import math

__all__ = ["clip_coefficient"]


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` multiplies the gradients by (NaN for a NaN norm, as
    torch's)."""
    coefficient = max_norm / (total_norm + 1e-6)
    return coefficient if math.isnan(coefficient) or coefficient < 1.0 else 1.0
