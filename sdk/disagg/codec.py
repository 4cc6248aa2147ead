"""Model values to and from plain JSON-ready data, for the ledger and ``--json`` output."""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import attrs
import cattrs
import cattrs.fns
import cattrs.gen
import orjson

from disagg.model import AttributeValue, Composition, PendingChange, Reservation, ResourceRequest

T = TypeVar("T")

_converter = cattrs.Converter()
_converter.register_unstructure_hook(MappingProxyType, dict)


def _is_frozenset(cls: Any) -> bool:
    return cls is frozenset or getattr(cls, "__origin__", None) is frozenset


_converter.register_unstructure_hook_func(
    _is_frozenset, lambda values: sorted((_converter.unstructure(v) for v in values), key=repr)
)


def _scalar(value: Any, _: Any) -> AttributeValue:
    if isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"attribute values are str, int, float or bool, not {type(value).__name__}")


_converter.register_structure_hook(AttributeValue, _scalar)


_public = _converter.copy()


def _without(cls: type, *fields: str) -> None:
    """Public data of ``cls`` leaves out ``fields``, which only the ledger keeps."""
    omitted: dict[str, Any] = {name: cattrs.gen.override(omit=True) for name in fields}
    _public.register_unstructure_hook(cls, cattrs.gen.make_dict_unstructure_fn(cls, _public, **omitted))


_without(
    Composition,
    "pending",
    "request_id",
    "request_fingerprint",
    "before_unknown",
    "missing",
    "equivalent_generations",
)
_without(Reservation, "request_id", "request_fingerprint")


def to_public_data(value: Any) -> Any:
    """`to_data` without what only the ledger keeps (a composition's change in flight, its request id, the state
    it had before it became UNKNOWN):
    what the CLI prints and scripts read, the same from a local composer and from a remote one."""
    return _public.unstructure(value)


def to_data(value: Any) -> Any:
    """A model value (or a list or dict of them) as dicts, lists and scalars; enums become their values."""
    return _converter.unstructure(value)


def from_data(data: Any, cls: type[T]) -> T:
    """Rebuild a model value from `to_data` output."""
    return _converter.structure(data, cls)


def dumps(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces, ASCII): what request fingerprints hash, so it never changes."""
    return json.dumps(to_data(value), sort_keys=True, separators=(",", ":"))


@attrs.frozen
class _NotFinite:
    """A float JSON has no number for (an infinity, NaN), in a wrapper orjson refuses."""

    value: float


def _is_enum(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _optional_of(cls: Any) -> Any:
    """``T`` for ``T | None``, else None."""
    args = typing.get_args(cls)
    if typing.get_origin(cls) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return args[0] if args[1] is type(None) else args[1]
    return None


def _tuple_of(cls: Any) -> Any:
    """``T`` for ``tuple[T, ...]``, else None."""
    args = typing.get_args(cls)
    if typing.get_origin(cls) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


_WRITTEN_WHEN_SET: dict[type, tuple[str, ...]] = {
    PendingChange: ("generations_before",),  # before Composition, which holds one: its hook is made with this one's
    Composition: ("equivalent_generations",),
}
"""Ledger-only fields a record leaves out while they hold their empty default: the release before knew none of
them and refuses a record that names a field it does not know (`load_record`), so a ledger in which no change was
ever undone stays one that release reads (a replica not yet upgraded may lead during a rolling upgrade)."""


def _leaving_out_unset(converter: cattrs.Converter) -> cattrs.Converter:
    """``converter``, writing each of `_WRITTEN_WHEN_SET` only when set."""
    for cls, fields in _WRITTEN_WHEN_SET.items():
        when_set: dict[str, Any] = {name: cattrs.gen.override(omit_if_default=True) for name in fields}
        converter.register_unstructure_hook(cls, cattrs.gen.make_dict_unstructure_fn(cls, converter, **when_set))
    return converter


_records = _converter.copy()
_records.register_unstructure_hook(float, lambda value: value if math.isfinite(value) else _NotFinite(value))
_leaving_out_unset(_records)
_record_data = _leaving_out_unset(_converter.copy())
"""The data of a record the standard encoder writes (one that holds an infinite float, `record`)."""
_RECORD = json.JSONEncoder(separators=(",", ":"))


class GeneratedSource:
    """The source of a function generated for one class (its record, its canonical text): lines that set local
    names, each part of the result one of them, and the globals the lines use."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self.names = names
        self._temps = 0
        self._open: set[type] = set()
        """The classes being written: a class that holds itself takes its cattrs hook inside itself."""

    def local(self) -> str:
        """A new local name."""
        self._temps += 1
        return f"v{self._temps}"

    def temp(self, indent: int, value: str) -> str:
        """A new local name, set to ``value``."""
        name = self.local()
        self.lines.append(f"{'    ' * indent}{name} = {value}")
        return name

    def named(self, indent: int, value: str) -> str:
        """``value`` if it is a name, else a new local name set to it: read once, used more than once."""
        return value if value.isidentifier() else self.temp(indent, value)

    def function(self, what: str, cls: type, result: str) -> Callable[[Any], Any]:
        """The function of one argument, ``value`` (a ``cls``): the lines, then ``return result``; ``what`` it
        makes names it in a traceback."""
        name = f"{what}_{cls.__name__}"
        text = "\n".join([f"def {name}(value):", *self.lines, f"    return {result}"])
        namespace = dict(self.names)
        exec(compile(text, f"<{what} of {cls.__module__}.{cls.__qualname__}>", "exec"), namespace)
        return typing.cast(Callable[[Any], Any], namespace[name])


class _RecordSource(GeneratedSource):
    """The source of one class's record function, which builds the data cattrs' ``_records`` would in a single
    call. Calls were most of a record's cost (a composition being composed took about 15 of them, one per hook of
    a field, tuple or optional value), and a durable Compose writes four records on the event loop. So an attrs
    class is written as a dict in field order, a tuple of values that need no hook is left to orjson (which writes
    it as an array), other tuples are built by a loop, an optional value is tested in place, an enum gives its
    ``_value_`` and a float is checked finite (else it becomes `_NotFinite`, which orjson refuses) without a call
    to a Python function, and a mapping the model keeps as a `MappingProxyType` is copied by its own ``copy``
    (``dict``, its cattrs hook, reads a view key by key: four times the cost, in an event's record). Any other type
    takes its cattrs hook, as before."""

    def __init__(self) -> None:
        super().__init__({"_isfinite": math.isfinite, "_NotFinite": _NotFinite, "_MappingProxyType": MappingProxyType})

    def value(self, cls: Any, src: str, indent: int) -> str:
        """An expression of the record data of ``src``, a value of type ``cls``; it may need lines added first."""
        if cls is Composition and self._open:  # inside an answer: the text its change just recorded, if it is
            self.names["_embedded"] = _embedded
            return f"_embedded({src})"
        if cls is ResourceRequest and self._open:  # a request's line, most often the very one recorded before
            line = f"line{len(self.names)}"
            self.names[line] = _remembered_record(_record_function(cls))
            return f"{line}({src})"
        if attrs.has(cls) and cls not in self._open and cls is not _NotFinite:
            return self._attrs(cls, self.named(indent, src), indent)
        if _is_enum(cls):
            return f"{src}._value_"
        if cls is float:
            src = self.named(indent, src)
            return f"({src} if _isfinite({src}) else _NotFinite({src}))"
        if _optional_of(cls) is not None:
            return self._optional(_optional_of(cls), src, indent)
        if _tuple_of(cls) is not None:
            return self._tuple(_tuple_of(cls), src, indent)
        hook = _records.get_unstructure_hook(cls)
        if hook is cattrs.fns.identity:
            return src
        if hook is dict:  # a mapping of plain values, which the model keeps as a read-only view of a dict
            src = self.named(indent, src)
            return f"({src}.copy() if type({src}) is _MappingProxyType else dict({src}))"
        name = f"hook{len(self.names)}"
        self.names[name] = hook
        return f"{name}({src})"

    def _attrs(self, cls: type, src: str, indent: int) -> str:
        self._open.add(cls)
        types = typing.get_type_hints(cls)
        when_set = _WRITTEN_WHEN_SET.get(cls, ())
        items = [
            f"{a.name!r}: {self.value(types[a.name], f'{src}.{a.name}', indent)}"
            for a in attrs.fields(cls)
            if a.name not in when_set
        ]
        data = "{" + ", ".join(items) + "}"
        if when_set:  # each written only when set (`_WRITTEN_WHEN_SET`)
            data = self.temp(indent, data)
            for name in when_set:
                self.lines.append(f"{'    ' * indent}if {src}.{name}:")
                inner = self.value(types[name], f"{src}.{name}", indent + 1)
                self.lines.append(f"{'    ' * (indent + 1)}{data}[{name!r}] = {inner}")
        self._open.discard(cls)
        return data

    def _optional(self, cls: Any, src: str, indent: int) -> str:
        start = len(self.lines)
        value = self.temp(indent, src)
        self.lines.append(f"{'    ' * indent}if {value} is not None:")
        inner = self.value(cls, value, indent + 1)
        if inner == value:  # nothing to do but write it: orjson does
            del self.lines[start:]
            return src
        self.lines.append(f"{'    ' * (indent + 1)}{value} = {inner}")
        return value

    def _tuple(self, cls: Any, src: str, indent: int) -> str:
        start = len(self.lines)
        items = self.temp(indent, "[]")
        item = self.local()
        self.lines.append(f"{'    ' * indent}for {item} in {src}:")
        inner = self.value(cls, item, indent + 1)
        if inner == item:  # an array of the values as they are: orjson writes the tuple as one
            del self.lines[start:]
            return src
        self.lines.append(f"{'    ' * (indent + 1)}{items}.append({inner})")
        return items


def _record_function(cls: type) -> Callable[[Any], Any]:
    """The function that turns a ``cls`` into the data of its record (see `_RecordSource`)."""
    source = _RecordSource()
    return source.function("record", cls, source.value(cls, "value", 1))


_record_functions: dict[type, Callable[[Any], Any]] = {}
"""Each model class's record function, made at its first record."""


def _refuse(value: Any) -> Any:
    raise TypeError(f"{value!r} has no JSON number")


def _record_function_of(cls: type) -> Callable[[Any], Any]:
    function = _record_functions.get(cls)
    if function is None:
        function = _record_functions[cls] = _record_function(cls)
    return function


_last_composition: tuple[Composition | None, str] = (None, "")
"""The composition `record` wrote last, and its text: a change records a composition and then, in the same hold,
the answer that carries it (a Compose's), which embeds that text (`_embedded`) rather than building it again.
One tuple, so that a thread reads both halves of the same write."""


def _embedded(comp: Composition) -> Any:
    """The record data of ``comp`` inside another record: the text `record` wrote of this very composition
    (frozen, so the text still holds), or its data."""
    last, text = _last_composition
    if last is comp:
        return orjson.Fragment(text)
    return _record_function_of(Composition)(comp)


def _remembered_record(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``function``, a record function, remembering the value it last wrote as its text (`orjson.Fragment`): the
    same value again (by identity: a model value is immutable) is not built again. The wire layer reads the same
    bytes as the same line, so the records of a change carry the lines of the request before them. A value orjson
    cannot write (an infinite float) is left as its data, for `record` to write otherwise."""
    last: tuple[object, Any] = (None, None)

    def data(value: Any) -> Any:
        nonlocal last
        seen, written = last
        if seen is not value:
            made = function(value)
            try:
                written = orjson.Fragment(orjson.dumps(made, default=_refuse))
            except TypeError:
                return made
            last = (value, written)
        return written

    return data


def record(value: Any) -> str:
    """A model value as a ledger record, which `loads` reads back: `dumps` without sorting the keys (they come
    in field order). orjson writes it: a durable Compose writes four records while it holds the event loop, and
    the standard encoder took a tenth of the loop's time there. orjson writes an infinite float as null, so a
    record holding one (a selector's value may be any float) is written by the standard encoder instead, as
    ``Infinity``, which `loads` reads back."""
    global _last_composition
    cls = type(value)
    function = _record_functions.get(cls) or _record_function_of(cls)  # a frame fewer once made
    try:
        text = orjson.dumps(function(value), default=_refuse).decode()
    except TypeError:
        text = _RECORD.encode(_record_data.unstructure(value))
    if cls is Composition:
        _last_composition = (value, text)
    return text


def loads(text: str | bytes, cls: type[T]) -> T:
    return from_data(json.loads(text), cls)


_known_fields_only = _converter.copy(forbid_extra_keys=True)
_known_fields_only.register_structure_hook(AttributeValue, _scalar)  # a copy leaves a union's hook behind


def load_record(text: str | bytes, cls: type[T]) -> T:
    """A ledger record that is written back from what it loads (a composition, a reservation), refusing a field
    ``cls`` does not have (cattrs' `ForbiddenExtraKeysError`, inside its validation error): a newer disagg wrote
    it, and dropping it here would lose it at the record's next write. No field of these records was ever
    removed or renamed, so every record an earlier version wrote has none."""
    return _known_fields_only.structure(json.loads(text), cls)


def mapping(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_data(v) for k, v in value.items()}
