"""A frozen attrs class's ``__init__`` that sets each field through its slot, not through ``object.__setattr__``.

attrs makes a frozen class's ``__init__`` call ``object.__setattr__`` for every field (its own ``__setattr__``
refuses), and that call looks the field up in the class and goes through a slot wrapper: for the classes a
durable Compose makes several of (a composition twice, two events), about 4% of its work on the event loop
(docs/benchmarks.md). The field's slot (a member descriptor) sets it directly, for about 40% less a field. The
``__init__`` attrs generated is kept as it is otherwise (defaults, factories, converters, validators, the post-init),
and the class stays frozen: only its ``__init__`` changes, its ``__setattr__`` still refuses.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

GENERATED: dict[type, Callable[..., None]] = {}
"""Each class given a quick ``__init__``, with the one attrs generated: the tests hold the two to the same result."""

_SETATTR = re.compile(r"\b_setattr\('(\w+)', ")
_GET_SETATTR = "    _setattr = _cached_setattr_get(self)\n"


def quick_init(cls: type[T]) -> type[T]:
    """``cls`` (a frozen, slotted attrs class, decorated after attrs) with an ``__init__`` that sets its fields
    through their slots. Left as it is when attrs did not generate the ``__init__`` this expects."""
    init: Any = cls.__init__
    code = init.__code__
    source = "".join(linecache.getlines(code.co_filename))
    start = source.find("def __init__(")
    if start < 0 or _GET_SETATTR not in source:
        return cls
    end = source.find("\ndef ", start + 1)
    body = source[start : end + 1 if end >= 0 else len(source)]
    if _GET_SETATTR not in body:
        return cls
    fields = _SETATTR.findall(body)
    slots: dict[str, Any] = {name: cls.__dict__.get(name) for name in fields}
    if not fields or any(slot is None or not hasattr(slot, "__set__") for slot in slots.values()):
        return cls
    body = _SETATTR.sub(lambda m: f"_set_{m.group(1)}(self, ", body.replace(_GET_SETATTR, ""))
    if "_setattr" in body:  # a use this does not rewrite: keep attrs' own
        return cls
    scope = dict(init.__globals__)
    scope.update({f"_set_{name}": slot.__set__ for name, slot in slots.items()})
    filename = f"<quick init of {cls.__module__}.{cls.__qualname__}>"
    linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)
    exec(compile(body, filename, "exec"), scope)
    quick = scope["__init__"]
    quick.__qualname__ = init.__qualname__
    quick.__module__ = init.__module__
    quick.__annotations__ = dict(init.__annotations__)
    quick.__doc__ = init.__doc__
    GENERATED[cls] = init
    cls.__init__ = quick  # type: ignore[method-assign]
    return cls
