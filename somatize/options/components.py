"""How the SDK's option classes are built: each is a model of :mod:`protocol.options` — the one
definition of its options, their rules, their defaults and their documentation — subclassed only
to take Python arguments, positionally as well as by keyword, and to name itself in refusals.

:class:`SdkOptions` is that construction; :class:`Component` the base of the parts a federated
strategy takes by name (a server optimizer, a robust aggregator, a privacy mechanism, secure
aggregation), which travel as ``{"name": ..., parameter: value}``.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from protocol.options.base import NamedOptions, Options, build, prefixed
from somatize.keywords import with_suggestion

__all__ = ["Component", "SdkOptions", "argument_order"]


class SdkOptions(Options):
    """An option model built from Python arguments: ``Cls(a, b, c=...)`` binds them to the
    model's fields in the model's order (:func:`argument_order`, after :attr:`positional`), the
    model's rules check them, and a refusal is a ``ValueError`` naming the class
    (``DataParallel: workers must be ...``).

    Each SDK class says ``__init__ = SdkOptions.__init__``: type checkers give every pydantic
    model a keyword-only ``__init__`` of its own unless its class names one.
    """

    positional: ClassVar[tuple[str, ...]] = ()
    """The arguments taken first, in this order, where the model's order
    (:func:`argument_order`) cannot say it; the others follow in the model's order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        try:
            bound = cls.__signature__.bind(*args, **kwargs)
        except TypeError as exc:  # as a call's: a missing argument, one it does not take
            named = cls.__signature__.parameters
            raise prefixed(cls.__name__, with_suggestion(exc, named)) from None
        try:
            values = cls._from_python(dict(bound.arguments))
        except ValueError as refusal:
            raise prefixed(cls.sdk_name, refusal) from None
        build(self, values)

    @classmethod
    def _from_python(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The arguments as the model takes them (what the SDK takes in another form, turned
        into the model's)."""
        return values

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.__signature__ = _signature(cls)
        if cls.__doc__ is None:  # the model's: its arguments are documented there, once
            models = (c for c in cls.__mro__ if not issubclass(c, SdkOptions))
            cls.__doc__ = next((c.__doc__ for c in models if c.__doc__), None)

    def __repr_args__(self) -> Any:
        """The arguments in the order the class takes them."""
        for name in type(self).__signature__.parameters:
            yield name, getattr(self, name)

    def options(self) -> dict[str, Any]:
        """The options sent to the coordinator (JSON values; those at their defaults left out)."""
        return self.to_wire()


def argument_order(cls: type[Options]) -> list[str]:
    """The fields of ``cls`` in the order its arguments are taken: each model's own fields in
    the order they are declared, those it inherits before them or after its own
    :attr:`~protocol.options.base.Options.inherited_after`."""
    order: list[str] = []
    for model in reversed(cls.__mro__):  # the bases first
        if not (isinstance(model, type) and issubclass(model, Options)):
            continue
        inherited = {name for base in model.__bases__ for name in getattr(base, "model_fields", {})}
        own = [name for name in model.model_fields if name not in inherited]
        after = vars(model).get("inherited_after")
        cut = own.index(after) + 1 if after is not None else 0
        order = own[:cut] + order + own[cut:]
    return order


def _signature(cls: type[SdkOptions]) -> inspect.Signature:
    """The parameters of ``cls``: its model's fields, :attr:`~SdkOptions.positional` first and
    the others in :func:`argument_order`, with their defaults and types; a required one after
    one with a default is keyword-only, and so are those after it (as Python takes them)."""
    first = list(cls.positional)
    if len(set(first)) != len(first) or not set(first) <= set(cls.model_fields):
        raise TypeError(
            f"{cls.__name__}.positional {first} must name some of its fields "
            f"{list(cls.model_fields)}, each once"
        )
    order = first + [name for name in argument_order(cls) if name not in first]
    kind: inspect._ParameterKind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters, defaulted = [], False
    for name in order:
        field = cls.model_fields[name]
        if field.is_required() and defaulted:
            kind = inspect.Parameter.KEYWORD_ONLY
        defaulted = defaulted or not field.is_required()
        default = inspect.Parameter.empty if field.is_required() else cls.default(name)
        parameters.append(
            inspect.Parameter(name, kind, default=default, annotation=field.annotation)
        )
    return inspect.Signature(parameters)


class Component(SdkOptions, NamedOptions):
    """A named part of a federated strategy: checked when it is built, by its model's rules,
    and sent as ``{"name": ..., parameter: value}`` (:meth:`options`)."""
