"""The CXL Fabric Manager API payloads: one request and one response class per command, and their opcodes.

Each class encodes to, and decodes from, exactly the bytes of its table in the CXL specification (r3.1 section
7.6.7; r3.2 for DCD Management). `REQUESTS` and `RESPONSES` map an opcode to its classes, so that a receiver
picks the decoder from the CCI header alone.
"""

from __future__ import annotations

from disagg_cxl_switch.fmapi._base import EmptyPayload, Payload
from disagg_cxl_switch.fmapi.dcd import (
    DCRegionConfig,
    Extent,
    GetDCDInfoRequest,
    GetDCDInfoResponse,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    InitiateDCAddRequest,
    InitiateDCAddResponse,
    InitiateDCReleaseRequest,
    InitiateDCReleaseResponse,
    RemovalPolicy,
    SelectionPolicy,
    SetDCRegionConfigRequest,
    SetDCRegionConfigResponse,
)
from disagg_cxl_switch.fmapi.mld import (
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetLDInfoRequest,
    GetLDInfoResponse,
    LDAllocation,
    MemoryGranularity,
    SetLDAllocationsRequest,
    SetLDAllocationsResponse,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    TunnelTargetType,
)
from disagg_cxl_switch.fmapi.opcodes import Opcode
from disagg_cxl_switch.fmapi.switch import (
    GetPhysicalPortStateRequest,
    GetPhysicalPortStateResponse,
    IdentifySwitchDeviceRequest,
    IdentifySwitchDeviceResponse,
    PhysicalPortControlRequest,
    PhysicalPortControlResponse,
    PortConfigurationState,
    PortInfo,
    PortOpcode,
)
from disagg_cxl_switch.fmapi.vcs import (
    LD_ID_NOT_MLD,
    BindVPPBRequest,
    BindVPPBResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    UnbindOption,
    UnbindVPPBRequest,
    UnbindVPPBResponse,
    VCSInfo,
    VCSState,
    VPPBBindingStatus,
    VPPBInfo,
)

_PAIRS: tuple[tuple[type[Payload], type[Payload]], ...] = (
    (IdentifySwitchDeviceRequest, IdentifySwitchDeviceResponse),
    (GetPhysicalPortStateRequest, GetPhysicalPortStateResponse),
    (PhysicalPortControlRequest, PhysicalPortControlResponse),
    (GetVirtualCxlSwitchInfoRequest, GetVirtualCxlSwitchInfoResponse),
    (BindVPPBRequest, BindVPPBResponse),
    (UnbindVPPBRequest, UnbindVPPBResponse),
    (TunnelManagementCommandRequest, TunnelManagementCommandResponse),
    (GetLDInfoRequest, GetLDInfoResponse),
    (GetLDAllocationsRequest, GetLDAllocationsResponse),
    (SetLDAllocationsRequest, SetLDAllocationsResponse),
    (GetDCDInfoRequest, GetDCDInfoResponse),
    (GetHostDCRegionConfigRequest, GetHostDCRegionConfigResponse),
    (SetDCRegionConfigRequest, SetDCRegionConfigResponse),
    (GetDCRegionExtentListsRequest, GetDCRegionExtentListsResponse),
    (InitiateDCAddRequest, InitiateDCAddResponse),
    (InitiateDCReleaseRequest, InitiateDCReleaseResponse),
)

REQUESTS: dict[Opcode, type[Payload]] = {request.OPCODE: request for request, _ in _PAIRS}
"""The request payload class of each implemented opcode."""

RESPONSES: dict[Opcode, type[Payload]] = {response.OPCODE: response for _, response in _PAIRS}
"""The response payload class of each implemented opcode."""

__all__ = [
    "LD_ID_NOT_MLD",
    "REQUESTS",
    "RESPONSES",
    "BindVPPBRequest",
    "BindVPPBResponse",
    "DCRegionConfig",
    "EmptyPayload",
    "Extent",
    "GetDCDInfoRequest",
    "GetDCDInfoResponse",
    "GetDCRegionExtentListsRequest",
    "GetDCRegionExtentListsResponse",
    "GetHostDCRegionConfigRequest",
    "GetHostDCRegionConfigResponse",
    "GetLDAllocationsRequest",
    "GetLDAllocationsResponse",
    "GetLDInfoRequest",
    "GetLDInfoResponse",
    "GetPhysicalPortStateRequest",
    "GetPhysicalPortStateResponse",
    "GetVirtualCxlSwitchInfoRequest",
    "GetVirtualCxlSwitchInfoResponse",
    "IdentifySwitchDeviceRequest",
    "IdentifySwitchDeviceResponse",
    "InitiateDCAddRequest",
    "InitiateDCAddResponse",
    "InitiateDCReleaseRequest",
    "InitiateDCReleaseResponse",
    "LDAllocation",
    "MemoryGranularity",
    "Opcode",
    "Payload",
    "PhysicalPortControlRequest",
    "PhysicalPortControlResponse",
    "PortConfigurationState",
    "PortInfo",
    "PortOpcode",
    "RemovalPolicy",
    "SelectionPolicy",
    "SetDCRegionConfigRequest",
    "SetDCRegionConfigResponse",
    "SetLDAllocationsRequest",
    "SetLDAllocationsResponse",
    "TunnelManagementCommandRequest",
    "TunnelManagementCommandResponse",
    "TunnelTargetType",
    "UnbindOption",
    "UnbindVPPBRequest",
    "UnbindVPPBResponse",
    "VCSInfo",
    "VCSState",
    "VPPBBindingStatus",
    "VPPBInfo",
]
