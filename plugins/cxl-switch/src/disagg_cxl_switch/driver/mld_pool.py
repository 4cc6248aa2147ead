"""The MLD's logical devices as a disagg `Pool`: an allocation is one LD given memory with Set LD Allocations
(5402h, tunnelled to the MLD's port through 5300h) and bound to a vPPB of the host's VCS with Bind vPPB (5201h).

The switch is the truth: Get LD Allocations says how much each LD holds and Get Virtual CXL Switch Info which
vPPB is bound to which LD, so an allocation is an LD bound to a host's VCS. An LD carries no tag, so the
allocation id it was carved for is kept in `DriverState`, written before its allocation is set. An LD bound to
no vPPB is free, whatever memory it still holds (the MLD's even split at power-on, a carve cut short by a
crash): no host reaches that memory, and the next carve sets every such LD back to 0. The block size is the
MLD's memory granularity; the extents are the LDs' ranges as the MLD lays them out, in LD order. An MLD failed
when the driver starts is read once it is back, so the driver still starts; until then the pool's calls raise
`FabricUnavailableError`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from disagg.errors import (
    OUTCOME,
    OUTCOME_UNKNOWN,
    CapacityExhaustedError,
    DisaggError,
    FabricUnavailableError,
    UnsupportedError,
)
from disagg.interfaces import CallContext, Pool
from disagg.model import MLD_MAX_LOGICAL_DEVICES, Allocation, Capacity, Extent, Health, PoolInfo, PoolKind

from disagg_cxl_switch.driver.carving import admit, already_held, tunnel_error
from disagg_cxl_switch.driver.client import CommandFailedError, Encodable, bind_error, decode
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetLDInfoRequest,
    GetLDInfoResponse,
    LDAllocation,
    MemoryGranularity,
    Opcode,
    SetLDAllocationsRequest,
    UnbindOption,
    UnbindVPPBRequest,
    VPPBBindingStatus,
)
from disagg_cxl_switch.returncodes import ReturnCode

if TYPE_CHECKING:
    from disagg_cxl_switch.driver.fabric import CxlSwitchFabric

_NOTHING = LDAllocation(0, 0)


@attrs.frozen
class _LDBinding:
    """The vPPB that holds an LD; ``done`` is False while its Bind or Unbind vPPB still runs."""

    vcs: int
    vppb: int
    done: bool


@attrs.frozen
class _Snapshot:
    """The MLD as the switch reports it now: each LD's allocation and the vPPB bound to it, if any."""

    lds: tuple[LDAllocation, ...]
    bound: dict[int, _LDBinding]

    def units(self, ld: int) -> int:
        return _units(self.lds[ld])


def _units(allocation: LDAllocation) -> int:
    return allocation.range_1_allocation_multiplier + allocation.range_2_allocation_multiplier


@attrs.frozen
class _Geometry:
    """The MLD as Get LD Info and Get LD Allocations describe it: its memory granularity, its LD count, and the
    pool they make."""

    unit: int
    ld_count: int
    info: PoolInfo


class MLDPool(Pool):
    def __init__(self, fabric: CxlSwitchFabric, port: int) -> None:
        self._fabric = fabric
        self._port = port
        self._device = fabric.device_id_of(port)
        self._id = f"{fabric.name}/mld-port{port}"
        self._read: _Geometry | None = None
        try:
            self._read = self._read_geometry()
        except CommandFailedError as exc:
            if fabric.port_view(port).health is Health.OK:
                raise tunnel_error(exc, f"pool {self._id}: the MLD's geometry cannot be read") from None
            # a failed MLD: read once it is back (see `_geometry`), so that the driver starts and can repair it

    def _read_geometry(self) -> _Geometry:
        client, port = self._fabric.client, self._port
        info = decode(GetLDInfoResponse.decode, client.tunnel(port, Opcode.GET_LD_INFO, GetLDInfoRequest()))
        first = decode(
            GetLDAllocationsResponse.decode, client.tunnel(port, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest())
        )
        try:
            unit = MemoryGranularity(first.memory_granularity).unit_bytes
        except ValueError:
            raise FabricUnavailableError(f"the MLD on port {port} reports an unknown memory granularity") from None
        if not 1 <= info.ld_count <= MLD_MAX_LOGICAL_DEVICES:
            raise FabricUnavailableError(
                f"the MLD on port {port} reports {info.ld_count} LDs; an MLD has 1 to {MLD_MAX_LOGICAL_DEVICES}"
            )
        capacity = Capacity(info.memory_size // unit * unit, unit)
        pool = PoolInfo(self._id, self._fabric.name, self._device, capacity, PoolKind.MLD, info.ld_count)
        return _Geometry(unit, info.ld_count, pool)

    def _geometry(self) -> _Geometry:
        """The MLD's geometry, read when the pool was made or, if the MLD was failed then, on first use after: a
        driver started while its link is down still starts. Two threads may both read it; they read the same."""
        if self._read is None:
            try:
                self._read = self._read_geometry()
            except CommandFailedError as exc:
                raise tunnel_error(exc, f"pool {self._id}: the MLD's geometry cannot be read") from None
        return self._read

    @property
    def id(self) -> str:
        return self._id

    def info(self) -> PoolInfo:
        return self._geometry().info

    # ------------------------------------------------------------------ reading the switch

    def _refusal(self, exc: CommandFailedError) -> DisaggError:
        """Resources Exhausted is the MLD out of memory; Unsupported a command it lacks; any other refusal
        (Invalid Input once it was pulled, Retry Required while its link is down) the fabric failing."""
        if exc.return_code == ReturnCode.RESOURCES_EXHAUSTED:
            return CapacityExhaustedError(f"pool {self._id}: {exc.message}")
        if exc.return_code == ReturnCode.UNSUPPORTED:
            return UnsupportedError(f"pool {self._id}: {exc.message}")
        return tunnel_error(exc, f"pool {self._id}")

    def _tunnel(self, opcode: Opcode, payload: Encodable, ctx: CallContext | None) -> bytes:
        try:
            return self._fabric.client.tunnel(self._port, opcode, payload, ctx)
        except CommandFailedError as exc:
            raise self._refusal(exc) from None

    def _snapshot(self, ctx: CallContext | None) -> _Snapshot:
        ld_count = self._geometry().ld_count
        lds: list[LDAllocation] = []
        while len(lds) < ld_count:
            request = GetLDAllocationsRequest(len(lds), 0xFF)
            raw = self._tunnel(Opcode.GET_LD_ALLOCATIONS, request, ctx)
            got = decode(GetLDAllocationsResponse.decode, raw).allocations
            if not got:
                raise FabricUnavailableError(f"pool {self._id}: Get LD Allocations stopped at LD {len(lds)}")
            lds += got
        bound = {
            vppb.bound_ld_id: _LDBinding(vcs.vcs_id, vppb_id, vppb.binding_status == VPPBBindingStatus.BOUND_LD)
            for vcs in self._fabric.view.vcss(self._fabric.client, ctx)
            for vppb_id, vppb in enumerate(vcs.vppbs)
            if vppb.binding_status != VPPBBindingStatus.UNBOUND and vppb.bound_port_id == self._port
        }
        return _Snapshot(tuple(lds[:ld_count]), bound)

    def _listed(self, snap: _Snapshot) -> dict[int, Allocation]:
        """The allocations by LD: each LD bound to a host's VCS, under its recorded id or else ``ld-<N>``."""
        unit = self._geometry().unit
        offsets = list(itertools.accumulate((snap.units(ld) for ld in range(len(snap.lds))), initial=0))
        listed = {}
        for ld, binding in sorted(snap.bound.items()):
            host = self._fabric.view.host_of.get(binding.vcs)
            if not binding.done or host is None:
                continue
            amount = snap.units(ld) * unit
            extents = (Extent(offsets[ld] * unit, amount),) if amount else ()
            name = self._fabric.state.ld_allocation(self._port, ld) or f"ld-{ld}"
            listed[ld] = Allocation(name, self._id, host, amount, extents)
        return listed

    def _held(self, snap: _Snapshot) -> list[Allocation]:
        return sorted(self._listed(snap).values(), key=lambda a: a.id)

    def allocations(self) -> Sequence[Allocation]:
        return self._held(self._snapshot(None))

    # ------------------------------------------------------------------ carving

    def _free_ld(self, snap: _Snapshot, allocation_id: str, amount: int) -> int:
        geometry = self._geometry()
        used = sum(snap.units(ld) for ld in snap.bound) * geometry.unit
        total = geometry.info.capacity.total_bytes
        if used + amount > total:
            raise CapacityExhaustedError(
                f"pool {self._id} has {total - used} bytes free, {allocation_id} asks {amount}"
            )
        free = [ld for ld in range(len(snap.lds)) if ld not in snap.bound]
        if not free:
            raise CapacityExhaustedError(f"pool {self._id}: all {len(snap.lds)} LDs are bound ({allocation_id})")
        return free[0]

    def _set(self, start: int, lds: Sequence[LDAllocation], ctx: CallContext) -> None:
        request = SetLDAllocationsRequest(start, tuple(lds))
        try:
            self._fabric.change(Opcode.SET_LD_ALLOCATIONS, request, ctx, port=self._port)
        except CommandFailedError as exc:
            raise self._refusal(exc) from None

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        """Name a free LD for the allocation, give it the amount (every other unbound LD 0), bind it to a free
        vPPB of the host's VCS; a bind that failed with nothing bound sets back the LDs the carve changed."""
        vcs, amount = admit(self._fabric, self, allocation_id, host, amount_bytes, device=self._device, ctx=ctx)
        with ctx.hold(self._fabric.vppb_lock, "the switch"):
            snap = self._snapshot(ctx)
            existing = already_held(self._held(snap), allocation_id, host, amount)
            if existing is not None:
                return existing
            ld = self._free_ld(snap, allocation_id, amount)
            vppb = self._fabric.view.free_vppb(self._fabric.client, vcs, ctx)
            if vppb is None:
                raise CapacityExhaustedError(f"host {host} has no unbound vPPB left to reach an LD of {self._device}")
            self._fabric.state.name_ld(self._port, ld, allocation_id)
            units = amount // self._geometry().unit
            carved = [
                LDAllocation(units, 0) if i == ld else a if i in snap.bound else _NOTHING
                for i, a in enumerate(snap.lds)
            ]
            self._set(0, carved, ctx)
            try:
                self._fabric.bind_vppb(self._device, BindVPPBRequest(vcs, vppb, self._port, ld), ctx)
            except CommandFailedError as exc:
                self._uncarve(snap.lds, carved, ld, ctx)
                raise bind_error(exc, f"allocation {allocation_id}: bind LD {ld} to {host}") from None
            except DisaggError as exc:
                if exc.metadata.get(OUTCOME) != OUTCOME_UNKNOWN:  # known: nothing bound; unknown: keep the record
                    self._uncarve(snap.lds, carved, ld, ctx)
                raise
            return next(a for a in self._held(self._snapshot(ctx)) if a.id == allocation_id)

    def _uncarve(
        self, before: Sequence[LDAllocation], carved: Sequence[LDAllocation], ld: int, ctx: CallContext
    ) -> None:
        """Undo a carve whose bind failed: set back each LD the carve changed that is still bound to no vPPB and
        holds what the carve set, the LDs that give memory back first. An LD another manager bound or set since is
        theirs and is left alone. Best effort: an unbound LD's memory is free anyway (see the module docstring)."""
        self._fabric.state.forget_ld(self._port, ld)  # or another manager's bind of it would show our id
        try:
            now = self._snapshot(ctx)
        except DisaggError:
            return
        mine = [i for i, (was, set_to) in enumerate(zip(before, carved, strict=True)) if was != set_to]
        mine.sort(key=lambda i: _units(carved[i]) <= _units(before[i]))
        for i in mine:
            if i not in now.bound and now.lds[i] == carved[i]:
                with contextlib.suppress(DisaggError):
                    self._set(i, [before[i]], ctx)

    def _lds_of(self, snap: _Snapshot, allocation_id: str) -> list[int]:
        """The LDs to free for ``allocation_id``: those recorded for it (bound or not: a carve cut short), and the
        one `allocations` lists under it, which is how an LD whose record is lost (``ld-<N>``) is freed."""
        recorded = {
            ld for ld in range(len(snap.lds)) if self._fabric.state.ld_allocation(self._port, ld) == allocation_id
        }
        listed = {ld for ld, allocation in self._listed(snap).items() if allocation.id == allocation_id}
        return sorted(recorded | listed)

    def _free(self, snap: _Snapshot, ld: int, allocation_id: str, ctx: CallContext) -> None:
        """Unbind the LD from its vPPB, set its allocation to 0, forget its record."""
        binding = snap.bound.get(ld)
        if binding is not None:
            failed = self._fabric.port_view(self._port).health is not Health.OK
            option = UnbindOption.SURPRISE_HOT_REMOVE if failed else UnbindOption.MANAGED_HOT_REMOVE
            request = UnbindVPPBRequest(binding.vcs, binding.vppb, option)
            try:
                self._fabric.unbind_vppb(request, ctx, port=self._port, ld=ld)
            except CommandFailedError as exc:
                raise FabricUnavailableError(f"release {allocation_id}: {exc.message}") from None
        if snap.units(ld):
            try:
                self._set(ld, [_NOTHING], ctx)
            except (UnsupportedError, CapacityExhaustedError) as exc:
                raise FabricUnavailableError(f"release {allocation_id}: {exc.message}") from None
        self._fabric.state.forget_ld(self._port, ld)

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        """Free each LD of the allocation; an id with none does nothing."""
        self._fabric.state.fence(ctx.epoch)
        with ctx.hold(self._fabric.vppb_lock, "the switch"):
            snap = self._snapshot(ctx)
            for ld in self._lds_of(snap, allocation_id):
                self._free(snap, ld, allocation_id, ctx)
