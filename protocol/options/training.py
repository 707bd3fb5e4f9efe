"""How a chain of TorchFilters trains: :class:`TrainingOptions`, the settings of its training
loop, defined once.

``sz.TorchFilter`` takes them as keyword arguments and holds them (``TorchFilter.training``); a
job carries them to the coordinator (:class:`~protocol.messages.NodeInfo`), which cuts its
global batches by them; the engine's loop runs by them. A chain trains by its last
TorchFilter's; each filter keeps its own optimizer, learning rate and schedule, which are code
and never travel.

Each rule is a field's constraints, worded beside them (:class:`~protocol.options.refusals.
Refusal`): ``sz.TorchFilter(net, max_steps=0)`` is refused as ``max_steps is a whole number of
steps >= 1, not 0``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.options.refusals import Refusal, refused

__all__ = ["TrainingOptions"]

_BATCHES = Refusal("must be a whole number of batches >= 1")
_STEPS = Refusal("is a whole number of steps >= 1")
_NORM = Refusal("must be a positive number")
_FINITE_POSITIVE = Field(gt=0, allow_inf_nan=False, strict=True)


class TrainingOptions(BaseModel):
    """The settings of a chain's training loop (those of its last TorchFilter).

    Attributes:
        epochs: passes over the data.
        batch_size: rows per batch (``None``: all rows in one batch).
        shuffle: permute the rows every epoch (a generator seeded with ``seed``); otherwise
            take them in order.
        seed: seeds the shuffling and, during training, torch's default generator (dropout).
        accumulate: take one optimizer step every ``accumulate`` batches, each batch's loss
            weighted by its share of their rows: the steps of ``batch_size * accumulate``-row
            batches (:attr:`step_rows`), in the memory of ``batch_size`` rows.
        clip_grad_norm: clip the gradient of the chain's parameters to this 2-norm before each
            step (``torch.nn.utils.clip_grad_norm_``).
        max_steps: stop after this many optimizer steps, mid-epoch if need be.
        validate_every: with validation data, evaluate it every this many optimizer steps
            too, beside each epoch's end.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: Annotated[int, Field(ge=0), Refusal("must be a whole number >= 0")] = 1
    batch_size: Annotated[int | None, Field(ge=1), Refusal("must be at least 1 or None")] = 32
    shuffle: Annotated[bool, Refusal("must be True or False")] = True
    seed: Annotated[int, Refusal("must be an integer")] = 0
    accumulate: Annotated[int, Field(ge=1, strict=True), _BATCHES] = 1
    clip_grad_norm: Annotated[float | None, _FINITE_POSITIVE, _NORM] = None
    max_steps: Annotated[int | None, Field(ge=1, strict=True), _STEPS] = None
    validate_every: Annotated[int | None, Field(ge=1, strict=True), _STEPS] = None

    @classmethod
    def checked(cls, **values: Any) -> TrainingOptions:
        """The options ``values`` give, the others their defaults.

        Raises:
            ValueError: the first value a rule refuses, in the rule's words.
        """
        try:
            return cls(**values)
        except ValidationError as exc:
            raise refused(exc, cls) from None

    @property
    def step_rows(self) -> int | None:
        """The rows of one optimizer step: ``batch_size`` times ``accumulate`` (the batches of
        an epoch are one permutation cut in order, so ``accumulate`` consecutive batches are
        one batch that many times larger); ``None``: all rows."""
        return self.batch_size * self.accumulate if self.batch_size else None
