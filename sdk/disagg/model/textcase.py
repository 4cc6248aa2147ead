"""Whether text equal to a selector's ``=`` value lies within a text range.

A selector's ``=`` compares text without regard to case (``str.lower``), while ``<`` and ``>`` order it as
written: ``vendor=acme`` is met by ``ACME`` and ``Acme`` too, so whether it can meet ``vendor>zeta`` depends on
every spelling that lowers to ``acme``, some of them other scripts' letters (KELVIN SIGN lowers to ``k``).
"""

from __future__ import annotations

import array
import functools
import sys

Bound = tuple[str, bool]
"""A range's end: the text, and whether the range stops short of it (``<``, ``>``)."""


_BLOCK = 64
"""Code points looked at together: a block that lowers to itself (all but about 60 of 17,408: scripts without
case, unassigned points) is passed over with one call."""


@functools.cache
def _spellings() -> dict[str, tuple[str, ...]]:
    """Each text some other character lowers to, and those characters. Built on first use, from every code
    point, so that no spelling is missed: one missed could refuse a request it meets. The text of every code
    point is decoded from their numbers at once, and lowered a block at a time (50 ms, against 120 ms point by
    point)."""
    found: dict[str, list[str]] = {"ς": ["Σ"]}  # lowers to ς at the end of a word: str.lower's one context rule
    codec = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"
    every = array.array("I", range(sys.maxunicode + 1)).tobytes().decode(codec, "surrogatepass")
    for start in range(0, len(every), _BLOCK):
        block = every[start : start + _BLOCK]
        if block.lower() == block:
            continue
        for char in block:
            lowered = char.lower()
            if lowered != char:
                found.setdefault(lowered, []).append(char)
    return {lowered: tuple(chars) for lowered, chars in found.items()}


@functools.cache
def _longest() -> int:
    """The most characters one character lowers to."""
    return max(map(len, _spellings()))


def _steps(target: str, at: int) -> list[tuple[int, str]]:
    """The characters a spelling of ``target`` may have next, where ``target[at:]`` is still to be spelled, and
    how far each goes into it (a character may lower to two: İ to i̇)."""
    steps = []
    for length in range(1, _longest() + 1):
        piece = target[at : at + length]
        if len(piece) < length:
            break
        if length == 1 and piece.lower() == piece:
            steps.append((length, piece))
        steps.extend((length, char) for char in _spellings().get(piece, ()))
    return steps


@functools.lru_cache(maxsize=256)
def spelled_within(text: str, low: Bound | None, high: Bound | None) -> bool:
    """Whether some text that lowers to ``text.lower()`` lies above ``low`` and below ``high`` (None: no end).

    A walk through the spellings one character at a time, remembering only whether what it has written so far
    is still each end's beginning (tight): once above ``low`` and below ``high``, any rest will do."""
    target = text.lower()
    done = [False] * len(target) + [True]  # whether a spelling can finish from here
    for at in range(len(target) - 1, -1, -1):
        done[at] = any(done[at + length] for length, _ in _steps(target, at))
    todo = [(0, 0, low is not None, high is not None)]
    seen = set(todo)
    while todo:
        at, written, low_tight, high_tight = todo.pop()
        if not done[at]:
            continue
        if not low_tight and not high_tight:
            return True
        if at == len(target) and _ends_within(written, low if low_tight else None, high if high_tight else None):
            return True
        for length, char in _steps(target, at):
            state = _next(char, written, low if low_tight else None, high if high_tight else None)
            if state is not None and (at + length, written + 1, *state) not in seen:
                seen.add((at + length, written + 1, *state))
                todo.append((at + length, written + 1, *state))
    return False


def _ends_within(written: int, low: Bound | None, high: Bound | None) -> bool:
    """Whether a spelling of ``written`` characters that is each given end's beginning lies within them."""
    if low is not None and (written < len(low[0]) or low[1]):  # below low, or equal to an end it stops short of
        return False
    return high is None or written < len(high[0]) or not high[1]


def _next(char: str, written: int, low: Bound | None, high: Bound | None) -> tuple[bool, bool] | None:
    """Whether each end is still tight after ``char`` is written at ``written``; None: past an end."""
    low_tight = high_tight = False
    if low is not None and written < len(low[0]):  # written all of low's text, a spelling is above it
        if char < low[0][written]:
            return None
        low_tight = char == low[0][written]
    if high is not None:
        if written == len(high[0]) or char > high[0][written]:
            return None
        high_tight = char == high[0][written]
    return low_tight, high_tight
