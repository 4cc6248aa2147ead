"""Little-endian field readers and writers shared by the CCI header and the FM API payloads.

Every payload in the FM API is a packed little-endian record; these two classes keep the byte arithmetic in one
place, so that each payload class reads as its table in the specification: one call per field, in order.
"""

from __future__ import annotations

from disagg_cxl_switch.errors import CCIFormatError


class Reader:
    """Reads fields from the front of a payload; running out of bytes is a `CCIFormatError` naming the field."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data = bytes(data)
        self._pos = 0
        self._what = what

    def raw(self, size: int, field: str) -> bytes:
        end = self._pos + size
        if end > len(self._data):
            raise CCIFormatError(
                f"{self._what}: truncated at {field} (needs {size} bytes at offset {self._pos}, "
                f"payload is {len(self._data)} bytes)"
            )
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def uint(self, size: int, field: str) -> int:
        return int.from_bytes(self.raw(size, field), "little")

    def u8(self, field: str) -> int:
        return self.uint(1, field)

    def u16(self, field: str) -> int:
        return self.uint(2, field)

    def u32(self, field: str) -> int:
        return self.uint(4, field)

    def u64(self, field: str) -> int:
        return self.uint(8, field)

    def reserved(self, size: int) -> None:
        """Skips reserved bytes: a receiver ignores their value, as the specification asks."""
        self.raw(size, "reserved")

    def remaining(self) -> int:
        return len(self._data) - self._pos

    def expect_records(self, count: int, record_size: int, field: str, trailer: int = 0) -> None:
        """Checks, before any is read, that exactly `count` records of `record_size` bytes follow (and then
        `trailer` bytes of fixed fields): a count that disagrees with the data is malformed either way."""
        want = count * record_size + trailer
        if self.remaining() != want:
            raise CCIFormatError(
                f"{self._what}: {field} declares {count} entries of {record_size} bytes ({want} bytes with what "
                f"follows them), but {self.remaining()} bytes remain"
            )

    def end(self) -> None:
        """Rejects trailing bytes: a payload longer than its layout is as malformed as a short one."""
        if self._pos != len(self._data):
            raise CCIFormatError(
                f"{self._what}: {len(self._data) - self._pos} unexpected trailing bytes "
                f"(layout ends at {self._pos}, payload is {len(self._data)} bytes)"
            )


class Writer:
    """Appends fields to a payload; a value that does not fit its field is a `ValueError` naming the field."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def raw(self, value: bytes, size: int, field: str) -> None:
        if len(value) != size:
            raise ValueError(f"{field} must be exactly {size} bytes, got {len(value)}")
        self._buf += value

    def uint(self, value: int, size: int, field: str) -> None:
        if not 0 <= value < 1 << (8 * size):
            raise ValueError(f"{field}={value} does not fit in an unsigned {8 * size}-bit field")
        self._buf += value.to_bytes(size, "little")

    def u8(self, value: int, field: str) -> None:
        self.uint(value, 1, field)

    def u16(self, value: int, field: str) -> None:
        self.uint(value, 2, field)

    def u32(self, value: int, field: str) -> None:
        self.uint(value, 4, field)

    def u64(self, value: int, field: str) -> None:
        self.uint(value, 8, field)

    def reserved(self, size: int) -> None:
        """Writes reserved bytes as zero, as the specification asks of a sender."""
        self._buf += bytes(size)

    def getvalue(self) -> bytes:
        return bytes(self._buf)
