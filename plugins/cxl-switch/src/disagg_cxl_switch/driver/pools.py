"""The DCD's dynamic capacity as disagg `Pool`s: Initiate Dynamic Capacity Add and Release, tunnelled to the
DCD's port (5300h), and the hosts' extent lists (Get DC Region Extent Lists) as the truth.

Each allocation is the set of extents of one host carrying the allocation's tag (`state.allocation_tag`), so
the switch itself says what is carved for whom, and a release is a tag-based Initiate DC Release. An allocation
lies in one region (Linux refuses a tagged allocation across regions), so a DCD of several regions is one pool
per region, of that region's length and block size: the sum of the regions would offer the composer what no one
allocation can take. A DCD of one region is one pool under the device's id, as it has always been; the
device's id of a DCD of several still answers, listing and releasing in every region, for the allocations the
release before recorded under it. The DCD's host ids are the VCS ids. A DCD failed when the driver starts is read once
it is back, so the driver still starts; until then the pool's calls raise `FabricUnavailableError`.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from disagg.errors import (
    CapacityExhaustedError,
    DisaggError,
    FabricUnavailableError,
    NotFoundError,
    outcome_unknown,
)
from disagg.interfaces import CallContext, Pool, check_id
from disagg.model import Allocation, Capacity, Extent, FabricEvent, FabricEventKind, Health, PoolInfo, PoolKind

from disagg_cxl_switch.driver.carving import admit, already_held, tunnel_error
from disagg_cxl_switch.driver.client import CommandFailedError, Encodable, decode
from disagg_cxl_switch.driver.state import allocation_tag
from disagg_cxl_switch.fmapi import (
    DCRegionConfig,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    Opcode,
    RemovalPolicy,
    SelectionPolicy,
)
from disagg_cxl_switch.returncodes import ReturnCode

if TYPE_CHECKING:
    from disagg_cxl_switch.driver.fabric import CxlSwitchFabric

_REGION_ID = re.compile(r"-region([0-9])")
"""What follows the DCD's id in the id of one region's pool (a DCD has at most 8 regions)."""
_EXTENTS_PER_READ = 64
_LIST_READS = 3
"""How many times a host's extent list is read from the start when it changes between pages, before giving up."""


@attrs.frozen
class _Geometry:
    """The DCD's regions as it reports them, the lowest region base, and the pool they make."""

    regions: tuple[DCRegionConfig, ...]
    base: int
    info: PoolInfo


def _region_of(geometry: _Geometry, dpa: int) -> int | None:
    """The region that holds device physical address ``dpa``; None if none does."""
    for region, config in enumerate(geometry.regions):
        if config.region_base <= dpa < config.region_base + config.region_length:
            return region
    return None


@attrs.frozen
class _Refused:
    """A page past the first of a host's extent list, of generation ``generation``, refused with Invalid Input."""

    generation: int
    error: CommandFailedError


class DCD:
    """The DCD on one port: its regions, its hosts' extent lists, and the lock its adds and releases hold, shared
    by its pools (`DCDPool`): one per region when it has several, or one for the whole device."""

    def __init__(self, fabric: CxlSwitchFabric, port: int) -> None:
        self._fabric = fabric
        self._port = port
        self.device = fabric.device_id_of(port)
        self.id = f"{fabric.name}/dcd-port{port}"
        self.lock = threading.Lock()
        self._read: _Geometry | None = None
        self._views: dict[int | None, DCDPool] = {}
        try:
            self._read = self._read_geometry()
        except CommandFailedError as exc:
            if fabric.port_view(port).health is Health.OK:
                raise tunnel_error(exc, f"pool {self.id}: the DCD's regions cannot be read") from None
            # a failed DCD: read once it is back (see `geometry`), so that the driver starts and can repair it

    def _read_geometry(self) -> _Geometry:
        first_host = min(self._fabric.hosts().values())
        request = GetHostDCRegionConfigRequest(first_host)
        raw = self._fabric.client.tunnel(self._port, Opcode.GET_HOST_DC_REGION_CONFIG, request)
        regions = decode(GetHostDCRegionConfigResponse.decode, raw).regions
        if not regions:
            raise FabricUnavailableError(f"the DCD on port {self._port} has no DC region")
        total = sum(r.region_length for r in regions)
        block = max(r.region_block_size for r in regions)
        info = PoolInfo(self.id, self._fabric.name, self.device, Capacity(total, block), PoolKind.DCD)
        return _Geometry(regions, min(r.region_base for r in regions), info)

    def geometry(self) -> _Geometry:
        """The regions, read when the DCD was first asked or, if it was failed then, on first use after: a driver
        started while its link is down still starts. Two threads may both read it; they read the same."""
        if self._read is None:
            try:
                self._read = self._read_geometry()
            except CommandFailedError as exc:
                raise tunnel_error(exc, f"pool {self.id}: the DCD's regions cannot be read") from None
        return self._read

    def forget_geometry(self) -> None:
        """Read the regions again at the next use (another fabric manager may have set them since)."""
        self._read = None

    def view(self, region: int | None) -> DCDPool:
        """The pool of ``region``, or of the whole device for None (made once, so that all share this DCD)."""
        if region not in self._views:
            self._views[region] = DCDPool(self, self._fabric, self._port, region)
        return self._views[region]

    def pools(self) -> list[DCDPool]:
        """The pools discovery reports: one per region when there are several, else the device's own, whose id a
        DCD of one region has always had. A DCD of several reports the device's pool too while it lists
        allocations (of no capacity: `DCDPool.info`), so that the composer finds those its ledger records under
        it."""
        regions = self.geometry().regions
        if len(regions) == 1:
            return [self.view(None)]
        pools = [self.view(r) for r in range(len(regions))]
        legacy = self._fabric.state.has_tags_without_region() and self.view(None).allocations()
        return [*pools, self.view(None)] if legacy else pools

    def every_pool(self) -> list[DCDPool]:
        """Every pool that lists some of the DCD's allocations: the device's, and each region's of a DCD of
        several."""
        regions = len(self.geometry().regions)
        return [self.view(None), *(self.view(r) for r in range(regions) if regions > 1)]

    def owner(self, tag: bytes, lowest: int) -> int | None:
        """The region whose pool lists the tag's extents, whose lowest lies at device physical address
        ``lowest``; None for the device's pool. That is the whole DCD's of one region. Of several: the region
        recorded as carving it; the device's for a tag recorded without one (carved by the release before, or
        through the device's id); for a tag the driver did not set, the region of its lowest extent."""
        geometry = self.geometry()
        if len(geometry.regions) == 1:
            return None
        carved_by = self._fabric.state.region_pool_of(tag)
        if carved_by is not None:
            match = _REGION_ID.fullmatch(carved_by.removeprefix(self.id))
            return int(match.group(1)) if carved_by.startswith(self.id) and match else None
        if self._fabric.state.recorded(tag):
            return None
        return _region_of(geometry, lowest)

    def held_apart(self, region: int) -> int:
        """The bytes of ``region`` that the device's pool lists (of a DCD of several regions): its own pool
        cannot carve them. Read only while the driver records a tag without a region."""
        if not self._fabric.state.has_tags_without_region():
            return 0
        geometry = self.geometry()
        return sum(
            e.length
            for allocation in self.view(None).allocations()
            for e in allocation.extents
            if _region_of(geometry, e.offset + geometry.base) == region
        )

    def find(self, pool_id: str) -> DCDPool | None:
        """The pool named ``pool_id``: a region's, or the device's (which a DCD of several regions still answers
        to, for the allocations the release before recorded under it); None if it is not this DCD's. A region's
        id is looked up without reading the regions, which a failed DCD may not give yet: its calls check it."""
        if pool_id == self.id:
            return self.view(None)
        match = _REGION_ID.fullmatch(pool_id.removeprefix(self.id)) if pool_id.startswith(self.id) else None
        if match is None:
            return None
        region = int(match.group(1))
        if self._read is not None and (len(self._read.regions) < 2 or region >= len(self._read.regions)):
            return None
        return self.view(region)


class DCDPool(Pool):
    """The DCD's dynamic capacity carved as ``region`` alone or, for None, as the whole device (the first region
    with room): one allocation lies in one region, whichever pool carved it."""

    def __init__(self, dcd: DCD, fabric: CxlSwitchFabric, port: int, region: int | None) -> None:
        self._dcd = dcd
        self._fabric = fabric
        self._port = port
        self._device = dcd.device
        self._region = region
        self._id = dcd.id if region is None else f"{dcd.id}-region{region}"
        self._lock = dcd.lock
        self._carver = None if region is None else self._id
        """The region pool its tags are recorded with (`state.allocation_tag`); None for the device's."""

    def _regions(self) -> list[int]:
        """The regions this pool carves, in the order an add tries them; `NotFoundError` for a region the DCD
        does not have as a pool of its own (a DCD of one region is carved by the device's pool)."""
        regions = self._dcd.geometry().regions
        if self._region is None:
            return list(range(len(regions)))
        if len(regions) < 2 or self._region >= len(regions):
            raise NotFoundError("pool", self._id)
        return [self._region]

    @property
    def id(self) -> str:
        return self._id

    def info(self) -> PoolInfo:
        """A DCD of one region: the region. Of several, a region's pool: the region, less what the device's pool
        holds in it; the device's pool: none, so that placement never carves it, while it still lists and
        releases what the release before recorded under it."""
        geometry = self._dcd.geometry()
        if len(geometry.regions) == 1:
            return geometry.info
        if self._region is None:
            return attrs.evolve(geometry.info, capacity=Capacity(0, geometry.info.capacity.block_bytes))
        config = geometry.regions[self._regions()[0]]
        free = config.region_length - self._dcd.held_apart(self._region)
        return PoolInfo(self._id, self._fabric.name, self._device, Capacity(free, config.region_block_size))

    def _tunnel(self, opcode: Opcode, payload: Encodable, ctx: CallContext | None) -> bytes:
        """A query of the DCD; its refusal is the fabric failing (`tunnel_error`)."""
        try:
            return self._fabric.client.tunnel(self._port, opcode, payload, ctx)
        except CommandFailedError as exc:
            raise tunnel_error(exc, f"pool {self._id}") from None

    def _extents(self, host_id: int, ctx: CallContext | None) -> list[tuple[int, int, bytes]]:
        """The host's extents, from pages of one version of its list (see `_extent_list`)."""
        refused: _Refused | None = None
        for _ in range(_LIST_READS):
            extents = self._extent_list(host_id, ctx, refused)
            if isinstance(extents, list):
                return extents
            refused = extents
        raise FabricUnavailableError(
            f"pool {self._id}: the extent list of DCD host {host_id} changed between its pages {_LIST_READS} times "
            "in a row (another fabric manager is adding or releasing capacity); try again"
        )

    def _extent_list(
        self, host_id: int, ctx: CallContext | None, refused: _Refused | None
    ) -> list[tuple[int, int, bytes]] | _Refused | None:
        """The host's extent list read page by page; None if its generation number changed between two pages (the
        list changed meanwhile, and the pages, of two versions of it, would miss an extent or hold one twice), or
        the refusal of a page past the first, taken for the list shrinking below its start. If the list read
        after such a refusal is of the refused one's generation, it did not change: that refusal is raised."""
        got: list[tuple[int, int, bytes]] = []
        generation: int | None = None
        while True:
            page = self._extent_page(host_id, len(got), ctx)
            if isinstance(page, CommandFailedError):
                assert generation is not None  # a first page refused is raised by `_extent_page`
                return _Refused(generation, page)
            if generation is None and refused is not None and page.extent_list_generation_number == refused.generation:
                raise tunnel_error(refused.error, f"pool {self._id}") from None
            if generation not in (None, page.extent_list_generation_number):
                return None
            generation = page.extent_list_generation_number
            got += [(e.start_dpa, e.length, e.tag) for e in page.extents]
            if not page.extents or len(got) >= page.total_extents:
                return got

    def _extent_page(
        self, host_id: int, start: int, ctx: CallContext | None
    ) -> GetDCRegionExtentListsResponse | CommandFailedError:
        """The host's extents from index ``start``; the refusal itself when a page past the first is refused with
        Invalid Input, as when the list shrank below ``start`` since the page before."""
        request = GetDCRegionExtentListsRequest(host_id, _EXTENTS_PER_READ, start)
        try:
            raw = self._fabric.client.tunnel(self._port, Opcode.GET_DC_REGION_EXTENT_LISTS, request, ctx)
        except CommandFailedError as exc:
            if start and exc.return_code == ReturnCode.INVALID_INPUT:
                return exc
            raise tunnel_error(exc, f"pool {self._id}") from None
        return decode(GetDCRegionExtentListsResponse.decode, raw)

    def _tagged(self, ctx: CallContext | None = None) -> list[tuple[Allocation, bytes]]:
        """Each host's extents grouped by tag, as allocations named from the tags, with their tags: those this
        pool lists (`DCD.owner`). Offsets are from the DCD's lowest region base, in every pool."""
        geometry = self._dcd.geometry()
        self._regions()  # a region the DCD does not have is no pool
        listed = []
        for host, host_id in sorted(self._fabric.hosts().items()):
            by_tag: dict[bytes, list[Extent]] = defaultdict(list)
            for start, length, tag in self._extents(host_id, ctx):
                by_tag[tag].append(Extent(start - geometry.base, length))
            for tag, extents in by_tag.items():
                extents.sort(key=lambda e: e.offset)
                if self._dcd.owner(tag, extents[0].offset + geometry.base) != self._region:
                    continue
                name = self._fabric.state.allocation_of(tag)
                allocation = Allocation(name, self._id, host, sum(e.length for e in extents), tuple(extents))
                listed.append((allocation, tag))
        return listed

    def _held(self, ctx: CallContext | None = None) -> list[Allocation]:
        return sorted((allocation for allocation, _ in self._tagged(ctx)), key=lambda a: a.id)

    def allocations(self) -> Sequence[Allocation]:
        return self._held()

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        host_id, amount = admit(self._fabric, self, allocation_id, host, amount_bytes, device=self._device, ctx=ctx)
        with ctx.hold(self._lock, "the switch"):
            existing = already_held(self._held(ctx), allocation_id, host, amount)
            if existing is not None:
                return existing
            tag = self._fabric.state.name_tag(allocation_id, self._carver)
            regions = self._dcd.geometry().regions
            for region in self._regions():
                if regions[region].region_length < amount:
                    continue
                request = InitiateDCAddRequest(host_id, SelectionPolicy.FREE, region, amount, tag)
                try:
                    self._fabric.change(Opcode.INITIATE_DC_ADD, request, ctx, port=self._port)
                except CommandFailedError as exc:
                    if exc.return_code == ReturnCode.RESOURCES_EXHAUSTED:
                        continue
                    self._fabric.state.forget_tag(allocation_id, self._carver)  # refused: no extent carries the tag
                    if exc.return_code == ReturnCode.INVALID_INPUT:
                        # The regions may have changed since they were read (another fabric manager's Set DC
                        # Region Config, its block size): read them again for the retry this error invites, which
                        # would otherwise round to the old block size and be refused the same way for good.
                        self._dcd.forget_geometry()
                    raise tunnel_error(exc, f"allocation {allocation_id}") from None
                return self._read_back(allocation_id, ctx)
            self._fabric.state.forget_tag(allocation_id, self._carver)
        where = "no region" if self._region is None else "not"
        raise CapacityExhaustedError(f"pool {self._id} has {where} {amount} bytes free for {allocation_id}")

    def _read_back(self, allocation_id: str, ctx: CallContext) -> Allocation:
        """The allocation just added, read from the extent lists. The add happened: a read that fails (the list
        still changing, the switch away) or misses it leaves the outcome unknown, so the caller's rollback
        releases its tag."""
        try:
            held = self._held(ctx)
        except DisaggError as exc:
            raise outcome_unknown(exc) from None
        for allocation in held:
            if allocation.id == allocation_id:
                return allocation
        raise outcome_unknown(
            FabricUnavailableError(f"allocation {allocation_id}: its extents, added, are not in the DCD's lists")
        )

    def _release_tag(self, allocation: Allocation, tag: bytes, ctx: CallContext) -> None:
        host_id = self._fabric.hosts()[allocation.host]
        request = InitiateDCReleaseRequest(host_id, RemovalPolicy.TAG_BASED, allocation.amount_bytes, tag)
        try:
            self._fabric.change(Opcode.INITIATE_DC_RELEASE, request, ctx, port=self._port)
        except CommandFailedError as exc:
            raise tunnel_error(exc, f"release {allocation.id}") from None

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        """Release by tag the extents listed under the id (``tag-<hex>`` for a tag with no recorded id) or
        carrying its tag, which a driver that lost its records still lists as ``tag-<hex>``. Once all are
        released the id's name is dropped, or every allocation ever made would stay in the state file; a release
        that fails keeps it, and its retry finds any extent left by the id's own tag all the same."""
        self._fabric.state.fence(ctx.epoch)
        check_id(allocation_id, "allocation_id")
        own_tag = allocation_tag(allocation_id, self._carver)
        with ctx.hold(self._lock, "the switch"):
            listed = self._tagged(ctx)
            released = 0
            for allocation, tag in listed:
                if allocation.id == allocation_id or tag == own_tag:
                    self._release_tag(allocation, tag, ctx)
                    released += 1
            self._fabric.state.forget_tag(allocation_id, self._carver)
        if released and released == len(listed) and self._region is None and len(self._dcd.geometry().regions) > 1:
            self._regions_whole_again()

    def _regions_whole_again(self) -> None:
        """The device's pool of a DCD of several regions listed its last allocation (one the release before
        recorded), now released: discovery leaves it out, and its regions' pools report the bytes it held again,
        which a manager that read them before would never offer. RESYNC_REQUIRED has it read the fabric again."""
        why = (
            f"the last allocation of pool {self._id}, recorded by the release before, was released: "
            "its DC regions' pools report their whole capacity again"
        )
        self._fabric.publish_soon(
            FabricEvent(self._fabric.name, FabricEventKind.RESYNC_REQUIRED, self._device, None, why)
        )
