"""The machinery of strategy options: the base model, its checks and how refusals are worded.

Each strategy's options (:mod:`protocol.options.strategies`, :mod:`protocol.options.federated`)
subclass :class:`StrategyOptions`, whose ``_check`` gets the raw fields and a :class:`Say` that
words a refusal for whoever asked (:class:`Dialect`); :func:`parse` builds one and turns a
refusal into a :class:`ValueError` naming the bad option.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from protocol.options.devices import is_device

__all__ = [
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_RESTART_TIMEOUT",
    "CheckpointOptions",
    "Dialect",
    "NamedOptions",
    "RestartOptions",
    "Say",
    "StrategyOptions",
    "T",
    "check_named",
    "from_spec",
    "message_of",
    "named",
    "parse",
]


class Dialect(StrEnum):
    """Who is asking, and so how a refusal is worded."""

    SDK = "sdk"  # Python arguments of a somatize class
    WIRE = "wire"  # JSON options of a StrategySpec


@dataclass(frozen=True)
class Say:
    """Words a refusal for ``owner`` in ``dialect``."""

    owner: str
    dialect: Dialect

    def no(self, sdk: str, wire: str | None = None) -> ValueError:
        text = sdk if self.dialect is Dialect.SDK or wire is None else wire
        return ValueError(f"{self.owner}: {text}")

    # -- the checks every strategy shares ------------------------------------------------------

    def selector(self, key: str, value: object) -> str | None:
        """A worker id or tag: a non-empty string, or unset."""
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise self.no(
                f"{key} must be a non-empty string or None, not {value!r}",
                f"{key} must be a non-empty string, not {value!r}",
            )
        return value

    def device(self, key: str, value: object) -> str | None:
        """A device a job may ask for (:data:`DEVICES`), or unset."""
        if value is not None and not is_device(value):
            forms = "'cpu', 'cuda' (any CUDA device), 'cuda:N' or 'mps'"
            raise self.no(
                f"{key} must be None (any device), {forms}, not {value!r}",
                f"{key} must be one of {forms}, not {value!r}",
            )
        return value if isinstance(value, str) else None

    def positive_int(self, key: str, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.no(f"{key} must be a positive integer, not {value!r}")
        return value

    def real(self, key: str, value: object, wire: str | None = None) -> float:
        """``value`` as a float, if it is a finite real number (not a bool)."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.no(f"{key} must be a finite number, not {value!r}", wire)
        return float(value)


def _say(cls: type[StrategyOptions], info: ValidationInfo) -> Say:
    dialect = Dialect((info.context or {}).get("dialect", Dialect.WIRE))
    return Say(cls.sdk_name if dialect is Dialect.SDK else cls.wire_name, dialect)


def _fields(data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"options must be an object, not {data!r}")
    return dict(data)


class StrategyOptions(BaseModel):
    """Options of one strategy: the schema, the rules (``_check``) and the wire form."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The strategy's name on the wire, and its SDK class's name.
    wire_name: ClassVar[str]
    sdk_name: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _validate(cls, data: Any, info: ValidationInfo) -> dict[str, Any]:
        return cls._check(_fields(data), _say(cls, info))

    @classmethod
    def _check(cls, fields: dict[str, Any], say: Say) -> dict[str, Any]:
        """``fields`` checked, in the order a person would fix them; the first fault raised."""
        return fields

    def to_wire(self) -> dict[str, Any]:
        """The options as a client sends them (JSON values; unset options left out)."""
        return self.model_dump(exclude_none=True)


T = TypeVar("T", bound=StrategyOptions)


def parse(cls: type[T], data: Mapping[str, Any], dialect: Dialect) -> T:
    """``data`` as ``cls``, or the one :class:`ValueError` saying what is wrong.

    On the wire an option the strategy does not take is refused, naming what it takes.
    """
    if dialect is Dialect.WIRE and isinstance(data, Mapping):
        allowed = set(cls.model_fields)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"strategy {cls.wire_name!r} takes no option {unknown}; it takes {sorted(allowed)}"
            )
    try:
        return cls.model_validate(data, context={"dialect": dialect})
    except ValidationError as exc:
        raise ValueError(message_of(exc)) from None


class NamedOptions(StrategyOptions):
    """Options of a part a strategy takes by name — a server optimizer, a robust aggregator, a
    privacy mechanism, secure aggregation — as ``{"name": ..., parameter: value}``; the range
    checks they share."""

    name: str

    def parameters(self) -> dict[str, Any]:
        """Everything but the name."""
        return {k: v for k, v in self.model_dump().items() if k != "name"}

    @classmethod
    def _given(cls, fields: dict[str, Any], key: str) -> Any:
        return fields.get(key, cls.model_fields[key].default)

    @classmethod
    def _positive(cls, say: Say, fields: dict[str, Any], key: str, zero: bool = False) -> float:
        """``key`` a finite number > 0 (>= 0 with ``zero``)."""
        value = cls._given(fields, key)
        number = say.real(key, value, f"{key} must be a finite number, got {value!r}")
        if number < 0 or (number == 0 and not zero):
            rule = ">= 0" if zero else "> 0"
            raise say.no(
                f"{key} must be {rule}, not {value!r}", f"{key} must be {rule}, got {value!r}"
            )
        return number

    @classmethod
    def _count(cls, say: Say, fields: dict[str, Any], key: str, least: int) -> int:
        """``key`` an integer >= ``least``."""
        value = cls._given(fields, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise say.no(f"{key} must be an integer >= {least}, not {value!r}")
        return value


def named(
    registry: Mapping[str, type[T]],
    what: str,
    name: object,
    parameters: Mapping[str, Any],
    dialect: Dialect,
) -> T:
    """The member of ``registry`` called ``name`` (a server optimizer, an aggregator...) with
    ``parameters``, checked; ``what`` names the kind in refusals.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    cls = registry.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(registry)}")
    allowed = [key for key in cls.model_fields if key != "name"]
    unknown = sorted(str(key) for key in parameters if key not in allowed)
    if unknown:
        takes = f"takes options {allowed}" if allowed else "takes no options"
        raise ValueError(f"{what} {name!r} {takes}; got unknown {unknown}")
    try:
        return cls.model_validate({"name": name, **parameters}, context={"dialect": dialect})
    except ValidationError as exc:
        raise ValueError(message_of(exc)) from None


def check_named(
    say: Say, registry: Mapping[str, type[T]], option: str, what: str, forms: str, spec: object
) -> T:
    """The ``option`` a strategy was given — ``{"name": ..., parameter: value}`` naming one of
    ``registry`` (each a ``what``; ``forms`` the SDK's classes) — checked, or refused naming
    the option."""
    if not isinstance(spec, Mapping):
        raise say.no(
            f"{option} must be {forms} or None, not {spec!r}",
            f"{option} must be an object with a name (one of {sorted(registry)}) and its "
            f"parameters, not {spec!r}",
        )
    try:
        return from_spec(registry, what, spec, say.dialect)
    except ValueError as exc:
        raise say.no(f"{option}: {exc}") from None


def from_spec(
    registry: Mapping[str, type[T]], what: str, spec: Mapping[str, Any], dialect: Dialect
) -> T:
    """:func:`named` of a ``{"name": ..., parameter: value}`` spec.

    Raises:
        ValueError: as :func:`named`.
    """
    parameters = {k: v for k, v in spec.items() if k != "name"}
    return named(registry, what, spec.get("name"), parameters, dialect)


def message_of(exc: ValidationError) -> str:
    """The message of the first check that refused (not pydantic's report around it)."""
    first = exc.errors()[0]
    error = (first.get("ctx") or {}).get("error")
    return str(error) if error is not None else str(exc)


DEFAULT_KEEP_CHECKPOINTS = 2
"""Checkpoints kept per job unless its strategy is told otherwise."""

DEFAULT_RESTART_TIMEOUT = 60.0
"""Seconds a job restarting after a fault waits for workers, unless told otherwise."""


class RestartOptions(StrategyOptions):
    """What a strategy whose jobs restart after a fault of the cluster takes: ``max_restarts``,
    how many times a job that a lost worker, a crashed daemon or a broken collective would fail
    is queued again instead (from its last checkpoint, where its strategy keeps them; else from
    the start), waiting up to ``restart_timeout`` seconds each time for workers to take it."""

    max_restarts: int = 0
    restart_timeout: float = DEFAULT_RESTART_TIMEOUT

    @classmethod
    def _check_restarts(cls, fields: dict[str, Any], say: Say) -> None:
        restarts = fields.get("max_restarts", 0)
        if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
            raise say.no(f"max_restarts must be an integer >= 0 (0: never), not {restarts!r}")
        timeout = fields.get("restart_timeout", DEFAULT_RESTART_TIMEOUT)
        wire = f"restart_timeout must be a positive number of seconds, not {timeout!r}"
        if say.real("restart_timeout", timeout, wire) <= 0:
            raise say.no(f"restart_timeout must be > 0, not {timeout!r}", wire)

    def _restarts_wire(self) -> dict[str, Any]:
        if not self.max_restarts:
            return {}
        return {"max_restarts": self.max_restarts, "restart_timeout": self.restart_timeout}


class CheckpointOptions(RestartOptions):
    """What a strategy that saves checkpoints of its runs takes: ``checkpoint_every`` steps (or
    rounds; ``None``: at the end of every epoch or after 60 s of training, whichever comes
    first; ``0``: never) and ``keep_checkpoints``, how many are kept (at least 1); and the
    restart options (:class:`RestartOptions`), a restart going back to the last checkpoint."""

    checkpoint_every: int | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS

    @classmethod
    def _check_checkpoints(cls, fields: dict[str, Any], say: Say) -> None:
        every = fields.get("checkpoint_every")
        if every is not None and (
            not isinstance(every, int) or isinstance(every, bool) or every < 0
        ):
            raise say.no(
                f"checkpoint_every must be None or an integer >= 0 (0: never), not {every!r}",
                f"checkpoint_every must be an integer >= 0 (0: never), not {every!r}",
            )
        say.positive_int(
            "keep_checkpoints", fields.get("keep_checkpoints", DEFAULT_KEEP_CHECKPOINTS)
        )
        cls._check_restarts(fields, say)

    def _checkpoints_wire(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.checkpoint_every is not None:
            options["checkpoint_every"] = self.checkpoint_every
        if self.keep_checkpoints != DEFAULT_KEEP_CHECKPOINTS:
            options["keep_checkpoints"] = self.keep_checkpoints
        return options | self._restarts_wire()
