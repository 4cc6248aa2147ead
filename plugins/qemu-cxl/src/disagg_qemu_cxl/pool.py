"""The fabric's CXL memory pool: an allocation is one Type-3 device hot-added on a host's free downstream port.

QEMU 7.2 checks almost nothing (a second device on an occupied port, one backend shared by two devices, a
size that is no multiple of 256 MiB: all accepted), so every check happens here, before QEMU is touched.
QEMU 7.2 also never completes a CXL hot-remove, so a release restarts the host's QEMU without the device and
with the others cold-plugged as they were (same ports, serials and backend files); it returns only once the
old process is gone and the new one answers QMP without the device.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
from disagg.errors import (
    CapacityExhaustedError,
    ConflictError,
    FabricUnavailableError,
    InvalidRequestError,
    StaleEpochError,
    UnknownHostError,
)
from disagg.interfaces import CallContext, Pool
from disagg.model import CXL_DC_BLOCK_BYTES, Allocation, Capacity, Extent, PoolInfo, PoolKind

from disagg_qemu_cxl.command import backend_props, device_props, host_dir, lsa_file, memory_file
from disagg_qemu_cxl.discovery import Features, HostView, Type3, walk
from disagg_qemu_cxl.hosts import HostProcess
from disagg_qemu_cxl.qmp import QMPCommandError, until
from disagg_qemu_cxl.state import Record, State, StateFile

UNRECORDED = "unrecorded"
"""Prefix of the allocation id reported for a Type-3 that QEMU holds but the state file does not name."""
_OURS = re.compile(r"^cxl-t3-([0-9a-f]+)$")


def unrecorded_id(host: str, device: str) -> str:
    return f"{UNRECORDED}:{host}:{device}"


def first_fit(used: Sequence[tuple[int, int]], size: int, total: int) -> tuple[tuple[int, int], ...] | None:
    """Extents of ``size`` bytes from the gaps between ``used`` (offset, length) ranges, lowest first."""
    extents: list[tuple[int, int]] = []
    need, at = size, 0
    for start, length in [*sorted(used), (total, 0)]:
        if start > at and need:
            take = min(start - at, need)
            extents.append((at, take))
            need -= take
        at = max(at, start + length)
    return tuple(extents) if need == 0 else None


class Ledger:
    """The state file in memory, with the fencing epoch check; callers hold the fabric's lock."""

    def __init__(self, path: StateFile) -> None:
        self.file = path
        self.state = path.load()

    def save(self, state: State) -> None:
        self.file.save(state)
        self.state = state

    def fence(self, ctx: CallContext) -> None:
        """Refuse an epoch older than the highest seen; remember a newer one before anything else happens."""
        if ctx.epoch < self.state.epoch:
            raise StaleEpochError(f"epoch {ctx.epoch} is older than {self.state.epoch}, which this driver has seen")
        if ctx.epoch > self.state.epoch:
            self.save(attrs.evolve(self.state, epoch=ctx.epoch))


class QemuCxlPool(Pool):
    """One pool over every configured host; a host reaches it through its own CXL switch."""

    def __init__(
        self,
        fabric: str,
        *,
        pool_bytes: int,
        hosts: Mapping[str, HostProcess],
        ledger: Ledger,
        lock: threading.RLock,
        features: Callable[[], Features],
        state_dir: Path,
    ) -> None:
        self._fabric = fabric
        self._state_dir = state_dir
        self._capacity = Capacity(pool_bytes, CXL_DC_BLOCK_BYTES)
        self._hosts = hosts
        self._ledger = ledger
        self._lock = lock
        self._features = features

    @property
    def id(self) -> str:
        return f"{self._fabric}/cxl-pool"

    @property
    def device_id(self) -> str:
        return f"{self._fabric}/cxl-memory"

    def info(self) -> PoolInfo:
        return PoolInfo(
            id=self.id, fabric=self._fabric, device=self.device_id, capacity=self._capacity, kind=PoolKind.DCD
        )

    # ------------------------------------------------------------------ reading the hardware

    def views(self) -> dict[str, HostView]:
        with self._lock:
            return {name: walk(host.monitor) for name, host in self._hosts.items()}

    def allocations(self) -> Sequence[Allocation]:
        with self._lock:
            return self._allocations(self.views())

    def _allocations(self, views: Mapping[str, HostView]) -> list[Allocation]:
        """QEMU is the truth: a record without its device is not held; a device without a record is reported
        under an ``unrecorded:<host>:<device>`` id, so that reconciliation sees it and can release it."""
        state = self._ledger.state
        out: list[Allocation] = []
        for host, view in sorted(views.items()):
            records = {r.device: r for r in state.on_host(host)}
            for dev in view.devices:
                record = records.get(dev.id)
                if record is not None:
                    extents = tuple(Extent(o, n) for o, n in record.extents)
                    out.append(Allocation(record.allocation, self.id, host, dev.size, extents))
                else:
                    out.append(Allocation(unrecorded_id(host, dev.id), self.id, host, dev.size, ()))
        return out

    # ------------------------------------------------------------------ allocate

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        with self._lock:
            self._ledger.fence(ctx)
            if isinstance(amount_bytes, bool) or not isinstance(amount_bytes, int) or amount_bytes <= 0:
                raise InvalidRequestError(f"amount must be a positive number of bytes, not {amount_bytes!r}")
            if not allocation_id or allocation_id.startswith(f"{UNRECORDED}:"):
                raise InvalidRequestError(f"invalid allocation id {allocation_id!r}", field="allocation_id")
            size = self._capacity.round_up(amount_bytes)
            process = self._hosts.get(host)
            record = self._ledger.state.record(allocation_id)
            if record is not None and (record.host != host or record.size != size):
                raise ConflictError(
                    f"allocation {allocation_id} exists for {record.size} bytes on host {record.host}, "
                    f"not {size} bytes on host {host}"
                )
            if process is None:
                raise UnknownHostError(host, f"host {host!r} is not configured in fabric {self._fabric!r}")
            ctx.check_deadline()
            with until(ctx.deadline):
                return self._allocate(allocation_id, host, size, record, process)

    def _allocate(
        self, allocation_id: str, host: str, size: int, record: Record | None, process: HostProcess
    ) -> Allocation:
        """`allocate` once its arguments are checked; every QMP call here is bounded by the caller's deadline. A
        deadline that passes after the intent is saved leaves the record: a retry of the same id completes it,
        a release forgets it."""
        views = self.views()
        if record is not None:
            present = views[host].device(record.device) is not None
            if record.releasing and present:
                raise ConflictError(f"allocation {allocation_id} is being released; release it again first")
            if present:
                return self._allocation(record)
            if record.releasing or views[host].on_port(record.port):
                self._forget(record)  # released by a restart that crashed before forgetting it, or never
                record = None  # added and its port taken since: carve it afresh
        if record is None:
            record = self._plan(allocation_id, host, size, views)
            self._ledger.save(
                attrs.evolve(self._ledger.state.with_record(record), next_sn=record.sn + 1)
            )  # the intent first: a crash after device_add then leaves a named device, never an orphan
        self._hot_add(process, record, views[host])
        return self._allocation(record)

    def _allocation(self, record: Record) -> Allocation:
        extents = tuple(Extent(o, n) for o, n in record.extents)
        return Allocation(record.allocation, self.id, record.host, record.size, extents)

    def _plan(self, allocation_id: str, host: str, size: int, views: Mapping[str, HostView]) -> Record:
        """Everything QEMU 7.2 would not check: capacity, a free downstream port, a unique serial and backends."""
        state = self._ledger.state
        held = self._allocations(views)
        pending = [r for r in state.records if not any(a.id == r.allocation for a in held)]
        used = sum(a.amount_bytes for a in held) + sum(r.size for r in pending)
        free = self._capacity.total_bytes - used
        if size > free:
            raise CapacityExhaustedError(f"pool {self.id} has {free} bytes free, {size} were asked for")
        view = views[host]
        taken = {d.port for d in view.devices} | {r.port for r in state.on_host(host)}
        ports = sorted(p for p in view.ports if p not in taken)
        if not ports:
            raise CapacityExhaustedError(
                f"host {host} has no free CXL downstream port (all {len(view.ports)} hold a Type-3)"
            )
        serials = {d.sn for v in views.values() for d in v.devices} | {r.sn for r in state.records}
        objects = set().union(*(v.objects for v in views.values()))
        sn = max([state.next_sn, *(s + 1 for s in serials)])
        record = Record(allocation_id, host, ports[0], sn, size, (), volatile=self._features().volatile)
        while sn in serials or record.memdev in objects or record.lsa in objects:
            sn += 1
            record = attrs.evolve(record, sn=sn)
        spans = [e for r in state.records for e in r.extents]
        extents = first_fit(spans, size, self._capacity.total_bytes)
        if extents is None:
            raise CapacityExhaustedError(f"pool {self.id} has no {size} bytes free")
        return attrs.evolve(record, extents=extents)

    def _hot_add(self, process: HostProcess, record: Record, view: HostView) -> None:
        """object-add the backends, then device_add the Type-3; on a refusal, undo and forget the record."""
        added: list[str] = []
        try:
            for backend in backend_props(record):
                if backend["id"] not in view.objects:
                    process.monitor.execute("object-add", backend)
                    added.append(str(backend["id"]))
            process.monitor.execute("device_add", device_props(record))
        except QMPCommandError as exc:
            for backend_id in reversed(added):
                with contextlib.suppress(QMPCommandError, FabricUnavailableError):
                    process.monitor.execute("object-del", {"id": backend_id})
            self._ledger.save(self._ledger.state.without(record.allocation))
            self._remove_files(record)
            raise FabricUnavailableError(f"QEMU of host {record.host} refused the Type-3: {exc}") from None

    # ------------------------------------------------------------------ release

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with self._lock:
            self._ledger.fence(ctx)
            record = self._ledger.state.record(allocation_id)
            if record is None:
                record = self._adopt_unrecorded(allocation_id)
                if record is None:
                    return
            process = self._hosts.get(record.host)
            if process is None:
                self._forget(record)
                return
            with until(ctx.deadline):  # the restart below, once begun, finishes whatever the deadline
                view = self.views()[record.host]
            if view.device(record.device) is None:
                self._forget(record)
                return
            ctx.check_deadline()
            keep = self._keep(record, view)
            self._ledger.save(self._ledger.state.with_record(attrs.evolve(record, releasing=True)))
            process.restart(keep)
            after = walk(process.monitor)
            if after.device(record.device) is not None:
                raise FabricUnavailableError(f"the restarted QEMU of host {record.host} still holds {record.device}")
            for other in keep:
                dev = after.device(other.device)
                if dev is None or dev.port != other.port or dev.sn != other.sn:
                    raise FabricUnavailableError(
                        f"the restarted QEMU of host {record.host} lost {other.device} (allocation {other.allocation})"
                    )
            self._forget(record)

    def _keep(self, leaving: Record, view: HostView) -> list[Record]:
        """The records to cold-plug again: every other device the host holds now. A device the driver did not
        make cannot be rebuilt faithfully, so the release is refused rather than dropping it."""
        records = {r.device: r for r in self._ledger.state.on_host(leaving.host)}
        keep: list[Record] = []
        for dev in view.devices:
            if dev.id == leaving.device:
                continue
            record = records.get(dev.id) or self._record_of(leaving.host, dev)
            if record is None:
                raise FabricUnavailableError(
                    f"host {leaving.host} holds a Type-3 {dev.id} that this driver did not make; a restart would "
                    f"lose it, so allocation {leaving.allocation} is not released"
                )
            keep.append(attrs.evolve(record, releasing=False))
        return keep

    def _record_of(self, host: str, dev: Type3) -> Record | None:
        """A record for a device that follows the driver's naming but lost its state file entry (a crash between
        device_add and the state write cannot cause this; a lost state file can). Saved, so its id is stable."""
        m = _OURS.match(dev.id)
        if m is None or dev.port is None or int(m.group(1), 16) != dev.sn:
            return None
        probe = Record(unrecorded_id(host, dev.id), host, dev.port, dev.sn, dev.size, ())
        if dev.memdev != probe.memdev or not (host_dir(self._state_dir, host) / memory_file(probe)).exists():
            return None
        volatile = not (host_dir(self._state_dir, host) / lsa_file(probe)).exists()
        spans = [e for r in self._ledger.state.records for e in r.extents]
        extents = first_fit(spans, dev.size, self._capacity.total_bytes) or ()
        record = attrs.evolve(probe, extents=extents, volatile=volatile)
        self._ledger.save(self._ledger.state.with_record(record))
        return record

    def _adopt_unrecorded(self, allocation_id: str) -> Record | None:
        parts = allocation_id.split(":")
        if len(parts) != 3 or parts[0] != UNRECORDED or parts[1] not in self._hosts:
            return None
        dev = walk(self._hosts[parts[1]].monitor).device(parts[2])
        if dev is None:
            return None
        record = self._record_of(parts[1], dev)
        if record is None:
            raise FabricUnavailableError(f"{parts[2]} on host {parts[1]} was not made by this driver; not released")
        return record

    def _forget(self, record: Record) -> None:
        self._ledger.save(self._ledger.state.without(record.allocation))
        self._remove_files(record)

    def _remove_files(self, record: Record) -> None:
        directory = host_dir(self._state_dir, record.host)
        for name in (memory_file(record), lsa_file(record)):
            with contextlib.suppress(OSError):
                (directory / name).unlink()
