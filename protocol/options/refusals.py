"""How a refused option is worded and named: the rule's own words, with whose option it is in
front.

A rule written as code (an option model's field declares it: :class:`~protocol.options.base.
Rule`) raises a ``ValueError`` in its own words (``tag must be a non-empty string or None, not
3``). A rule written as a field's constraints (``Field(ge=1)``) is worded by
the :class:`Refusal` beside them::

    max_steps: Annotated[int | None, Field(ge=1), Refusal("is a whole number of steps >= 1")]

refuses ``0`` as ``max_steps is a whole number of steps >= 1, not 0`` (pydantic's own message
where a field says nothing). :func:`named_by` then puts the owner's name in front: the SDK
class's (``DataParallel: ...``) or the strategy's as it travels (``data_parallel: ...``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

__all__ = ["Refusal", "named_by", "prefixed", "refused"]


@dataclass(frozen=True)
class Refusal:
    """How a field's constraints read when they refuse a value: ``{field} {words}, not
    {value!r}``."""

    words: str


def refused(exc: ValidationError, model: type[BaseModel] | None = None) -> Exception:
    """The first rule ``exc`` says a value broke (the first field, in the model's order, where
    several did), in its words (a field of ``model`` worded by its :class:`Refusal`)."""
    first = exc.errors()[0]
    error = (first.get("ctx") or {}).get("error")
    if isinstance(error, ValueError):
        return error
    loc = first.get("loc", ())
    field = model.model_fields.get(str(loc[0])) if model is not None and loc else None
    words = [m.words for m in field.metadata if isinstance(m, Refusal)] if field else []
    if words:
        return ValueError(f"{loc[0]} {words[0]}, not {first.get('input')!r}")
    where = ".".join(str(part) for part in loc)
    return ValueError(f"{where + ': ' if where else ''}{first.get('msg', exc)}")


def prefixed(owner: str, refusal: Exception) -> Exception:
    """``refusal``, of the same class, with ``owner``'s name in front: the one place a
    refusal's words are given a name (``DataParallel: ...``, ``data_parallel: ...``)."""
    return type(refusal)(f"{owner}: {refusal}")


def named_by(owner: str, exc: ValidationError, model: type[BaseModel] | None = None) -> Exception:
    """The first rule that refused (:func:`refused`), named for ``owner``."""
    return prefixed(owner, refused(exc, model))
