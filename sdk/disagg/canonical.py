"""The canonical JSON of a model value, `codec.dumps`'s text character for character, written without cattrs.

A request's digest hashes this text and the ledger keeps the digest, so the text never changes: it is what
`codec.dumps` writes (sorted keys, no spaces, ASCII). `codec.dumps` converts with cattrs and then lets the
standard encoder sort each dict's keys as it writes; a durable Compose with a request id digested its request so
on the event loop, a tenth of its work there. Here each model class gets a function, made at its first use, that
writes its text as one f-string: the fields in the order of their names, strings by the standard encoder's own
escaping function, numbers by the reprs it uses. A field whose type has a cattrs hook of its own is converted by
that hook and written by the standard encoder, as `codec.dumps` does. A value the standard encoder cannot write
raises TypeError, as there; a caller that must have a text takes `codec.dumps` then.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

import attrs
import cattrs.fns

from disagg.codec import GeneratedSource, _converter, _is_enum, _optional_of, _tuple_of
from disagg.model import HostRequest, ResourceRequest

_STANDARD = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
"""`codec.dumps`'s encoder."""
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _float(value: float) -> str:
    """A float, of type float itself, as the standard encoder writes it (``allow_nan``, as `codec.dumps` leaves
    it): its repr, which is ``float.__repr__`` since no subclass has its own."""
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


def scalar(value: Any) -> str:
    """Any value as the standard encoder writes it; a scalar without a call into it."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is int:
        return repr(value)
    if kind is float:
        return _float(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    return _STANDARD.encode(value)


def _of_scalars(cls: Any) -> bool:
    """Whether ``cls`` is a union of scalar types (an attribute's value), which cattrs leaves as they are."""
    return typing.get_origin(cls) in (typing.Union, types.UnionType) and set(typing.get_args(cls)) <= _SCALARS


def _member_texts(cls: type[enum.Enum]) -> dict[enum.Enum, str]:
    """The text of each member of ``cls``: an enum is written as its value."""
    return {member: scalar(member._value_) for member in cls}


class _Source(GeneratedSource):
    """The source of one class's text function. Each part of the text is a local name; an attrs class is an
    f-string of its fields' names, an optional value and a tuple take a few lines each."""

    def __init__(self) -> None:
        super().__init__({"_string": encode_basestring_ascii, "_scalar": scalar})

    def text(self, cls: Any, src: str, indent: int) -> str:
        """A local name holding the text of ``src``, a value of type ``cls``; lines that set it are added."""
        if cls in _REMEMBERED and self._open:
            remembered = f"remembered{len(self.names)}"
            self.names[remembered] = _remembered(_function(cls))
            return self.temp(indent, f"{remembered}({src})")
        if attrs.has(cls) and cls not in self._open:
            return self._attrs(cls, self.named(indent, src), indent)
        if _is_enum(cls) and not issubclass(cls, enum.Flag):  # each member's text, looked up (a Flag's may be none)
            texts = f"texts{len(self.names)}"
            self.names[texts] = _member_texts(cls)
            value = self.named(indent, src)
            return self.temp(indent, f"{texts}.get({value}) or _scalar({value}._value_)")
        if _is_enum(cls):
            kinds = {type(member.value) for member in cls}
            return self._scalar(f"{src}._value_", indent, kinds.pop() if len(kinds) == 1 else None)
        if _optional_of(cls) is not None:
            return self._optional(_optional_of(cls), src, indent)
        if _tuple_of(cls) is not None:
            return self._tuple(_tuple_of(cls), src, indent)
        hook = _converter.get_unstructure_hook(cls)
        if hook is cattrs.fns.identity or _of_scalars(cls):
            return self._scalar(src, indent, cls)
        name = f"hook{len(self.names)}"
        self.names[name] = lambda value, hook=hook: _STANDARD.encode(hook(value))
        return self.temp(indent, f"{name}({src})")

    def _scalar(self, src: str, indent: int, expected: Any) -> str:
        """``src``, a plain value: written in place when it is of the type ``expected`` (a str, an int)."""
        value = self.named(indent, src)
        if expected is str:
            return self.temp(indent, f"_string({value}) if type({value}) is str else _scalar({value})")
        if expected is int:
            # An int's format with no spec is its repr, written in place (no call, as ``int.__repr__`` was).
            return self.temp(indent, f"f'{{{value}}}' if type({value}) is int else _scalar({value})")
        return self.temp(indent, f"_scalar({value})")

    def _attrs(self, cls: type, src: str, indent: int) -> str:
        self._open.add(cls)
        hints = typing.get_type_hints(cls)
        parts = [
            f"{encode_basestring_ascii(a.name)}:{{{self.text(hints[a.name], f'{src}.{a.name}', indent)}}}"
            for a in sorted(attrs.fields(cls), key=lambda a: a.name)
        ]
        self._open.discard(cls)
        return self.temp(indent, "f" + repr("{{" + ",".join(parts) + "}}"))

    def _optional(self, cls: Any, src: str, indent: int) -> str:
        value = self.temp(indent, src)
        result = self.local()
        self.lines.append(f"{'    ' * indent}if {value} is None:")
        self.lines.append(f"{'    ' * (indent + 1)}{result} = 'null'")
        self.lines.append(f"{'    ' * indent}else:")
        self.lines.append(f"{'    ' * (indent + 1)}{result} = {self.text(cls, value, indent + 1)}")
        return result

    def _tuple(self, cls: Any, src: str, indent: int) -> str:
        items = self.temp(indent, "[]")
        item = self.local()
        self.lines.append(f"{'    ' * indent}for {item} in {src}:")
        self.lines.append(f"{'    ' * (indent + 1)}{items}.append({self.text(cls, item, indent + 1)})")
        return self.temp(indent, f"'[' + ','.join({items}) + ']'")


_REMEMBERED = frozenset({ResourceRequest, HostRequest})
"""Parts of a request whose text is remembered for the next request (`_remembered`): the wire layer reads the same
bytes as the very same value (`disagg.wire.fabric`), and clients send a few kinds of lines and hosts again and
again."""


def _remembered(function: Callable[[Any], str]) -> Callable[[Any], str]:
    """``function``, remembering the value it last wrote and its text: the same value again (by identity: a model
    value is immutable) is not written again. One tuple, so that a thread reads both halves of the same write."""
    last: tuple[object, str] = (None, "")

    def text(value: Any) -> str:
        nonlocal last
        seen, written = last
        if seen is not value:
            written = function(value)
            last = (value, written)
        return written

    return text


def _function(cls: type) -> Callable[[Any], str]:
    """The function that writes a ``cls`` as canonical JSON."""
    source = _Source()
    return source.function("canonical_text", cls, source.text(cls, "value", 1))


_functions: dict[type, Callable[[Any], str]] = {str: encode_basestring_ascii, int: repr, float: _float}
"""Each model class's text function, made at its first use; an enum's is a lookup of its members' texts, and the
scalars of a fingerprint (its mode's time to live) are written without the checks below."""


def text(value: Any) -> str:
    """``codec.dumps(value)`` for a model value, an enum, a scalar, or a tuple or list of them (what a request's
    fingerprint is). Raises TypeError where the standard encoder would (`codec.dumps` may still write the value:
    an attrs value in a field typed as a plain value, which cattrs converts by its own class)."""
    kind = type(value)
    function = _functions.get(kind)
    if function is not None:
        return function(value)
    if kind is tuple or kind is list:
        return f"[{','.join([text(item) for item in value])}]"
    if kind in _SCALARS:
        return scalar(value)
    if isinstance(value, enum.Enum):
        if issubclass(kind, enum.Flag):  # a combination of members is no member
            return scalar(value._value_)
        function = _functions[kind] = _member_texts(kind).__getitem__
        return function(value)
    if attrs.has(kind):
        function = _functions[kind] = _function(kind)
        return function(value)
    return scalar(value)
