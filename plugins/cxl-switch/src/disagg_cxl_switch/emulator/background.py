"""The one background operation a CCI runs at a time, and the Background Operation Status command (0002h).

A command that answers Background Command Started hands its effect to `BackgroundOperations.start`; the effect
is applied once the delay has passed, checked whenever the switch handles a request. No timer thread: a client
that polls Background Operation Status drives completion, and a test with a fake clock controls it exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.fmapi._base import NoPayload
from disagg_cxl_switch.returncodes import ReturnCode

BACKGROUND_OPERATION_STATUS = 0x0002
"""Opcode of Background Operation Status in the generic command set (CXL r3.1 8.2.9.1.2)."""

_RUNNING_BIT = 0x01
_PERCENT_SHIFT = 1


@attrs.frozen
class BackgroundOperationStatusRequest(NoPayload):
    """Background Operation Status takes no input payload."""

    OPCODE: ClassVar[int] = BACKGROUND_OPERATION_STATUS


@attrs.frozen
class BackgroundOperationStatusResponse:
    """Progress of the last background command (8 bytes): byte 0 bit 0 set while it runs and bits[7:1] the
    percentage complete (CXL r3.1 8.2.9.1.2; QEMU and libcxlmi read it so), 1 reserved byte, its opcode (2), its
    return code (2, valid once done), vendor status (2)."""

    OPCODE: ClassVar[int] = BACKGROUND_OPERATION_STATUS

    running: bool
    percentage_complete: int
    command_opcode: int
    return_code: int
    vendor_specific_status: int = 0

    def encode(self) -> bytes:
        if not 0 <= self.percentage_complete <= 100:
            raise ValueError(f"percentage complete={self.percentage_complete} is not 0..100")
        w = Writer()
        status = self.percentage_complete << _PERCENT_SHIFT | (_RUNNING_BIT if self.running else 0)
        w.u8(status, "background operation status")
        w.reserved(1)
        w.u16(self.command_opcode, "command opcode")
        w.u16(self.return_code, "return code")
        w.u16(self.vendor_specific_status, "vendor specific extended status")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        status = r.u8("background operation status")
        r.reserved(1)
        opcode = r.u16("command opcode")
        code = r.u16("return code")
        vendor = r.u16("vendor specific extended status")
        r.end()
        return cls(bool(status & _RUNNING_BIT), status >> _PERCENT_SHIFT, opcode, code, vendor)


@attrs.define
class _Operation:
    opcode: int
    started: float
    delay: float
    complete: Callable[[], ReturnCode]
    return_code: ReturnCode | None = None


class BackgroundOperations:
    """At most one background command at a time; the last one's outcome stays readable until the next starts."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: _Operation | None = None

    def poll(self) -> None:
        """Completes the running operation if its delay has passed."""
        op = self._last
        if op is not None and op.return_code is None and self._clock() >= op.started + op.delay:
            op.return_code = op.complete()

    @property
    def running(self) -> bool:
        self.poll()
        return self._last is not None and self._last.return_code is None

    def start(self, opcode: int, delay: float, complete: Callable[[], ReturnCode]) -> None:
        if self.running:
            raise RuntimeError("a background operation is already running")
        self._last = _Operation(opcode, self._clock(), delay, complete)

    def status(self) -> BackgroundOperationStatusResponse:
        self.poll()
        op = self._last
        if op is None:
            return BackgroundOperationStatusResponse(False, 0, 0, 0)
        if op.return_code is not None:
            return BackgroundOperationStatusResponse(False, 100, op.opcode, op.return_code)
        elapsed = self._clock() - op.started
        percent = min(99, int(100 * elapsed / op.delay)) if op.delay > 0 else 99
        return BackgroundOperationStatusResponse(True, percent, op.opcode, 0)
