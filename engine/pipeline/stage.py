"""A pipeline stage (ModelParallel): micro-batches forward and backward, one step per batch.

The micro-batches of a global batch go forward and backward one by one through the stage's
nodes, their gradients accumulate on the parameters, and the stage steps once per global batch
(GPipe, Huang et al. 2019).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.batches import num_rows
from engine.errors import EngineError
from engine.nodes import Node, Nodes, segments, trainable
from engine.optimizers import Optimizers
from engine.stepping import current_lr, squared_norm
from engine.transfer import cpu_tensor, to_cpu
from protocol.errors import ErrorCode


@dataclass
class _InFlight:
    """What a pipeline stage keeps of one micro-batch between its forward and its backward."""

    input: torch.Tensor | None  # the leaf whose gradient goes back; None on the first stage
    output: torch.Tensor  # the activation sent on, or (last stage) the scaled loss
    last: bool


class PipelineStage:
    """``nodes`` as one stage of a pipeline: its micro-batches in flight, its steps (taken
    with ``optimizers``)."""

    def __init__(self, nodes: Nodes, optimizers: Optimizers) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self._in_flight: dict[int, _InFlight] = {}  # by micro id
        self._batch_open = False  # a global batch has started and not been stepped

    def forget_in_flight(self) -> None:
        """Drop the micro-batches in flight and the open batch: the filters were replaced
        (:meth:`engine.engine.Engine.load`), and they belong to the modules that were."""
        self._in_flight.clear()
        self._batch_open = False

    def stage_forward(
        self,
        node_ids: Sequence[str],
        micro: int,
        x: Any,
        y: Any = None,
        scale: float = 1.0,
        last: bool = False,
        *,
        first: bool = False,
    ) -> Any:
        """Forward micro-batch ``micro`` through this pipeline stage and keep what its backward
        needs.

        A stage is zero or more plain filters followed by one run of differentiable filters. The
        plain filters only *apply* the state they hold (fitted beforehand with ``fit`` or
        ``composite_fit``, then held fixed, as single-process training holds them); the run
        goes forward in training mode. Gradients cannot flow back through a plain filter, so
        plain filters may only open the first stage.

        On a stage other than the first, a floating ``x`` is the previous stage's activation:
        it becomes a leaf that requires grad, so that :meth:`stage_backward` can send its
        gradient back. On the first stage (``first``, or an input that is not floating) the
        input needs no gradient.

        On the last stage the loss of the run's last filter is kept, multiplied by ``scale``:
        with ``scale = n_micro / N`` (rows of this micro-batch over rows of the global batch) the
        scaled losses of a global batch sum to its mean loss, so the gradients accumulated over
        its micro-batches are those of the whole batch (GPipe, Huang et al. 2019).

        Args:
            node_ids: the stage's nodes, in graph order.
            micro: the micro-batch id; unique among the micro-batches in flight.
            x: the micro-batch (first stage) or the previous stage's activation.
            y: the labels; required on the last stage, ignored elsewhere.
            scale: the weight of this micro-batch's loss (last stage only).
            last: this is the last stage: compute and keep the loss.
            first: this is the first stage: the input needs no gradient.

        Returns:
            The stage's output activation, detached; on the last stage
            ``{"loss": unscaled loss, "rows": rows, "lr": the learning rate the batch's step
            takes}``.

        Raises:
            EngineError: ``BAD_REQUEST`` for a micro id already in flight, a last stage without
                labels, or a stage that is not plain filters then one differentiable run.
        """
        plain, run = self._forward_parts(node_ids, micro, x, y, first=first, last=last)
        if not self._batch_open:
            # The first forward since the last step (or the load) opens a global batch: only its
            # micro-batches may contribute, whatever fit or gradient_pass left on the parameters.
            for node in run:
                node.filter.module.zero_grad(set_to_none=True)
            self._batch_open = True
        for node in plain:
            x = to_cpu(self.nodes.apply(node, x, self.nodes.state_of(node)))
        xt = self.nodes.on_device(run[0].filter.prepare_input(x))
        leaf: torch.Tensor | None = None
        if not first and not isinstance(xt, torch.Tensor):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"stage {list(node_ids)} gets the stage before's output, and a stage after "
                f"the first takes one tensor, not {type(xt).__name__}",
                {"micro": micro},
            )
        if not first and xt.is_floating_point():
            leaf = xt.detach().requires_grad_(True)  # detach: the caller's tensor is left alone
            xt = leaf
        if not last:
            out = self.nodes.train_forward(run, xt)
            self._in_flight[micro] = _InFlight(leaf, out, last=False)
            return to_cpu(out.detach())
        target = self.nodes.on_device(run[-1].filter.prepare_target(y))
        loss = self.nodes.batch_loss(run, xt, target).loss
        self._in_flight[micro] = _InFlight(leaf, loss * scale, last=True)
        lr = current_lr(self.optimizers.optimizer(run[-1]))  # what the step of this batch will take
        return {"loss": float(loss.detach()), "rows": num_rows(xt), "lr": lr}

    def _forward_parts(
        self, node_ids: Sequence[str], micro: int, x: Any, y: Any, *, first: bool, last: bool
    ) -> tuple[list[Node], list[Node]]:
        """The stage's plain nodes and its run, once the forward of ``micro`` can go ahead."""
        nodes = self.nodes.chain(node_ids, x, y if last else None)
        if micro in self._in_flight:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batch {micro} is already in flight (in flight: {sorted(self._in_flight)})",
                {"micro": micro, "in_flight": sorted(self._in_flight)},
            )
        plain, run = stage_parts(nodes)
        if plain and not first:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"plain filters {[n.node_id for n in plain]} open a stage that is not the first: "
                "gradients cannot flow back through them",
                {"node_ids": [n.node_id for n in plain]},
            )
        if last:
            self.nodes.check_labels(run, y, "training")
        return plain, run

    def stage_backward(self, micro: int, grad_output: Any = None) -> torch.Tensor | None:
        """Backward micro-batch ``micro`` through this stage; gradients accumulate.

        The last stage backpropagates its kept (scaled) loss, the others the gradient of the
        next stage's input, ``grad_output``. Parameter gradients are added to what the earlier
        micro-batches of the global batch left, never zeroed in between: GPipe's accumulation,
        so that :meth:`stage_step` applies the whole batch's gradient in one step.

        Returns:
            The gradient w.r.t. the stage's input, for the previous stage; ``None`` on the first
            stage (its input had no gradient).

        Raises:
            EngineError: ``BAD_REQUEST`` for a micro id not in flight (naming those that are), a
                ``grad_output`` on the last stage or none elsewhere, or one of the wrong shape.
        """
        flight = self._in_flight.get(micro)
        if flight is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batch {micro} is not in flight (in flight: {sorted(self._in_flight)})",
                {"micro": micro, "in_flight": sorted(self._in_flight)},
            )
        if flight.last:
            if grad_output is not None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro} ended on the last stage: it backpropagates its loss "
                    "and takes no grad_output",
                    {"micro": micro},
                )
            grad = None
        else:
            if grad_output is None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro} needs the gradient of this stage's output (grad_output)",
                    {"micro": micro},
                )
            grad = torch.as_tensor(grad_output)
            if tuple(grad.shape) != tuple(flight.output.shape):
                raise EngineError(
                    ErrorCode.BAD_REQUEST,
                    f"micro-batch {micro}: grad_output has shape {list(grad.shape)}, the "
                    f"stage's output has {list(flight.output.shape)}",
                    {"micro": micro},
                )
            grad = grad.to(dtype=flight.output.dtype, device=flight.output.device)
        del self._in_flight[micro]
        torch.autograd.backward(flight.output, grad)
        if flight.input is None:
            return None
        if flight.input.grad is None:  # the output does not depend on the input
            return cpu_tensor(torch.zeros_like(flight.input, requires_grad=False))
        return cpu_tensor(flight.input.grad)

    def stage_norm(self, node_ids: Sequence[str]) -> float:
        """The sum of the squared 2-norms of the gradients this stage's micro-batches left on
        its parameters: its part of the norm of the whole pipeline's gradient, which a
        ``clip_grad_norm`` clips (the coefficient comes back with :meth:`stage_step`)."""
        nodes = [n for n in self.nodes.select(node_ids) if n.differentiable]
        return squared_norm([p for node in nodes for p in trainable(node).values()])

    def stage_step(
        self,
        node_ids: Sequence[str],
        *,
        epoch_end: bool = False,
        coefficient: float | None = None,
    ) -> int:
        """End a global batch: one step of the stage's nodes as a run on the gradients its
        micro-batches accumulated — multiplied first by ``coefficient`` (the pipeline's
        clipping), then each node's persistent optimizer and scheduler (an epoch-wise one
        at ``epoch_end``) — then zero them (``set_to_none``).

        Gradients start as ``None`` after a load (:meth:`engine.engine.Engine.load`) and are
        zeroed here after each step, so each global batch accumulates from zero without relying
        on the order of micro ids; the first :meth:`stage_forward` after a step also clears
        whatever another command left.

        Returns:
            How many parameters were stepped (those with a gradient).

        Raises:
            EngineError: ``BAD_REQUEST`` while micro-batches are in flight (naming them);
                ``NO_GRADIENTS`` when no differentiable node has a gradient to step on.
        """
        if self._in_flight:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"micro-batches {sorted(self._in_flight)} are still in flight: backward them "
                "before stepping",
                {"in_flight": sorted(self._in_flight)},
            )
        nodes = [n for n in self.nodes.select(node_ids) if n.differentiable]
        stepped = sum(1 for node in nodes for p in trainable(node).values() if p.grad is not None)
        if not stepped:
            raise EngineError(
                ErrorCode.NO_GRADIENTS,
                f"nodes {list(node_ids)} have no gradients to step on "
                "(run stage_forward and stage_backward first)",
                {"node_ids": list(node_ids)},
            )
        # The pipeline's clipping is the coefficient, never this stage's own norm.
        self.optimizers.step_run(nodes, epoch_end=epoch_end, coefficient=coefficient, clip=False)
        for node in nodes:
            self.optimizers.optimizer(node).zero_grad(set_to_none=True)
        self._batch_open = False
        return stepped


def stage_parts(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """A pipeline stage's leading plain nodes and its one differentiable run.

    Raises:
        EngineError: ``BAD_REQUEST`` when the stage is anything else (no differentiable node,
            two runs, a plain filter after the run): its gradients could not flow as one graph.
    """
    parts = list(segments(nodes))
    if not parts[-1][0].differentiable or sum(s[0].differentiable for s in parts) != 1:
        ids = [n.node_id for n in nodes]
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"a pipeline stage is plain filters followed by one run of differentiable filters; "
            f"{ids} is not",
            {"node_ids": ids},
        )
    return [s[0] for s in parts[:-1]], parts[-1]
