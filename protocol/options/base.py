"""The machinery of option models: the base model, the rules options share, and whose name a
refusal carries (its words: :mod:`protocol.options.refusals`).

Every option a job may ask for is a field of one frozen pydantic model (:class:`Options`), the
one definition the SDK builds (``somatize`` subclasses the models), the wire carries and the
coordinator reads. Each option's rule is declared on its field (:class:`Rule`, or one of the
annotated types built with it: :data:`PositiveInt`, :data:`Seconds`, :data:`Selector`...) and
gets the value as given, before pydantic's own validation, so that nothing is coerced (``"3"``
is not 3, ``1`` is not ``True``); what spans several options is a model validator of the model
that takes them (``model_validator(mode="after")``: it sees the options once each has passed
its rule). A rule raises a ``ValueError`` in its own words (``tag must be a non-empty string or
None, not 3``); whoever asked (:class:`Caller`) only decides whose name prefixes it: the SDK
class's (``Local: tag must ...``) or the strategy's as it travels (``local: tag must ...``).
Where several options are wrong, the first in the model's field order is refused.

The parts a strategy takes by name — a server optimizer, a robust aggregator, a privacy
mechanism, secure aggregation — are models too (:class:`NamedOptions`): in Python the model
itself, on the wire ``{"name": ..., parameter: value}`` (:func:`part`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError
from enum import StrEnum
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticUndefined, core_schema

from protocol.options.devices import is_device
from protocol.options.refusals import named_by, prefixed

__all__ = [
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_RESTART_TIMEOUT",
    "KEEP_ON_SUCCESS",
    "AboveZero",
    "Boolean",
    "Caller",
    "CheckpointOptions",
    "Decay",
    "DeviceName",
    "Form",
    "NamedOptions",
    "Options",
    "Part",
    "PositiveInt",
    "RestartOptions",
    "Rule",
    "Seconds",
    "Selector",
    "StrategyOptions",
    "T",
    "above_zero",
    "boolean",
    "build",
    "count",
    "decay",
    "device",
    "finite_positive",
    "form_of",
    "from_spec",
    "integer",
    "is_finite",
    "named",
    "named_by",
    "number_in",
    "one_of",
    "parse",
    "part",
    "positive_int",
    "prefixed",
    "real",
    "real_in",
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


def form_of(info: ValidationInfo) -> Form:
    """How the options being validated are given (:class:`Form`; the wire unless told)."""
    return Form((info.context or {}).get(_FORM, Form.WIRE))


# -- the rules every model may use ---------------------------------------------------------------
#
# Each is ``rule(key, value, *args)``: ``value`` as the field holds it, or a ``ValueError`` in
# the rule's words, naming the option ``key``. A field declares its rule with :class:`Rule`.


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


def integer(value: object) -> bool:
    """Whether ``value`` is an integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(key: str, value: object) -> int:
    """An integer >= 1 (not a bool)."""
    if not integer(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{key} must be a positive integer, not {value!r}")
    return value  # type: ignore[return-value]


def count(key: str, value: object, least: int) -> int:
    """An integer >= ``least`` (not a bool)."""
    if not integer(value) or value < least:  # type: ignore[operator]
        raise ValueError(f"{key} must be an integer >= {least}, not {value!r}")
    return value  # type: ignore[return-value]


def one_of(key: str, value: object, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return value


def is_finite(value: object) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def real(key: str, value: object) -> float:
    """``value`` as a float, if it is a finite real number (not a bool)."""
    if not is_finite(value):
        raise ValueError(f"{key} must be a finite number, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def _within(number: float, interval: str) -> bool:
    """Whether ``number`` lies in ``interval``, written as a refusal shows it: ``"[0, 1)"``."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    above = number >= low if interval.startswith("[") else number > low
    below = number <= high if interval.endswith("]") else number < high
    return above and below


def number_in(key: str, value: object, interval: str) -> float:
    """A finite number in ``interval`` (``"(0, 1]"``: brackets closed, parentheses open)."""
    if not is_finite(value) or not _within(value, interval):  # type: ignore[arg-type]
        raise ValueError(f"{key} must be a number in {interval}, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def real_in(key: str, value: object, interval: str) -> float:
    """A finite number (:func:`real`), then one in ``interval`` (as :func:`number_in`)."""
    if not _within(real(key, value), interval):
        raise ValueError(f"{key} must be in {interval}, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def finite_positive(key: str, value: object, why: str = "") -> float:
    """A finite number > 0; ``why`` says, after the value, what the limit means."""
    if not is_finite(value) or value <= 0:  # type: ignore[operator]
        because = f" ({why})" if why else ""
        raise ValueError(f"{key} must be a finite number > 0, not {value!r}{because}")
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


class Rule:
    """A field's rule, declared on the field: ``check(key, value, *args, **kwargs)`` (one of
    the rules above, or a model's own) gets the value as given, before pydantic's own
    validation of the field's type (which then only confirms it: nothing is coerced), and
    returns it as the field holds it, or raises a ``ValueError`` in its words, ``key`` being
    the field's name (:meth:`key`)::

        spares: Annotated[int, Rule(count, 0)] = 0
        workers: PositiveInt | None = None  # (a rule inside ``| None``: not run on None)

    A rule named like a field (``device``) is that field's default inside the class body:
    declare it through a module-level alias (:data:`DeviceName`).
    """

    __slots__ = ("args", "check", "kwargs")

    def __init__(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.check, self.args, self.kwargs = check, args, kwargs

    def key(self, info: ValidationInfo) -> str:
        """What the refusal calls the field: its name."""
        return str(info.field_name)

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.with_info_before_validator_function(self._validate, handler(source))

    def _validate(self, value: Any, info: ValidationInfo) -> Any:
        return self.check(self.key(info), value, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        given = [*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"Rule({', '.join([self.check.__name__, *given])})"


PositiveInt = Annotated[int, Rule(positive_int)]
"""An integer >= 1 (not a bool)."""

Seconds = Annotated[float, Rule(seconds)]
"""A timeout: a finite number of seconds > 0."""

Boolean = Annotated[bool, Rule(boolean)]
"""``True`` or ``False`` (not 1, not ``"yes"``)."""

Selector = Annotated[str | None, Rule(selector)]
"""A worker id or tag: a non-empty string, or unset."""

DeviceName = Annotated[str | None, Rule(device)]
"""A device a job may ask for (:data:`~protocol.options.devices.DEVICES`), or unset."""

AboveZero = Annotated[float, Rule(above_zero)]
"""A part's parameter: a finite number > 0."""

Decay = Annotated[float, Rule(decay)]
"""A part's decay rate: a finite number in [0, 1)."""


# -- the models ----------------------------------------------------------------------------------


def _fields(data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"options must be an object, not {data!r}")
    return dict(data)


class Options(BaseModel):
    """A frozen set of options: the schema (the fields, each with its rule: :class:`Rule`), the
    rules that span several options (a subclass's ``model_validator(mode="after")``) and the
    wire form (:meth:`to_wire`)."""

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
    def _as_given(cls, data: Any, info: ValidationInfo) -> dict[str, Any]:
        """The options given, with the defaults this model gives those it inherits
        (:attr:`defaults`), and ``None`` for a required one not given: its rule then says what
        it must be (``rounds must be a positive integer, not None``)."""
        fields = dict(cls.defaults) | _fields(data)
        required = (key for key, field in cls.model_fields.items() if field.is_required())
        return {key: None for key in required if key not in fields} | fields

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


class Part:
    """A field that holds a part (:func:`part`): one of ``registry``'s models, or on the wire
    its spec, made the model here; ``what`` and ``forms`` name the kind and its SDK classes in
    refusals::

        server: Annotated[ServerOptimizerOptions | None, Part(SERVER_OPTIMIZERS, ...)] = None
    """

    __slots__ = ("forms", "registry", "what")

    def __init__(self, registry: Mapping[str, type[NamedOptions]], what: str, forms: str) -> None:
        self.registry, self.what, self.forms = registry, what, forms

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.with_info_before_validator_function(self._validate, handler(source))

    def _validate(self, value: Any, info: ValidationInfo) -> NamedOptions | None:
        option = str(info.field_name)
        return part(self.registry, option, self.what, self.forms, value, form_of(info))

    def __repr__(self) -> str:
        return f"Part({self.what!r})"


# -- what strategies that restart, or save checkpoints, take -------------------------------------

DEFAULT_KEEP_CHECKPOINTS = 2
"""Checkpoints kept per job unless its strategy is told otherwise."""

KEEP_ON_SUCCESS = ("newest", "all", "none")
"""What of a job's checkpoints stays once it succeeded (``keep_on_success``)."""

DEFAULT_RESTART_TIMEOUT = 60.0
"""Seconds a job restarting after a fault waits for workers, unless told otherwise."""


def _restarts(key: str, value: object) -> int:
    if not integer(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{key} must be an integer >= 0 (0: never), not {value!r}")
    return value  # type: ignore[return-value]


def _every(key: str, value: object) -> int | None:
    if value is not None and (not integer(value) or value < 0):  # type: ignore[operator]
        raise ValueError(f"{key} must be None or an integer >= 0 (0: never), not {value!r}")
    return value  # type: ignore[return-value]


class RestartOptions(StrategyOptions):
    """What a strategy whose jobs restart after a fault of the cluster takes.

    Args:
        max_restarts: how many times a job that a lost worker, a crashed daemon or a broken
            collective would fail is queued again instead (from its last checkpoint, where its
            strategy keeps them; else from the start); 0 (default): never.
        restart_timeout: seconds each restart waits for workers to take the job.
    """

    max_restarts: Annotated[int, Rule(_restarts)] = 0
    restart_timeout: Seconds = DEFAULT_RESTART_TIMEOUT


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

    checkpoint_every: Annotated[int | None, Rule(_every)] = None
    keep_checkpoints: PositiveInt = DEFAULT_KEEP_CHECKPOINTS
    inherited_after = "keep_checkpoints"
    keep_on_success: Annotated[str, Rule(one_of, KEEP_ON_SUCCESS)] = "newest"
