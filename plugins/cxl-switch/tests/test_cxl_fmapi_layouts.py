"""Every FM API payload encodes to, and decodes from, the bytes of its table in the specification."""

from __future__ import annotations

from typing import Any

import pytest
from cxl_switch_layouts import CASES, VCS_INFO, VCS_RESPONSE, le
from disagg_cxl_switch.emulator.background import BackgroundOperationStatusResponse
from disagg_cxl_switch.fmapi import (
    REQUESTS,
    RESPONSES,
    GetVirtualCxlSwitchInfoResponse,
    MemoryGranularity,
    Opcode,
    UnbindVPPBRequest,
    VCSInfo,
    VPPBInfo,
)


def _case_id(case: tuple[Any, bytes]) -> str:
    return type(case[0]).__name__


class TestLayouts:
    """Encoding gives the hand-written bytes exactly, and decoding them gives the object back."""

    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_encode(self, case: tuple[Any, bytes]) -> None:
        payload, raw = case
        assert payload.encode() == raw

    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_decode(self, case: tuple[Any, bytes]) -> None:
        payload, raw = case
        assert type(payload).decode(raw) == payload

    def test_every_class_has_a_case(self) -> None:
        classes = {type(payload) for payload, _ in CASES}
        assert classes == set(REQUESTS.values()) | set(RESPONSES.values())


class TestOpcodes:
    """Opcodes carry their specification values, and each has one request and one response class."""

    def test_values(self) -> None:
        spec = {
            0x5100, 0x5101, 0x5102, 0x5200, 0x5201, 0x5202, 0x5300, 0x5400, 0x5401, 0x5402,
            0x5600, 0x5601, 0x5602, 0x5603, 0x5604, 0x5605,
        }  # fmt: skip
        assert {op.value for op in Opcode} == spec
        assert (Opcode.BIND_VPPB.command_set, Opcode.BIND_VPPB.command) == (0x52, 0x01)

    def test_registry(self) -> None:
        assert set(REQUESTS) == set(RESPONSES) == set(Opcode)
        for opcode in Opcode:
            assert REQUESTS[opcode].OPCODE is opcode
            assert RESPONSES[opcode].OPCODE is opcode


class TestVirtualSwitchWindow:
    """A VCS block carries the vPPBs of the request's window, so decoding needs the window."""

    def test_window_of_a_later_request(self) -> None:
        # start vPPB 1, limit 1: a VCS of 3 vPPBs returns one entry, vPPB 1.
        raw = le(1, 1) + bytes(3) + bytes([0, 0x01, 1, 3]) + bytes([0x03, 6, 2, 0])
        info = GetVirtualCxlSwitchInfoResponse.decode(raw, start_vppb=1, vppb_list_limit=1)
        assert info == GetVirtualCxlSwitchInfoResponse((VCSInfo(0, 0x01, 1, 3, (VPPBInfo(0x03, 6, 2),)),))
        assert info.encode(start_vppb=1, vppb_list_limit=1) == raw

    def test_start_beyond_the_vppbs_returns_none(self) -> None:
        raw = le(1, 1) + bytes(3) + bytes([0, 0x01, 1, 2])
        info = GetVirtualCxlSwitchInfoResponse.decode(raw, start_vppb=4, vppb_list_limit=8)
        assert info.vcss[0].vppbs == ()

    def test_encode_rejects_entries_outside_the_window(self) -> None:
        with pytest.raises(ValueError, match="returns 1 for start vPPB 0 and limit 1"):
            VCS_INFO.encode(start_vppb=0, vppb_list_limit=1)

    def test_default_window_is_every_vppb(self) -> None:
        assert GetVirtualCxlSwitchInfoResponse.decode(VCS_RESPONSE) == VCS_INFO


class TestFieldDetails:
    """Reserved bits are ignored on decode, and enums give units."""

    def test_unbind_option_ignores_reserved_high_bits(self) -> None:
        assert UnbindVPPBRequest.decode(bytes([1, 2, 0xF1])) == UnbindVPPBRequest(1, 2, 0x1)

    def test_memory_granularity_bytes(self) -> None:
        assert [g.unit_bytes for g in MemoryGranularity] == [256 << 20, 512 << 20, 1 << 30]

    @pytest.mark.parametrize(
        ("status", "byte0"),
        [
            (BackgroundOperationStatusResponse(True, 50, Opcode.BIND_VPPB, 0), 0x65),
            (BackgroundOperationStatusResponse(False, 100, Opcode.BIND_VPPB, 0), 0xC8),
            (BackgroundOperationStatusResponse(True, 0, Opcode.UNBIND_VPPB, 0), 0x01),
        ],
    )
    def test_background_status_byte_0(self, status: BackgroundOperationStatusResponse, byte0: int) -> None:
        """Bit 0 is "operation in progress" and bits[7:1] the percentage complete (CXL r3.1 8.2.9.1.2), as QEMU
        and libcxlmi read it."""
        raw = bytes([byte0, 0]) + le(status.command_opcode, 2) + bytes(4)
        assert status.encode() == raw
        assert BackgroundOperationStatusResponse.decode(raw) == status
