"""Deliberately broken drivers: each is the ``sim`` driver with exactly one defect, to prove that the
conformance suite (``disagg certify``) catches it.

A plugin module for ``disagg certify DRIVER --plugin broken_drivers``. Every driver takes the ``sim`` driver's
options, declares the sim's capabilities, and certifies by default on a small generated fabric: four
domains, each with GPUs that its four hosts reach and the other domains' hosts do not, and a CXL pool.
``BROKEN`` maps each driver to the clause its defect breaks.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from disagg import hookimpl
from disagg.errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    DeviceBusyError,
    FabricUnavailableError,
    InvalidRequestError,
    NotFoundError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
    UnsupportedError,
)
from disagg.interfaces import CallContext, EventHandler, Fabric, Subscription
from disagg.model import (
    Allocation,
    Binding,
    Capabilities,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    PoolInfo,
    PoolKind,
    Topology,
)
from disagg.plugins import DriverRegistry
from disagg_sim.dispatch import EventDispatcher
from disagg_sim.fabric import SIM_CAPABILITIES, SimDevice, SimFabric, SimPool
from disagg_sim.generator import generate_topology
from disagg_sim.options import parse_options
from disagg_sim.state import SimState
from disagg_sim.topology import load_topology
from remote_helpers import Plain

RACE_WINDOW_S = 0.01
"""How long `RacyBind` lets go of its lock between checking that a device is free and binding it."""


class BindNotIdempotent(SimFabric):
    """A repeated bind to the same host is refused as busy: a retry after a lost reply then fails a bind
    that had succeeded."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        with self._lock:
            current = self._bindings.get(device)
        if current == host:
            raise DeviceBusyError(f"device {device} is bound to host {host}")
        return super().bind(device, host, ctx)


class UnbindNotIdempotent(SimFabric):
    """Unbinding a binding that is absent raises: a retried unbind, or a cleanup after a crash, fails."""

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            current = self._bindings.get(binding.device)
        if current != binding.host:
            raise UnknownDeviceError(binding.device, f"device {binding.device} is not bound to {binding.host}")
        super().unbind(binding, ctx)


class LeaksFailedBind(SimFabric):
    """A bind failed by an injected fault reports the failure but leaves the device bound: the caller thinks
    the device is free while a host holds it."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._injected: set[str] = set()

    def _take_flaky(self, device: str) -> None:
        try:
            super()._take_flaky(device)
        except FabricUnavailableError:
            self._injected.add(device)
            raise

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        try:
            return super().bind(device, host, ctx)
        except FabricUnavailableError:
            with self._lock:
                if device in self._injected:
                    self._injected.discard(device)
                    self._bindings[device] = host  # the hot-add went through; only the answer says otherwise
                    self._persist(lambda: None)
            raise


class RacyBind(SimFabric):
    """Bind checks that the device is free, lets go of the lock for the slow hot-add, then binds without
    looking again: racing binds to different hosts all succeed and the last one wins the device."""

    def _check_healthy(self, device: str, refusal: str) -> None:
        # A bind's check once it found the device free; the checks after it look at nothing a bind changes.
        super()._check_healthy(device, refusal)
        self._lock.release()
        try:
            time.sleep(RACE_WINDOW_S)
        finally:
            self._lock.acquire()


class WrongError(SimFabric):
    """Binding an unknown device raises the generic NotFoundError, not UnknownDeviceError: a client cannot
    tell a wrong device id from a wrong host or pool."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if device not in self._device_index:
            raise NotFoundError("device", device)
        return super().bind(device, host, ctx)


class IgnoresEpoch(SimFabric):
    """Remembers the highest fencing epoch but never refuses an older one: a deposed fabric manager can
    still undo its successor's work."""

    def _fence(self, ctx: CallContext) -> None:
        if ctx.epoch > self._epoch:
            super()._fence(ctx)


class SanitizeIgnoresEpoch(SimFabric):
    """Refuses an older fencing epoch everywhere but in sanitize, which takes the newest as its own: a deposed
    fabric manager can still erase a device its successor is handing out."""

    def _sanitize(self, device: str, ctx: CallContext) -> None:
        super()._sanitize(device, attrs.evolve(ctx, epoch=max(ctx.epoch, self.epoch)))


class BindIgnoresEpoch(SimFabric):
    """Refuses an older fencing epoch everywhere but in bind, which takes the newest as its own: one of the
    two tests of FENCE-STALE-EPOCH fails, the pool's passes."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        return super().bind(device, host, attrs.evolve(ctx, epoch=max(ctx.epoch, self.epoch)))


class _OffsetZeroCarver:
    """Counts free blocks but not where they are: every allocation is carved from block 0."""

    def __init__(self, blocks: int) -> None:
        self.total_blocks = blocks
        self.free_blocks = blocks

    def carve(self, blocks: int, *, contiguous: bool) -> list[tuple[int, int]] | None:
        if blocks > self.free_blocks:
            return None
        self.free_blocks -= blocks
        return [(0, blocks)]

    def claim(self, start: int, blocks: int) -> None:
        if blocks > self.free_blocks:
            raise ValueError("no room")
        self.free_blocks -= blocks

    def release(self, start: int, blocks: int) -> None:
        self.free_blocks += blocks


class OverlappingExtents(SimFabric):
    """Pools count their free capacity right but carve every allocation at offset 0: two hosts get the same
    memory."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._blind_carvers()

    def _restore(self, state: SimState) -> None:
        self._blind_carvers()  # before saved allocations are re-carved
        super()._restore(state)

    def _blind_carvers(self) -> None:
        for pool in self._pools.values():
            if not isinstance(pool._carver, _OffsetZeroCarver):
                pool._carver = _OffsetZeroCarver(pool._carver.total_blocks)  # type: ignore[assignment]


class ForgetsBindings(SimFabric):
    """Saves everything but the bindings: after a restart it reports every device free, though hosts still
    hold them."""

    def _snapshot(self) -> SimState:
        return attrs.evolve(super()._snapshot(), bindings={})


class _DropsHealthEvents(EventDispatcher):
    def post(self, event: FabricEvent) -> None:
        if event.kind is not FabricEventKind.DEVICE_HEALTH:
            super().post(event)


class SilentFailures(SimFabric):
    """A device that fails is marked FAILED but no subscriber is told: the fabric manager never moves the
    work off it."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._events = _DropsHealthEvents()


class UnstableSerials(SimFabric):
    """Every discovery reports new serials (unique within it): the fabric manager sees every device replaced
    by a new one each time it looks."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._discoveries = 0
        self._count_lock = threading.Lock()

    def discover(self) -> Topology:
        topology = super().discover()
        with self._count_lock:
            self._discoveries += 1
            n = self._discoveries
        devices = tuple(attrs.evolve(d, serial=f"{d.serial}-{n}") for d in topology.devices)
        return attrs.evolve(topology, devices=devices)


class BindsUndeclared(SimFabric):
    """Declares neither bind nor unbind (nor sanitize, which needs them), yet binds and unbinds: the composer,
    which binds whatever discovery reports, binds through a driver that says it cannot."""

    def capabilities(self) -> Capabilities:
        return attrs.evolve(
            SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.BIND, Feature.UNBIND, Feature.SANITIZE}
        )


class CarvesUndeclared(SimFabric):
    """Reports pools and carves them, but does not declare carve."""

    def capabilities(self) -> Capabilities:
        return attrs.evolve(SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.CARVE})


class ForgetsEpoch(SimFabric):
    """Keeps its bindings across a restart but not its fencing epoch: a restarted driver obeys a fabric manager
    that was deposed before the restart."""

    def _restore(self, state: SimState) -> None:
        super()._restore(state)
        self._epoch = 0


class DeclaresUnimplementedFaults(Plain):
    """Declares fault injection (as the sim does) on a fabric object that does not implement `FaultInjection`:
    the clauses that inject faults cannot run, and a declared feature must not pass as NOT TESTED."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(SimFabric(topology, **options))

    def close(self) -> None:
        self.inner.close()


def _pools_as(fabric: SimFabric, cls: type[SimPool]) -> list[SimPool]:
    """Give the fabric's pools the one defect of ``cls`` (a `SimPool` subclass), keeping what they hold: the sim
    builds its pools itself, and restores the saved allocations into them."""
    pools = list(fabric._pools.values())
    for pool in pools:
        pool.__class__ = cls
    return pools


class _CarvesForNothing(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        if amount_bytes <= 0:
            return Allocation(allocation_id, self.id, host, 0, ())
        return super().allocate(allocation_id, host, amount_bytes, ctx)


class AllocatesNoCapacity(SimFabric):
    """An allocation of 0 bytes, or of a negative amount, succeeds instead of raising InvalidRequestError: a
    caller's bug (an amount computed as a difference) passes for memory that a host holds."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _CarvesForNothing)


class _HostBlindPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        with self._fabric._lock:
            existing = self._allocations.get(allocation_id)
        same_amount = existing is not None and existing.amount_bytes == self.info().capacity.round_up(amount_bytes)
        if existing is not None and amount_bytes > 0 and same_amount:
            return existing
        return super().allocate(allocation_id, host, amount_bytes, ctx)


class _RepeatBeforeFencePool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        with self._fabric._lock:
            existing = self._allocations.get(allocation_id) if isinstance(allocation_id, str) else None
        repeat = existing is not None and existing.host == host and isinstance(amount_bytes, int) and amount_bytes > 0
        if existing is not None and repeat and existing.amount_bytes == self.info().capacity.round_up(amount_bytes):
            return existing
        return super().allocate(allocation_id, host, amount_bytes, ctx)


class AllocateRepeatBeforeFence(SimFabric):
    """An allocate that repeats an allocation the pool holds returns it without looking at the epoch: a deposed
    manager is told its memory is carved (the pool's `RepeatBeforeFence`)."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _RepeatBeforeFencePool)


class _ReleaseOfNothingFreesPool(SimPool):
    _freed: int

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with self._fabric._lock:
            held = isinstance(allocation_id, str) and allocation_id in self._allocations
        super().release(allocation_id, ctx)
        if not held:
            with self._fabric._lock:
                self._freed = getattr(self, "_freed", 0) + self._block

    def free_bytes(self) -> int:
        return super().free_bytes() + getattr(self, "_freed", 0)


class ReleaseOfNothingFrees(SimFabric):
    """A release of an allocation id the pool never held gives a block back: its free capacity overstates what
    it can carve."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _ReleaseOfNothingFreesPool)


class AllocationIgnoresHost(SimFabric):
    """An existing allocation id asked again for another host, with the same amount, returns the existing
    allocation instead of raising ConflictError: a second host is told it holds memory the first one holds."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _HostBlindPool)


class _DoubleFreePool(SimPool):
    _released: dict[str, int]
    _returned: int

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with self._fabric._lock:
            held = self._allocations.get(allocation_id)
            again = held is None and allocation_id in self._released
            if again:
                self._returned += self._released.pop(allocation_id)
        if again:
            return
        super().release(allocation_id, ctx)
        if held is not None:
            with self._fabric._lock:
                self._released[allocation_id] = held.amount_bytes

    def free_bytes(self) -> int:
        with self._fabric._lock:
            returned = self._returned
        return super().free_bytes() + returned


class ReleasesTwice(SimFabric):
    """A release retried after it succeeded (its reply lost) gives the capacity back a second time: the pool
    then reports, and would carve, more free capacity than it has."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        for pool in _pools_as(self, _DoubleFreePool):
            assert isinstance(pool, _DoubleFreePool)
            pool._released, pool._returned = {}, 0


class ForgetsAllocations(SimFabric):
    """Saves everything but the allocations: after a restart every pool is reported empty, and its memory is
    carved again for other hosts while the first ones still use it."""

    def _snapshot(self) -> SimState:
        return attrs.evolve(super()._snapshot(), allocations=())


class BindsFailedDevices(SimFabric):
    """Binds a device that has failed (it still refuses to carve from a failed pool's device): the host gets
    hardware that does not work, where the contract says DeviceBusyError."""

    def _check_healthy(self, device: str, refusal: str) -> None:
        if refusal != "cannot be bound":
            super()._check_healthy(device, refusal)


class IgnoresDeadlines(SimFabric):
    """Never looks at a call's deadline: a bind, unbind, allocate or release made after its deadline still
    changes the fabric, after the caller gave up on it."""

    def _mutate(self, ctx: CallContext, key: tuple[str, ...], prepare: Any, **kw: Any) -> Any:
        return super()._mutate(attrs.evolve(ctx, deadline=None), key, prepare, **kw)


def _malformed(value: object) -> bool:
    return not isinstance(value, str) or not value


class TakesAnyId(SimFabric):
    """Takes an id that is empty or not a string for one that names nothing, as the generated driver once did: a
    bind of one raises UnknownDeviceError or UnknownHostError, and an unbind of one does nothing, where the
    contract says InvalidRequestError. Both still fence first."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if _malformed(device) or _malformed(host):
            with self._lock:
                self._fence(ctx)
            if _malformed(device):
                raise UnknownDeviceError(device, f"fabric {self.name!r} has no device {device!r}")
            raise UnknownHostError(host, f"host {host!r} is not attached to fabric {self.name!r}")
        return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if _malformed(binding.device) or _malformed(binding.host):
            with self._lock:
                self._fence(ctx)
            return
        super().unbind(binding, ctx)


CARVE_ONLY = attrs.evolve(
    SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.BIND, Feature.UNBIND, Feature.SANITIZE}
)
"""What a driver that carves memory and binds nothing whole declares, as qemu-cxl does: carve and fencing."""


class CarveOnly(SimFabric):
    """Not broken: carves memory and binds nothing whole. It declares carve and fencing but not bind, and
    refuses a bind with UnsupportedError after fencing."""

    def capabilities(self) -> Capabilities:
        return CARVE_ONLY

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        with self._lock:
            self._fence(ctx)
        raise UnsupportedError(f"fabric {self.name} binds nothing whole")


class CarveOnlyIgnoresEpoch(CarveOnly):
    """Carves and binds nothing whole (declares carve and fencing, not bind), and its allocate and release take
    any epoch: a deposed fabric manager still carves and releases memory."""

    def _mutate(self, ctx: CallContext, key: tuple[str, ...], prepare: Any, **kw: Any) -> Any:
        if key[0] == "allocation":
            ctx = attrs.evolve(ctx, epoch=max(ctx.epoch, self.epoch))
        return super()._mutate(ctx, key, prepare, **kw)


HANG_S = float(os.environ.get("BROKEN_HANG_S", "600"))
"""How long a driver that hangs sleeps."""
_hung = threading.Event()


def _hangs_the_first_time() -> None:
    """Sleep `HANG_S` on the first call in the process of any hanging driver; return at once after that."""
    if not _hung.is_set():
        _hung.set()
        time.sleep(HANG_S)


class HangsAtFirstBind(SimFabric):
    """The first bind in the process ignores its deadline and hangs (hardware that never answers); later binds
    work."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        _hangs_the_first_time()
        return super().bind(device, host, ctx)


class HangsAtFirstDiscover(SimFabric):
    """The first discovery in the process hangs (a switch that never answers an inventory query)."""

    def discover(self) -> Topology:
        _hangs_the_first_time()
        return super().discover()


class HangsAtFirstBindings(SimFabric):
    """The first question for the bindings in the process hangs."""

    def bindings(self) -> Sequence[Binding]:
        _hangs_the_first_time()
        return super().bindings()


class HangsAtSubscribe(SimFabric):
    """The first subscription in the process hangs (an event bus that never answers)."""

    def subscribe(self, handler: EventHandler) -> Subscription:
        _hangs_the_first_time()
        return super().subscribe(handler)


class _HangingSubscription(Subscription):
    def __init__(self, inner: Subscription) -> None:
        self.inner = inner

    def cancel(self) -> None:
        _hangs_the_first_time()
        self.inner.cancel()


class HangsAtCancel(SimFabric):
    """The first cancel of a subscription in the process hangs."""

    def subscribe(self, handler: EventHandler) -> Subscription:
        return _HangingSubscription(super().subscribe(handler))


class HangsAtFailDevice(SimFabric):
    """The first injected device failure in the process never returns (an emulator that never answers)."""

    def fail_device(self, device: str, message: str = "") -> None:
        _hangs_the_first_time()
        super().fail_device(device, message)


class HangsAtFlakyBind(SimFabric):
    """The first arming of a failing bind in the process never returns."""

    def flaky_bind(self, device: str | None, failures: int) -> None:
        _hangs_the_first_time()
        super().flaky_bind(device, failures)


class DeclaresAnHourForEvents(SilentFailures):
    """Declares an event latency of an hour and, as `SilentFailures`, never reports a failure: waited for as
    declared, it would hold certification for an hour."""

    def capabilities(self) -> Capabilities:
        return attrs.evolve(SIM_CAPABILITIES, event_latency_s=3600.0)


class HangsAtRestart(SimFabric):
    """Hangs as it restores a saved state that holds bindings: the driver hangs when it is restarted after a
    bind (as RESTART-BINDINGS does), and starts at once on a state with none."""

    def _restore(self, state: SimState) -> None:
        if state.bindings:
            _hangs_the_first_time()
        super()._restore(state)


class HangsAsItIsBuilt(SimFabric):
    """The first fabric built in the process hangs as it is built (a vendor SDK that never opens the device)."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        _hangs_the_first_time()
        super().__init__(topology, **options)


_late_bind_waiting = threading.Event()
_late_bind_go = threading.Event()
_late_bind_landed = threading.Event()


class BindsLate(SimFabric):
    """The first bind in the process stalls past its deadline, then goes through after all, when the next
    fabric is built (hardware that answers late): a device ends up bound that the caller gave up on, and that
    every later fabric reads from the saved state."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        if _late_bind_waiting.is_set() and not _late_bind_go.is_set():
            _late_bind_go.set()
            _late_bind_landed.wait(HANG_S)
        super().__init__(topology, **options)

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if _late_bind_waiting.is_set():
            return super().bind(device, host, ctx)
        _late_bind_waiting.set()
        _late_bind_go.wait(HANG_S)
        try:  # the hardware finishes what it was asked, deadline or not
            return super().bind(device, host, attrs.evolve(ctx, deadline=None))
        finally:
            _late_bind_landed.set()


class FailsToBuild(SimFabric):
    """Raises as it is built, with the exception ``BROKEN_BUILD`` names: the vendor SDK cannot open the
    device, the switch is not found, the options are wrong."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        kind = os.environ.get("BROKEN_BUILD", "runtime")
        if kind == "config":
            raise ConfigError("broken-fails-to-build: option 'address' is required", field="address")
        if kind == "not-found":
            raise NotFoundError("switch", "sw0", "switch sw0 not found on the emulator")
        raise RuntimeError("vendor SDK: cannot open /dev/acme0")


class InterruptedAtBind(SimFabric):
    """The run is interrupted (as by Ctrl-C) at the first bind: not a defect of a clause, a run that never
    finishes, which certifies nothing."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        raise KeyboardInterrupt


class ExitsInBind(SimFabric):
    """Ends the process with exit status 0 at the first bind (a vendor C library that calls exit() on a reply
    it does not expect): the run never finishes, and no status of the process may pass for a verdict."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        os._exit(0)


class UnbindRaisesNonSdk(SimFabric):
    """Unbinding a bound device raises the vendor SDK's own exception, not a `disagg.errors` one, and leaves
    the device bound."""

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            bound = self._bindings.get(binding.device) == binding.host
        if bound:
            raise RuntimeError("vendor SDK: hot-remove failed (EIO)")
        super().unbind(binding, ctx)


WITHOUT_UNBIND = attrs.evolve(SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.UNBIND, Feature.SANITIZE})


class BindWithoutUnbind(SimFabric):
    """Not broken: a fabric without hot-remove. It declares bind but not unbind (nor sanitize, which needs it),
    and refuses to unbind a bound device with UnsupportedError; an unbind of what is not bound fences and
    succeeds, as the contract asks."""

    def capabilities(self) -> Capabilities:
        return WITHOUT_UNBIND

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            self._fence(ctx)
            bound = self._bindings.get(binding.device) == binding.host
        if bound:
            raise UnsupportedError("this fabric cannot hot-remove a device")


class _NotCancelled(Subscription):
    def __init__(self, inner: Subscription) -> None:
        self.inner = inner

    def cancel(self) -> None:
        return None


class CancelDoesNothing(SimFabric):
    """A subscription's cancel() does nothing: the handler goes on hearing every event."""

    def subscribe(self, handler: EventHandler) -> Subscription:
        return _NotCancelled(super().subscribe(handler))


BROKEN: dict[str, tuple[Callable[..., Fabric], str]] = {
    "broken-bind-not-idempotent": (BindNotIdempotent, "BIND-IDEMPOTENT"),
    "broken-unbind-not-idempotent": (UnbindNotIdempotent, "UNBIND-IDEMPOTENT"),
    "broken-leaks-failed-bind": (LeaksFailedBind, "BIND-FAILED-LEAVES-NOTHING"),
    "broken-race": (RacyBind, "CONC-RACE-ONE-WINNER"),
    "broken-wrong-error": (WrongError, "ERR-UNKNOWN-DEVICE"),
    "broken-ignores-epoch": (IgnoresEpoch, "FENCE-STALE-EPOCH"),
    "broken-bind-ignores-epoch": (BindIgnoresEpoch, "FENCE-STALE-EPOCH"),
    "broken-sanitize-ignores-epoch": (SanitizeIgnoresEpoch, "SANITIZE-STALE-EPOCH"),
    "broken-allocate-repeat-before-fence": (AllocateRepeatBeforeFence, "CARVE-STALE-EPOCH"),
    "broken-release-of-nothing-frees": (ReleaseOfNothingFrees, "CARVE-RELEASE-UNKNOWN"),
    "broken-cancel-does-nothing": (CancelDoesNothing, "EVENT-CANCEL-STOPS"),
    "broken-overlapping-extents": (OverlappingExtents, "CARVE-NO-OVERLAP"),
    "broken-forgets-bindings": (ForgetsBindings, "RESTART-BINDINGS"),
    "broken-silent-failures": (SilentFailures, "EVENT-FAILURE-REPORTED"),
    "broken-unstable-serials": (UnstableSerials, "DISC-STABLE"),
    "broken-binds-undeclared": (BindsUndeclared, "UNDECLARED-UNSUPPORTED"),
    "broken-carves-undeclared": (CarvesUndeclared, "DISC-WELL-FORMED"),
    "broken-forgets-epoch": (ForgetsEpoch, "RESTART-FENCING"),
    "broken-declares-unimplemented-faults": (DeclaresUnimplementedFaults, "BIND-FAILED-LEAVES-NOTHING"),
    "broken-unbind-raises-non-sdk": (UnbindRaisesNonSdk, "CLEANUP-NOTHING-LEFT"),
    "broken-carve-only-ignores-epoch": (CarveOnlyIgnoresEpoch, "CARVE-STALE-EPOCH"),
    "broken-forgets-allocations": (ForgetsAllocations, "RESTART-ALLOCATIONS"),
    "broken-allocation-ignores-host": (AllocationIgnoresHost, "CARVE-CONFLICT"),
    "broken-releases-twice": (ReleasesTwice, "CARVE-RELEASE-IDEMPOTENT"),
    "broken-binds-failed-devices": (BindsFailedDevices, "ERR-DEVICE-FAILED"),
    "broken-ignores-deadlines": (IgnoresDeadlines, "DEADLINE-PASSED"),
    "broken-ignores-carve-deadlines": (IgnoresDeadlines, "CARVE-DEADLINE-PASSED"),
    "broken-allocates-no-capacity": (AllocatesNoCapacity, "CARVE-INVALID-AMOUNT"),
    "broken-takes-any-id": (TakesAnyId, "ERR-INVALID-ID"),
}
"""Driver name: (fabric class, the clause its defect breaks)."""
ALSO_BROKEN: dict[str, tuple[str, ...]] = {
    "broken-allocate-repeat-before-fence": ("FENCE-STALE-EPOCH",),
    "broken-carves-undeclared": ("UNDECLARED-UNSUPPORTED",),
    "broken-declares-unimplemented-faults": ("EVENT-FAILURE-REPORTED",),
}
"""Driver name: the other clauses its defect breaks."""


class NoHealthyDevice(BindNotIdempotent):
    """Its bind is not idempotent, and it reports every device's health UNKNOWN (not polled yet): no device is one
    the suite may bind, so no clause of bind could run."""

    def discover(self) -> Topology:
        found = super().discover()
        devices = tuple(attrs.evolve(d, health=Health.UNKNOWN) for d in found.devices)
        return attrs.evolve(found, devices=devices)


class DeclaresNothing(SimFabric):
    """Declares no feature and discovers an empty fabric."""

    def capabilities(self) -> Capabilities:
        return Capabilities()

    def discover(self) -> Topology:
        return Topology(fabric=self.name)


UNCERTIFIABLE: dict[str, tuple[Callable[..., Fabric], Capabilities]] = {
    "sim-no-healthy-device": (NoHealthyDevice, SIM_CAPABILITIES),
    "sim-declares-nothing": (DeclaresNothing, Capabilities()),
}
"""Drivers of which a run tests too little to certify: driver name: (fabric class, the capabilities it declares)."""
OTHERS: dict[str, Callable[..., Fabric]] = {
    "broken-interrupted": InterruptedAtBind,
    "broken-hangs-at-first-bind": HangsAtFirstBind,
    "broken-hangs-at-first-discover": HangsAtFirstDiscover,
    "broken-hangs-at-first-bindings": HangsAtFirstBindings,
    "broken-binds-late": BindsLate,
    "broken-fails-to-build": FailsToBuild,
    "broken-hangs-as-it-is-built": HangsAsItIsBuilt,
    "broken-exits-in-bind": ExitsInBind,
    "broken-hangs-at-subscribe": HangsAtSubscribe,
    "broken-hangs-at-cancel": HangsAtCancel,
    "broken-hangs-at-fail-device": HangsAtFailDevice,
    "broken-hangs-at-flaky-bind": HangsAtFlakyBind,
    "broken-declares-an-hour-for-events": DeclaresAnHourForEvents,
}
"""Drivers whose defect is not a clause's: certify must still finish, and say what happened. `HangsAtRestart`
is not among them: its test runs the suite in process, with its bounds lowered."""
UNBROKEN: dict[str, tuple[Callable[..., Fabric], Capabilities]] = {
    "sim-without-unbind": (BindWithoutUnbind, WITHOUT_UNBIND),
    "sim-carve-only": (CarveOnly, CARVE_ONLY),
}
"""Correct drivers that the suite must certify though they declare less than the sim: driver name: (fabric
class, the capabilities it declares)."""


def certify_options(workdir: Path) -> dict[str, Any]:
    """Four domains of four hosts, two GPU chassis and one CXL pool each; state kept in ``workdir``."""
    return {"generate": {"devices": 120, "hosts_per_domain": 4}, "state_file": str(workdir / "state.json")}


def factory(cls: Callable[..., Fabric]) -> Any:
    """A driver factory building ``cls`` from the ``sim`` driver's options."""

    def create(name: str, options: Mapping[str, Any]) -> Fabric:
        opts = parse_options(name, options)
        if opts.generate is not None:
            topology = generate_topology(name, **attrs.asdict(opts.generate))
        else:
            assert opts.topology is not None
            topology = load_topology(name, opts.topology)
        return cls(topology, state_file=opts.state_file, bind_delay_s=opts.bind_delay_s)

    return create


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    for name, cls in [*((n, c) for n, (c, _clause) in BROKEN.items()), *OTHERS.items()]:
        description = " ".join((cls.__doc__ or "").split())
        registry.add_driver(
            name,
            factory(cls),
            capabilities=SIM_CAPABILITIES,
            description=f"sim with a defect: {description}",
            certify_options=certify_options,
        )
    for name, (cls, capabilities) in [*UNBROKEN.items(), *UNCERTIFIABLE.items()]:
        registry.add_driver(
            name,
            factory(cls),
            capabilities=capabilities,
            description=" ".join((cls.__doc__ or "").split()),
            certify_options=certify_options,
        )


def _unscoped(topology: Topology) -> Topology:
    """``topology`` with the fabric's name taken off its switch and pool ids, wherever they are named; device ids
    keep it."""
    prefix = f"{topology.fabric}/"
    switches = {s.id for s in topology.switches}

    def local(node: str) -> str:
        return node.removeprefix(prefix) if node in switches else node

    return attrs.evolve(
        topology,
        hosts=tuple(attrs.evolve(h, switch=local(h.switch)) for h in topology.hosts),
        switches=tuple(
            attrs.evolve(s, id=local(s.id), ports=tuple(attrs.evolve(p, connected=local(p.connected)) for p in s.ports))
            for s in topology.switches
        ),
        devices=tuple(attrs.evolve(d, switch=local(d.switch)) for d in topology.devices),
        links=tuple(attrs.evolve(link, a=local(link.a), b=local(link.b)) for link in topology.links),
        pools=_unscoped_pools(topology).pools,
    )


def _unscoped_pools(topology: Topology) -> Topology:
    """``topology`` with the fabric's name taken off its pool ids."""
    prefix = f"{topology.fabric}/"
    return attrs.evolve(topology, pools=tuple(attrs.evolve(p, id=p.id.removeprefix(prefix)) for p in topology.pools))


class UnscopedSwitchesAndPools(SimFabric):
    """Scopes its device ids by its fabric but not its switch and pool ids (``d0000-top``, ``d0000-pool0``): two
    such fabrics in one composer name a switch or a pool alike, and the composer refuses to start."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_unscoped(topology), **options)


class UnscopedPools(SimFabric):
    """Scopes its device and switch ids by its fabric but not its pool ids (``d0000-pool0``)."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_unscoped_pools(topology), **options)


BROKEN["broken-unscoped-switches-and-pools"] = (UnscopedSwitchesAndPools, "DISC-SCOPED-IDS")
BROKEN["broken-unscoped-pools"] = (UnscopedPools, "DISC-SCOPED-IDS")


class UnbindIgnoresHost(SimFabric):
    """Unbinds a device from whichever host holds it, whatever host the unbind names (a vendor hot-remove keyed
    on the port alone): the rollback of a bind to one host takes the device from the host that holds it."""

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            holder = self._bindings.get(binding.device) if isinstance(binding.device, str) else None
        if holder is not None and isinstance(binding.host, str) and binding.host:
            binding = Binding(binding.device, holder)
        super().unbind(binding, ctx)


class BindingsHideFailed(SimFabric):
    """`bindings()` leaves out a device that has failed, though its host still holds it: the composer never
    unbinds it, and the ledger and the hardware part ways."""

    def bindings(self) -> Sequence[Binding]:
        with self._lock:
            failed = set(self._failed)
        return tuple(b for b in super().bindings() if b.device not in failed)


class BindingsStaleHost(SimFabric):
    """`bindings()` reports each device on the host of its first bind (a stale cache), though it was moved."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._first: dict[str, str] = {}

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        got = super().bind(device, host, ctx)
        with self._lock:
            self._first.setdefault(device, host)
        return got

    def bindings(self) -> Sequence[Binding]:
        with self._lock:
            first = dict(self._first)
        return tuple(Binding(b.device, first.get(b.device, b.host)) for b in super().bindings())


def _last_renamed(topology: Topology, local: str) -> Topology:
    """``topology`` with its last device (by id, a pool's device in the generated fabrics, so that no clause
    but discovery's picks it) renamed ``<fabric>/<local>``, wherever it is named."""
    last = max(topology.devices, key=lambda d: d.id).id
    new = f"{topology.fabric}/{local}"
    return attrs.evolve(
        topology,
        devices=tuple(attrs.evolve(d, id=new) if d.id == last else d for d in topology.devices),
        pools=tuple(attrs.evolve(p, device=new) if p.device == last else p for p in topology.pools),
    )


class DeviceIdTooLong(SimFabric):
    """Reports a device whose id is 305 characters long: the driver protocol carries ids of at most 256, so the
    device can be discovered but never named in a request."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_last_renamed(topology, "x" * 300), **options)


class DeviceIdWithTab(SimFabric):
    """Reports a device whose id holds a tab."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_last_renamed(topology, "zz\tbad"), **options)


class _RewritesHealthEvents(EventDispatcher):
    """Posts, for each DEVICE_HEALTH event, what ``rewrite`` makes of it."""

    def __init__(self, rewrite: Callable[[FabricEvent], list[FabricEvent]]) -> None:
        super().__init__()
        self._rewrite = rewrite

    def post(self, event: FabricEvent) -> None:
        for each in self._rewrite(event) if event.kind is FabricEventKind.DEVICE_HEALTH else [event]:
            super().post(each)


class _HealthEventsRewritten(SimFabric):
    """The sim, with each health event replaced by what `rewrite` makes of it."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._events = _RewritesHealthEvents(self.rewrite)

    def rewrite(self, event: FabricEvent) -> list[FabricEvent]:
        raise NotImplementedError


class FailureSaysOk(_HealthEventsRewritten):
    """A device failure is reported as a DEVICE_HEALTH event with health OK: the composer never moves work off
    the device."""

    def rewrite(self, event: FabricEvent) -> list[FabricEvent]:
        return [attrs.evolve(event, health=Health.OK)]


class FailureWithoutHealth(_HealthEventsRewritten):
    """A device failure is reported as a DEVICE_HEALTH event with no health."""

    def rewrite(self, event: FabricEvent) -> list[FabricEvent]:
        return [attrs.evolve(event, health=None)]


class FailureOfAnotherFabric(_HealthEventsRewritten):
    """Health events name another fabric: the composer files them under it, or drops them."""

    def rewrite(self, event: FabricEvent) -> list[FabricEvent]:
        return [attrs.evolve(event, fabric="some-other-fabric")]


class FailureOfGhosts(_HealthEventsRewritten):
    """Every health event is followed by one for a device that does not exist."""

    def rewrite(self, event: FabricEvent) -> list[FabricEvent]:
        return [event, attrs.evolve(event, subject=f"{self.name}/no-such-device")]


class PoolEpochSeparate(SimFabric):
    """Pools keep their own highest epoch, in memory, apart from the fabric's: a bind or the new leader's
    announcement does not fence a deposed manager's allocate or release, nor does anything after a restart."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        self._pool_epoch = 0
        self._in_pool = threading.local()
        super().__init__(topology, **options)

    def _mutate(self, ctx: CallContext, key: tuple[str, ...], prepare: Any, **kw: Any) -> Any:
        self._in_pool.on = key[0] == "allocation"
        try:
            return super()._mutate(ctx, key, prepare, **kw)
        finally:
            self._in_pool.on = False

    def _fence(self, ctx: CallContext) -> None:
        if not getattr(self._in_pool, "on", False):
            super()._fence(ctx)
            return
        if ctx.epoch < self._pool_epoch:
            raise StaleEpochError(f"pool epoch {ctx.epoch} is older than {self._pool_epoch}")
        self._pool_epoch = ctx.epoch


class RepeatBeforeFence(SimFabric):
    """A bind that repeats a binding the device has returns it without looking at the epoch: a deposed manager
    is told its bind holds."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        with self._lock:
            if isinstance(device, str) and self._bindings.get(device) == host:
                return Binding(device, host)
        return super().bind(device, host, ctx)


SLOW_BIND_S = 1.5
"""How long a bind of `SlowBindIgnoresDeadline` takes."""


class SlowBindIgnoresDeadline(SimFabric):
    """Looks at the deadline only as a bind starts, which then takes `SLOW_BIND_S` and succeeds whatever the
    deadline: a caller that gave up is told nothing, and the device is bound to no one's knowledge."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        ctx.check_deadline()
        with self._lock:
            repeat = isinstance(device, str) and self._bindings.get(device) == host
        if not repeat:
            time.sleep(SLOW_BIND_S)
        return super().bind(device, host, attrs.evolve(ctx, deadline=None))


class SlowUnbindIgnoresDeadline(SimFabric):
    """Looks at the deadline only as an unbind starts; the hot-remove of a bound device then takes `SLOW_BIND_S`
    and succeeds whatever the deadline: the caller, who gave up, holds the device in doubt while it is free."""

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        ctx.check_deadline()
        with self._lock:
            bound = isinstance(binding.device, str) and self._bindings.get(binding.device) == binding.host
        if bound:
            time.sleep(SLOW_BIND_S)
        super().unbind(binding, attrs.evolve(ctx, deadline=None))


class _SlowAllocatePool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        ctx.check_deadline()
        if allocation_id not in {a.id for a in self.allocations()}:
            time.sleep(SLOW_BIND_S)
        return super().allocate(allocation_id, host, amount_bytes, attrs.evolve(ctx, deadline=None))


class SlowAllocateIgnoresDeadline(SimFabric):
    """Looks at the deadline only as an allocate starts, which then takes `SLOW_BIND_S` and carves whatever the
    deadline: memory is carved for a caller that gave up on it."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _SlowAllocatePool)


class _SlowReleasePool(SimPool):
    def release(self, allocation_id: str, ctx: CallContext) -> None:
        ctx.check_deadline()
        if allocation_id in {a.id for a in self.allocations()}:
            time.sleep(SLOW_BIND_S)
        super().release(allocation_id, attrs.evolve(ctx, deadline=None))


class SlowReleaseIgnoresDeadline(SimFabric):
    """Looks at the deadline only as a release starts, which then takes `SLOW_BIND_S` and frees whatever the
    deadline: the caller, who gave up, still counts the memory as held."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _SlowReleasePool)


HELPER = ("sleep", "60")
"""The helper process (an emulator, a vendor daemon) that `LeavesItsHelperRunning` starts with every fabric."""


class LeavesItsHelperRunning(SimFabric):
    """Starts a helper process with every fabric built and leaves it running when the fabric is closed: the
    emulator of a closed fabric runs on, and a fabric manager that reopens its fabrics piles them up."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self.helper = subprocess.Popen(HELPER, stdin=subprocess.DEVNULL)


class StopsItsHelperAtClose(LeavesItsHelperRunning):
    """Not broken: close() asks its helper to end (SIGTERM) and does not wait for it, which ends soon after."""

    def close(self) -> None:
        self.helper.terminate()
        super().close()


class ListsAPortBoundToNothing(SimFabric):
    """Lists, beside each host's bindings, a binding of no device (id "") for the host: the port's vPPB as the
    switch reports it, not a device. Reconciliation quarantines a binding of a device it does not know."""

    def bindings(self) -> Sequence[Binding]:
        held = tuple(super().bindings())
        return held + tuple(Binding("", host) for host in sorted({b.host for b in held}))


class _ListsTheSwitchsAllocationsPool(SimPool):
    def allocations(self) -> Sequence[Allocation]:
        with self._fabric._lock:
            pools = list(self._fabric._pools.values())
        return tuple(a for pool in pools for a in SimPool.allocations(pool))


class ListsOtherPoolsAllocations(SimFabric):
    """Each pool lists the allocations of every pool of the fabric, as a switch's table holds them: the
    composition that holds one seems to have lost it from its own pool and to hold memory of another."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _ListsTheSwitchsAllocationsPool)


class _ForAnotherHostPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        fabric = self._fabric
        with fabric._lock:
            switch = fabric._device(self._info.device).switch
            reaching = [h for h in sorted(fabric._hosts) if fabric._reaches(h, switch)]
        if host in reaching and len(reaching) > 1:
            host = reaching[(reaching.index(host) + 1) % len(reaching)]
        return super().allocate(allocation_id, host, amount_bytes, ctx)


class AllocatesForAnotherHost(SimFabric):
    """Carves memory for the next host that reaches the pool, not the one asked: one host's memory is mapped
    into another."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _ForAnotherHostPool)


class _UnroundedPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        got = super().allocate(allocation_id, host, amount_bytes, ctx)
        return attrs.evolve(got, amount_bytes=amount_bytes)


class AllocateReturnsUnrounded(SimFabric):
    """Carves whole blocks but answers an allocation of the amount asked: the caller records less than the
    pool holds."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _UnroundedPool)


class _UnknownHostKeyErrorPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        self._fabric._hosts[host]  # a KeyError for an unknown host, as a bare dict lookup raises
        return super().allocate(allocation_id, host, amount_bytes, ctx)


class AllocateUnknownHostKeyError(SimFabric):
    """An allocate for a host the fabric does not have raises KeyError, not UnknownHostError."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _UnknownHostKeyErrorPool)


class PoolUnknownKeyError(SimFabric):
    """`Fabric.pool` of an id the fabric does not have raises KeyError, not NotFoundError."""

    def pool(self, pool: str) -> SimPool:
        return self._pools[pool]


class DeviceUnknownKeyError(SimFabric):
    """`Fabric.device` of an id the fabric does not have raises KeyError, not UnknownDeviceError."""

    def device(self, device: str) -> SimDevice:
        self._device_index[device]  # a KeyError for an unknown device
        return super().device(device)


class _AnyIdPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        return super().allocate(allocation_id or "anon", host, amount_bytes, ctx)


class AllocateEmptyId(SimFabric):
    """An allocate with an empty allocation id carves (under ``anon``) instead of raising InvalidRequestError."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _AnyIdPool)


class _ReachBlindPool(SimPool):
    def _check_can_carve(self, host: str) -> None:
        return None


class AllocateIgnoresReach(SimFabric):
    """Carves for a host that no working path joins to the pool, and for a failed pool device, instead of
    raising HostUnreachableError."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _ReachBlindPool)


BROKEN.update(
    {
        "broken-unbind-ignores-host": (UnbindIgnoresHost, "UNBIND-OTHER-HOST"),
        "broken-bindings-hide-failed": (BindingsHideFailed, "BINDINGS-REPORTED"),
        "broken-bindings-stale-host": (BindingsStaleHost, "BINDINGS-REPORTED"),
        "broken-id-too-long": (DeviceIdTooLong, "DISC-WELL-FORMED"),
        "broken-id-with-tab": (DeviceIdWithTab, "DISC-WELL-FORMED"),
        "broken-failure-says-ok": (FailureSaysOk, "EVENT-FAILURE-REPORTED"),
        "broken-failure-without-health": (FailureWithoutHealth, "EVENT-FAILURE-REPORTED"),
        "broken-failure-of-another-fabric": (FailureOfAnotherFabric, "EVENT-FAILURE-REPORTED"),
        "broken-failure-of-ghosts": (FailureOfGhosts, "EVENT-FAILURE-REPORTED"),
        "broken-pool-epoch-separate": (PoolEpochSeparate, "FENCE-STALE-EPOCH"),
        "broken-repeat-before-fence": (RepeatBeforeFence, "FENCE-STALE-EPOCH"),
        "broken-slow-bind-ignores-deadline": (SlowBindIgnoresDeadline, "DEADLINE-DURING-CALL"),
        "broken-slow-unbind-ignores-deadline": (SlowUnbindIgnoresDeadline, "DEADLINE-DURING-UNBIND"),
        "broken-slow-allocate-ignores-deadline": (SlowAllocateIgnoresDeadline, "CARVE-DEADLINE-DURING-CALL"),
        "broken-slow-release-ignores-deadline": (SlowReleaseIgnoresDeadline, "CARVE-DEADLINE-DURING-CALL"),
        "broken-leaves-its-helper-running": (LeavesItsHelperRunning, "CLOSE-NO-CHILDREN"),
        "broken-lists-a-port-bound-to-nothing": (ListsAPortBoundToNothing, "LIST-WELL-FORMED"),
        "broken-lists-other-pools-allocations": (ListsOtherPoolsAllocations, "LIST-WELL-FORMED"),
        "broken-allocates-for-another-host": (AllocatesForAnotherHost, "CARVE-CONSERVES"),
        "broken-allocate-returns-unrounded": (AllocateReturnsUnrounded, "CARVE-CONSERVES"),
        "broken-allocate-unknown-host-keyerror": (AllocateUnknownHostKeyError, "CARVE-UNKNOWN-HOST"),
        "broken-pool-unknown-keyerror": (PoolUnknownKeyError, "ERR-UNKNOWN-POOL"),
        "broken-device-unknown-keyerror": (DeviceUnknownKeyError, "ERR-UNKNOWN-DEVICE-HANDLE"),
        "broken-allocate-empty-id": (AllocateEmptyId, "CARVE-INVALID-ID"),
        "broken-allocate-ignores-reach": (AllocateIgnoresReach, "CARVE-HOST-UNREACHABLE"),
    }
)
ALSO_BROKEN["broken-pool-epoch-separate"] = ("CARVE-STALE-EPOCH", "RESTART-FENCING")
UNBROKEN["sim-stops-its-helper-at-close"] = (StopsItsHelperAtClose, SIM_CAPABILITIES)


def _overstated(info: PoolInfo) -> PoolInfo:
    """``info`` with twice its capacity: the half past what the device has is a region it never carves."""
    return attrs.evolve(info, capacity=attrs.evolve(info.capacity, total_bytes=2 * info.capacity.total_bytes))


class _OverstatedPool(SimPool):
    def info(self) -> PoolInfo:
        return _overstated(super().info())

    def free_bytes(self) -> int:
        return super().free_bytes() + super().info().capacity.total_bytes


class OverstatesCapacity(SimFabric):
    """Reports each pool with twice the capacity it can carve (a region the device keeps for itself counted in),
    in discovery and as free capacity: an allocation beyond what it has still raises CapacityExhaustedError, but
    the composer places memory on what is reported, and its allocate fails."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _OverstatedPool)

    def discover(self) -> Topology:
        found = super().discover()
        return attrs.evolve(found, pools=tuple(_overstated(p) for p in found.pools))


BROKEN["broken-overstates-capacity"] = (OverstatesCapacity, "CARVE-FREE-CARVABLE")


WITHOUT_FAULTS = attrs.evolve(SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.FAULT_INJECTION})


class SilentWithoutFaultInjection(SilentFailures):
    """Declares health events but not fault injection, and, as `SilentFailures`, never reports a failure: the
    composer, told that events bring its devices' health, stops reading it from discovery, and a failed device
    keeps its compositions HEALTHY."""

    def capabilities(self) -> Capabilities:
        return WITHOUT_FAULTS


UNCERTIFIABLE["broken-silent-without-fault-injection"] = (SilentWithoutFaultInjection, WITHOUT_FAULTS)


class StaleNoopUnbind(SimFabric):
    """An unbind of a binding that does not exist answers success whatever its epoch: it looks at the epoch only
    when there is something to unbind, so a deposed manager is told its unbind is done."""

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            absent = self._bindings.get(binding.device) != binding.host
            stale = ctx.epoch < self._epoch
        if not (absent and stale):
            super().unbind(binding, ctx)


class _StaleNoopReleasePool(SimPool):
    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with self._fabric._lock:
            absent = allocation_id not in self._allocations
            stale = ctx.epoch < self._fabric._epoch
        if not (absent and stale):
            super().release(allocation_id, ctx)


class StaleNoopRelease(SimFabric):
    """A release of an allocation the pool does not hold answers success whatever its epoch: its pools look at
    the epoch only when there is something to release."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _StaleNoopReleasePool)


BROKEN["broken-stale-noop-unbind"] = (StaleNoopUnbind, "FENCE-STALE-EPOCH")
BROKEN["broken-stale-noop-release"] = (StaleNoopRelease, "CARVE-STALE-EPOCH")


class DiscoveryHidesFailures(SimFabric):
    """Discovery reports every device OK (an inventory read once and cached), though a failed one is refused
    and its failure sent as an event: a composer that reads health from discovery never moves work off it."""

    def discover(self) -> Topology:
        found = super().discover()
        return attrs.evolve(found, devices=tuple(attrs.evolve(d, health=Health.OK) for d in found.devices))


BROKEN["broken-discovery-hides-failures"] = (DiscoveryHidesFailures, "DISC-HEALTH-REPORTED")

REASONS: dict[str, str] = {
    "broken-cancel-does-nothing": "once cancelled, a handler is called no more",
    "broken-allocate-repeat-before-fence": "even on a repeat that would change nothing",
    "broken-release-of-nothing-frees": "the pool would carve memory it does not have",
    "broken-sanitize-ignores-epoch": "is refused before anything is erased",
    "broken-unbind-ignores-host": "an unbind of an absent binding (one naming another host) does nothing",
    "broken-bindings-hide-failed": "a failed device is still held by its host until it is unbound",
    "broken-bindings-stale-host": "not the binding the hardware holds",
    "broken-id-too-long": "a device id of 305 characters",
    "broken-id-with-tab": "every id is 1 to 256 printable characters without whitespace",
    "broken-failure-says-ok": "reported with health OK, not FAILED",
    "broken-failure-without-health": "reported with health None, not FAILED",
    "broken-failure-of-another-fabric": "names fabric 'some-other-fabric', not 'cert'",
    "broken-failure-of-ghosts": "'cert/no-such-device', a device that discovery does not report",
    "broken-pool-epoch-separate": "a driver keeps one highest epoch",
    "broken-repeat-before-fence": "even on a call that would change nothing",
    "broken-slow-bind-ignores-deadline": "s after its deadline: a call that would run past its deadline raises",
    "broken-slow-unbind-ignores-deadline": "s after its deadline: a call that would run past its deadline raises",
    "broken-slow-allocate-ignores-deadline": "s after its deadline: a call that would run past its deadline raises",
    "broken-slow-release-ignores-deadline": "s after its deadline: a call that would run past its deadline raises",
    "broken-leaves-its-helper-running": "'sleep 60'",
    "broken-lists-a-port-bound-to-nothing": ".device: an id must be a non-empty string",
    "broken-lists-other-pools-allocations": "listed as an allocation of pool",
    "broken-allocates-for-another-host": "a pool carves for the host asked",
    "broken-allocate-returns-unrounded": "the allocation returned is the one the pool holds",
    "broken-allocate-unknown-host-keyerror": "raised KeyError",
    "broken-pool-unknown-keyerror": "raised KeyError",
    "broken-device-unknown-keyerror": "raised KeyError",
    "broken-allocate-empty-id": "raise InvalidRequestError for an allocation id or host that is not a non-empty",
    "broken-allocate-ignores-reach": "not HostUnreachableError",
    "broken-overstates-capacity": "a pool offers only what it can carve",
    "broken-stale-noop-unbind": "even on a call that would change nothing",
    "broken-stale-noop-release": "even on a call that would change nothing",
    "broken-discovery-hides-failures": "a failed device FAILED",
}
"""Driver name: words the reason of the clause its defect breaks must hold, which name the rule it breaks."""


class SanitizeIgnoresDeadline(SimFabric):
    """Sanitize never looks at its deadline: one made after its caller gave up still erases the device, and
    answers success."""

    def _sanitize(self, device: str, ctx: CallContext) -> None:
        super()._sanitize(device, attrs.evolve(ctx, deadline=None))


class SlowSanitizeIgnoresDeadline(SimFabric):
    """Looks at the deadline only as a sanitize starts, which then takes `SLOW_BIND_S` and succeeds whatever the
    deadline: the caller, who gave up, holds the device in doubt, erased or not."""

    def _sanitize(self, device: str, ctx: CallContext) -> None:
        ctx.check_deadline()
        time.sleep(SLOW_BIND_S)
        super()._sanitize(device, attrs.evolve(ctx, deadline=None))


class _RacyAllocatePool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        with self._fabric._lock:
            known = allocation_id in self._allocations
        if known:
            return super().allocate(allocation_id, host, amount_bytes, ctx)
        time.sleep(RACE_WINDOW_S)  # the slow carve, made without looking at the id again
        carved = super().allocate(f"{allocation_id}.{threading.get_ident()}", host, amount_bytes, ctx)
        with self._fabric._lock:
            del self._allocations[carved.id]
            carved = attrs.evolve(carved, id=allocation_id)
            self._allocations[allocation_id] = carved  # the record of an earlier carve of the id is overwritten
            self._fabric._persist(lambda: None)
        return carved


class RacyAllocate(SimFabric):
    """An allocate of an id the pool does not hold carves without looking at the id again once its slow carve
    is done: a retry racing its first call carves a second time, and the first carve's memory is lost to
    every host."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _RacyAllocatePool)


MLD_LDS = 4
"""The logical devices of each pool of `MldPools`: fewer than the allocations CARVE-NO-OVERLAP holds at once (nine),
which an MLD of four cannot hold, so `MldPools` keeps one pool a DCD for that clause to carve from."""


def _mlds(topology: Topology, logical_devices: int, *, keep_first: bool = True) -> Topology:
    """``topology`` with every pool (but the first in id order, with ``keep_first``) an MLD of ``logical_devices``."""
    first = min(p.id for p in topology.pools) if keep_first else None
    pools = tuple(
        p if p.id == first else attrs.evolve(p, kind=PoolKind.MLD, logical_devices=logical_devices)
        for p in topology.pools
    )
    return attrs.evolve(topology, pools=pools)


class MldPools(SimFabric):
    """Not broken: the sim with its pools (but the first, a DCD) MLDs of `MLD_LDS` logical devices, each of which
    holds one allocation."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_mlds(topology, MLD_LDS), **options)


class OnlySmallMlds(SimFabric):
    """Not broken: the sim with every pool an MLD of two logical devices. The carving clauses that hold more
    allocations at once than that (CARVE-NO-OVERLAP) find no pool to judge and are not tested; they must not fail
    a driver for the size CXL gave its MLDs."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(_mlds(topology, 2, keep_first=False), **options)


def _carving_as(fabric: SimFabric, change: Callable[[PoolInfo], PoolInfo]) -> None:
    """Make each MLD of ``fabric`` carve as ``change`` makes its record (a sim pool carves by its own record, and
    discovery reports the topology's): what it reports and what it carves part ways."""
    for pool in fabric._pools.values():
        if pool._info.kind is PoolKind.MLD:
            pool._info = change(pool._info)


class MldCarvesPastItsLds(MldPools):
    """Reports its MLDs with `MLD_LDS` logical devices but carves them as extents, any number of allocations: a
    driver that holds more allocations than the MLD has LDs has not bound each to an LD."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _carving_as(self, lambda info: attrs.evolve(info, kind=PoolKind.DCD, logical_devices=0))


class MldOverstatesItsLds(MldPools):
    """Reports its MLDs with `MLD_LDS` logical devices but carves only half as many allocations from each (the
    LD Count read where the LDs a host may use were meant): the composer offers a pool whose LDs are all used,
    and the allocates of plans that fit are refused."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _carving_as(self, lambda info: attrs.evolve(info, logical_devices=MLD_LDS // 2))


MLD_TOO_MANY_LDS = 17
"""The logical devices `MldOfTooManyLds` reports: one more than CXL lets an MLD have."""


def _too_many_lds(info: PoolInfo) -> PoolInfo:
    """``info`` with `MLD_TOO_MANY_LDS` logical devices when it is an MLD, which `PoolInfo` refuses to be built
    with: as a driver reports it that builds its own record of a pool, or reads one back unchecked."""
    if info.kind is PoolKind.MLD:
        info = attrs.evolve(info)
        object.__setattr__(info, "logical_devices", MLD_TOO_MANY_LDS)
    return info


class MldOfTooManyLds(MldPools):
    """Reports its MLDs with 17 logical devices, and carves 17 allocations from each: more than CXL lets an MLD
    expose (Get LD Info's LD Count is 1 to 16)."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _carving_as(self, _too_many_lds)

    def discover(self) -> Topology:
        found = super().discover()
        return attrs.evolve(found, pools=tuple(_too_many_lds(p) for p in found.pools))


BROKEN["broken-sanitize-ignores-deadline"] = (SanitizeIgnoresDeadline, "SANITIZE-DEADLINE")
BROKEN["broken-slow-sanitize-ignores-deadline"] = (SlowSanitizeIgnoresDeadline, "SANITIZE-DEADLINE")
BROKEN["broken-racy-allocate"] = (RacyAllocate, "CARVE-RACE-SAME-ID")
BROKEN["broken-mld-carves-past-its-lds"] = (MldCarvesPastItsLds, "CARVE-MLD-LOGICAL-DEVICES")
BROKEN["broken-mld-overstates-its-lds"] = (MldOverstatesItsLds, "CARVE-MLD-LOGICAL-DEVICES")
BROKEN["broken-mld-of-too-many-lds"] = (MldOfTooManyLds, "CARVE-MLD-LOGICAL-DEVICES")
UNBROKEN["sim-mld-pools"] = (MldPools, SIM_CAPABILITIES)
UNBROKEN["sim-only-small-mlds"] = (OnlySmallMlds, SIM_CAPABILITIES)
REASONS.update(
    {
        "broken-sanitize-ignores-deadline": "a call that would run past its deadline raises",
        "broken-slow-sanitize-ignores-deadline": "s after its deadline: a call that would run past its deadline raises",
        "broken-racy-allocate": "a retried call never doubles an effect",
        "broken-mld-carves-past-its-lds": "an MLD holds one allocation per logical device",
        "broken-mld-overstates-its-lds": "an MLD holds one allocation per logical device",
        "broken-mld-of-too-many-lds": "an MLD has 1 to 16",
    }
)


class StartsAHotplugHelperAtItsFirstBind(SimFabric):
    """Starts a hot-plug helper process (a vendor daemon) at its first bind, and leaves it running when the fabric
    is closed: a fabric that only discovered starts none, and each fabric that bound leaves one behind."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self.hotplug: subprocess.Popen[bytes] | None = None

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if self.hotplug is None:
            self.hotplug = subprocess.Popen(HELPER, stdin=subprocess.DEVNULL)
        return super().bind(device, host, ctx)


class _ForgetsItsExtentsPool(SimPool):
    """Reads its allocations back at a restart, and counts its free capacity from them, but claims none of their
    blocks: its carver starts empty, and carves the blocks they hold again."""

    _unclaimed: set[str]

    def _restore(self, allocation: Allocation) -> None:
        if not hasattr(self, "_unclaimed"):  # made a pool of this class by `_pools_as`, not built as one
            self._unclaimed = set()
        if allocation.id in self._allocations:
            raise ValueError("duplicate allocation id")
        self._allocations[allocation.id] = allocation
        self._unclaimed.add(allocation.id)

    def free_bytes(self) -> int:
        with self._fabric._lock:
            held = getattr(self, "_unclaimed", set())
            unclaimed = sum(self._allocations[a].amount_bytes for a in held if a in self._allocations)
            return self._carver.free_blocks * self._block - unclaimed

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with self._fabric._lock:
            if allocation_id in getattr(self, "_unclaimed", set()) and allocation_id in self._allocations:
                self._unclaimed.discard(allocation_id)
                for extent in self._allocations[allocation_id].extents:
                    with contextlib.suppress(ValueError):  # what it carved again over them is lost to both
                        self._carver.claim(extent.offset // self._block, extent.length // self._block)
        super().release(allocation_id, ctx)


class ForgetsItsExtentsOnRestart(SimFabric):
    """After a restart each pool lists the allocations it held and the free capacity left, but carves the next
    allocation over their blocks: one host's memory is mapped into another's."""

    def _restore(self, state: SimState) -> None:
        _pools_as(self, _ForgetsItsExtentsPool)
        super()._restore(state)


class SanitizeEpochApartFromBinds(SimFabric):
    """Sanitize keeps its own highest epoch, fed by sanitizes and by unbinds (a new leader's announcement among
    them) but not by binds: a deposed manager's sanitize erases a device after its successor's first bind."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._sanitize_epoch = self._epoch

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            self._sanitize_epoch = max(self._sanitize_epoch, ctx.epoch)
        super().unbind(binding, ctx)

    def _sanitize(self, device: str, ctx: CallContext) -> None:
        with self._lock:
            if ctx.epoch < self._sanitize_epoch:
                raise StaleEpochError(f"epoch {ctx.epoch} is older than {self._sanitize_epoch}, the highest seen")
            self._sanitize_epoch = ctx.epoch
        super()._sanitize(device, attrs.evolve(ctx, epoch=max(ctx.epoch, self.epoch)))


BROKEN["broken-hotplug-helper-left-running"] = (StartsAHotplugHelperAtItsFirstBind, "CLOSE-NO-CHILDREN")
BROKEN["broken-forgets-its-extents-on-restart"] = (ForgetsItsExtentsOnRestart, "RESTART-ALLOCATIONS")
BROKEN["broken-sanitize-epoch-apart-from-binds"] = (SanitizeEpochApartFromBinds, "SANITIZE-STALE-EPOCH")
REASONS.update(
    {
        "broken-hotplug-helper-left-running": "close() ends every process the driver started",
        "broken-forgets-its-extents-on-restart": "a restarted driver still holds what it carved, and carves around it",
        "broken-sanitize-epoch-apart-from-binds": "a bind fences sanitize too",
    }
)


class ForgetsWhoHoldsOnRestart(SimFabric):
    """After a restart it lists the bindings it read back, but its bind does not look at them: a device bound
    before the restart is bound again to the next host asked, and taken from the one that holds it."""

    def _restore(self, state: SimState) -> None:
        super()._restore(state)
        self._listed = dict(self._bindings)
        self._bindings.clear()

    def _held(self) -> dict[str, str]:
        return {**getattr(self, "_listed", {}), **self._bindings}

    def bindings(self) -> Sequence[Binding]:
        with self._lock:
            return tuple(Binding(device=d, host=h) for d, h in self._held().items())

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with self._lock:
            listed = getattr(self, "_listed", {})
            if listed.get(binding.device) == binding.host and binding.device not in self._bindings:
                self._bindings[binding.device] = listed.pop(binding.device)  # unbound as one it holds
        super().unbind(binding, ctx)

    def _snapshot(self) -> SimState:
        return attrs.evolve(super()._snapshot(), bindings=self._held())


BROKEN["broken-forgets-who-holds-on-restart"] = (ForgetsWhoHoldsOnRestart, "RESTART-BINDINGS")
REASONS["broken-forgets-who-holds-on-restart"] = "a restarted driver still holds the bindings it lists"


class UnknownPoolAsDevice(SimFabric):
    """Answers a pool it does not have with UnknownDeviceError, not NotFoundError: its caller is told of an
    unknown device (reason UNKNOWN_DEVICE) when it named a pool."""

    def pool(self, pool: str) -> SimPool:
        try:
            return super().pool(pool)
        except NotFoundError as exc:
            raise UnknownDeviceError(pool, exc.message) from None


class _ConflictAsAlreadyExistsPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        try:
            return super().allocate(allocation_id, host, amount_bytes, ctx)
        except ConflictError as exc:
            raise AlreadyExistsError(exc.message) from None


class ConflictAsAlreadyExists(SimFabric):
    """Refuses an allocation id reused for another host or amount with AlreadyExistsError (reason ALREADY_EXISTS,
    gRPC ALREADY_EXISTS), not ConflictError: a sibling the contract keeps for names and request ids."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _ConflictAsAlreadyExistsPool)


@contextlib.contextmanager
def _invalid_as_config() -> Iterator[None]:
    """An InvalidRequestError raised in the block as the ConfigError (reason INVALID_CONFIG) that a driver's options
    get."""
    try:
        yield
    except InvalidRequestError as exc:
        if type(exc) is not InvalidRequestError:
            raise
        raise ConfigError(exc.message, field=exc.field) from None


class InvalidIdAsConfig(SimFabric):
    """Refuses a malformed device or host id in a bind or unbind with ConfigError, as if a configuration were
    wrong (reason INVALID_CONFIG), not InvalidRequestError."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        with _invalid_as_config():
            return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        with _invalid_as_config():
            super().unbind(binding, ctx)


class _InvalidAsConfigPool(SimPool):
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        with _invalid_as_config():
            return super().allocate(allocation_id, host, amount_bytes, ctx)

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        with _invalid_as_config():
            super().release(allocation_id, ctx)


class CarveInvalidAsConfig(SimFabric):
    """Refuses a malformed allocate or release (an id that is not one, an amount that is not positive) with
    ConfigError, not InvalidRequestError."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        _pools_as(self, _InvalidAsConfigPool)


BROKEN["broken-unknown-pool-as-device"] = (UnknownPoolAsDevice, "ERR-UNKNOWN-POOL")
BROKEN["broken-conflict-as-already-exists"] = (ConflictAsAlreadyExists, "CARVE-CONFLICT")
BROKEN["broken-invalid-id-as-config"] = (InvalidIdAsConfig, "ERR-INVALID-ID")
BROKEN["broken-carve-invalid-as-config"] = (CarveInvalidAsConfig, "CARVE-INVALID-ID")
ALSO_BROKEN["broken-conflict-as-already-exists"] = ("CARVE-IDEMPOTENT", "CARVE-RACE-SAME-ID")
ALSO_BROKEN["broken-carve-invalid-as-config"] = ("CARVE-INVALID-AMOUNT",)
REASONS.update(
    {
        "broken-unknown-pool-as-device": "raised UnknownDeviceError (reason UNKNOWN_DEVICE), not NotFoundError",
        "broken-conflict-as-already-exists": "raised AlreadyExistsError (reason ALREADY_EXISTS), not ConflictError",
        "broken-invalid-id-as-config": "raised ConfigError (reason INVALID_CONFIG), not InvalidRequestError",
        "broken-carve-invalid-as-config": "raised ConfigError (reason INVALID_CONFIG), not InvalidRequestError",
    }
)
