"""Model values to and from plain JSON-ready data, for the ledger and ``--json`` output."""

from __future__ import annotations

import enum
import json
import math
import operator
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

from disagg.model import AttributeValue, Composition, Reservation

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


_without(Composition, "pending", "request_id", "request_fingerprint", "before_unknown", "missing")
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


def _optional_record(cls: Any) -> Callable[[Any], Any]:
    inner = _records.get_unstructure_hook(_optional_of(cls))
    if inner is cattrs.fns.identity:
        return cattrs.fns.identity
    return lambda value: None if value is None else inner(value)


def _tuple_record(cls: Any) -> Callable[[Any], Any]:
    inner = _records.get_unstructure_hook(_tuple_of(cls))
    if inner is cattrs.fns.identity:
        return cattrs.fns.identity
    return lambda values: list(map(inner, values))


_records = _converter.copy()
_records.register_unstructure_hook(float, lambda value: value if math.isfinite(value) else _NotFinite(value))
# Calls were most of a record's cost (a composition being composed took about 30 of them), and a durable Compose
# writes four records on the event loop. So a record leaves to orjson what it writes itself (a tuple as an array,
# an optional scalar), which the code cattrs generates then reads in place instead of calling a hook, and takes an
# enum's value from the member (``_value_``) in C rather than through `Enum.value`, a Python property.
_records.register_unstructure_hook_func(_is_enum, operator.attrgetter("_value_"))
_records.register_unstructure_hook_factory(lambda cls: _optional_of(cls) is not None, _optional_record)
_records.register_unstructure_hook_factory(lambda cls: _tuple_of(cls) is not None, _tuple_record)
_RECORD = json.JSONEncoder(separators=(",", ":"))
_record_hooks: dict[type, Callable[[Any], Any]] = {}
"""Each model class's record function, looked up once rather than dispatched on every record."""


def _refuse(value: Any) -> Any:
    raise TypeError(f"{value!r} has no JSON number")


def record(value: Any) -> str:
    """A model value as a ledger record, which `loads` reads back: `dumps` without sorting the keys (they come
    in field order). orjson writes it: a durable Compose writes four records while it holds the event loop, and
    the standard encoder took a tenth of the loop's time there. orjson writes an infinite float as null, so a
    record holding one (a selector's value may be any float) is written by the standard encoder instead, as
    ``Infinity``, which `loads` reads back."""
    cls = type(value)
    hook = _record_hooks.get(cls)
    if hook is None:
        hook = _record_hooks[cls] = _records.get_unstructure_hook(cls)
    try:
        return orjson.dumps(hook(value), default=_refuse).decode()
    except TypeError:
        return _RECORD.encode(to_data(value))


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
