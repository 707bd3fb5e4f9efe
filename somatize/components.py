"""The base of the parts a federated strategy takes by name — a robust aggregator, a privacy
mechanism, secure aggregation: each is checked when it is built, by the options model the
coordinator checks it with, and travels as ``{"name": ..., parameter: value}``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from protocol.options.base import Dialect, NamedOptions, from_spec

__all__ = ["Component"]


@dataclass(frozen=True)
class Component:
    """A named part of a strategy; subclasses set :attr:`name`, :attr:`registry` (its kind's
    options models by name) and :attr:`kind` (how a refusal names the kind)."""

    #: The part's name on the wire.
    name: ClassVar[str]
    registry: ClassVar[Mapping[str, type[NamedOptions]]]
    kind: ClassVar[str]

    def __post_init__(self) -> None:
        self.options()

    def options(self) -> dict[str, Any]:
        """``{"name": ..., parameter: value, ...}``, as the strategy sends it."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        checked = from_spec(self.registry, self.kind, {"name": self.name, **given}, Dialect.SDK)
        return {"name": self.name, **checked.parameters()}
