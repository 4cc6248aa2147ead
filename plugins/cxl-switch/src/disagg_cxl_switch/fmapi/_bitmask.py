"""Port and VCS bitmasks: a fixed number of bytes, bit n of the little-endian whole set when id n is active."""

from __future__ import annotations

from disagg_cxl_switch._wire import Reader, Writer


def write_bitmask(w: Writer, ids: frozenset[int], size: int, field: str) -> None:
    value = 0
    for i in ids:
        if not 0 <= i < 8 * size:
            raise ValueError(f"{field}: id {i} is outside the {8 * size}-bit mask")
        value |= 1 << i
    w.uint(value, size, field)


def read_bitmask(r: Reader, size: int, field: str) -> frozenset[int]:
    value = r.uint(size, field)
    return frozenset(i for i in range(8 * size) if value >> i & 1)
