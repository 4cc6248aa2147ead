"""Malformed payloads are CCIFormatError (the future Invalid Payload Length); bad values are ValueError."""

from __future__ import annotations

from typing import Any

import pytest
from cxl_switch_layouts import (
    CASES,
    DC_ADD,
    DC_RELEASE,
    DCD_INFO,
    EXTENT_LIST_RESPONSE,
    HOST_DC_RESPONSE,
    LD_ALLOC_RESPONSE,
    PORT_STATE_REQUEST,
    PORT_STATE_RESPONSE,
    SET_LD_ALLOC,
    TUNNEL_REQUEST,
    TUNNEL_RESPONSE,
    VCS_REQUEST,
    VCS_RESPONSE,
)
from disagg_cxl_switch import CCIFormatError
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    Extent,
    GetDCDInfoResponse,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigResponse,
    GetLDAllocationsResponse,
    GetPhysicalPortStateRequest,
    GetPhysicalPortStateResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    IdentifySwitchDeviceResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    SetLDAllocationsRequest,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    UnbindVPPBRequest,
)


def _case_id(case: tuple[Any, bytes]) -> str:
    return type(case[0]).__name__


def _with(raw: bytes, offset: int, value: int) -> bytes:
    return raw[:offset] + bytes([value]) + raw[offset + 1 :]


class TestLength:
    """A payload shorter or longer than its layout is rejected, whatever the class."""

    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_every_truncation(self, case: tuple[Any, bytes]) -> None:
        payload, raw = case
        for size in range(len(raw)):
            with pytest.raises(CCIFormatError):
                type(payload).decode(raw[:size])

    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_trailing_byte(self, case: tuple[Any, bytes]) -> None:
        payload, raw = case
        with pytest.raises(CCIFormatError):
            type(payload).decode(raw + b"\x00")


# (class, valid bytes, offset of the count byte): a count one higher or one lower than the list it counts.
COUNTED = [
    (GetPhysicalPortStateRequest, PORT_STATE_REQUEST, 0),
    (GetPhysicalPortStateResponse, PORT_STATE_RESPONSE, 0),
    (GetVirtualCxlSwitchInfoRequest, VCS_REQUEST, 2),
    (GetVirtualCxlSwitchInfoResponse, VCS_RESPONSE, 0),
    (TunnelManagementCommandRequest, TUNNEL_REQUEST, 2),
    (TunnelManagementCommandResponse, TUNNEL_RESPONSE, 0),
    (GetLDAllocationsResponse, LD_ALLOC_RESPONSE, 3),
    (SetLDAllocationsRequest, SET_LD_ALLOC, 0),
    (GetHostDCRegionConfigResponse, HOST_DC_RESPONSE, 3),
    (GetDCRegionExtentListsResponse, EXTENT_LIST_RESPONSE, 8),
    (InitiateDCAddRequest, DC_ADD, 0x1C),
    (InitiateDCReleaseRequest, DC_RELEASE, 0x1C),
]


class TestCounts:
    """A count that disagrees with the list that follows is rejected."""

    @pytest.mark.parametrize(("cls", "raw", "offset"), COUNTED, ids=[c[0].__name__ for c in COUNTED])
    @pytest.mark.parametrize("delta", [-1, 1])
    def test_count_off_by_one(self, cls: type[Any], raw: bytes, offset: int, delta: int) -> None:
        with pytest.raises(CCIFormatError):
            cls.decode(_with(raw, offset, raw[offset] + delta))

    def test_huge_extent_count_is_rejected_without_reading(self) -> None:
        raw = DC_ADD[:0x1C] + b"\xff\xff\xff\xff" + DC_ADD[0x20:]
        with pytest.raises(CCIFormatError, match="declares 4294967295 entries of 40 bytes"):
            InitiateDCAddRequest.decode(raw)

    def test_more_than_eight_dc_regions(self) -> None:
        with pytest.raises(CCIFormatError, match="9 DC regions, at most 8"):
            GetDCDInfoResponse.decode(_with(DCD_INFO, 1, 9))

    def test_malformed_tunnelled_message(self) -> None:
        # The embedded message claims a 1-byte payload it does not carry; command size still matches.
        inner = bytes([0x00, 0x05, 0x00, 0x00, 0x54, 0x01, 0x00, 0x00, 0, 0, 0, 0])
        with pytest.raises(CCIFormatError, match="tunnelled command: CCI message: header declares a 1-byte"):
            TunnelManagementCommandRequest.decode(bytes([4, 0, 12, 0]) + inner)

    def test_tunnelled_message_with_bad_category(self) -> None:
        bad = _with(TUNNEL_RESPONSE, 4, 0x07)
        with pytest.raises(CCIFormatError, match="unknown message category"):
            TunnelManagementCommandResponse.decode(bad)


class TestEncodeValues:
    """A value that does not fit its field is a ValueError naming the field, before anything is sent."""

    @pytest.mark.parametrize(
        ("payload", "field"),
        [
            (BindVPPBRequest(256, 0, 0), "VCS id"),
            (BindVPPBRequest(0, 0, 0, 0x1_0000), "LD id"),
            (UnbindVPPBRequest(0, 0, 0x10), "unbind option"),
            (GetPhysicalPortStateRequest(tuple(range(256))), "number of ports"),
            (IdentifySwitchDeviceResponse(0, 0, 0, frozenset({256}), frozenset(), 0, 0, 0), "active port bitmask"),
            (GetDCDInfoResponse(1, 0, 0, 0, 0, (0,) * 9), "at most 8 DC regions"),
            (InitiateDCAddRequest(0, 0x10, 0, 0), "selection policy"),
            (InitiateDCReleaseRequest(0, 0x10, 0), "removal policy"),
            (InitiateDCAddRequest(0, 0, 0, 0, b"short"), "tag"),
            (GetDCRegionExtentListsResponse(0, 0, 0, 0, (Extent(-1, 0),)), "extent start DPA"),
        ],
        ids=lambda v: v if isinstance(v, str) else type(v).__name__,
    )
    def test_out_of_range(self, payload: Any, field: str) -> None:
        with pytest.raises(ValueError, match=field):
            payload.encode()
