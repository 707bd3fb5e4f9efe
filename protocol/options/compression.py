"""What a DataParallel (or DiLoCo) replica's gradients travel as: a :class:`Compression`, parsed
once where it enters — the SDK's argument, a strategy's JSON options, a daemon command — and
carried as the value everywhere after.

It is its wire string (``"fp16"``, ``"bf16"``, ``"int8"`` or ``"powersgd:RANK"``), parsed: a
``str`` that also holds its :attr:`~Compression.kind` and, for PowerSGD,
:attr:`~Compression.rank`. So the JSON options, the daemon commands and the SDK's attribute
(``sz.DataParallel(2, compression="fp16").compression == "fp16"``) keep the string, and every
reader asks the value what it is instead of parsing the string again.

* ``"fp16"`` / ``"bf16"``: each value cast to half precision (a :attr:`~Compression.half` one).
* ``"int8"``: 8-bit codes in chunks, with error feedback.
* ``"powersgd:RANK"``: each matrix as a rank-RANK factorisation (Vogels et al. 2019), which only
  torch's DDP hook computes: it never travels as a tree through the coordinator
  (:data:`TreeCompression`, :attr:`~Compression.travels_as_tree`).

What each does to the gradients is told where it is done: ``engine.data_parallel.compression``
on the torch collective, :mod:`protocol.compressed_trees` through the coordinator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, GetCoreSchemaHandler
from pydantic_core import core_schema

__all__ = ["KINDS", "TREE_KINDS", "Compression", "Kind", "TreeCompression"]

Kind = Literal["fp16", "bf16", "int8", "powersgd"]
KINDS: tuple[str, ...] = get_args(Kind)
"""The kinds of compression, as the wire string starts."""

TREE_KINDS: tuple[str, ...] = ("fp16", "bf16", "int8")
"""The kinds a tree of tensors travels as through the coordinator (all but PowerSGD)."""

_POWERSGD = "powersgd:"


class Compression(str):
    """A compression as it travels (its string) and what it is (:attr:`kind`, :attr:`rank`).

    ``Compression("powersgd:4")`` parses the string; a field typed ``Compression`` parses what it
    is given the same way and writes the string back.

    Raises:
        ValueError: a string that is none of the forms, in the words every caller shows.
    """

    kind: Kind
    rank: int | None
    """PowerSGD's rank (a positive integer); ``None`` for the others."""

    def __new__(cls, text: object) -> Compression:
        if isinstance(text, Compression):
            return text
        kind, rank = _parsed(text)
        value = super().__new__(cls, text)
        object.__setattr__(value, "kind", kind)
        object.__setattr__(value, "rank", rank)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Compression is a value: cannot set {name!r}")

    def __reduce__(self) -> tuple[type[Compression], tuple[str]]:
        return Compression, (str(self),)  # (pickled as its string, parsed again)

    @classmethod
    def parse(cls, value: object) -> Compression | None:
        """``value`` as a compression: ``None`` (uncompressed) stays ``None``.

        Raises:
            ValueError: a value that is none of the forms.
        """
        return None if value is None else cls(value)

    @property
    def half(self) -> bool:
        """Whether each value travels in half precision (fp16 or bf16)."""
        return self.kind in ("fp16", "bf16")

    @property
    def travels_as_tree(self) -> bool:
        """Whether it can carry a tree of tensors through the coordinator (not PowerSGD, which
        factorises DDP's buckets on the torch collective)."""
        return self.kind in TREE_KINDS

    def as_tree(self) -> Compression:
        """This compression, for a tree through the coordinator.

        Raises:
            ValueError: PowerSGD (:attr:`travels_as_tree`).
        """
        if not self.travels_as_tree:
            forms = ", ".join(map(repr, TREE_KINDS))
            raise ValueError(f"a tree travels as one of {forms}, not {str(self)!r}")
        return self

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """As a pydantic field: parsed from its string, written back as the string."""
        return core_schema.no_info_plain_validator_function(
            cls, serialization=core_schema.to_string_ser_schema(when_used="always")
        )


def _parsed(text: object) -> tuple[Kind, int | None]:
    if text in ("fp16", "bf16", "int8"):
        return text, None
    if isinstance(text, str) and text.startswith(_POWERSGD):
        rank = text.removeprefix(_POWERSGD)
        if rank.isdigit() and rank.isascii() and int(rank) > 0:
            return "powersgd", int(rank)
    raise ValueError(
        "compression must be None, 'fp16', 'bf16', 'int8' or 'powersgd:RANK' (RANK a positive "
        f"integer), not {text!r}"
    )


TreeCompression = Annotated[Compression, AfterValidator(Compression.as_tree)]
"""A compression a tree of tensors travels as through the coordinator (fp16, bf16 or int8)."""
