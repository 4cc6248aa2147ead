"""The MLD's logical devices as a disagg `Pool`: an allocation is one LD given memory with Set LD Allocations
(5402h, tunnelled to the MLD's port through 5300h) and bound to a vPPB of the host's VCS with Bind vPPB (5201h).

The switch is the truth: Get LD Allocations says how much each LD holds and Get Virtual CXL Switch Info which
vPPB is bound to which LD, so an allocation is an LD bound to a host's VCS. An LD carries no tag, so the
allocation id it was carved for, and its host's VCS, are kept in `DriverState`, written before its allocation is
set; the record names the LD only while it is unbound or bound to that VCS. An LD bound to no vPPB is free,
whatever memory it still holds (the MLD's even split at power-on, a carve cut short by a crash): no host reaches
that memory, and the next carve sets every such LD back to 0. Another fabric manager may carve the same free LD
at the same time, so each Set LD Allocations writes one LD only, and a carve reads its LD back once bound. The
block size is the MLD's memory granularity; the extents are the LDs' ranges as the MLD lays them out, in LD
order. An MLD failed when the driver starts is read once it is back, so the driver still starts; until then the
pool's calls raise `FabricUnavailableError`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from disagg.errors import (
    CapacityExhaustedError,
    DisaggError,
    FabricUnavailableError,
    UnsupportedError,
    outcome_is_unknown,
    outcome_unknown,
)
from disagg.interfaces import CallContext, Pool, check_id
from disagg.model import MLD_MAX_LOGICAL_DEVICES, Allocation, Capacity, Extent, Health, PoolInfo, PoolKind

from disagg_cxl_switch.driver.carving import admit, already_held, tunnel_error
from disagg_cxl_switch.driver.client import CommandFailedError, Encodable, bind_error, decode, malformed
from disagg_cxl_switch.driver.state import LDRecord
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
    VCSInfo,
    VPPBBindingStatus,
)
from disagg_cxl_switch.returncodes import ReturnCode

if TYPE_CHECKING:
    from disagg_cxl_switch.driver.fabric import CxlSwitchFabric

log = logging.getLogger("disagg.cxl_switch")

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
            response = decode(GetLDAllocationsResponse.decode, self._tunnel(Opcode.GET_LD_ALLOCATIONS, request, ctx))
            if response.start_ld_id != len(lds):
                raise malformed(f"Get LD Allocations from LD {len(lds)} answered from LD {response.start_ld_id}")
            if not response.allocations:
                raise FabricUnavailableError(f"pool {self._id}: Get LD Allocations stopped at LD {len(lds)}")
            lds += response.allocations
        return _Snapshot(tuple(lds[:ld_count]), self._bound(self._fabric.view.vcss(self._fabric.client, ctx)))

    def _bound(self, vcss: Sequence[VCSInfo]) -> dict[int, _LDBinding]:
        """The vPPBs bound (or being bound) to an LD of the MLD, by LD; an LD the MLD does not have is
        `malformed`."""
        ld_count = self._geometry().ld_count
        bound = {}
        for vcs in vcss:
            for vppb_id, vppb in enumerate(vcs.vppbs):
                if vppb.binding_status == VPPBBindingStatus.UNBOUND or vppb.bound_port_id != self._port:
                    continue
                if vppb.bound_ld_id >= ld_count:
                    raise malformed(
                        f"vPPB {vppb_id} of VCS {vcs.vcs_id} is bound to LD {vppb.bound_ld_id} of the MLD on port "
                        f"{self._port}, which has {ld_count} LDs"
                    )
                done = vppb.binding_status == VPPBBindingStatus.BOUND_LD
                bound[vppb.bound_ld_id] = _LDBinding(vcs.vcs_id, vppb_id, done)
        return bound

    def _record(self, snap: _Snapshot, ld: int) -> LDRecord | None:
        """What the LD was carved for, while that holds: the LD is unbound, or bound to the record's VCS."""
        record = self._fabric.state.ld_record(self._port, ld)
        binding = snap.bound.get(ld)
        if record is None or binding is None or record.held_by(binding.vcs):
            return record
        return None

    def _prune(self, snap: _Snapshot) -> None:
        """Forget the records of LDs bound to a VCS other than theirs: another manager carved the LD since (a
        carve whose bind failed or whose outcome was unknown left the record), and it is that manager's."""
        for ld in snap.bound:
            if self._record(snap, ld) is None:
                self._fabric.state.forget_ld(self._port, ld)

    def _listed(self, snap: _Snapshot) -> dict[int, Allocation]:
        """The allocations by LD: each LD bound to a host's VCS, under the id recorded for it on that VCS or else
        ``ld-<N>``."""
        unit = self._geometry().unit
        offsets = list(itertools.accumulate((snap.units(ld) for ld in range(len(snap.lds))), initial=0))
        listed = {}
        for ld, binding in sorted(snap.bound.items()):
            host = self._fabric.view.host_of.get(binding.vcs)
            if not binding.done or host is None:
                continue
            amount = snap.units(ld) * unit
            extents = (Extent(offsets[ld] * unit, amount),) if amount else ()
            record = self._record(snap, ld)
            name = record.allocation if record is not None else f"ld-{ld}"
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

    def _set(self, ld: int, allocation: LDAllocation, ctx: CallContext) -> None:
        """Set LD Allocations of this one LD: a write of more would put back what another manager changed since the
        read."""
        request = SetLDAllocationsRequest(ld, (allocation,))
        try:
            self._fabric.change(Opcode.SET_LD_ALLOCATIONS, request, ctx, port=self._port)
        except CommandFailedError as exc:
            raise self._refusal(exc) from None

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        """Name a free LD for the allocation, give it the amount (every other unbound LD 0), bind it to a free
        vPPB of the host's VCS, and read it back; a carve that failed with nothing bound sets back the LDs it
        changed."""
        vcs, amount = admit(self._fabric, self, allocation_id, host, amount_bytes, device=self._device, ctx=ctx)
        with ctx.hold(self._fabric.vppb_lock, "the switch"):
            snap = self._snapshot(ctx)
            self._prune(snap)
            existing = already_held(self._held(snap), allocation_id, host, amount)
            if existing is not None:
                return existing
            ld = self._free_ld(snap, allocation_id, amount)
            vppb = self._fabric.view.free_vppb(self._fabric.client, vcs, ctx)
            if vppb is None:
                raise CapacityExhaustedError(f"host {host} has no unbound vPPB left to reach an LD of {self._device}")
            self._fabric.state.name_ld(self._port, ld, allocation_id, vcs)
            want = LDAllocation(amount // self._geometry().unit, 0)
            bind = BindVPPBRequest(vcs, vppb, self._port, ld)
            self._carve(snap, bind, want, f"allocation {allocation_id}: bind LD {ld} to {host}", ctx)
            return self._confirm(allocation_id, _LDBinding(vcs, vppb, True), ld, want, ctx)

    def _carve(self, snap: _Snapshot, bind: BindVPPBRequest, want: LDAllocation, what: str, ctx: CallContext) -> None:
        """Set every other unbound LD that holds memory to 0, then the chosen LD to ``want``, one LD a command, and
        bind it. A known failure sets back what was set (`_uncarve`); an unknown outcome keeps the LD's record,
        so that a `release` of the id frees it."""
        ld = bind.ld_id
        plan = [(i, _NOTHING) for i in range(len(snap.lds)) if i != ld and i not in snap.bound and snap.units(i)]
        done: list[tuple[int, LDAllocation]] = []
        try:
            for i, allocation in [*plan, (ld, want)]:
                self._set(i, allocation, ctx)
                done.append((i, allocation))
            self._fabric.bind_vppb(self._device, bind, ctx)
        except CommandFailedError as exc:
            self._uncarve(snap.lds, done, ld, ctx)
            raise bind_error(exc, what) from None
        except DisaggError as exc:
            if not outcome_is_unknown(exc):
                self._uncarve(snap.lds, done, ld, ctx)
            raise

    def _confirm(
        self, allocation_id: str, binding: _LDBinding, ld: int, want: LDAllocation, ctx: CallContext
    ) -> Allocation:
        """The allocation, read back once its LD is bound. Another manager that picked the same free LD may have
        set it between this carve's Set LD Allocations and its bind: the LD is set back to ``want`` (or, refused,
        unbound again: `_set_back`). It never returns another amount than the carve set."""
        snap = self._read_back(ctx)
        if snap.lds[ld] != want:
            log.warning(
                "cxl-switch pool %s: LD %d of allocation %s holds %d units, not the %d it was set to (another fabric "
                "manager set it as it was carved); setting it back",
                self._id,
                ld,
                allocation_id,
                snap.units(ld),
                _units(want),
            )
            self._set_back(allocation_id, binding, ld, want, ctx)
            snap = self._read_back(ctx)
        held = self._listed(snap).get(ld)
        if held is None or held.id != allocation_id or snap.lds[ld] != want:
            raise outcome_unknown(
                FabricUnavailableError(f"allocation {allocation_id}: LD {ld} changed on the switch as it was carved")
            )
        return held

    def _read_back(self, ctx: CallContext) -> _Snapshot:
        """The MLD read once the carve's LD is bound: a failure leaves the outcome unknown, and the LD's record
        lets a `release` of the id free it."""
        try:
            return self._snapshot(ctx)
        except DisaggError as exc:
            raise outcome_unknown(exc) from None

    def _set_back(self, allocation_id: str, binding: _LDBinding, ld: int, want: LDAllocation, ctx: CallContext) -> None:
        """Give the bound LD ``want`` again. If the MLD refuses, the LD is unbound (its memory is then free) and its
        record forgotten: the carve failed with nothing held, retryable."""
        try:
            self._set(ld, want, ctx)
        except DisaggError as exc:
            if outcome_is_unknown(exc):
                raise
            what = f"allocation {allocation_id}: LD {ld} was set by another fabric manager as it was carved"
            try:
                self._unbind(binding, ld, what, ctx)
            except DisaggError as unbind_failed:
                raise outcome_unknown(unbind_failed) from None
            self._fabric.state.forget_ld(self._port, ld)
            raise FabricUnavailableError(f"{what}, and the MLD refuses it back ({exc.message}); retry") from None

    def _uncarve(
        self, before: Sequence[LDAllocation], done: Sequence[tuple[int, LDAllocation]], ld: int, ctx: CallContext
    ) -> None:
        """Undo a carve whose bind failed: set back each LD the carve set that is still bound to no vPPB and holds
        what the carve set, the LDs that give memory back first. An LD another manager bound or set since is
        theirs and is left alone. Best effort: an unbound LD's memory is free anyway (see the module docstring)."""
        self._fabric.state.forget_ld(self._port, ld)  # or another manager's bind of it would show our id
        try:
            now = self._snapshot(ctx)
        except DisaggError:
            return
        for i, set_to in sorted(done, key=lambda step: _units(step[1]) <= _units(before[step[0]])):
            if i not in now.bound and now.lds[i] == set_to and set_to != before[i]:
                with contextlib.suppress(DisaggError):
                    self._set(i, before[i], ctx)

    def _lds_of(self, snap: _Snapshot, allocation_id: str) -> list[int]:
        """The LDs to free for ``allocation_id``: those recorded for it, unbound (a carve cut short) or bound to the
        recorded VCS, and the one `allocations` lists under it, which is how an LD whose record is lost
        (``ld-<N>``) is freed. An LD recorded for it but bound to another VCS is another manager's."""
        recorded = {
            ld
            for ld in range(len(snap.lds))
            if (record := self._record(snap, ld)) is not None and record.allocation == allocation_id
        }
        listed = {ld for ld, allocation in self._listed(snap).items() if allocation.id == allocation_id}
        return sorted(recorded | listed)

    def _unbind(self, binding: _LDBinding, ld: int, what: str, ctx: CallContext) -> None:
        """Unbind vPPB of the vPPB holding the LD: managed hot-remove, surprise hot-remove when the MLD is failed."""
        failed = self._fabric.port_view(self._port).health is not Health.OK
        option = UnbindOption.SURPRISE_HOT_REMOVE if failed else UnbindOption.MANAGED_HOT_REMOVE
        request = UnbindVPPBRequest(binding.vcs, binding.vppb, option)
        try:
            self._fabric.unbind_vppb(request, ctx, port=self._port, ld=ld)
        except CommandFailedError as exc:
            raise FabricUnavailableError(f"{what}: {exc.message}") from None

    def _free(self, snap: _Snapshot, ld: int, allocation_id: str, ctx: CallContext) -> None:
        """Unbind the LD from its vPPB, set its allocation to 0, forget its record."""
        binding = snap.bound.get(ld)
        if binding is not None:
            self._unbind(binding, ld, f"release {allocation_id}", ctx)
        if snap.units(ld):
            try:
                self._set(ld, _NOTHING, ctx)
            except (UnsupportedError, CapacityExhaustedError) as exc:
                raise FabricUnavailableError(f"release {allocation_id}: {exc.message}") from None
        self._fabric.state.forget_ld(self._port, ld)

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        """Free each LD of the allocation; an id with none does nothing, one that is not an id (`check_id`) is
        refused."""
        self._fabric.state.fence(ctx.epoch)
        check_id(allocation_id, "allocation_id")
        with ctx.hold(self._fabric.vppb_lock, "the switch"):
            snap = self._snapshot(ctx)
            self._prune(snap)
            for ld in self._lds_of(snap, allocation_id):
                self._free(snap, ld, allocation_id, ctx)
