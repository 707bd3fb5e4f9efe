"""Reading and applying the gradients of the loaded differentiable nodes.

The gradient primitives never report an empty success: no gradient at all is an error. Fitting
(:mod:`engine.fitting`) leaves gradients on the parameters without stepping, because whoever
owns the round owns the step: :meth:`Gradients.apply_gradients` writes a gradient (the mean of
the replicas', say) and steps the persistent optimizers (:mod:`engine.optimizers`).

Through the coordinator, gradients may travel compressed both ways
(:mod:`protocol.compressed_trees`): read out encoded by this replica's own
:class:`~protocol.compressed_trees.TreeCompressor` (which keeps the int8 residual from step to
step), and a compressed mean decoded before it is applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.errors import EngineError
from engine.nodes import Node, Nodes, check_same_names, trainable
from engine.optimizers import Optimizers
from engine.transfer import to_cpu
from protocol.compressed_trees import TreeCompressor, decode, is_compressed
from protocol.errors import BadCompressedTree, ErrorCode
from protocol.options.compression import Compression

__all__ = ["Gradients"]


class Gradients:
    """The gradients on ``nodes``' parameters: read out, or written in and stepped on with
    ``optimizers``."""

    def __init__(self, nodes: Nodes, optimizers: Optimizers) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self._sent: TreeCompressor | None = None  # what the gradients last travelled as

    def sent(
        self, gradients: dict[str, dict[str, Any]], compression: Compression
    ) -> dict[str, Any]:
        """``gradients`` as they travel under ``compression``, the int8 residual of the last
        ones added (and this one's kept)."""
        if self._sent is None or self._sent.compression != compression:
            self._sent = TreeCompressor(compression)
        return self._sent.encode(gradients)

    def get_gradients(self, node_ids: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The gradients left by the last ``fit``/``composite_fit``, by node and parameter name.

        ``node_ids=None`` means every differentiable node. The tensors are the live ``.grad``
        tensors on a CPU engine (the engine always replaces, never mutates, a gradient): copy
        them to keep them across a later backward. On another device, CPU copies.

        Raises:
            EngineError: ``NO_GRADIENTS`` for a node that is not differentiable, has no trainable
                parameters, or has parameters without a gradient (no backward ran).
        """
        if node_ids is None:
            nodes = [n for n in self.nodes.select(None) if n.differentiable]
            if not nodes:
                raise EngineError(ErrorCode.NO_GRADIENTS, "no differentiable filter is loaded")
        else:
            nodes = self.nodes.select(node_ids)
        out: dict[str, dict[str, Any]] = {}
        for node in nodes:
            if not node.differentiable:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r} is not differentiable: it has no gradients",
                    {"node_id": node.node_id},
                )
            params = trainable(node)
            if not params:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r} has no trainable parameters",
                    {"node_id": node.node_id},
                )
            missing = [name for name, p in params.items() if p.grad is None]
            if missing:
                raise EngineError(
                    ErrorCode.NO_GRADIENTS,
                    f"node {node.node_id!r}: no gradient on {missing} "
                    "(run fit or composite_fit with labels first)",
                    {"node_id": node.node_id, "parameters": missing},
                )
            out[node.node_id] = {name: to_cpu(p.grad) for name, p in params.items()}
        return out

    def apply_gradients(
        self, gradients: Mapping[str, Any], *, epoch_end: bool = False
    ) -> dict[str, int]:
        """Write ``gradients`` onto the parameters and take one step of the nodes as a run
        (:meth:`~engine.optimizers.Optimizers.step_run`: their gradient clipped as a whole,
        each node's persistent optimizer, then its scheduler; an epoch-wise one when
        ``epoch_end``).

        ``gradients`` may be compressed (:mod:`protocol.compressed_trees`). Every node and
        tensor is checked before anything is written, so a mismatch leaves the model untouched.

        Returns:
            How many parameters were stepped, by node id.

        Raises:
            EngineError: ``GRADIENT_MISMATCH`` when names or shapes are not the same model,
                ``NO_GRADIENTS`` for an empty gradient set, ``BAD_REQUEST`` for a compressed
                one that cannot be decoded.
        """
        gradients = _received(gradients)
        if not gradients:
            raise EngineError(ErrorCode.NO_GRADIENTS, "apply_gradients was given no gradients")
        plan: list[tuple[Node, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = []
        for node_id, grads in gradients.items():
            node = self.nodes.node(node_id)
            params = trainable(node) if node.differentiable else {}
            if not params:
                raise EngineError(
                    ErrorCode.GRADIENT_MISMATCH,
                    f"node {node_id!r} has no trainable parameters to apply gradients to",
                    {"node_id": node_id},
                )
            check_same_names(node_id, "gradients", set(grads), set(params))
            pairs = []
            for name, p in params.items():
                g = torch.as_tensor(grads[name])
                if tuple(g.shape) != tuple(p.shape):
                    raise EngineError(
                        ErrorCode.GRADIENT_MISMATCH,
                        f"node {node_id!r}, parameter {name!r}: gradient has shape "
                        f"{list(g.shape)}, parameter has {list(p.shape)}",
                        {"node_id": node_id, "parameter": name},
                    )
                pairs.append((p, g))
            plan.append((node, pairs))
        applied: dict[str, int] = {}
        for node, pairs in plan:
            for p, g in pairs:
                p.grad = g.to(dtype=p.dtype, device=p.device)
            applied[node.node_id] = len(pairs)
        self.optimizers.step_run([node for node, _ in plan], epoch_end=epoch_end)
        return applied


def _received(tree: Mapping[str, Any]) -> Mapping[str, Any]:
    """``tree`` as it was sent: decoded when it travelled compressed.

    Raises:
        EngineError: ``BAD_REQUEST`` for a compressed tree that cannot be decoded.
    """
    if not is_compressed(tree):
        return tree
    try:
        return decode(tree)
    except BadCompressedTree as exc:
        raise EngineError(ErrorCode.BAD_REQUEST, f"a compressed tree: {exc}") from exc
