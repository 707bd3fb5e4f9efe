"""The machinery of option models: the base model, the rules options share, and whose name a
refusal carries (its words: :mod:`protocol.options.refusals`).

Every option a job may ask for is a field of one frozen pydantic model (:class:`Options`), the
one definition the SDK builds (``somatize`` subclasses the models), the wire carries and the
coordinator reads. A model's rules live in its ``_check``, which gets the raw fields and raises a
``ValueError`` in the rule's own words (``tag must be a non-empty string or None, not 3``);
whoever asked (:class:`Caller`) only decides whose name prefixes it: the SDK class's
(``Local: tag must ...``) or the strategy's as it travels (``local: tag must ...``).

The parts a strategy takes by name — a server optimizer, a robust aggregator, a privacy
mechanism, secure aggregation — are models too (:class:`NamedOptions`): in Python the model
itself, on the wire ``{"name": ..., parameter: value}`` (:func:`part`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import FrozenInstanceError
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticUndefined

from protocol.options.devices import is_device
from protocol.options.refusals import named_by, prefixed

__all__ = [
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_RESTART_TIMEOUT",
    "KEEP_ON_SUCCESS",
    "Caller",
    "CheckpointOptions",
    "Form",
    "NamedOptions",
    "Options",
    "RestartOptions",
    "StrategyOptions",
    "T",
    "above_zero",
    "boolean",
    "build",
    "count",
    "decay",
    "device",
    "from_spec",
    "is_finite",
    "named",
    "named_by",
    "parse",
    "part",
    "positive_int",
    "prefixed",
    "real",
    "seconds",
    "selector",
]


class Caller(StrEnum):
    """Who asks, and so whose name prefixes a refusal (the words are the rule's own)."""

    SDK = "sdk"  # the somatize class's name: ``DataParallel: ...``
    WIRE = "wire"  # the strategy's name as it travels: ``data_parallel: ...``


class Form(StrEnum):
    """How the options are given, and so how a part may be."""

    WIRE = "wire"  # JSON options: a part is ``{"name": ..., parameter: value}``
    PYTHON = "python"  # a somatize class's arguments: a part is its model (``sz.FedAdam()``)


_FORM = "form"
"""The validation context's key for the :class:`Form`."""


def _form(info: ValidationInfo) -> Form:
    return Form((info.context or {}).get(_FORM, Form.WIRE))


# -- the rules every model may use ---------------------------------------------------------------


def selector(key: str, value: object) -> str | None:
    """A worker id or tag: a non-empty string, or unset."""
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{key} must be a non-empty string or None, not {value!r}")
    return value


def device(key: str, value: object) -> str | None:
    """A device a job may ask for (:data:`~protocol.options.devices.DEVICES`), or unset."""
    if value is not None and not is_device(value):
        forms = "'cpu', 'cuda' (any CUDA device), 'cuda:N' or 'mps'"
        raise ValueError(f"{key} must be None (any device), {forms}, not {value!r}")
    return value if isinstance(value, str) else None


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(key: str, value: object) -> int:
    """An integer >= 1 (not a bool)."""
    if not _integer(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{key} must be a positive integer, not {value!r}")
    return value  # type: ignore[return-value]


def count(key: str, value: object, least: int) -> int:
    """An integer >= ``least`` (not a bool)."""
    if not _integer(value) or value < least:  # type: ignore[operator]
        raise ValueError(f"{key} must be an integer >= {least}, not {value!r}")
    return value  # type: ignore[return-value]


def is_finite(value: object) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def real(key: str, value: object) -> float:
    """``value`` as a float, if it is a finite real number (not a bool)."""
    if not is_finite(value):
        raise ValueError(f"{key} must be a finite number, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def seconds(key: str, value: object) -> float:
    """A timeout: a finite number of seconds > 0."""
    if not is_finite(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{key} must be a positive number of seconds, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def boolean(key: str, value: object) -> bool:
    """``True`` or ``False`` (not 1, not ``"yes"``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be True or False, not {value!r}")
    return value


def above_zero(key: str, value: object, zero: bool = False) -> float:
    """A part's parameter: a finite number > 0 (>= 0 with ``zero``)."""
    if not is_finite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    number = float(value)  # type: ignore[arg-type]
    if number < 0 or (number == 0 and not zero):
        raise ValueError(f"{key} must be {'>= 0' if zero else '> 0'}, got {value!r}")
    return number


def decay(key: str, value: object) -> float:
    """A part's decay rate: a finite number in [0, 1)."""
    if not is_finite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if not 0 <= float(value) < 1:  # type: ignore[arg-type]
        raise ValueError(f"{key} must be in [0, 1), got {value!r}")
    return float(value)  # type: ignore[arg-type]


# -- the models ----------------------------------------------------------------------------------


def _fields(data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"options must be an object, not {data!r}")
    return dict(data)


class Options(BaseModel):
    """A frozen set of options: the schema (the fields), the rules (:meth:`_check`) and the wire
    form (:meth:`to_wire`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: How a refusal names the model on the wire (a strategy's or a part's ``name``, where it
    #: has one), and in the SDK (its class's name there).
    wire_name: ClassVar[str]
    sdk_name: ClassVar[str]

    #: The defaults this model gives options it inherits (DiLoCo's ``checkpoint_every=0``), so
    #: that each option stays declared once, in the model that first takes it.
    defaults: ClassVar[Mapping[str, Any]] = {}

    #: Where the options a model inherits come in the order its options are given as
    #: arguments (the SDK's positional order): after this option of its own, set on the model
    #: itself; unset, before its own ones (the order of its fields). Options added to a model
    #: later are declared after it, so the arguments already taken keep their places.
    inherited_after: ClassVar[str | None] = None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if isinstance(name, str):
            cls.wire_name = name

    @model_validator(mode="before")
    @classmethod
    def _validate(cls, data: Any, info: ValidationInfo) -> dict[str, Any]:
        return cls._check(dict(cls.defaults) | _fields(data), _form(info))

    @classmethod
    def _check(cls, fields: dict[str, Any], form: Form) -> dict[str, Any]:
        """``fields`` checked, in the order a person would fix them (the first fault raised as
        a ``ValueError`` in the rule's words), parts made models (:func:`part`)."""
        return fields

    @classmethod
    def _given(cls, fields: Mapping[str, Any], key: str) -> Any:
        """``key`` as given, or its default (:meth:`default`)."""
        return fields[key] if key in fields else cls.default(key)

    @classmethod
    def default(cls, key: str) -> Any:
        """Option ``key``'s default here (``None`` for a required one)."""
        if key in cls.defaults:
            return cls.defaults[key]
        default = cls.model_fields[key].default
        return None if default is PydanticUndefined else default

    def to_wire(self) -> dict[str, Any]:
        """The options as a client sends them: JSON values, those at their defaults left out
        (the coordinator's model gives them again)."""
        return self.model_dump(mode="json", exclude_defaults=True)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}: options are frozen")

    def __str__(self) -> str:
        return repr(self)


T = TypeVar("T", bound=Options)


def _owner(cls: type[Options], caller: Caller) -> str:
    return cls.sdk_name if caller is Caller.SDK else cls.wire_name


def parse(cls: type[T], data: Mapping[str, Any], caller: Caller = Caller.WIRE) -> T:
    """``data`` as ``cls``, or the one :class:`ValueError` saying what is wrong, named for
    ``caller``.

    On the wire an option the strategy does not take is refused, naming what it takes.
    """
    if caller is Caller.WIRE and isinstance(data, Mapping):
        allowed = set(cls.model_fields)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"strategy {cls.wire_name!r} takes no option {unknown}; it takes {sorted(allowed)}"
            )
    try:
        return cls.model_validate(data, context={_FORM: Form.WIRE})
    except ValidationError as exc:
        raise named_by(_owner(cls, caller), exc, cls) from None


def build(model: Options, values: Mapping[str, Any]) -> None:
    """Validate Python arguments ``values`` into ``model`` (a new instance, as ``__init__``
    does; parts given as their models), refusals naming the SDK class."""
    cls = type(model)
    try:
        cls.__pydantic_validator__.validate_python(
            dict(values), self_instance=model, context={_FORM: Form.PYTHON}
        )
    except ValidationError as exc:
        raise named_by(cls.sdk_name, exc, cls) from None
    except TypeError as exc:  # a rule's own (pydantic passes them on): an argument not callable
        raise prefixed(cls.sdk_name, exc) from None


class StrategyOptions(Options):
    """Options of one strategy; ``name`` is the strategy's on the wire."""

    name: ClassVar[str]


N = TypeVar("N", bound="NamedOptions")


class NamedOptions(Options):
    """Options of a part a strategy takes by name — a server optimizer, a robust aggregator, a
    privacy mechanism, secure aggregation; on the wire ``{"name": name, parameter: value}``."""

    name: ClassVar[str]

    def parameters(self) -> dict[str, Any]:
        """The parameters by name (all of them, unset ones ``None``)."""
        return {key: getattr(self, key) for key in type(self).model_fields}

    @model_serializer
    def _as_part(self) -> dict[str, Any]:
        """``{"name": ..., parameter: value, ...}``, every parameter, as a strategy sends it
        (alone, :meth:`to_wire`, or as one of its options)."""
        return {"name": self.name, **self.parameters()}


def named(
    registry: Mapping[str, type[N]],
    what: str,
    name: object,
    parameters: Mapping[str, Any],
    caller: Caller = Caller.WIRE,
) -> N:
    """The member of ``registry`` called ``name`` (a server optimizer, an aggregator...) with
    ``parameters``, checked; ``what`` names the kind in refusals.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    cls = registry.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(registry)}")
    allowed = list(cls.model_fields)
    unknown = sorted(str(key) for key in parameters if key not in allowed)
    if unknown:
        takes = f"takes options {allowed}" if allowed else "takes no options"
        raise ValueError(f"{what} {name!r} {takes}; got unknown {unknown}")
    try:
        return cls.model_validate(dict(parameters), context={_FORM: Form.WIRE})
    except ValidationError as exc:
        raise named_by(_owner(cls, caller), exc, cls) from None


def from_spec(
    registry: Mapping[str, type[N]],
    what: str,
    spec: Mapping[str, Any],
    caller: Caller = Caller.WIRE,
) -> N:
    """:func:`named` of a ``{"name": ..., parameter: value}`` spec.

    Raises:
        ValueError: as :func:`named`.
    """
    parameters = {k: v for k, v in spec.items() if k != "name"}
    return named(registry, what, spec.get("name"), parameters, caller)


def part(
    registry: Mapping[str, type[N]],
    option: str,
    what: str,
    forms: str,
    value: object,
    form: Form,
) -> N | None:
    """The part a strategy's ``option`` holds (``what``, one of ``registry``; ``forms`` its SDK
    classes): a model of the registry, or on the wire ``{"name": ..., parameter: value}``.

    Raises:
        ValueError: anything else, or a spec the part refuses, naming the option.
    """
    if value is None or isinstance(value, tuple(registry.values())):
        return value  # type: ignore[return-value]
    if isinstance(value, Mapping) and form is Form.WIRE:
        try:
            return from_spec(registry, what, value)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    raise ValueError(
        f"{option} must be {forms} or None (on the wire: an object with a name, one of "
        f"{sorted(registry)}, and its parameters), not {value!r}"
    )


# -- what strategies that restart, or save checkpoints, take -------------------------------------

DEFAULT_KEEP_CHECKPOINTS = 2
KEEP_ON_SUCCESS = ("newest", "all", "none")
"""What of a job's checkpoints stays once it succeeded (``keep_on_success``)."""
"""Checkpoints kept per job unless its strategy is told otherwise."""

DEFAULT_RESTART_TIMEOUT = 60.0
"""Seconds a job restarting after a fault waits for workers, unless told otherwise."""


class RestartOptions(StrategyOptions):
    """What a strategy whose jobs restart after a fault of the cluster takes.

    Args:
        max_restarts: how many times a job that a lost worker, a crashed daemon or a broken
            collective would fail is queued again instead (from its last checkpoint, where its
            strategy keeps them; else from the start); 0 (default): never.
        restart_timeout: seconds each restart waits for workers to take the job.
    """

    max_restarts: int = 0
    restart_timeout: float = DEFAULT_RESTART_TIMEOUT

    @classmethod
    def _check_restarts(cls, fields: dict[str, Any]) -> None:
        restarts = cls._given(fields, "max_restarts")
        if not _integer(restarts) or restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0 (0: never), not {restarts!r}")
        seconds("restart_timeout", cls._given(fields, "restart_timeout"))


class CheckpointOptions(RestartOptions):
    """What a strategy that saves checkpoints of its runs takes, and the restart options
    (:class:`RestartOptions`: a restart goes back to the last checkpoint).

    Args:
        checkpoint_every: save a checkpoint every this many steps (or rounds); ``None``: at
            the end of every epoch or after 60 s of training, whichever comes first (every
            round, for a federated strategy); ``0``: never.
        keep_checkpoints: how many checkpoints of the job are kept (at least 1).
        keep_on_success: which of them stay once the job succeeded: ``"newest"`` (its end,
            what ``resume_from`` continues; the default), ``"all"`` (every one kept, to
            evaluate or continue from) or ``"none"``. A job that fails or is cancelled keeps
            them all.
    """

    checkpoint_every: int | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    inherited_after = "keep_checkpoints"
    keep_on_success: str = "newest"

    @classmethod
    def _check_checkpoints(cls, fields: dict[str, Any]) -> None:
        every = cls._given(fields, "checkpoint_every")
        if every is not None and (not _integer(every) or every < 0):
            raise ValueError(
                f"checkpoint_every must be None or an integer >= 0 (0: never), not {every!r}"
            )
        positive_int("keep_checkpoints", cls._given(fields, "keep_checkpoints"))
        kept = cls._given(fields, "keep_on_success")
        if kept not in KEEP_ON_SUCCESS:
            raise ValueError(
                f"keep_on_success must be one of {', '.join(map(repr, KEEP_ON_SUCCESS))}, "
                f"not {kept!r}"
            )
        cls._check_restarts(fields)
