"""DCD Management command set (56h): configure a Dynamic Capacity Device and move extents to and from hosts.

CXL r3.1/r3.2 7.6.7.6. DPAs, lengths and block sizes are bytes; the total dynamic capacity of Get DCD Info is
in 256 MiB units, as the specification states it, and kept raw.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.fmapi._base import EmptyPayload
from disagg_cxl_switch.fmapi.opcodes import Opcode

MAX_DC_REGIONS = 8
GET_DCD_INFO_RESPONSE_SIZE = 0x54
DC_REGION_CONFIG_SIZE = 40
EXTENT_SIZE = 40
TAG_SIZE = 16
NO_TAG = bytes(TAG_SIZE)


class SelectionPolicy(IntEnum):
    """Selection Policy of Initiate DC Add (bits[3:0]), and bit positions of the supported-policies mask."""

    FREE = 0x0
    CONTIGUOUS = 0x1
    PRESCRIPTIVE = 0x2
    ENABLE_SHARED_ACCESS = 0x3


class RemovalPolicy(IntEnum):
    """Removal Policy of Initiate DC Release (flags bits[3:0]), and bit positions of the supported mask."""

    TAG_BASED = 0x0
    PRESCRIPTIVE = 0x1


@attrs.frozen
class Extent:
    """One 40-byte DC extent: start DPA (8), length (8), tag (16), shared extent sequence (2), 6 reserved."""

    start_dpa: int
    length: int
    tag: bytes = NO_TAG
    shared_extent_sequence: int = 0

    def write(self, w: Writer) -> None:
        w.u64(self.start_dpa, "extent start DPA")
        w.u64(self.length, "extent length")
        w.raw(self.tag, TAG_SIZE, "extent tag")
        w.u16(self.shared_extent_sequence, "shared extent sequence")
        w.reserved(6)

    @classmethod
    def read(cls, r: Reader) -> Extent:
        start = r.u64("extent start DPA")
        length = r.u64("extent length")
        tag = r.raw(TAG_SIZE, "extent tag")
        sequence = r.u16("shared extent sequence")
        r.reserved(6)
        return cls(start, length, tag, sequence)


def _write_extents(w: Writer, extents: tuple[Extent, ...]) -> None:
    for extent in extents:
        extent.write(w)


def _read_extents(r: Reader, count: int, field: str) -> tuple[Extent, ...]:
    r.expect_records(count, EXTENT_SIZE, field)
    return tuple(Extent.read(r) for _ in range(count))


@attrs.frozen
class GetDCDInfoRequest(EmptyPayload):
    """Get DCD Info takes no input payload."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_DCD_INFO


@attrs.frozen
class GetDCDInfoResponse:
    """What the DCD supports (54h bytes): hosts, regions, policies, capacity, block sizes per region.

    Layout: number of hosts (1), number of supported DC regions (1), reserved (2), capacity selection policies
    supported (2, a bitmask by `SelectionPolicy`), reserved (2), capacity removal policies supported (2, by
    `RemovalPolicy`), sanitize-on-release configuration support mask (1, a bit per region), reserved (1), total
    dynamic capacity (8, 256 MiB units), then eight 8-byte supported block size masks, region 0 to 7. Masks of
    regions beyond the supported count are sent as zero and not kept, so `region_block_size_masks` has exactly
    one entry per supported region.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GET_DCD_INFO

    number_of_hosts: int
    capacity_selection_policies: int
    capacity_removal_policies: int
    sanitize_on_release_support_mask: int
    total_dynamic_capacity: int
    region_block_size_masks: tuple[int, ...]

    def encode(self) -> bytes:
        if len(self.region_block_size_masks) > MAX_DC_REGIONS:
            raise ValueError(f"at most {MAX_DC_REGIONS} DC regions, got {len(self.region_block_size_masks)}")
        w = Writer()
        w.u8(self.number_of_hosts, "number of hosts")
        w.u8(len(self.region_block_size_masks), "number of supported DC regions")
        w.reserved(2)
        w.u16(self.capacity_selection_policies, "capacity selection policies")
        w.reserved(2)
        w.u16(self.capacity_removal_policies, "capacity removal policies")
        w.u8(self.sanitize_on_release_support_mask, "sanitize on release configuration support mask")
        w.reserved(1)
        w.u64(self.total_dynamic_capacity, "total dynamic capacity")
        for mask in self.region_block_size_masks:
            w.u64(mask, "region supported block size mask")
        w.reserved(8 * (MAX_DC_REGIONS - len(self.region_block_size_masks)))
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        hosts = r.u8("number of hosts")
        regions = r.u8("number of supported DC regions")
        if regions > MAX_DC_REGIONS:
            raise CCIFormatError(f"{cls.__name__}: {regions} DC regions, at most {MAX_DC_REGIONS}")
        r.reserved(2)
        selection = r.u16("capacity selection policies")
        r.reserved(2)
        removal = r.u16("capacity removal policies")
        sanitize = r.u8("sanitize on release configuration support mask")
        r.reserved(1)
        total = r.u64("total dynamic capacity")
        masks = tuple(r.u64("region supported block size mask") for _ in range(MAX_DC_REGIONS))
        r.end()
        return cls(hosts, selection, removal, sanitize, total, masks[:regions])


@attrs.frozen
class GetHostDCRegionConfigRequest:
    """Which regions of a host's view to report: host id (2), region count (1), starting region index (1)."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_HOST_DC_REGION_CONFIG

    host_id: int
    region_count: int = MAX_DC_REGIONS
    starting_region_index: int = 0

    def encode(self) -> bytes:
        w = Writer()
        w.u16(self.host_id, "host id")
        w.u8(self.region_count, "region count")
        w.u8(self.starting_region_index, "starting region index")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        count = r.u8("region count")
        start = r.u8("starting region index")
        r.end()
        return cls(host, count, start)


@attrs.frozen
class DCRegionConfig:
    """One 40-byte DC region configuration: base, decode length, length, block size (8 bytes each), DSMAS
    flags (1), 3 reserved, sanitize-on-release flags (1, bit 0), 3 reserved. The decode length alone is in
    256 MiB units (as QEMU sends it); the others are bytes.
    """

    region_base: int
    region_decode_length: int
    region_length: int
    region_block_size: int
    dsmas_flags: int = 0
    sanitize_on_release: bool = False

    def write(self, w: Writer) -> None:
        w.u64(self.region_base, "region base")
        w.u64(self.region_decode_length, "region decode length")
        w.u64(self.region_length, "region length")
        w.u64(self.region_block_size, "region block size")
        w.u8(self.dsmas_flags, "DSMAS flags")
        w.reserved(3)
        w.u8(int(self.sanitize_on_release), "sanitize on release")
        w.reserved(3)

    @classmethod
    def read(cls, r: Reader) -> DCRegionConfig:
        base = r.u64("region base")
        decode_length = r.u64("region decode length")
        length = r.u64("region length")
        block_size = r.u64("region block size")
        flags = r.u8("DSMAS flags")
        r.reserved(3)
        sanitize = bool(r.u8("sanitize on release") & 0x01)
        r.reserved(3)
        return cls(base, decode_length, length, block_size, flags, sanitize)


@attrs.frozen
class GetHostDCRegionConfigResponse:
    """A host's DC regions and the DCD's extent and tag budget.

    Host id (2), number of available regions (1), regions returned (1), one 40-byte `DCRegionConfig` per
    returned region, then four 4-byte counts: total supported extents, available extents, total supported
    tags, available tags.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GET_HOST_DC_REGION_CONFIG

    host_id: int
    number_of_available_regions: int
    regions: tuple[DCRegionConfig, ...]
    total_supported_extents: int
    available_extents: int
    total_supported_tags: int
    available_tags: int

    def encode(self) -> bytes:
        w = Writer()
        w.u16(self.host_id, "host id")
        w.u8(self.number_of_available_regions, "number of available regions")
        w.u8(len(self.regions), "regions returned")
        for region in self.regions:
            region.write(w)
        w.u32(self.total_supported_extents, "total number of supported extents")
        w.u32(self.available_extents, "number of available extents")
        w.u32(self.total_supported_tags, "total number of supported tags")
        w.u32(self.available_tags, "number of available tags")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        available = r.u8("number of available regions")
        returned = r.u8("regions returned")
        r.expect_records(returned, DC_REGION_CONFIG_SIZE, "regions returned", trailer=16)
        regions = tuple(DCRegionConfig.read(r) for _ in range(returned))
        return cls(
            host,
            available,
            regions,
            total_supported_extents=r.u32("total number of supported extents"),
            available_extents=r.u32("number of available extents"),
            total_supported_tags=r.u32("total number of supported tags"),
            available_tags=r.u32("number of available tags"),
        )


@attrs.frozen
class SetDCRegionConfigRequest:
    """Configure a region: region id (1), 3 reserved, block size (8), flags (1, bit 0 sanitize on release),
    3 reserved (16 bytes)."""

    OPCODE: ClassVar[Opcode] = Opcode.SET_DC_REGION_CONFIG

    region_id: int
    block_size: int
    sanitize_on_release: bool = False

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.region_id, "region id")
        w.reserved(3)
        w.u64(self.block_size, "block size")
        w.u8(int(self.sanitize_on_release), "flags")
        w.reserved(3)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        region = r.u8("region id")
        r.reserved(3)
        block_size = r.u64("block size")
        sanitize = bool(r.u8("flags") & 0x01)
        r.reserved(3)
        r.end()
        return cls(region, block_size, sanitize)


@attrs.frozen
class SetDCRegionConfigResponse(EmptyPayload):
    """Set DC Region Configuration returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.SET_DC_REGION_CONFIG


@attrs.frozen
class GetDCRegionExtentListsRequest:
    """A window of a host's extent list: host id (2), 2 reserved, extent count (4), starting extent index (4)."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_DC_REGION_EXTENT_LISTS

    host_id: int
    extent_count: int
    starting_extent_index: int = 0

    def encode(self) -> bytes:
        w = Writer()
        w.u16(self.host_id, "host id")
        w.reserved(2)
        w.u32(self.extent_count, "extent count")
        w.u32(self.starting_extent_index, "starting extent index")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        r.reserved(2)
        count = r.u32("extent count")
        start = r.u32("starting extent index")
        r.end()
        return cls(host, count, start)


@attrs.frozen
class GetDCRegionExtentListsResponse:
    """The window of extents: host id (2), 2 reserved, starting extent index (4), extents returned (4), total
    extents (4), extent list generation number (4), 4 reserved, then one 40-byte `Extent` per returned extent.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GET_DC_REGION_EXTENT_LISTS

    host_id: int
    starting_extent_index: int
    total_extents: int
    extent_list_generation_number: int
    extents: tuple[Extent, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u16(self.host_id, "host id")
        w.reserved(2)
        w.u32(self.starting_extent_index, "starting extent index")
        w.u32(len(self.extents), "number of extents returned")
        w.u32(self.total_extents, "total extents")
        w.u32(self.extent_list_generation_number, "extent list generation number")
        w.reserved(4)
        _write_extents(w, self.extents)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        r.reserved(2)
        start = r.u32("starting extent index")
        returned = r.u32("number of extents returned")
        total = r.u32("total extents")
        generation = r.u32("extent list generation number")
        r.reserved(4)
        return cls(host, start, total, generation, _read_extents(r, returned, "number of extents returned"))


@attrs.frozen
class InitiateDCAddRequest:
    """Offer capacity to a host: host id (2), selection policy (1, bits[3:0]), region number (1), length (8),
    tag (16), extent count (4), then the extents (used by the prescriptive policy)."""

    OPCODE: ClassVar[Opcode] = Opcode.INITIATE_DC_ADD

    host_id: int
    selection_policy: int
    region_number: int
    length: int
    tag: bytes = NO_TAG
    extents: tuple[Extent, ...] = ()

    def encode(self) -> bytes:
        if not 0 <= self.selection_policy <= 0xF:
            raise ValueError(f"selection policy={self.selection_policy} does not fit in 4 bits")
        w = Writer()
        w.u16(self.host_id, "host id")
        w.u8(self.selection_policy, "selection policy")
        w.u8(self.region_number, "region number")
        w.u64(self.length, "length")
        w.raw(self.tag, TAG_SIZE, "tag")
        w.u32(len(self.extents), "extent count")
        _write_extents(w, self.extents)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        policy = r.u8("selection policy") & 0x0F
        region = r.u8("region number")
        length = r.u64("length")
        tag = r.raw(TAG_SIZE, "tag")
        count = r.u32("extent count")
        return cls(host, policy, region, length, tag, _read_extents(r, count, "extent count"))


@attrs.frozen
class InitiateDCAddResponse(EmptyPayload):
    """Initiate Dynamic Capacity Add returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.INITIATE_DC_ADD


_REMOVAL_POLICY_MASK = 0x0F
_FORCED_REMOVAL = 1 << 4
_SANITIZE_ON_RELEASE = 1 << 5


@attrs.frozen
class InitiateDCReleaseRequest:
    """Ask a host to give capacity back: host id (2), flags (1), 1 reserved, length (8), tag (16), extent count
    (4), then the extents. Flags: bits[3:0] removal policy, bit 4 forced removal, bit 5 sanitize on release,
    bits[7:6] reserved.
    """

    OPCODE: ClassVar[Opcode] = Opcode.INITIATE_DC_RELEASE

    host_id: int
    removal_policy: int
    length: int
    tag: bytes = NO_TAG
    extents: tuple[Extent, ...] = ()
    forced_removal: bool = False
    sanitize_on_release: bool = False

    def encode(self) -> bytes:
        if not 0 <= self.removal_policy <= _REMOVAL_POLICY_MASK:
            raise ValueError(f"removal policy={self.removal_policy} does not fit in 4 bits")
        flags = self.removal_policy
        flags |= _FORCED_REMOVAL if self.forced_removal else 0
        flags |= _SANITIZE_ON_RELEASE if self.sanitize_on_release else 0
        w = Writer()
        w.u16(self.host_id, "host id")
        w.u8(flags, "flags")
        w.reserved(1)
        w.u64(self.length, "length")
        w.raw(self.tag, TAG_SIZE, "tag")
        w.u32(len(self.extents), "extent count")
        _write_extents(w, self.extents)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host = r.u16("host id")
        flags = r.u8("flags")
        r.reserved(1)
        length = r.u64("length")
        tag = r.raw(TAG_SIZE, "tag")
        count = r.u32("extent count")
        extents = _read_extents(r, count, "extent count")
        return cls(
            host,
            flags & _REMOVAL_POLICY_MASK,
            length,
            tag,
            extents,
            forced_removal=bool(flags & _FORCED_REMOVAL),
            sanitize_on_release=bool(flags & _SANITIZE_ON_RELEASE),
        )


@attrs.frozen
class InitiateDCReleaseResponse(EmptyPayload):
    """Initiate Dynamic Capacity Release returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.INITIATE_DC_RELEASE


__all__ = [
    "DC_REGION_CONFIG_SIZE",
    "EXTENT_SIZE",
    "GET_DCD_INFO_RESPONSE_SIZE",
    "MAX_DC_REGIONS",
    "NO_TAG",
    "TAG_SIZE",
    "DCRegionConfig",
    "Extent",
    "GetDCDInfoRequest",
    "GetDCDInfoResponse",
    "GetDCRegionExtentListsRequest",
    "GetDCRegionExtentListsResponse",
    "GetHostDCRegionConfigRequest",
    "GetHostDCRegionConfigResponse",
    "InitiateDCAddRequest",
    "InitiateDCAddResponse",
    "InitiateDCReleaseRequest",
    "InitiateDCReleaseResponse",
    "RemovalPolicy",
    "SelectionPolicy",
    "SetDCRegionConfigRequest",
    "SetDCRegionConfigResponse",
]
