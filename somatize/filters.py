"""The filter that learns by gradient descent: :class:`TorchFilter`.

A filter (:class:`somatize.graph.Filter`, the unit a graph is made of) learns in ``fit(x,
y=None) -> state`` and applies what it learned in ``forward(x, state) -> output``. A
:class:`TorchFilter` wraps a ``torch.nn.Module`` and learns by gradient descent; its state is
the module's ``state_dict`` (tensors). It is trained by :class:`engine.engine.Engine`, the one
training loop used in-process and in the filter daemon.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from engine.batches import INPUTS, arguments
from engine.metrics import METRICS, check_metrics, metric_name
from engine.step_functions import model_loss
from engine.stepping import check_schedule, made_scheduler, named_scheduler
from engine.transfer import PRECISIONS
from protocol.options.training import TrainingOptions
from protocol.rules.rows import map_leaves
from protocol.text.wording import did_you_mean
from somatize.graph import Filter, Graph, snake_case
from somatize.keywords import suggesting

LossSpec = str | Callable[[Any, torch.Tensor], torch.Tensor]
StepSpec = Callable[[Any, Any], Any]
OptimizerSpec = str | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerSpec = str | Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "cross_entropy": F.cross_entropy,
    "nll": F.nll_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}
_REGRESSION_LOSSES = {"mse", "l1", "bce_with_logits"}
_CLASS_LOSSES = {"cross_entropy", "nll"}
MODEL_LOSS = "model"
"""``loss="model"``: the module computes its own loss (``output.loss``, or a scalar output)."""
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


DEFAULT_TRAINING = TrainingOptions()
"""The training options of a TorchFilter given none: its keyword arguments' defaults."""

_NORM = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)
_RANDOM = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def layer_kinds(module: Any) -> dict[str, Any]:
    """What in ``module`` makes data-parallel replicas differ from one process training it
    (:mod:`protocol.rules.equivalence`): whether it holds buffers, its classes that normalise with
    batch statistics and those that draw random numbers in training; and the shapes of its
    trainable parameters (what a step exchanges: :mod:`protocol.rules.traffic`). A dropout
    layer with ``p=0`` draws nothing. Nothing for what is not a module."""
    if not isinstance(module, torch.nn.Module):
        return {}
    modules = list(module.modules())
    return {
        "parameter_shapes": [list(p.shape) for p in module.parameters() if p.requires_grad],
        "buffers": any(True for _ in module.buffers()),
        "normalization": sorted({type(m).__name__ for m in modules if isinstance(m, _NORM)}),
        "randomness": sorted(
            {type(m).__name__ for m in modules if isinstance(m, _RANDOM) and _draws(m)}
        ),
    }


def _draws(module: torch.nn.Module) -> bool:
    """Whether a dropout layer draws anything in training: not with ``p=0``."""
    return float(getattr(module, "p", 1.0)) > 0


class TorchFilter(Filter):
    """A filter that wraps a ``torch.nn.Module`` and learns by gradient descent.

    Args:
        module: the model; its current weights are the initial weights of training. It is
            called on a batch as ``inputs`` says: by default ``module(x)`` for an array,
            ``module(*x)`` for a tuple of arrays, ``module(**x)`` for a dict of them.
        loss: ``"mse"``, ``"l1"``, ``"cross_entropy"``, ``"nll"``, ``"bce_with_logits"``, a
            callable ``(output, y) -> scalar tensor``, or ``"model"``: the module computes its
            own loss from the batch (``output.loss``, as a Hugging Face model given
            ``labels``; ``output["loss"]``; or a scalar output), and there is no ``y``.
            ``"cross_entropy"``/``"nll"`` take sequence logits ``(B, T, V)`` against ``(B, T)``
            targets too (the mean over every token). Only the last filter of a chain of
            TorchFilters has its loss used.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"``, or a callable ``(params) -> Optimizer``.
        lr: learning rate of a named optimizer.
        batch_size: rows per optimizer step (``None``: all rows in one batch).
        epochs: passes over the data.
        shuffle: permute the rows every epoch (a ``torch.Generator`` seeded with ``seed``);
            otherwise take them in order.
        seed: seeds the shuffling and, during training, torch's default generator (dropout...).
        optimizer_options: extra keyword arguments of a named optimizer (``momentum=0.9``...).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: forward and loss run under
            ``torch.autocast`` with that dtype (weights and states stay fp32); ``"fp16"``
            training steps through a ``torch.amp.GradScaler``.
        scheduler: a learning-rate schedule for the optimizer: a callable ``(optimizer) ->
            torch.optim.lr_scheduler.LRScheduler``, or ``"cosine"`` (``CosineAnnealingLR`` down
            to ``eta_min`` over the whole run, or ``t_max`` intervals) or ``"linear_warmup"``
            (``LinearLR`` from ``start_factor`` times ``lr`` up to ``lr`` over ``warmup``
            intervals, then constant), their arguments in ``scheduler_options``.
        scheduler_interval: ``"step"``: the scheduler steps after every optimizer step;
            ``"epoch"``: after every epoch.
        scheduler_options: the arguments of a named scheduler.
        clip_grad_norm: clip the gradient of the whole chain's parameters to this 2-norm before
            each step (``torch.nn.utils.clip_grad_norm_``); in DataParallel the global gradient,
            after the all-reduce; in a pipeline that of every stage's parameters together.
        accumulate: take one optimizer step every ``accumulate`` batches, each batch's loss
            weighted by its share of their rows: the steps of ``batch_size * accumulate``-row
            batches, in the memory of ``batch_size`` rows.
        metrics: what to evaluate on validation data at the end of every epoch, beside
            ``val_loss``: ``"accuracy"``, ``"mse"``, ``"mae"``, or callables ``(output, y) ->
            float`` (named after the function), each the mean of its value on every
            validation batch weighted by the batch's rows.
        step: what a training step computes, when the loss is more than ``loss(output, y)``:
            ``step(model, batch) -> loss`` (a scalar tensor) or ``(loss, {name: value})``,
            ``batch`` being ``x`` (``(x, y)`` with labels) on the device. The engine still
            owns the optimizer, accumulation, clipping, precision, the collectives and
            checkpoints; validation computes ``val_loss`` and ``val_<name>`` with it, and the
            history's rows carry each metric's epoch mean. A filter with a step function
            trains alone (no other TorchFilter right before or after it).
        inputs: how the module takes a batch: ``"auto"`` (above) or ``"one"`` (``module(x)``
            whatever ``x`` is: a module whose ``forward`` takes the whole dict).
        eval_batch_size: rows per forward when evaluating validation data and forwarding the
            training data after training (default ``batch_size``): memory bounded by a batch,
            never the dataset.
        max_steps: stop after this many optimizer steps, mid-epoch if need be (the schedules
            span the steps actually taken; the last epoch's row is of the batches it trained).
            ``graph.fit``, Local, DataParallel and DiLoCo (which synchronises at the last
            step); the federated strategies (whose horizon is rounds) and ModelParallel refuse
            it at submit.
        validate_every: with validation data, evaluate it every this many optimizer steps
            too, beside each epoch's end (``FittedGraph.validations``). ``graph.fit``, Local
            and DataParallel; the other strategies refuse it at submit.

    Training settings (``batch_size``, ``epochs``, ``shuffle``, ``seed``, ``clip_grad_norm``,
    ``accumulate``, ``max_steps``, ``validate_every``, and ``metrics``) are those of the last
    TorchFilter of a chain; each filter keeps its own optimizer, ``lr`` and scheduler. The
    filter holds the first eight as one value, :attr:`training`
    (:class:`~protocol.options.training.TrainingOptions`: their rules and defaults, what a job
    carries to the coordinator); each reads as an attribute too (``net.batch_size``).
    """

    differentiable = True

    @suggesting
    def __init__(
        self,
        module: torch.nn.Module,
        *,
        loss: LossSpec = "mse",
        optimizer: OptimizerSpec = "sgd",
        lr: float = 0.01,
        batch_size: int | None = DEFAULT_TRAINING.batch_size,
        epochs: int = DEFAULT_TRAINING.epochs,
        shuffle: bool = DEFAULT_TRAINING.shuffle,
        seed: int = DEFAULT_TRAINING.seed,
        optimizer_options: Mapping[str, Any] | None = None,
        precision: str = "fp32",
        scheduler: SchedulerSpec | None = None,
        scheduler_interval: str = "step",
        scheduler_options: Mapping[str, Any] | None = None,
        clip_grad_norm: float | None = DEFAULT_TRAINING.clip_grad_norm,
        accumulate: int = DEFAULT_TRAINING.accumulate,
        metrics: Sequence[str | Callable[[torch.Tensor, torch.Tensor], Any]] | None = None,
        step: StepSpec | None = None,
        inputs: str = "auto",
        eval_batch_size: int | None = None,
        max_steps: int | None = DEFAULT_TRAINING.max_steps,
        validate_every: int | None = DEFAULT_TRAINING.validate_every,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchFilter wraps a torch.nn.Module, not {type(module).__name__}")
        if isinstance(loss, str) and loss not in _LOSSES and loss != MODEL_LOSS:
            raise ValueError(
                f"unknown loss {loss!r}; choose one of {sorted(_LOSSES)}, 'model' or a callable"
                + did_you_mean(loss, [*_LOSSES, MODEL_LOSS])
            )
        if step is not None and not callable(step):
            raise TypeError(f"step is a function (model, batch) -> loss, not {step!r:.60}")
        if step is not None and metrics:
            raise ValueError(
                "a step function returns its metrics itself, (loss, {name: value}): "
                "leave metrics= out"
            )
        if inputs not in INPUTS:
            raise ValueError(f"inputs is one of {list(INPUTS)}, not {inputs!r}")
        if eval_batch_size is not None and (
            isinstance(eval_batch_size, bool)
            or not isinstance(eval_batch_size, int)
            or eval_batch_size < 1
        ):
            raise ValueError(f"eval_batch_size must be at least 1, not {eval_batch_size!r}")
        if isinstance(optimizer, str) and optimizer not in _OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPTIMIZERS)} "
                "or a callable" + did_you_mean(optimizer, _OPTIMIZERS)
            )
        training = TrainingOptions.checked(
            epochs=epochs,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            accumulate=accumulate,
            clip_grad_norm=clip_grad_norm,
            max_steps=max_steps,
            validate_every=validate_every,
        )
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
        schedule_options = check_schedule(scheduler, scheduler_interval, scheduler_options)
        checked_metrics = check_metrics(metrics)
        self.module = module
        self.loss = loss
        self.optimizer = optimizer
        self.lr = lr
        self.training = training
        self.optimizer_options = dict(optimizer_options or {})
        self.precision = precision
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.scheduler_options = schedule_options
        self.metrics = checked_metrics
        self.step = step
        self.inputs = inputs
        self.eval_batch_size = eval_batch_size

    def default_name(self) -> str:
        return snake_case(type(self.module).__name__)

    # -- what the engine calls ----------------------------------------------------------------

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``; the engine makes it once and keeps it."""
        if callable(self.optimizer):
            return self.optimizer(params)
        optimizer_class: Any = _OPTIMIZERS[self.optimizer]
        return optimizer_class(params, lr=self.lr, **self.optimizer_options)  # type: ignore[no-any-return]

    def make_scheduler(
        self, optimizer: torch.optim.Optimizer, total: int | None
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate scheduler over ``optimizer`` (``None`` without one); a named one
        spans ``total`` intervals (steps or epochs: the whole run). The engine makes it with the
        optimizer and keeps it beside it."""
        scheduler = getattr(self, "scheduler", None)  # a filter pickled before schedules
        if scheduler is None:
            return None
        if callable(scheduler):
            return made_scheduler(scheduler, optimizer)
        if total is None:
            raise ValueError(f"the scheduler {scheduler!r} needs the run's length")
        return named_scheduler(scheduler, optimizer, total, self.scheduler_options)

    def compute_loss(self, output: Any, y: Any) -> torch.Tensor:
        """The mean loss of a batch."""
        if callable(self.loss):
            return self.loss(output, y)
        if self.loss == MODEL_LOSS:
            return model_loss(output, self.name or self.default_name())
        if self.loss in _CLASS_LOSSES and output.dim() > 2 and output.shape[:-1] == y.shape:
            # Sequence logits (B, T, V) against (B, T) targets: every token a row. (torch's own
            # layout, (B, V, T), goes to cross_entropy as it is.)
            output, y = output.reshape(-1, output.shape[-1]), y.reshape(-1)
        if self.loss in _REGRESSION_LOSSES:
            # The weights' dtype, not a bf16/fp16 autocast output's: labels are not rounded.
            # (getattr: a filter pickled before precision existed has none.)
            autocast = getattr(self, "precision", "fp32") != "fp32"
            y = y.to(self._float_dtype() or output.dtype if autocast else output.dtype)
            if y.shape != output.shape and y.numel() == output.numel():
                y = y.reshape(output.shape)  # (n,) labels against an (n, 1) output
        return _LOSSES[self.loss](output, y)

    def compute_metrics(self, output: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Each of :attr:`metrics` of ``output`` against ``y``, by name."""
        out = {}
        for metric in getattr(self, "metrics", ()):
            compute = METRICS[metric] if isinstance(metric, str) else metric
            out[metric_name(metric)] = float(compute(output, y))
        return out

    def prepare_input(self, x: Any) -> Any:
        """``x`` as a tensor (a tuple or dict of arrays: each as one); floating input is cast
        to the module's floating dtype."""
        dtype = self._float_dtype()

        def one(array: Any) -> torch.Tensor:
            tensor = torch.as_tensor(array)
            if tensor.is_floating_point() and dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            return tensor

        return map_leaves(one, x)

    def prepare_target(self, y: Any) -> Any:
        """``y`` as a tensor, or tensors (its dtype is settled against the output in
        :meth:`compute_loss`); ``None`` stays ``None``."""
        return None if y is None else map_leaves(torch.as_tensor, y)

    def forward(self, x: Any, state: Any) -> Any:
        """Run the module on ``x`` with the weights in ``state`` (eval mode, no gradient)."""
        args, kwargs = arguments(getattr(self, "inputs", "auto"), self.prepare_input(x))
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                if state is None or not state:
                    return self.module(*args, **kwargs)
                return functional_call(self.module, dict(state), args, kwargs)
        finally:
            self.module.train(was_training)

    def fit(self, x: Any, y: Any = None) -> Any:
        """Train a copy of this filter alone, as a one-node graph, and return its state."""
        graph = Graph([self])
        return graph.fit(x, y).states[graph.node_ids[0]]

    def _float_dtype(self) -> torch.dtype | None:
        for p in itertools.chain(self.module.parameters(), self.module.buffers()):
            if p.is_floating_point():
                return p.dtype
        return None


def _training_option(name: str) -> property:
    return property(lambda f: getattr(f.training, name), doc=f"``training.{name}``")


for _name in TrainingOptions.model_fields:  # each training option reads as the filter's own
    setattr(TorchFilter, _name, _training_option(_name))
