"""The ``cxl-switch`` Fabric: hosts are the switch's VCSs, devices the endpoints on its downstream ports, a bind
is Bind vPPB of a free vPPB of the host's VCS to the device's port.

The switch is the truth: `discover` and `bindings` read it (Get Physical Port State, Get Virtual CXL Switch
Info) on every call, so a restarted driver finds what the switch holds. Bind and Unbind vPPB run in the
background on the switch, one at a time, so the driver serialises them under one lock and waits for each
(Background Operation Status) before answering. Memory is carved through pools, never bound whole: the DCD's
extents (`pools`) and the MLD's logical devices (`mld_pool`), whose LD binds share that lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from disagg.errors import (
    CapacityExhaustedError,
    DeadlineExceededError,
    DeviceBusyError,
    DisaggError,
    FabricUnavailableError,
    HostUnreachableError,
    NotFoundError,
    UnknownDeviceError,
    UnknownHostError,
    UnsupportedError,
)
from disagg.interfaces import CallContext, Fabric, FaultInjection, Pool, Subscription, check_id
from disagg.interfaces.fabric import EventHandler
from disagg.model import (
    Binding,
    Capabilities,
    DeviceKind,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    PoolInfo,
    Topology,
)
from disagg.statedir import claim

from disagg_cxl_switch.driver import client as cci
from disagg_cxl_switch.driver import process
from disagg_cxl_switch.driver.client import CCIClient, CommandFailedError, Encodable, Verify, bind_error
from disagg_cxl_switch.driver.events import EventPoller, next_sequence
from disagg_cxl_switch.driver.layout import PortView, SwitchView
from disagg_cxl_switch.driver.mld_pool import MLDPool
from disagg_cxl_switch.driver.options import Options
from disagg_cxl_switch.driver.pools import DCD
from disagg_cxl_switch.driver.state import DriverState
from disagg_cxl_switch.emulator.events import EventRecord, EventType
from disagg_cxl_switch.emulator.vendor import (
    HotAddDeviceKind,
    InjectBindFailureRequest,
    InjectHotAddRequest,
    InjectLinkDownRequest,
    VendorOpcode,
)
from disagg_cxl_switch.fmapi import (
    LD_ID_NOT_MLD,
    BindVPPBRequest,
    Opcode,
    PhysicalPortControlRequest,
    PortOpcode,
    UnbindOption,
    UnbindVPPBRequest,
)
from disagg_cxl_switch.returncodes import ReturnCode

log = logging.getLogger("disagg.cxl_switch")

CXL_SWITCH_CAPABILITIES = Capabilities(
    kinds=frozenset({DeviceKind.GPU, DeviceKind.NVME, DeviceKind.NIC, DeviceKind.CXL_MEMORY}),
    features=frozenset(
        {Feature.BIND, Feature.UNBIND, Feature.CARVE, Feature.HEALTH_EVENTS, Feature.FENCING, Feature.FAULT_INJECTION}
    ),
    event_latency_s=0.5,
)

_HOT_ADD_KIND = {
    DeviceKind.GPU: HotAddDeviceKind.GPU,
    DeviceKind.NVME: HotAddDeviceKind.NVME,
    DeviceKind.NIC: HotAddDeviceKind.NIC,
}
"""What Inject Hot-Add plugs back in for each kind; the emulator hot-adds no CXL memory device."""


class _Subscription(Subscription):
    def __init__(self, fabric: CxlSwitchFabric, handler: EventHandler) -> None:
        self._fabric, self.handler = fabric, handler

    def cancel(self) -> None:
        self._fabric._unsubscribe(self)


class CxlSwitchFabric(Fabric, FaultInjection):
    """One emulated CXL switch; also `FaultInjection`, on the emulator's vendor commands."""

    def __init__(self, name: str, options: Options) -> None:
        self._name = name
        self._opts = options
        self._started = False
        state_dir = options.state_dir
        if options.address is not None:
            self._address = options.address
        else:
            assert state_dir is not None
            self._address = process.emulator_address(state_dir)
        # One driver per state_dir: a second would stop, on close, the emulator the first is using.
        self._owner = claim(name, "cxl-switch", state_dir) if state_dir is not None else None
        launched = False  # by this call: stopped again if the fabric cannot be built; an adopted one never is
        try:
            self._state = DriverState(state_dir)  # read first: a state file it refuses starts no emulator
            self._client = CCIClient(self._address)
            if options.address is None and state_dir is not None:
                if not process.running(state_dir):
                    process.start(state_dir, options.emulator_flags(), self._identify)
                    launched = True
                else:
                    process.check_revision(state_dir)  # one of another version would be misread
                    process.check_options(state_dir, options.emulator_flags())
                self._started = True
        except BaseException:
            self._let_go()  # or a retry in this process would be told another driver holds the state_dir
            raise
        self._op_lock = threading.Lock()  # one Bind/Unbind vPPB at a time, as the switch runs them
        self._lock = threading.Lock()
        self._subs: list[_Subscription] = []
        self._links_down: set[str] = set()
        self._flaky: dict[str | None, int] = {}
        self._told: dict[str, Health] = {}  # each device's health as last published
        self._read_told: dict[str, Health] = {}  # told by the ports' read, no record of it since (poller's thread)
        self._queued: list[FabricEvent] = []  # for the poller's thread to publish (`publish_soon`)
        try:
            self._view = SwitchView.read(self._client, name, options)
            self._dcd = None if self._view.dcd_port is None else DCD(self, self._view.dcd_port)
            self._mld = None if self._view.mld_port is None else MLDPool(self, self._view.mld_port)
            first = next_sequence(self._client)
        except BaseException:
            self._client.close()
            if launched and state_dir is not None:
                process.stop(state_dir)  # started for a fabric that cannot be built; one adopted holds bindings
            self._let_go()
            raise
        self._poller = EventPoller(
            self._address, first, self._on_record, self._resync, self._restarted, queued=self._publish_queued
        )
        self._closed = False

    def _let_go(self) -> None:
        """Give the state_dir up to the next driver."""
        if self._owner is not None:
            self._owner.close()

    def _identify(self) -> None:
        self._client.call(Opcode.IDENTIFY_SWITCH_DEVICE)

    # ------------------------------------------------------------------ what the pool shares

    @property
    def address(self) -> str:
        """Where the emulator listens (``unix:/path`` or ``127.0.0.1:PORT``)."""
        return self._address

    @property
    def client(self) -> CCIClient:
        return self._client

    @property
    def state(self) -> DriverState:
        return self._state

    @property
    def view(self) -> SwitchView:
        return self._view

    @property
    def vppb_lock(self) -> threading.Lock:
        """Held from choosing a free vPPB until its Bind or Unbind vPPB is done: the switch runs one at a time."""
        return self._op_lock

    def change(
        self,
        opcode: int,
        payload: Encodable,
        ctx: CallContext,
        *,
        port: int | None = None,
        verify: Verify | None = None,
    ) -> bytes:
        """Send a command that changes the switch (tunnelled to ``port`` if given), fencing first: the caller
        holds its lock by now, and a call that queued for it must not land after a newer epoch was seen."""
        self._state.fence(ctx.epoch)
        if port is None:
            return self._client.call(opcode, payload, ctx, verify=verify)
        return self._client.tunnel(port, opcode, payload, ctx)

    def bind_vppb(self, device: str, request: BindVPPBRequest, ctx: CallContext) -> None:
        """Bind vPPB, waited for and then checked on the switch (another client's Bind vPPB may have replaced its
        status); the caller holds `vppb_lock`. A bind armed by `flaky_bind` is made to fail in the switch (Inject
        Bind Failure) first: that command binds nothing, and Bind vPPB is not sent if it fails, so its failure
        (even a lost answer) is a plain one, never an outcome unknown. The switch's refusal or failure of the bind
        is `CommandFailedError`."""
        if self._take_flaky(device):
            self._state.fence(ctx.epoch)
            self._client.call(VendorOpcode.INJECT_BIND_FAILURE, InjectBindFailureRequest(), ctx, changes=False)
        ld = None if request.ld_id == LD_ID_NOT_MLD else request.ld_id

        def bound() -> bool | None:
            return self._view.holds(
                self._client, request.vcs_id, request.vppb_id, request.physical_port_id, ld=ld, ctx=ctx
            )

        self.change(Opcode.BIND_VPPB, request, ctx, verify=bound)

    def unbind_vppb(self, request: UnbindVPPBRequest, ctx: CallContext, *, port: int, ld: int | None = None) -> None:
        """Unbind vPPB of the vPPB bound to ``port`` (its LD ``ld``), waited for and then checked on the switch;
        the caller holds `vppb_lock`."""

        def unbound() -> bool | None:
            held = self._view.holds(self._client, request.vcs_id, request.vppb_id, port, ld=ld, ctx=ctx)
            return None if held is None else not held

        self.change(Opcode.UNBIND_VPPB, request, ctx, verify=unbound)

    def check_host(self, host: str) -> int:
        """The VCS id of ``host``; `UnknownHostError`, or `HostUnreachableError` when its link is down."""
        vcs = self._view.vcs_of.get(host)
        if vcs is None:
            raise UnknownHostError(host)
        if host in self._links_down:
            raise HostUnreachableError(f"the link of host {host} to {self._view.switch_id} is down")
        return vcs

    def hosts(self) -> dict[str, int]:
        """Host name to VCS id (which is also the host's id on the DCD)."""
        return dict(self._view.vcs_of)

    def device_id_of(self, port: int) -> str:
        return self._view.device_of[port]

    def port_view(self, port: int) -> PortView:
        return self._view.read_port(self._client, port)

    # ------------------------------------------------------------------ Fabric

    @property
    def name(self) -> str:
        return self._name

    def capabilities(self) -> Capabilities:
        return CXL_SWITCH_CAPABILITIES

    def discover(self) -> Topology:
        infos: dict[int, list[PoolInfo]] = {}
        for port, pools in self._carvers():
            with contextlib.suppress(FabricUnavailableError):  # its device failed before it was ever read
                infos[port] = [pool.info() for pool in pools()]
        return self._view.topology(self._client, self._links_down, infos)

    def _carvers(self) -> list[tuple[int, Callable[[], Sequence[Pool]]]]:
        """The port of each device carved through pools, and how to get the pools discovery reports of it."""
        carvers: list[tuple[int, Callable[[], Sequence[Pool]]]] = []
        if self._dcd is not None and self._view.dcd_port is not None:
            carvers.append((self._view.dcd_port, self._dcd.pools))
        if self._mld is not None and self._view.mld_port is not None:
            mld = self._mld
            carvers.append((self._view.mld_port, lambda: [mld]))
        return carvers

    def bindings(self) -> Sequence[Binding]:
        return [Binding(self._view.device_of[port], host) for host, _, port in self._view.bound(self._client)]

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self._state.fence(ctx.epoch)
        device, host = check_id(device, "device"), check_id(host, "host")
        port = self._view.port_of.get(device)
        if port is None:
            raise UnknownDeviceError(device)
        if port in self._view.carved_ports:
            raise DeviceBusyError(f"{device} is carved through its pool, never bound whole")
        vcs = self.check_host(host)
        with ctx.hold(self._op_lock, "the switch"):
            held = self._binding_of(device, host, port, ctx)
            if held is not None:
                return held
            vppb = self._view.free_vppb(self._client, vcs, ctx)
            if vppb is None:  # every vPPB held: only an unbind or a release frees one, not a retry
                raise CapacityExhaustedError(f"VCS {vcs} of {host} has no unbound vPPB left to bind {device}")
            try:
                self.bind_vppb(device, BindVPPBRequest(vcs, vppb, port), ctx)
            except CommandFailedError as exc:
                return self._refused(exc, device, host, port, ctx)
        return Binding(device, host)

    def _binding_of(self, device: str, host: str, port: int, ctx: CallContext) -> Binding | None:
        """The binding when the device is bound to ``host``, None when it is free; `DeviceBusyError` when it is
        bound to another host or failed."""
        for owner, _, bound_port in self._view.bound(self._client, ctx):
            if bound_port == port:
                if owner == host:
                    return Binding(device, host)
                raise DeviceBusyError(f"{device} is bound to {owner}")
        if self.port_view(port).health is not Health.OK:
            raise DeviceBusyError(f"{device} is failed")
        return None

    def _refused(self, exc: CommandFailedError, device: str, host: str, port: int, ctx: CallContext) -> Binding:
        """Bind vPPB refused: when it is Invalid Input, another fabric manager may have bound the device since the
        read, so the switch is read again and answers as a bind would now (`DeviceBusyError`)."""
        if exc.return_code == ReturnCode.INVALID_INPUT:
            held = self._binding_of(device, host, port, ctx)
            if held is not None:
                return held
        raise bind_error(exc, f"bind {device} to {host}")

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        self._state.fence(ctx.epoch)
        check_id(binding.device, "device")
        check_id(binding.host, "host")
        port = self._view.port_of.get(binding.device)
        vcs = self._view.vcs_of.get(binding.host)
        if port is None or vcs is None:
            return
        with ctx.hold(self._op_lock, "the switch"):
            held = self._settled(binding, vcs, port, ctx)
            failed = self.port_view(port).health is not Health.OK
            option = UnbindOption.SURPRISE_HOT_REMOVE if failed else UnbindOption.MANAGED_HOT_REMOVE
            for vppb in held:
                try:
                    self.unbind_vppb(UnbindVPPBRequest(vcs, vppb, option), ctx, port=port)
                except CommandFailedError as exc:
                    raise FabricUnavailableError(
                        f"unbind {binding.device} from {binding.host}: {exc.message}"
                    ) from None

    def _settled(self, binding: Binding, vcs: int, port: int, ctx: CallContext) -> list[int]:
        """The vPPBs of the host's VCS bound to the device's port, once no Bind or Unbind vPPB towards it runs.

        A bind whose deadline passed (outcome unknown) still runs on the switch, and the composer's rollback then
        unbinds: were that unbind to find nothing bound and succeed, the bind would land after it and leak. So it
        waits for the bind, no longer than the call's deadline or `BACKGROUND_TIMEOUT_S`; past that nothing has
        been sent, and `FabricUnavailableError` says to retry."""
        give_up = time.monotonic() + cci.BACKGROUND_TIMEOUT_S
        if ctx.deadline is not None:
            give_up = min(give_up, ctx.deadline)
        still_runs = FabricUnavailableError(
            f"unbind {binding.device} from {binding.host}: a Bind or Unbind vPPB of it still runs on the switch; "
            "retry once it is done"
        )
        seen_running = False
        while True:
            try:
                held, running = self._view.towards(self._client, vcs, port, ctx)
            except DeadlineExceededError:
                if seen_running:  # the deadline passed during a later read: nothing was sent, and one still ran
                    raise still_runs from None
                raise
            if not running:
                return held
            seen_running = True
            if time.monotonic() + cci.POLL_INTERVAL_S >= give_up:
                raise still_runs
            time.sleep(cci.POLL_INTERVAL_S)

    def pool(self, pool: str) -> Pool:
        found: Pool | None = self._mld if self._mld is not None and self._mld.id == pool else None
        if found is None and self._dcd is not None:
            found = self._dcd.find(pool)
        if found is None:
            raise NotFoundError("pool", pool)
        return found

    # ------------------------------------------------------------------ events

    def subscribe(self, handler: EventHandler) -> Subscription:
        sub = _Subscription(self, handler)
        with self._lock:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: _Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def _publish(self, events: Sequence[FabricEvent]) -> None:
        """Run the handlers on ``events``; only on the poller's thread, the one ordered path (calls queue theirs)."""
        with self._lock:
            handlers = [s.handler for s in self._subs]
            for event in events:
                if event.kind is FabricEventKind.DEVICE_HEALTH and event.health is not None:
                    self._told[event.subject] = event.health
        for event in events:
            for handler in handlers:
                try:
                    handler(event)
                except Exception:  # one subscriber's failure is no other's
                    log.exception("cxl-switch: an event handler failed on %s", event)

    def publish_soon(self, event: FabricEvent) -> None:
        """Have the poller's thread publish ``event`` before its next poll, so before the records that poll reads
        (even one the switch logged just before this call: within one poll interval the two sources are not
        ordered): a subscriber's handler is never run inside the driver call that caused it (a composer's reads
        the fabric again, which that call may still hold)."""
        with self._lock:
            self._queued.append(event)

    def _publish_queued(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
        if queued:
            self._publish(queued)

    def _on_record(self, record: EventRecord) -> None:
        """Publish what a record tells. The first record of a device after a read of the ports told its health
        (`_resync`) may be the change that read saw: when it tells the same health it is not published again, which
        leaves the health told last as it was (a later change has a record of its own)."""
        port = self._view.dcd_port if record.event_type is EventType.EXTENT_POISONED else record.port_id
        device = self._view.device_of.get(port) if port is not None else None
        if device is None:
            return
        read = self._read_told.pop(device, None)
        kind, health, what = {
            EventType.HOT_ADD: (FabricEventKind.DEVICE_ADDED, Health.OK, "hot-added"),
            EventType.SURPRISE_REMOVAL: (FabricEventKind.DEVICE_HEALTH, Health.FAILED, "surprise removal"),
            EventType.LINK_DOWN: (FabricEventKind.DEVICE_HEALTH, Health.FAILED, "link down"),
            EventType.LINK_UP: (FabricEventKind.DEVICE_HEALTH, Health.OK, "link up"),
            EventType.EXTENT_POISONED: (FabricEventKind.DEVICE_HEALTH, Health.DEGRADED, "extent poisoned"),
        }[record.event_type]
        if kind is FabricEventKind.DEVICE_ADDED and self.port_view(record.port_id).health is Health.OK:
            self._publish([FabricEvent(self._name, kind, device, None, what)])
            kind = FabricEventKind.DEVICE_HEALTH
        if kind is FabricEventKind.DEVICE_HEALTH and health is read:
            log.debug("cxl-switch: record %d (%s) of %s was told by the ports' read", record.sequence, what, device)
            return
        self._publish([FabricEvent(self._name, kind, device, health, f"port {record.port_id}: {what}")])

    def _restarted(self) -> None:
        """The switch may have restarted (the poller reached it anew): RESYNC_REQUIRED, since the restart lost its
        bindings and allocations and no record tells of them. The poller sends it before the records it read then
        and the health its resync reads (a port up again), which must not stand a lost composition as whole."""
        why = "the switch was reached anew and may have restarted, losing its bindings and allocations"
        self._read_told.clear()  # a restarted switch's records are none of those the last read saw
        self._publish([FabricEvent(self._name, FabricEventKind.RESYNC_REQUIRED, self._view.switch_id, None, why)])

    def _resync(self) -> None:
        """After the event log dropped records unread: each device's health read from its port, published where it
        differs from what was last published (or nothing was), so that subscribers converge on the switch. A
        device last published DEGRADED (a poisoned extent) whose port is up stays so: its port cannot show it."""
        ports = self._view.read_ports(self._client)
        with self._lock:
            told = dict(self._told)
        events = []
        for port, view in sorted(ports.items()):
            device, health = self._view.device_of[port], view.health
            before = told.get(device)
            if before is health or (before is Health.DEGRADED and health is Health.OK):
                continue
            why = f"port {port}: {health.value}, read after the event log dropped records"
            events.append(FabricEvent(self._name, FabricEventKind.DEVICE_HEALTH, device, health, why))
            self._read_told[device] = health
        self._publish(events)

    # ------------------------------------------------------------------ FaultInjection

    def _port(self, device: str) -> int:
        port = self._view.port_of.get(device)
        if port is None:
            raise UnknownDeviceError(device)
        return port

    def fail_device(self, device: str, message: str = "") -> None:
        """Inject Link Down on the device's port; the event log reports it, and the poller the failure."""
        port = self._port(device)
        if self.port_view(port).health is Health.OK:
            self._client.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(port))

    def repair_device(self, device: str) -> None:
        """Reset the port's PPB (link up), or plug the device back in if it was pulled (Inject Hot-Add).
        `UnsupportedError` for a pulled MLD or DCD: the emulator can hot-add only PCIe endpoints, and another
        kind in the port of a pool's device is no repair."""
        port = self._port(device)
        view = self.port_view(port)
        if not view.present:
            kind = _HOT_ADD_KIND.get(self._view.kind_of[port])
            if kind is None:
                raise UnsupportedError(
                    f"{device} was pulled and the emulator cannot hot-add a {self._view.kind_of[port].value} "
                    "device; restart the emulator to have it back"
                )
            self._client.call(VendorOpcode.INJECT_HOT_ADD, InjectHotAddRequest(port, kind))
        elif view.health is not Health.OK:
            self._client.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(port, PortOpcode.RESET_PPB))

    def set_link(self, a: str, b: str, up: bool) -> None:
        """A host's link to the switch is taken out of service in the driver: the emulator has no USP fault. Its
        LINK_DOWN or LINK_UP is published by the poller's thread, as `publish_soon` does."""
        host = a if b == self._view.switch_id else b if a == self._view.switch_id else None
        if host is None or host not in self._view.vcs_of:
            raise NotFoundError("link", f"{a}|{b}")
        kind = FabricEventKind.LINK_UP if up else FabricEventKind.LINK_DOWN
        with self._lock:  # queued as it changes: two calls at once are told in the order the link changed
            if (host in self._links_down) == up:
                (self._links_down.discard if up else self._links_down.add)(host)
                self._queued.append(FabricEvent(self._name, kind, f"{a}|{b}"))

    def flaky_bind(self, device: str | None, failures: int) -> None:
        """Arm Inject Bind Failure before each of the next ``failures`` binds (of ``device``, or of any)."""
        with self._lock:
            self._flaky[device] = failures

    def _take_flaky(self, device: str) -> bool:
        with self._lock:
            for key in (device, None):
                if self._flaky.get(key, 0) > 0:
                    self._flaky[key] -= 1
                    return True
        return False

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Stop the poller, once it has published the events calls queued (a link's last change: `EventPoller.stop`);
        stop an emulator this driver runs if asked to, or if the switch is read to hold nothing. A switch that
        cannot be read (a pool's device failed, the emulator not answering) may hold bindings or carved memory,
        which stopping it would lose: it is left running, and the log says why."""
        if self._closed:
            return
        self._closed = True
        self._poller.stop()
        state_dir = self._opts.state_dir
        if self._started and state_dir is not None and (self._opts.stop_emulator == "always" or self._idle()):
            self._client.close()
            process.stop(state_dir)
        self._client.close()
        self._let_go()

    def _idle(self) -> bool:
        """Whether the switch is read to hold no binding and no allocation; False when it cannot be read."""
        try:
            carving: list[Pool] = [] if self._mld is None else [self._mld]
            carving += [] if self._dcd is None else self._dcd.every_pool()
            return not self.bindings() and not any(p.allocations() for p in carving)
        except DisaggError as exc:
            log.warning(
                "cxl-switch %s: the emulator in %s is left running: whether it holds bindings or allocations "
                "cannot be read (%s); stop_emulator = 'always' stops it regardless",
                self._name,
                self._opts.state_dir,
                exc.message,
            )
            return False
