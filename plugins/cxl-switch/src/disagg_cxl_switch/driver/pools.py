"""The DCD's dynamic capacity as a disagg `Pool`: Initiate Dynamic Capacity Add and Release, tunnelled to the
DCD's port (5300h), and the hosts' extent lists (Get DC Region Extent Lists) as the truth.

Each allocation is the set of extents of one host carrying the allocation's tag (`state.allocation_tag`), so
the switch itself says what is carved for whom, and a release is a tag-based Initiate DC Release. The pool is
the DCD's regions end to end; an allocation lies in one region (the first with room), and the block size is
the regions' DC block size. The DCD's host ids are the VCS ids. A DCD failed when the driver starts is read once
it is back, so the driver still starts; until then the pool's calls raise `FabricUnavailableError`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from disagg.errors import CapacityExhaustedError, DisaggError, FabricUnavailableError, outcome_unknown
from disagg.interfaces import CallContext, Pool, check_id
from disagg.model import Allocation, Capacity, Extent, Health, PoolInfo, PoolKind

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

_EXTENTS_PER_READ = 64
_LIST_READS = 3
"""How many times a host's extent list is read from the start when it changes between pages, before giving up."""


@attrs.frozen
class _Geometry:
    """The DCD's regions as it reports them, the lowest region base, and the pool they make."""

    regions: tuple[DCRegionConfig, ...]
    base: int
    info: PoolInfo


@attrs.frozen
class _Refused:
    """A page past the first of a host's extent list, of generation ``generation``, refused with Invalid Input."""

    generation: int
    error: CommandFailedError


class DCDPool(Pool):
    def __init__(self, fabric: CxlSwitchFabric, port: int) -> None:
        self._fabric = fabric
        self._port = port
        self._device = fabric.device_id_of(port)
        self._id = f"{fabric.name}/dcd-port{port}"
        self._lock = threading.Lock()
        self._read: _Geometry | None = None
        try:
            self._read = self._read_geometry()
        except CommandFailedError as exc:
            if fabric.port_view(port).health is Health.OK:
                raise tunnel_error(exc, f"pool {self._id}: the DCD's regions cannot be read") from None
            # a failed DCD: read once it is back (see `_geometry`), so that the driver starts and can repair it

    def _read_geometry(self) -> _Geometry:
        first_host = min(self._fabric.hosts().values())
        request = GetHostDCRegionConfigRequest(first_host)
        raw = self._fabric.client.tunnel(self._port, Opcode.GET_HOST_DC_REGION_CONFIG, request)
        regions = decode(GetHostDCRegionConfigResponse.decode, raw).regions
        if not regions:
            raise FabricUnavailableError(f"the DCD on port {self._port} has no DC region")
        total = sum(r.region_length for r in regions)
        block = max(r.region_block_size for r in regions)
        info = PoolInfo(self._id, self._fabric.name, self._device, Capacity(total, block), PoolKind.DCD)
        return _Geometry(regions, min(r.region_base for r in regions), info)

    def _geometry(self) -> _Geometry:
        """The regions, read when the pool was made or, if the DCD was failed then, on first use after: a driver
        started while its link is down still starts. Two threads may both read it; they read the same."""
        if self._read is None:
            try:
                self._read = self._read_geometry()
            except CommandFailedError as exc:
                raise tunnel_error(exc, f"pool {self._id}: the DCD's regions cannot be read") from None
        return self._read

    @property
    def id(self) -> str:
        return self._id

    def info(self) -> PoolInfo:
        return self._geometry().info

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
        """Each host's extents grouped by tag, as allocations named from the tags, with their tags."""
        base = self._geometry().base
        tagged = []
        for host, host_id in sorted(self._fabric.hosts().items()):
            by_tag: dict[bytes, list[Extent]] = defaultdict(list)
            for start, length, tag in self._extents(host_id, ctx):
                by_tag[tag].append(Extent(start - base, length))
            for tag, extents in by_tag.items():
                extents.sort(key=lambda e: e.offset)
                name = self._fabric.state.allocation_of(tag)
                allocation = Allocation(name, self._id, host, sum(e.length for e in extents), tuple(extents))
                tagged.append((allocation, tag))
        return tagged

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
            tag = self._fabric.state.name_tag(allocation_id)
            for region, config in enumerate(self._geometry().regions):
                if config.region_length < amount:
                    continue
                request = InitiateDCAddRequest(host_id, SelectionPolicy.FREE, region, amount, tag)
                try:
                    self._fabric.change(Opcode.INITIATE_DC_ADD, request, ctx, port=self._port)
                except CommandFailedError as exc:
                    if exc.return_code == ReturnCode.RESOURCES_EXHAUSTED:
                        continue
                    self._fabric.state.forget_tag(allocation_id)  # refused: no extent carries the tag
                    if exc.return_code == ReturnCode.INVALID_INPUT:
                        # The regions may have changed since they were read (another fabric manager's Set DC
                        # Region Config, its block size): read them again for the retry this error invites, which
                        # would otherwise round to the old block size and be refused the same way for good.
                        self._read = None
                    raise tunnel_error(exc, f"allocation {allocation_id}") from None
                return self._read_back(allocation_id, ctx)
            self._fabric.state.forget_tag(allocation_id)
        raise CapacityExhaustedError(f"pool {self._id} has no region with {amount} bytes free for {allocation_id}")

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
        own_tag = allocation_tag(allocation_id)
        with ctx.hold(self._lock, "the switch"):
            for allocation, tag in self._tagged(ctx):
                if allocation.id == allocation_id or tag == own_tag:
                    self._release_tag(allocation, tag, ctx)
            self._fabric.state.forget_tag(allocation_id)
