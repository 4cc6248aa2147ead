"""Parsing and printing of sizes and latencies, for the request language, configuration and tables."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_LATENCY_UNITS = {"": 1, "ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Zµ]*)\s*$", flags=re.ASCII)


SHOWN = 64
"""The characters of what a user wrote that a refusal quotes: a token of thousands made a message as long."""


def shown(text: object) -> str:
    """``text`` quoted as a refusal quotes what the user wrote: its first `SHOWN` characters, then ``...``."""
    if isinstance(text, str) and len(text) > SHOWN:
        return f"{text[:SHOWN]!r}..."
    quoted = repr(text)
    return quoted if len(quoted) <= SHOWN + 2 else f"{quoted[:SHOWN]}..."


def _too_long(number: str, what: str) -> ValueError:
    """The refusal of ``number``, of more digits than `int` reads (`sys.get_int_max_str_digits`, 4300): Python's
    own message tells the user to raise that limit."""
    digits = sum(c.isdigit() for c in number)
    return ValueError(f"{what} {number[:12]}... has {digits:,} digits, more than any {what} needs: write it in fewer")


def _whole(number: str, factor: int, text: object, what: str) -> int:
    """``number`` times ``factor`` exactly (no float rounding), or ValueError if it is not whole."""
    whole, _, frac = number.partition(".")
    scale = int(10 ** len(frac))
    try:
        parts = int(whole) * scale + int(frac or "0")
    except ValueError:
        raise _too_long(number, what) from None
    value, rest = divmod(parts * factor, scale)
    if rest:
        raise ValueError(f"{what} {shown(text)} is not a whole number of {'bytes' if what == 'size' else 'ns'}")
    return value


def _check_type(text: object, what: str) -> None:
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise ValueError(f"{what} must be a whole number or a string with a unit, not {shown(text)}")


def parse_size(text: str | int) -> int:
    """Bytes from ``512GiB``, ``1.5TiB``, ``80 GB`` or a plain integer."""
    _check_type(text, "size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _NUMBER.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {shown(text)} (use a number with B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)")
    return _whole(match.group(1), _SIZE_UNITS[match.group(2).lower()], text, "size")


def parse_latency(text: str | int) -> int:
    """Nanoseconds from ``600ns``, ``1.2us``, ``2ms`` or a plain integer (nanoseconds). A fraction of a ns is
    refused, as a fraction of a byte is: rounded, ``latency<=349.5ns`` would admit a 350 ns device."""
    _check_type(text, "latency")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"latency must not be negative: {text}")
        return text
    match = _NUMBER.match(text)
    if not match or match.group(2).lower() not in _LATENCY_UNITS:
        raise ValueError(f"not a latency: {shown(text)} (use a number with ns, us or ms)")
    return _whole(match.group(1), _LATENCY_UNITS[match.group(2).lower()], text, "latency")


def format_size(nbytes: int) -> str:
    """The largest binary unit that shows ``nbytes`` without a fraction beyond two digits."""
    for unit, factor in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor:
            value = nbytes / factor
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def parse_attribute_value(text: str) -> str | int | float | bool:
    """An attribute value written as text (a selector's, a failure-domain label): a boolean, an integer, a number,
    a size with a unit (bytes), or a string."""
    raw = text.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"-?\d+", raw, flags=re.ASCII):
        try:
            return int(raw)
        except ValueError:
            raise _too_long(raw, "number") from None
    if re.fullmatch(r"-?\d+\.\d*", raw, flags=re.ASCII):
        return float(raw)
    if re.fullmatch(r"\d+(\.\d+)?\s*[KMGTP]i?B", raw, flags=re.IGNORECASE | re.ASCII):
        return parse_size(raw)
    return raw
