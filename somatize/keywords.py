"""A misspelt keyword in a call of the SDK's own: the ``TypeError`` Python raises, with the
names the call takes that are near it (``los`` → ``did you mean 'loss'?``)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from protocol.text.wording import did_you_mean

__all__ = ["suggesting", "with_suggestion"]

P = ParamSpec("P")
R = TypeVar("R")

_UNEXPECTED = re.compile(r"got an unexpected keyword argument '([^']+)'")


def with_suggestion(exc: TypeError, names: Iterable[str]) -> TypeError:
    """``exc`` — where it is Python's refusal of an unexpected keyword — with the ``names``
    near that keyword said after it; else ``exc`` itself."""
    found = _UNEXPECTED.search(str(exc))
    near = did_you_mean(found.group(1), names) if found else ""
    return TypeError(f"{exc}{near}") if near else exc


def suggesting(func: Callable[P, R]) -> Callable[P, R]:
    """``func``, a keyword it does not take refused as Python does, with the nearest it takes
    (:func:`with_suggestion`)."""
    names = list(inspect.signature(func).parameters)
    open_ended = _takes_any_keyword(func)

    @functools.wraps(func)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = [] if open_ended else [k for k in kwargs if k not in names]
        if unknown:
            given = f"{func.__qualname__}() got an unexpected keyword argument {unknown[0]!r}"
            raise with_suggestion(TypeError(given), names)
        return func(*args, **kwargs)

    return call


def _takes_any_keyword(func: Callable[..., Any]) -> bool:
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(func).parameters.values()
    )
