"""Pagination over a listing sorted by a unique key: a page starts after the last key of the previous one."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def page(
    items: Sequence[T],
    key: Callable[[T], str],
    *,
    after: str | None,
    size: int,
    keep: Callable[[T], bool] = lambda _: True,
) -> tuple[list[T], str | None]:
    """The first ``size`` items that ``keep`` accepts with a key above ``after``, and the key to resume after
    when more such items follow (None on the last page). ``items`` are sorted by ``key``, which is unique."""
    start = 0 if after is None else bisect.bisect_right(items, after, key=key)
    out: list[T] = []
    for item in itertools.islice(items, start, None):
        if not keep(item):
            continue
        if len(out) == size:
            return out, key(out[-1])
        out.append(item)
    return out, None
