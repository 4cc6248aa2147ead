"""Checks of the client's arguments, made before a message is built: an argument of the wrong type is refused as
`InvalidRequestError` naming it, where protobuf raised a bare TypeError (or took ``True`` for 1)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import TypeVar

from disagg.errors import InvalidRequestError
from disagg.model.composition import text_refusal

E = TypeVar("E", bound=Enum)
T = TypeVar("T")


def _refuse(name: str, wanted: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {wanted}, not {type(value).__name__} {value!r}", field=name)


def text(value: object, name: str) -> str:
    """``value``, an id, name or other string argument called ``name``: a string the wire can carry, so not one
    holding a lone surrogate (Python's reading of bytes that are not UTF-8), on which protobuf raised a bare
    UnicodeEncodeError."""
    if not isinstance(value, str):
        raise _refuse(name, "a string", value)
    why = text_refusal(value)
    if why:
        raise InvalidRequestError(f"{name}: {why}", field=name)
    return value


def optional_text(value: object, name: str) -> str | None:
    """``value``, a string argument called ``name`` that may be left out (None)."""
    return None if value is None else text(value, name)


def texts(values: object, name: str) -> list[str]:
    """``values``, a sequence of strings called ``name``: a string itself is refused, not read as its letters."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise _refuse(name, "a sequence of strings", values)
    return [text(value, f"{name}[{n}]") for n, value in enumerate(values)]


def instance(value: object, kind: type[T], name: str, made_by: str) -> T:
    """``value``, a ``kind`` called ``name``; ``made_by`` says what makes one (a string is no request: the
    client does not parse the request language)."""
    if not isinstance(value, kind):
        raise _refuse(name, f"a {kind.__name__} ({made_by} makes one)", value)
    return value


def instances(values: object, kind: type[T], name: str, made_by: str) -> list[T]:
    """``values``, a sequence of ``kind`` called ``name`` (`instance`); a string is refused whole."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise _refuse(name, f"a sequence of {kind.__name__} ({made_by} makes each)", values)
    return [instance(value, kind, f"{name}[{n}]", made_by) for n, value in enumerate(values)]


def whole(value: object, name: str) -> int:
    """``value``, an integer argument called ``name`` (a `disagg.model.Revision` is one); a bool is not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, "an integer", value)
    return value


def flag(value: object, name: str) -> bool:
    """``value``, a switch called ``name``: True or False. A string was taken for true ("no" too), or raised
    protobuf's bare TypeError."""
    if not isinstance(value, bool):
        raise _refuse(name, "True or False", value)
    return value


def number(value: object, name: str, wanted: str = "a number") -> float:
    """``value``, a real number called ``name`` (``wanted`` says of what); a bool is not one. Its range is the
    caller's to check."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(name, wanted, value)
    return value


def seconds(value: object, name: str) -> float:
    """``value``, a number of seconds called ``name`` (`number`)."""
    return number(value, name, "a number of seconds")


def member(value: object, kind: type[E], name: str) -> E:
    """``value``, a member of the enum ``kind`` called ``name`` (``DeviceKind.GPU``, not ``"gpu"``)."""
    if not isinstance(value, kind):
        raise _refuse(name, f"a {kind.__name__}", value)
    return value


def optional_member(value: object, kind: type[E], name: str) -> E | None:
    """``value``, a member of ``kind`` or None (no filter)."""
    return None if value is None else member(value, kind, name)
