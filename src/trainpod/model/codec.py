"""How event dataclasses map to rows: the per-field codec behind ``to_row_data`` and
``parse`` in :mod:`trainpod.model.events` (its docstring states the rules).

A decoder returns :data:`BAD` for a value it cannot read; it never raises.
"""

from __future__ import annotations

import enum
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal, Union

COLUMNS = ("node", "job_id", "attempt")
"""The event table's columns that events carry as fields; the rest is the JSON payload."""


class Bad:
    """A value that cannot be read as the field's type."""


BAD: Any = Bad()


@dataclass(frozen=True)
class FieldCodec:
    """How one field of an event class is stored, and read back."""

    name: str
    key: str  # the column, or the payload key
    column: bool
    decode: Callable[[Any], Any]  # returns BAD when it cannot
    nullable: bool
    has_default: bool
    omit_none: bool


def plain(value: Any) -> Any:
    """A field's value as JSON has it: enums as their values, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def _float(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return BAD
    return float(v)


def _int(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return BAD if (f := _float(v)) is BAD else int(f)


def _str(v: Any) -> Any:
    if isinstance(v, str):
        return v
    return str(v) if isinstance(v, int | float) else BAD


def _bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    return bool(v) if isinstance(v, int) and v in (0, 1) else BAD


def _names(v: Any) -> Any:
    """A list of names (a dict: its keys; one name: itself), as strings."""
    if isinstance(v, list | tuple | dict):
        return tuple(str(x) for x in v)
    return (str(v),) if v else ()


def _ints(v: Any) -> Any:
    """A list of integers (rank numbers); one that is not an integer makes it bad."""
    if not isinstance(v, list | tuple):
        return BAD
    out = tuple(_int(x) for x in v)
    return BAD if any(x is BAD for x in out) else out


def _mapping(v: Any) -> Any:
    """name -> name; a list of names reads as names -> "" (what they map to is unknown)."""
    if isinstance(v, dict):
        return {str(k): "" if x is None else str(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return {str(x): "" for x in v}
    return BAD


def _choice(allowed: tuple[Any, ...]) -> Callable[[Any], Any]:
    return lambda v: v if isinstance(v, str) and v in allowed else BAD


def _member(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    def decode(v: Any) -> Any:
        try:
            return cls(v)
        except (ValueError, TypeError):
            return BAD

    return decode


_SCALARS: dict[Any, Callable[[Any], Any]] = {float: _float, int: _int, str: _str, bool: _bool}


def _decoder(hint: Any) -> tuple[Callable[[Any], Any], bool]:
    """How to read a value of type ``hint``, and whether None is one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _decoder(inner)[0], True
    if hint in _SCALARS:
        return _SCALARS[hint], False
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _member(hint), False
    if origin is Literal:
        return _choice(args), False
    if origin is tuple and args[1:] == (...,) and args[0] is str:
        return _names, False
    if origin is tuple and args == (int, ...):
        return _ints, False
    if origin is dict and args == (str, str):
        return _mapping, False
    raise TypeError(f"no event decoder for {hint!r}")


def codecs_of(cls: type) -> tuple[FieldCodec, ...]:
    """The codec of each field of the event dataclass ``cls`` (built once, when registered).

    Raises TypeError for a field type it has no decoder for: a bug in the class, found at
    import."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        decode, nullable = _decoder(hints[f.name])
        column = f.name in COLUMNS
        out.append(
            FieldCodec(
                name=f.name,
                key=f.metadata.get("key") or f.name,
                column=column,
                decode=decode,
                nullable=nullable,
                has_default=f.default is not MISSING or f.default_factory is not MISSING,
                omit_none=bool(f.metadata.get("omit_none")),
            )
        )
    return tuple(out)
