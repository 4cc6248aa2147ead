"""Model values to and from plain JSON-ready data, for the ledger and ``--json`` output."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import attrs
import cattrs
import cattrs.gen
import orjson

from disagg.model import AttributeValue, Composition

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
_public.register_unstructure_hook(
    Composition,
    cattrs.gen.make_dict_unstructure_fn(
        Composition,
        _public,
        pending=cattrs.gen.override(omit=True),
        request_id=cattrs.gen.override(omit=True),
        request_fingerprint=cattrs.gen.override(omit=True),
    ),
)


def to_public_data(value: Any) -> Any:
    """`to_data` without what only the ledger keeps (a composition's change in flight and its request id):
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


_records = _converter.copy()
_records.register_unstructure_hook(float, lambda value: value if math.isfinite(value) else _NotFinite(value))
_RECORD = json.JSONEncoder(separators=(",", ":"))


def _refuse(value: Any) -> Any:
    raise TypeError(f"{value!r} has no JSON number")


def record(value: Any) -> str:
    """A model value as a ledger record, which `loads` reads back: `dumps` without sorting the keys (they come
    in field order). orjson writes it: a durable Compose writes four records while it holds the event loop, and
    the standard encoder took a tenth of the loop's time there. orjson writes an infinite float as null, so a
    record holding one (a selector's value may be any float) is written by the standard encoder instead, as
    ``Infinity``, which `loads` reads back."""
    try:
        return orjson.dumps(_records.unstructure(value), default=_refuse).decode()
    except TypeError:
        return _RECORD.encode(to_data(value))


def loads(text: str | bytes, cls: type[T]) -> T:
    return from_data(json.loads(text), cls)


def mapping(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_data(v) for k, v in value.items()}
