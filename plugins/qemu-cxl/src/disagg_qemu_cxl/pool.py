"""The fabric's CXL memory pool: an allocation is one Type-3 device hot-added on a host's free downstream port.

QEMU 7.2 checks almost nothing (a second device on an occupied port, one backend shared by two devices, a
size that is no multiple of 256 MiB: all accepted), so every check happens here, before QEMU is touched.
QEMU 7.2 also never completes a CXL hot-remove, so a release restarts the host's QEMU without the device and
with the others cold-plugged as they were (same ports, serials and backend files); it returns only once the
old process is gone and the new one answers QMP without the device.

A record whose device QEMU does not hold (the driver crashed before device_add, or its answer was lost) holds
nothing: neither reported nor counted, only remembered so that a retry can complete it and a release forget it.
A host whose QEMU died is started again from its records when a call next needs it; a host that cannot be read
(dead, or hung) does not stop allocations on the others (its records count as held meanwhile).

Calls on one host take turns on that host's lock (`HostProcess.lock`), so a hung QEMU holds up only the calls on
its host; the state file's updates take turns on the fabric's lock, which is never held while QEMU works.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
from disagg.errors import (
    OUTCOME,
    CapacityExhaustedError,
    ConflictError,
    DeadlineExceededError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    StaleEpochError,
    UnknownHostError,
    outcome_is_unknown,
    outcome_unknown,
)
from disagg.interfaces import CallContext, Pool, check_id
from disagg.model import CXL_DC_BLOCK_BYTES, Allocation, Capacity, Extent, PoolInfo, PoolKind

from disagg_qemu_cxl.command import LSA_BYTES, backend_props, device_props, host_dir, lsa_file, memory_file
from disagg_qemu_cxl.discovery import Features, HostView, Type3, walk
from disagg_qemu_cxl.hosts import HostProcess
from disagg_qemu_cxl.qmp import QMPCommandError, until, within
from disagg_qemu_cxl.state import Record, State, StateFile

T = TypeVar("T")
UNRECORDED = "unrecorded"
"""Prefix of the allocation id reported for a Type-3 that QEMU holds but the state file does not name."""
_OURS = re.compile(r"^cxl-t3-([0-9a-f]+)$")
PEEK_TIMEOUT_S = 1.0
"""How long another host's view may take when an allocate can do without it (`_readable`): a host that takes
longer is taken for hung (`QemuCxlPool._peek`)."""
UNREAD_RETRY_S = 5.0
"""How long an adopted host not yet read whose try failed (`_first_read`) is not tried again: the allocates on
other hosts meanwhile are refused at once, for the same reason, instead of each waiting a second or two on it."""
VIEW_TIMEOUT_S = 5.0
"""How long a host's view may take in a read that has no deadline of its own (`QemuCxlPool.views`: discovery,
the allocations): a full read takes tens of milliseconds, so one that takes longer is taken for hung, with room
for a loaded machine."""
UNDO_TIMEOUT_S = 1.0
"""How long deleting the backends of a hot-add that failed may take, whatever the caller's deadline."""
_NO_ROOM = frozenset(os.strerror(e) for e in (errno.ENOMEM, errno.ENOSPC, errno.EDQUOT))
"""The ends of QEMU's refusals (``...: <strerror>``) that say the host lacks the memory or disk for a backend."""
_BACKEND_FILE = "can't open backing store"
"""How QEMU 7.2 begins refusing a memory-backend-file it cannot open (``...: Not a directory``)."""


def backend_files(record: Record) -> list[tuple[str, int]]:
    """The backend files of ``record`` (in its host's directory) and the bytes each holds once filled."""
    return [(memory_file(record), record.size)] + ([] if record.volatile else [(lsa_file(record), LSA_BYTES)])


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
        self.closed = False

    def close(self) -> None:
        """Never write again: the state_dir's lock is given up, and the next driver owns the file."""
        self.closed = True

    def save(self, state: State) -> None:
        if self.closed:
            raise FabricUnavailableError(f"the fabric is closed; {self.file.path} is not written")
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
        self._seen: dict[str, tuple[Type3, ...]] = {}
        """The Type-3s each host held when last read: while it cannot be read (another call holds it, or its QEMU
        does not answer), those that no record names still count against the pool (`_held`). Written under the
        host's lock, not the fabric's: a reader takes a copy of its items, which CPython makes in one step."""
        self._unread: set[str] = set()
        """The adopted hosts not read since the driver started (`read_adopted` failed): what they hold beyond the
        records is unknown, so nothing is carved from the pool beside them (`_first_read`). Written under the
        host's lock, like `_seen`."""
        self._failed: dict[str, tuple[float, str]] = {}
        """Of the `_unread` hosts, those whose last try failed: when (``time.monotonic()``) and why, so that none
        is tried again for `UNREAD_RETRY_S` (`_first_read`). Written under the host's lock, like `_unread`."""

    def close(self) -> None:
        with self._lock:
            self._ledger.close()

    @contextlib.contextmanager
    def every_host(self) -> Iterator[None]:
        """Hold every host, in one order, so that no call uses a QEMU meanwhile (stopping them, closing)."""
        with contextlib.ExitStack() as held:
            for name in sorted(self._hosts):
                held.enter_context(self._hosts[name].lock)
            yield

    def _check_open(self) -> None:
        if self._ledger.closed:
            raise FabricUnavailableError(f"fabric {self._fabric} is closed")

    @property
    def id(self) -> str:
        return f"{self._fabric}/cxl-pool"

    @property
    def device_id(self) -> str:
        return f"{self._fabric}/cxl-memory"

    def info(self) -> PoolInfo:
        self._check_open()
        return PoolInfo(
            id=self.id, fabric=self._fabric, device=self.device_id, capacity=self._capacity, kind=PoolKind.DCD
        )

    # ------------------------------------------------------------------ reading the hardware

    def read_adopted(self, hosts: Sequence[str]) -> None:
        """Read the adopted ``hosts`` once, so that what they hold beyond the records (a Type-3 added behind the
        driver's back) counts against the pool before any call has read them. One that cannot be read now is
        left to the next call that needs it, and no allocate carves the pool until one has (`_unread`)."""
        for host in hosts:
            try:
                self._reading(host, lambda view: view)
            except DisaggError:
                self._unread.add(host)

    def views(self) -> dict[str, HostView]:
        """Every host's view; a host that cannot be read, even started again, is FabricUnavailableError."""
        self._check_open()
        return {name: self._reading(name, lambda view: view) for name in sorted(self._hosts)}

    def _reading(self, host: str, read: Callable[[HostView], T]) -> T:
        """``read`` of ``host``'s view, holding the host against other calls on it meanwhile. No deadline bounds
        these reads, so the host is read by a `_peek`: one that hung holds up the calls on it for
        `VIEW_TIMEOUT_S`, not for 10 s per QMP call, and is disconnected rather than asked again. A host that
        another call holds for as long (waiting on its hung QEMU) is FabricUnavailableError too."""
        process = self._hosts[host]
        if not process.lock.acquire(timeout=VIEW_TIMEOUT_S):
            raise FabricUnavailableError(f"host {host} was busy with another call for {VIEW_TIMEOUT_S:g} s")
        try:
            self._check_open()
            return read(self._view(host, peek=VIEW_TIMEOUT_S))
        finally:
            process.lock.release()

    @contextlib.contextmanager
    def _holding(self, host: str, ctx: CallContext) -> Iterator[HostProcess]:
        """Hold ``host`` for a call that changes it, waiting no longer than the caller's deadline; calls on other
        hosts go on meanwhile (the ledger is shared: its updates take turns on the fabric's lock)."""
        process = self._hosts[host]
        with ctx.hold(process.lock, f"host {host}"):
            self._check_open()
            yield process

    def _view(self, host: str, *, peek: float | None = None) -> HostView:
        """``host``'s view, its QEMU started again first (its records cold-plugged) if it died; read by `_peek`
        within ``peek`` seconds when given, else within the caller's deadline."""
        process = self._hosts[host]
        process.revive(self._ledger.state.cold_plugged(host))
        view = self._peek(host, peek) if peek is not None else walk(process.monitor)
        self._saw(host, view.devices)
        self._note_plugged(host, view)
        return view

    def _peek(self, host: str, seconds: float = PEEK_TIMEOUT_S) -> HostView:
        """``host``'s view within ``seconds``. A host that does not answer in that time (its QEMU hung) is
        disconnected, so that the next calls skip it or reconnect it (`HostProcess.revive`) instead of waiting
        on it again: FabricUnavailableError. When the caller's deadline comes first and passes, the host is not
        to blame: it stays connected, and the caller's DeadlineExceededError is raised."""
        process = self._hosts[host]
        peek_bound = True
        try:
            with within(seconds) as peek_bound:
                view = walk(process.monitor)
            self._saw(host, view.devices)
            return view
        except DeadlineExceededError:
            if not peek_bound:
                raise
            process.monitor.disconnect()
            raise FabricUnavailableError(
                f"QEMU of host {host} did not answer within {seconds:g} s (hung?); disconnected from it"
            ) from None

    def _saw(self, host: str, devices: tuple[Type3, ...]) -> None:
        """``host`` was read (or found gone: no devices), holding ``devices``; under the host's lock."""
        self._seen[host] = devices
        self._unread.discard(host)
        self._failed.pop(host, None)

    def _first_read(self, host: str) -> HostView | None:
        """The view of an adopted host not read since the driver started (`_unread`), or None if its QEMU is gone
        (what no record names went with it). An allocate on another host cannot count it by its records alone,
        so a host that cannot be read now (hung, its monitor lost and not regained within `PEEK_TIMEOUT_S`)
        refuses the allocate rather than let it promise what that host may hold. A failed try is not made again
        for `UNREAD_RETRY_S`: a host that stays hung would cost every allocate meanwhile its wait."""
        failed = self._failed.get(host)
        if failed is not None and (ago := time.monotonic() - failed[0]) < UNREAD_RETRY_S:
            left = UNREAD_RETRY_S - ago
            raise self._unknown(host, f"{failed[1]}, when tried {ago:.1f} s ago; not tried again for {left:.1f} s")
        process = self._hosts[host]
        own = True
        try:
            if not process.alive():
                with within(PEEK_TIMEOUT_S) as own:
                    if not process.reconnect():
                        self._saw(host, ())
                        return None
            return self._peek(host)
        except DeadlineExceededError:
            if not own:
                raise
            process.monitor.disconnect()
            why = f"its QEMU did not answer a new QMP connection within {PEEK_TIMEOUT_S:g} s (hung?)"
        except FabricUnavailableError as exc:
            why = exc.message
        self._failed[host] = (time.monotonic(), why)
        raise self._unknown(host, why)

    def _unknown(self, host: str, why: str) -> FabricUnavailableError:
        return FabricUnavailableError(
            f"host {host} has not been read since the driver adopted its QEMU, so what it holds beyond the records "
            f"is unknown, and nothing is carved from pool {self.id} until it is ({why}); retry once it answers"
        )

    def _note_plugged(self, host: str, view: HostView) -> None:
        """Mark plugged the records whose device ``host`` holds though their hot-add was not seen to end (its
        answer was lost, yet it happened): a later start of the host plugs them again."""
        with self._lock:
            found = [r for r in self._ledger.state.on_host(host) if not r.plugged and view.device(r.device)]
            if found:
                state = self._ledger.state
                for record in found:
                    state = state.with_record(attrs.evolve(record, plugged=True))
                self._ledger.save(state)

    def _readable(self, host: str, held: contextlib.ExitStack) -> dict[str, HostView]:
        """``host``'s view and those of the other hosts that answer: a dead, broken, hung or busy one must not
        stop allocations elsewhere (`_held` counts its records instead). Another host is read only if no other
        call holds it, and stays held (in ``held``) until the plan is written, so that what was read of it is
        still so when the pool is carved; a call in flight there counts by its records. It is read by a `_peek`:
        one that hung is skipped by the next calls until a call that needs it reconnects; the caller's deadline
        passing is raised, as by every other QMP call of `_allocate`. One whose QEMU is gone holds only its
        records, which a start cold-plugs again. An adopted host not read since the driver started is read first,
        or refuses the allocate (`_first_read`): it may hold more than its records."""
        views = {host: self._view(host)}
        for name, process in sorted(self._hosts.items()):
            if name == host:
                continue
            if not process.lock.acquire(blocking=False):
                if name in self._unread:
                    raise self._unknown(name, "another call holds it")
                continue
            held.callback(process.lock.release)
            if name in self._unread:
                if (view := self._first_read(name)) is not None:
                    views[name] = view
            elif process.alive():
                with contextlib.suppress(FabricUnavailableError):
                    views[name] = self._peek(name)
            elif process.running_pid() is None:
                self._saw(name, ())  # its QEMU is gone, and what no record names went with it
        return views

    def allocations(self) -> Sequence[Allocation]:
        """Read host by host, each with the records of that moment, so that a device released meanwhile is not
        reported as unrecorded."""
        self._check_open()
        out: list[Allocation] = []
        for name in sorted(self._hosts):
            out += self._reading(name, functools.partial(self._allocations_on, name))
        return out

    def _allocations_on(self, host: str, view: HostView) -> list[Allocation]:
        return self._allocations({host: view})

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
        with ctx.hold(self._lock, "the fabric"):
            self._check_open()
            self._ledger.fence(ctx)
            if isinstance(amount_bytes, bool) or not isinstance(amount_bytes, int) or amount_bytes <= 0:
                raise InvalidRequestError(f"amount must be a positive number of bytes, not {amount_bytes!r}")
            check_id(allocation_id, "allocation_id")
            check_id(host, "host")
            if allocation_id.startswith(f"{UNRECORDED}:"):
                raise InvalidRequestError(f"invalid allocation id {allocation_id!r}", field="allocation_id")
            size = self._capacity.round_up(amount_bytes)
            self._recorded(allocation_id, host, size)
            if host not in self._hosts:
                raise UnknownHostError(host, f"host {host!r} is not configured in fabric {self._fabric!r}")
        with self._holding(host, ctx) as process:
            ctx.check_deadline()
            with until(ctx.deadline):
                return self._allocate(allocation_id, host, size, process)

    def _recorded(self, allocation_id: str, host: str, size: int) -> Record | None:
        """The record of ``allocation_id``, if any: ConflictError if it is another allocation than the one asked
        for. Under the fabric's lock."""
        record = self._ledger.state.record(allocation_id)
        if record is not None and (record.host != host or record.size != size):
            raise ConflictError(
                f"allocation {allocation_id} exists for {record.size} bytes on host {record.host}, "
                f"not {size} bytes on host {host}"
            )
        return record

    def _allocate(self, allocation_id: str, host: str, size: int, process: HostProcess) -> Allocation:
        """`allocate` once its arguments are checked; every QMP call here is bounded by the caller's deadline. A
        device_add whose answer is lost leaves the record (the error says the outcome is unknown): a retry of the
        same id completes it, a release forgets it. Once device_add has answered, QEMU holds the memory: a later
        failure (writing the state file) is outcome-unknown too, so that the composer releases it."""
        with contextlib.ExitStack() as held:
            views = self._readable(host, held)
            with self._lock:  # the record again: another call on another host may have made it meanwhile
                record = self._recorded(allocation_id, host, size)
                if record is not None:
                    present = views[host].device(record.device) is not None
                    if record.releasing and present:
                        raise ConflictError(f"allocation {allocation_id} is being released; release it again first")
                    if present:
                        return self._allocation(record)
                    if record.releasing or not self._fits(record, views):
                        self._forget(record)  # released by a restart that crashed before forgetting it, or its
                        record = None  # port, blocks or capacity (which a record without its device does not hold)
                fresh = record is None  # this call writes the intent, so a failure before device_add removes it
                if record is None:
                    record = attrs.evolve(self._plan(allocation_id, host, size, views), plugged=False)
                self._check_room(record)
                if fresh:
                    self._ledger.save(
                        attrs.evolve(self._ledger.state.with_record(record), next_sn=record.sn + 1)
                    )  # the intent first: a crash after device_add then leaves a named device, never an orphan
        self._hot_add(process, record, views[host], fresh)
        if not record.plugged:
            try:
                with self._lock:
                    self._ledger.save(self._ledger.state.with_record(attrs.evolve(record, plugged=True)))
            except DisaggError as exc:  # QEMU holds the device, which the intent names: the composer releases it
                raise outcome_unknown(exc) from None
        return self._allocation(record)

    def _allocation(self, record: Record) -> Allocation:
        extents = tuple(Extent(o, n) for o, n in record.extents)
        return Allocation(record.allocation, self.id, record.host, record.size, extents)

    def _plan(self, allocation_id: str, host: str, size: int, views: Mapping[str, HostView]) -> Record:
        """Everything QEMU 7.2 would not check: capacity, a free downstream port, a unique serial and backends."""
        state = self._ledger.state
        spans, used = self._held(views)
        free = self._capacity.total_bytes - used
        if size > free:
            raise CapacityExhaustedError(f"pool {self.id} has {free} bytes free, {size} were asked for")
        view = views[host]
        taken = {d.port for d in view.devices} | view.occupied
        ports = sorted(p for p in view.ports if p not in taken)
        if not ports:
            raise CapacityExhaustedError(
                f"host {host} has no free CXL downstream port (all {len(view.ports)} hold a device)"
            )
        serials = {d.sn for v in views.values() for d in v.devices} | {r.sn for r in state.records}
        objects = set().union(*(v.objects for v in views.values()))
        sn = max([state.next_sn, *(s + 1 for s in serials)])
        record = Record(allocation_id, host, ports[0], sn, size, (), volatile=self._features().volatile)
        while sn in serials or record.memdev in objects or record.lsa in objects:
            sn += 1
            record = attrs.evolve(record, sn=sn)
        extents = first_fit(spans, size, self._capacity.total_bytes)
        if extents is None:
            raise CapacityExhaustedError(f"pool {self.id} has no {size} bytes free")
        return attrs.evolve(record, extents=extents)

    def _held(self, views: Mapping[str, HostView]) -> tuple[list[tuple[int, int]], int]:
        """The extents and bytes that hold the pool, as `allocations` reports them on the hosts read, plus, for a
        host not read (busy or unreachable now), whose holdings are unknown, every record and the Type-3s it was
        last seen to hold that no record names."""
        records = self._ledger.state.records
        held = self._allocations(views)
        unread = [r for r in records if r.host not in views]
        named = {(r.host, r.device) for r in records}
        unrecorded = [
            d.size
            for host, devices in list(self._seen.items())
            if host not in views
            for d in devices
            if (host, d.id) not in named
        ]
        spans = [(e.offset, e.length) for a in held for e in a.extents] + [e for r in unread for e in r.extents]
        return spans, sum(a.amount_bytes for a in held) + sum(r.size for r in unread) + sum(unrecorded)

    def _fits(self, record: Record, views: Mapping[str, HostView]) -> bool:
        """Whether a record whose device QEMU does not hold can still be completed as recorded (its blocks may lie
        past the end of a pool made smaller since)."""
        view = views[record.host]
        if record.port not in view.ports or view.on_port(record.port) or record.port in view.occupied:
            return False
        if any(o + n > self._capacity.total_bytes for o, n in record.extents):
            return False
        spans, used = self._held(views)
        overlaps = any(o < a + n and a < o + m for o, m in record.extents for a, n in spans)
        return not overlaps and used + record.size <= self._capacity.total_bytes

    def _check_room(self, record: Record) -> None:
        """Refuse a hot-add whose backend files the file system of its host's directory could not hold once
        filled: QEMU only sizes them (they are sparse), so a full disk surfaces later, in the guest (SIGBUS). The
        holes of every other record's backend files on that file system are promised already; a record's files
        not made yet are promised in full (an allocation in flight on another host). The hot-add needs the holes
        of its own files too: all of them when they are new, less what they hold already when a retry finds them
        (QEMU opens them again as they are). Under the fabric's lock, so that two allocations never promise the
        same free space. A directory that cannot be read is left to QEMU's own refusal (`_refusal`)."""
        directory = host_dir(self._state_dir, record.host)
        try:
            device = directory.stat().st_dev
            fs = os.statvfs(directory)
        except OSError:
            return
        free = fs.f_bavail * fs.f_frsize
        promised = sum(
            self._unfilled(other, device)
            for other in self._ledger.state.records
            if other.allocation != record.allocation
        )
        need = self._unfilled(record, device)
        if need > free - promised:
            held = sum(n for _, n in backend_files(record)) - need
            raise CapacityExhaustedError(
                f"host {record.host}'s directory {directory} has {free} bytes free on its file system, {promised} of "
                f"them promised to backend files not yet filled, and allocation {record.allocation} needs {need} bytes "
                f"({record.size // 1024**2} MiB and its label storage area"
                + (f", less the {held} bytes its backend files hold already" if held else "")
                + "): free space there, or allocate less; nothing was added"
            )

    def _unfilled(self, record: Record, device: int) -> int:
        """The bytes ``record``'s backend files may still take on file system ``device``: their holes."""
        directory = host_dir(self._state_dir, record.host)
        try:
            if directory.stat().st_dev != device:
                return 0
        except OSError:
            return 0
        unfilled = 0
        for name, size in backend_files(record):
            try:
                filled = (directory / name).stat().st_blocks * 512
            except OSError:
                filled = 0
            unfilled += max(0, size - filled)
        return unfilled

    def _hot_add(self, process: HostProcess, record: Record, view: HostView, fresh: bool) -> None:
        """object-add the backends, then device_add the Type-3. Only a device_add whose answer was lost may have
        made the allocation: that error stays OUTCOME_UNKNOWN and the record stays for the release. Any other
        failure left no Type-3, so it is an answer (even a lost object-add: a backend alone holds nothing): the
        backends this call sent are deleted again, and the record is forgotten if this call made it, or if QEMU
        refused (a retry's record may still be completed by the lost device_add of an earlier call)."""
        added: list[str] = []  # the backends sent, the last one perhaps not added
        device_sent = False
        try:
            for backend in backend_props(record):
                if backend["id"] not in view.objects:
                    added.append(str(backend["id"]))
                    process.monitor.execute("object-add", backend)
            device_sent = True
            process.monitor.execute("device_add", device_props(record))
        except QMPCommandError as exc:
            self._undo(process, added)
            self._forget(record)
            raise self._refusal(record, exc) from None
        except DisaggError as exc:
            if device_sent and outcome_is_unknown(exc):
                raise
            exc.metadata.pop(OUTCOME, None)  # a lost object-add answer: no Type-3 was asked for
            self._undo(process, added)
            if fresh:
                self._forget(record)
            raise

    def _refusal(self, record: Record, exc: QMPCommandError) -> DisaggError:
        """The error for QEMU refusing a hot-add, by its reason (QEMU answers GenericError to all): too little
        memory or disk on the host is capacity, which may pass; a backend file the host's directory cannot hold
        is the operator's to mend, and the host unusable meanwhile; anything else is a conflict with the
        machine's state, which a retry meets again (not UNAVAILABLE, which says "retry")."""
        if exc.desc.rsplit(": ", 1)[-1] in _NO_ROOM:
            return CapacityExhaustedError(
                f"host {record.host} has no room for the {record.size // 1024**2} MiB backend of allocation "
                f"{record.allocation}: its QEMU answered {exc.desc!r}; nothing was added"
            )
        if exc.desc.startswith(_BACKEND_FILE):
            return FabricUnavailableError(
                f"QEMU of host {record.host} cannot open the backend file of allocation {record.allocation} in "
                f"{host_dir(self._state_dir, record.host)}: {exc.desc}; nothing was added"
            )
        return ConflictError(f"QEMU of host {record.host} refused the Type-3: {exc}")

    @staticmethod
    def _undo(process: HostProcess, backends: Sequence[str]) -> None:
        """object-del ``backends``, newest first, even past the caller's deadline (which has often passed), but
        briefly. One left behind is no harm: no device uses it, `_plan` never reuses an id QEMU holds, and the
        next start of the host drops it."""
        with until(time.monotonic() + UNDO_TIMEOUT_S):
            for backend_id in reversed(backends):
                with contextlib.suppress(QMPCommandError, DisaggError):
                    process.monitor.execute("object-del", {"id": backend_id})

    # ------------------------------------------------------------------ release

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with ctx.hold(self._lock, "the fabric"):
            self._check_open()
            self._ledger.fence(ctx)
            check_id(allocation_id, "allocation_id")
            record = self._ledger.state.record(allocation_id)
            host = record.host if record is not None else self._unrecorded_host(allocation_id)
            if record is not None and host not in self._hosts:
                self._forget(record)
                return
        if host is None:
            return
        with self._holding(host, ctx) as process:
            record = self._ledger.state.record(allocation_id)
            if record is None:
                with until(ctx.deadline):  # its host's view, read within the caller's deadline
                    record = self._adopt_unrecorded(allocation_id)
                if record is None:
                    return
            if record.host != host:
                raise ConflictError(f"allocation {allocation_id} was made again on host {record.host} meanwhile")
            with until(ctx.deadline):  # the restart below, once begun, finishes whatever the deadline
                view = self._view(record.host)
            if view.device(record.device) is None:
                self._forget(record)
                return
            ctx.check_deadline()
            process.check_boot_files()  # a restart that could not boot is refused before anything changes
            with self._lock:
                keep = self._keep(record, view)
                self._ledger.save(self._ledger.state.with_record(attrs.evolve(record, releasing=True)))
            try:  # from here the device may be gone (the old QEMU too: the next call starts the host again)
                self._restart(process, record, keep)
                self._forget(record)
            except DisaggError as exc:
                raise outcome_unknown(exc) from None

    def _unrecorded_host(self, allocation_id: str) -> str | None:
        """The configured host an ``unrecorded:<host>:<device>`` id names, or None."""
        parts = allocation_id.split(":")
        if len(parts) != 3 or parts[0] != UNRECORDED or parts[1] not in self._hosts:
            return None
        return parts[1]

    def _restart(self, process: HostProcess, leaving: Record, keep: Sequence[Record]) -> None:
        """Restart the host without ``leaving``; check that the new QEMU holds exactly ``keep``, where it was."""
        process.restart(keep)
        after = walk(process.monitor)
        self._saw(leaving.host, after.devices)
        if after.device(leaving.device) is not None:
            raise FabricUnavailableError(f"the restarted QEMU of host {leaving.host} still holds {leaving.device}")
        for other in keep:
            dev = after.device(other.device)
            if dev is None or dev.port != other.port or dev.sn != other.sn:
                raise FabricUnavailableError(
                    f"the restarted QEMU of host {leaving.host} lost {other.device} (allocation {other.allocation})"
                )

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
        device_add and the state write cannot cause this; a lost state file can). Saved, so its id is stable; its
        blocks are planned under the fabric's lock too, so that an allocate on another host cannot take them
        between the plan and the save."""
        m = _OURS.match(dev.id)
        if m is None or dev.port is None or int(m.group(1), 16) != dev.sn:
            return None
        probe = Record(unrecorded_id(host, dev.id), host, dev.port, dev.sn, dev.size, ())
        if dev.memdev != probe.memdev or not (host_dir(self._state_dir, host) / memory_file(probe)).exists():
            return None
        volatile = not (host_dir(self._state_dir, host) / lsa_file(probe)).exists()
        with self._lock:
            spans = [e for r in self._ledger.state.records for e in r.extents]
            extents = first_fit(spans, dev.size, self._capacity.total_bytes) or ()
            record = attrs.evolve(probe, extents=extents, volatile=volatile)
            self._ledger.save(self._ledger.state.with_record(record))
        return record

    def _adopt_unrecorded(self, allocation_id: str) -> Record | None:
        """The record of the device an ``unrecorded:`` id names, made now; None when there is nothing to release.
        A device that a record names is reported under that record's id only: an ``unrecorded:`` id for it is
        made up, and releasing it would take the recorded allocation's device and data."""
        host = self._unrecorded_host(allocation_id)
        if host is None:
            return None
        device = allocation_id.rsplit(":", 1)[1]
        if any(r.device == device for r in self._ledger.state.on_host(host)):
            return None
        dev = self._view(host).device(device)
        if dev is None:
            return None
        record = self._record_of(host, dev)
        if record is None:
            raise FabricUnavailableError(f"{device} on host {host} was not made by this driver; not released")
        return record

    def _forget(self, record: Record) -> None:
        with self._lock:
            self._ledger.save(self._ledger.state.without(record.allocation))
        self._remove_files(record)

    def _remove_files(self, record: Record) -> None:
        directory = host_dir(self._state_dir, record.host)
        for name in (memory_file(record), lsa_file(record)):
            with contextlib.suppress(OSError):
                (directory / name).unlink()
