"""`RemoteFabric`: a ``disagg.driver.v1.FabricDriverService`` endpoint seen through the `Fabric` interface.

The composer cannot tell it from an in-process driver:

- each call's gRPC timeout is ``ctx.remaining()`` (or the default call timeout), and it carries the
  context's epoch and request id; a call whose deadline passed already is sent all the same, saying so, for the
  driver to refuse (`disagg.wire.driver.DEADLINE_PASSED_KEY`), as it refuses one in process;
- each call names the fabric meant (`disagg.wire.driver.FABRIC_KEY`), and a call on a channel that lost its
  connection since the endpoint last said which fabric it serves asks it first: a driver of another fabric
  restarted at the address is refused as unavailable, whether it checks the name or not;
- a failed call raises the SDK error the driver raised, rebuilt from the status details
  (`disagg.wire.errors.from_rpc_error`); an endpoint that cannot be reached is `FabricUnavailableError`,
  and a driver that failed unexpectedly (INTERNAL) is a `DriverError`, as the composer reports an unexpected
  exception of an in-process driver;
- `subscribe` delivers events in order from one watcher thread (`disagg.remote.watch`), which reconnects
  when the stream breaks (or its headers do not come within the call timeout) and reports what changed
  meanwhile; while no stream is open, `events_heard` is False and the composer discovers the fabric's health;
- a fault injected through it returns once its events have been handled, when the driver numbers its
  events (see `disagg.wire.driver`), as the simulator delivers them before it returns.

`discover` answers from a cache while a watch stream is open, for at most `DISCOVER_TTL_S`; every event,
injected fault and reconnection empties it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

import attrs
import grpc

from disagg.config import MAX_CALL_TIMEOUT_S
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.driver.v1 import fabric_driver_pb2_grpc as pb_grpc
from disagg.errors import (
    OUTCOME,
    OUTCOME_UNKNOWN,
    CapacityExhaustedError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    DeviceBusyError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    HostUnreachableError,
    InvalidRequestError,
    NotFoundError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
    UnsupportedError,
)
from disagg.interfaces import CallContext, Device, EventHandler, Fabric, FaultInjection, Pool, Subscription
from disagg.interfaces.context import epoch_announcement
from disagg.model import (
    Allocation,
    Binding,
    Capabilities,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    PoolInfo,
    Topology,
)
from disagg.model import Device as DeviceInfo
from disagg.remote.watch import EventCall, EventWatcher
from disagg.wire import driver as wire
from disagg.wire.deadlines import remaining_of
from disagg.wire.errors import build, from_rpc_error, server_status
from disagg.wire.types import binding_from_wire, capabilities_from_wire, topology_from_wire

log = logging.getLogger("disagg.remote")

DRIVER_ERRORS: frozenset[type[DisaggError]] = frozenset(
    {
        DisaggError,
        DriverError,
        UnknownDeviceError,
        UnknownHostError,
        NotFoundError,
        DeviceBusyError,
        HostUnreachableError,
        StaleEpochError,
        CapacityExhaustedError,
        ConflictError,
        InvalidRequestError,
        UnsupportedError,
        FabricUnavailableError,
        DeadlineExceededError,
    }
)
"""The errors a driver raises (docs/driver-interface.md), as the driver service sends them; an unknown reason comes
back as the class of its code, among these, or as `DisaggError`."""

DEFAULT_CALL_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_EVENT_HEARTBEAT_S = 5.0
"""How often the event stream asks the driver for a heartbeat while no event comes (`watch.HEARTBEATS_MISSED`)."""
DISCOVER_TTL_S = 1.0
FAULT_EVENTS_WAIT_S = 5.0
"""The longest a fault injection waits for its events to be handled."""
PASSED_DEADLINE_TIMEOUT_S = 5.0
"""The gRPC timeout of a call whose deadline passed before it was sent: the driver only has to refuse it."""
NOT_CONNECTED = "failed to connect to all addresses"
"""How gRPC's status message begins when it failed a call without sending it: the channel could not connect
(TRANSIENT_FAILURE), and a call that does not wait for ready fails at once, never transmitted (gRPC's
``doc/wait-for-ready.md``; the message is that of its pick_first policy's failing picker)."""
MAX_MESSAGE_BYTES = 1 << 30
"""Discover answers the whole fabric in one message: tens of MB at 100,000 devices."""
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

_READY = grpc.ChannelConnectivity.READY.value[0]
"""gRPC core's number of the READY state, which grpcio's Cython channel answers."""

T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


LinkKey = tuple[str, str]


_UNTOLD = threading.Event()
"""Set once the log has said that this grpcio does not tell a channel's state (`connected`)."""


def connected(channel: grpc.Channel) -> bool:
    """Whether ``channel`` has a connection now (READY), without trying to make one; False when grpcio cannot
    tell. grpcio's public API tells the state only to a subscription, whose polling thread (one per channel)
    raises when the channel is closed under it (grpc/grpc#18995); the Cython channel it wraps answers at once."""
    check = getattr(getattr(channel, "_channel", None), "check_connectivity_state", None)
    if check is None:
        if not _UNTOLD.is_set():
            _UNTOLD.set()
            log.warning(
                "this grpcio does not tell a channel's state: every call to a remote driver asks first which "
                "fabric it serves (one more round trip a call)"
            )
        return False
    try:
        return bool(check(False) == _READY)
    except ValueError:  # the channel was closed
        return False


def _link_key(a: str, b: str) -> LinkKey:
    """A link's ends as an unordered pair: a driver may name them in an event in the other order than discovery
    does (cxl-switch names them as its caller did)."""
    return (a, b) if a <= b else (b, a)


@attrs.frozen
class _Snapshot:
    """What the handlers have been told of the fabric: to report what changed while the watcher was
    disconnected, and to drop an event that tells them nothing new.

    An event published between a reconnected stream's registration and the answer to the resync's discovery
    (the resync's window) may be in both the resync's differences and the stream. A health or link event is a
    state: its copy changes nothing told and is dropped. A device added or removed is not (cxl-switch adds again
    a surprise-removed device it still lists), so its copy is recognised by the driver's event numbers: the
    resync `reported` the change, and the stream's event of it is numbered within the `window`, at or below the
    driver's count of events published once the discovery was answered. A copy is always in the window (it was
    published before the discovery saw its change, after the stream registered), so none is delivered twice; an
    event numbered past the window is always delivered, and the first one empties `reported`, so a change the
    resync reported that the stream never carries (made while disconnected) swallows no later event.
    """

    health: dict[str, Health]
    links: dict[LinkKey, tuple[str, bool]]
    """A link's ends (`_link_key`) to its subject as first learnt (``a|b``) and whether it is up."""
    reported: set[tuple[FabricEventKind, str]] = attrs.field(factory=set)
    """The devices added or removed (kind, id) that the resync reported from this discovery and whose copy the
    stream may still bring, within the `window`."""
    window: tuple[str, int] | None = None
    """The driver's instance and count of events published once the resync's discovery was answered (sent with
    the Discover answer, else read from a watch stream's initial metadata, `RemoteFabric._published`); None
    when not known: then no event is taken for a copy."""

    @classmethod
    def of(cls, topology: Topology) -> _Snapshot:
        return cls(
            {d.id: d.health for d in topology.devices},
            {_link_key(link.a, link.b): (f"{link.a}|{link.b}", link.up) for link in topology.links},
        )

    def _link(self, subject: str) -> LinkKey:
        """The key of the link ``subject`` (``a|b``) names: an id may hold a ``|``, so the split that names a
        known link wins, else the first."""
        keys = [_link_key(subject[:i], subject[i + 1 :]) for i, c in enumerate(subject) if c == "|"]
        return next((key for key in keys if key in self.links), keys[0] if keys else (subject, subject))

    def in_window(self, number: tuple[str, int] | None) -> bool:
        """Whether the stream event numbered ``number`` was published before the resync's discovery answered."""
        window = self.window
        return window is not None and number is not None and number[0] == window[0] and number[1] <= window[1]

    def apply(self, event: FabricEvent, number: tuple[str, int] | None = None) -> bool:
        """Take in ``event``, numbered ``number`` by the driver; whether it changed what the handlers were told.
        A device added or removed always does (a driver may add again a device it still lists, as cxl-switch
        does one surprise-removed), except the stream's copy of one the resync `reported`, within the `window`
        only; a link not known yet is learnt."""
        if self.reported and not self.in_window(number):
            self.reported.clear()  # past the window: no copy can come any more
        if event.kind is FabricEventKind.DEVICE_HEALTH and event.health is not None:
            changed = self.health.get(event.subject) is not event.health
            self.health[event.subject] = event.health
            return changed
        if event.kind in (FabricEventKind.LINK_DOWN, FabricEventKind.LINK_UP):
            key = self._link(event.subject)
            up = event.kind is FabricEventKind.LINK_UP
            known = self.links.get(key)
            self.links[key] = (known[0] if known is not None else event.subject, up)
            return known is None or known[1] is not up
        if event.kind in (FabricEventKind.DEVICE_ADDED, FabricEventKind.DEVICE_REMOVED):
            added = event.kind is FabricEventKind.DEVICE_ADDED
            if (event.kind, event.subject) in self.reported:
                self.reported.discard((event.kind, event.subject))  # its copy comes once
                return False
            # A copy still awaited of the opposite change would have come before this one: there is none.
            other = FabricEventKind.DEVICE_REMOVED if added else FabricEventKind.DEVICE_ADDED
            self.reported.discard((other, event.subject))
            if added:
                self.health.setdefault(event.subject, Health.OK)  # a health event follows one added unhealthy
            else:
                self.health.pop(event.subject, None)
        return True

    def changes(self, fabric: str, now: _Snapshot, why: str) -> list[FabricEvent]:
        """Events that take this snapshot to ``now``: removed and added devices, health, then links, those that
        are gone (re-cabled while the driver was down, a host unplugged) as down."""
        out = [
            FabricEvent(fabric, FabricEventKind.DEVICE_REMOVED, d, message=why)
            for d in self.health
            if d not in now.health
        ]
        for device, health in now.health.items():
            old = self.health.get(device)
            if old is None:
                out.append(FabricEvent(fabric, FabricEventKind.DEVICE_ADDED, device, message=why))
                if health is not Health.OK:
                    out.append(FabricEvent(fabric, FabricEventKind.DEVICE_HEALTH, device, health=health, message=why))
            elif old is not health:
                out.append(FabricEvent(fabric, FabricEventKind.DEVICE_HEALTH, device, health=health, message=why))
        added = {e.subject for e in out if e.kind is FabricEventKind.DEVICE_ADDED}
        for key, (subject, up) in now.links.items():
            known = self.links.get(key)
            if known is None:  # new: up unless it came with a device added, whose event tells it
                if up and not added.intersection(key):
                    out.append(FabricEvent(fabric, FabricEventKind.LINK_UP, subject, message=why))
            elif known[1] is not up:
                kind = FabricEventKind.LINK_UP if up else FabricEventKind.LINK_DOWN
                out.append(FabricEvent(fabric, kind, subject, message=why))
        for key, (subject, up) in self.links.items():
            if key not in now.links and up:  # gone (re-cabled, a host unplugged): no path passes it any more
                out.append(FabricEvent(fabric, FabricEventKind.LINK_DOWN, subject, message=why))
        return out


class _Subscription(Subscription):
    def __init__(self, fabric: RemoteFabric, handler: EventHandler) -> None:
        self.fabric = fabric
        self.handler = handler

    def cancel(self) -> None:
        self.fabric._unsubscribe(self)


def _seconds(name: str, option: str, value: object) -> float:
    """A timeout of at most a day, as ``[composer] call_timeout_s``: gRPC fails at once a call whose timeout it
    cannot carry (1e10 s and more, infinity: a driver refusing the connection was said to have had "1e+300s"
    to answer), and the fabric waits on threading primitives, which overflow beyond `threading.TIMEOUT_MAX`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_CALL_TIMEOUT_S
    ):
        raise ConfigError(
            f"fabric {name!r} (driver remote): option {option!r}: must be a number of seconds above 0 and at most "
            f"{MAX_CALL_TIMEOUT_S:.0f} (a day), not {value!r}",
            field=option,
        )
    return float(value)


class RemoteFabric(Fabric, FaultInjection):
    """The fabric served at ``address`` (``unix:PATH`` or ``127.0.0.1:PORT``), configured as ``name``.

    The constructor waits up to ``connect_timeout_s`` for the endpoint (`FabricUnavailableError` naming the
    address if none answers), then reads the served fabric's name and capabilities; a served fabric of
    another name is a `ConfigError` naming both. With ``lazy``, an endpoint that does not answer yet is not an
    error: the fabric is made unconnected, its `capabilities` and `discover` raise `FabricUnavailableError`
    until the driver answers (then the name is checked), and the fabric manager serves the other fabrics
    meanwhile, counting this one unreachable, as it does an in-process driver that does not answer.
    """

    def __init__(
        self,
        name: str,
        address: str,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        event_heartbeat_s: float = DEFAULT_EVENT_HEARTBEAT_S,
        lazy: bool = False,
    ) -> None:
        self._name = name
        self.address = address
        self.call_timeout_s = _seconds(name, "call_timeout_s", call_timeout_s)
        self.connect_timeout_s = _seconds(name, "connect_timeout_s", connect_timeout_s)
        if not wire.heartbeat_valid(event_heartbeat_s):
            raise ConfigError(
                f"fabric {name!r} (driver remote): option 'event_heartbeat_s': must be 0 (ask the driver for no "
                f"heartbeats) or a number of seconds from {wire.MIN_HEARTBEAT_MS / 1000:g} to "
                f"{wire.MAX_HEARTBEAT_MS // 1000}, not {event_heartbeat_s!r}",
                field="event_heartbeat_s",
            )
        self.event_heartbeat_s = event_heartbeat_s
        """The heartbeat interval asked of the driver's event stream (0: none); see `DEFAULT_EVENT_HEARTBEAT_S`."""
        self._lock = threading.Lock()
        self._closed = False
        self._handlers: list[_Subscription] = []
        self._watcher: EventWatcher | None = None
        self._snapshot: _Snapshot | None = None
        self._discovered: _Snapshot | None = None
        """The last `discover` answered before the first resync began: what the caller knows before any event."""
        self._resyncing = False
        """A resync has taken what it compares with: `discover` must not change that any more."""
        self._generation = 0
        self._cache: tuple[float, Topology, dict[str, DeviceInfo]] | None = None
        self._pools: dict[str, PoolInfo] = {}
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.FabricDriverServiceStub(self._channel)
        self.driver = ""
        """The fabric type the endpoint serves (its `disagg driver serve DRIVER`), as it reports it."""
        self._capabilities: Capabilities | None = None
        self._disconnections = 0
        """How many times a call found the channel without a connection (`_lost_connection`)."""
        self._checked_at: int | None = None
        """`_disconnections` when the endpoint last answered which fabric it serves (`_served_here`)."""
        self._epoch = 0
        """The highest epoch of a mutating call made through this fabric, told again on reconnecting (`_resync`)."""
        self._metadata = ((wire.FABRIC_KEY, wire.fabric_to_metadata(name)),)
        self._late_calls = False
        """Whether the endpoint judges a call whose deadline passed (`wire.LATE_CALLS_KEY`); else it is refused
        here, before it is sent."""
        try:
            self._accept(self._connect(self.connect_timeout_s), 0)
        except FabricUnavailableError as exc:
            if not lazy:
                self._channel.close()
                raise
            log.warning("%s; the fabric is unreachable until it answers", exc.message)
        except BaseException:
            self._channel.close()
            raise

    def _lost_connection(self) -> None:
        """Count a loss of the channel's connection: the next connection may reach another process, which
        `_served_here` asks which fabric it serves before the next call."""
        with self._lock:
            self._disconnections += 1

    def _reconnecting(self) -> None:
        """Before a call: a channel without a connection makes a new one for it, maybe to another process (a
        driver restarted for another fabric at the address), so count a loss. Every call does this before it
        starts (the watcher's streams too), so a connection made for any of them counts."""
        if not connected(self._channel):
            self._lost_connection()

    def _accept(self, answer: pb.GetCapabilitiesResponse, disconnections: int) -> Capabilities:
        """Take the endpoint's answer to GetCapabilities, asked when the channel had lost its connection
        ``disconnections`` times: its fabric must be this one. The first answer of another is a mistake of the
        configuration (`ConfigError`); a later one is another driver restarted at the address, refused as
        unavailable, every call with it."""
        if answer.fabric != self._name and self._capabilities is not None:
            raise self._another_fabric(answer.fabric)
        if answer.fabric != self._name:
            raise ConfigError(
                f"fabric {self._name!r} (driver remote): the driver at {self.address} serves fabric "
                f"{answer.fabric!r}, not {self._name!r}; name the fabric {answer.fabric!r} in the configuration or "
                f"serve it as {self._name!r}",
                field="name",
            )
        capabilities = self._read(lambda: capabilities_from_wire(answer.capabilities), "capabilities")
        with self._lock:
            self.driver = answer.driver
            self._capabilities = capabilities
            self._checked_at = disconnections
        return capabilities

    def _another_fabric(self, served: str) -> FabricUnavailableError:
        return FabricUnavailableError(
            f"fabric {self._name!r}: the driver at {self.address} now serves fabric {served!r}; "
            "give each fabric's driver its own address"
        )

    def _served_here(self, timeout: float) -> Capabilities:
        """The capabilities, once the endpoint answered that it serves this fabric since the channel last lost
        its connection: a fabric made unconnected (``lazy``) waits a little for its first answer, a connection
        lost since the last answer (the driver may have been restarted for another fabric at the address) asks
        again within ``timeout``. Whatever fails here, the call it precedes was not sent: the error says nothing
        of an unknown outcome."""
        self._reconnecting()
        with self._lock:
            capabilities, disconnections = self._capabilities, self._disconnections
            if capabilities is not None and self._checked_at == disconnections:
                return capabilities
        try:
            if capabilities is None:
                answer = self._connect(min(self.connect_timeout_s, self.call_timeout_s, 1.0))
            else:
                answer = self._connect(timeout, wait_for_ready=False)
        except DisaggError as exc:
            exc.metadata.pop(OUTCOME, None)
            raise
        except ValueError:  # grpcio's answer on a closed channel
            if self._closed:
                raise self._closed_error() from None
            raise
        return self._accept(answer, disconnections)

    def _connect(self, wait_s: float, *, wait_for_ready: bool = True) -> pb.GetCapabilitiesResponse:
        """Ask for the capabilities, waiting up to ``wait_s`` for the endpoint to be there (or, without
        ``wait_for_ready``, failing at once when it cannot be reached)."""
        try:
            answer, call = self._stub.GetCapabilities.with_call(
                pb.GetCapabilitiesRequest(), timeout=wait_s, wait_for_ready=wait_for_ready
            )
            late = wire.metadata_value(call.trailing_metadata(), wire.LATE_CALLS_KEY) == wire.LATE_CALLS_JUDGED
            with self._lock:
                self._late_calls = late
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code is grpc.StatusCode.UNIMPLEMENTED:
                raise ConfigError(
                    f"fabric {self._name!r} (driver remote): {self.address} does not serve "
                    "disagg.driver.v1.FabricDriverService (a fabric manager's address?); give the address where "
                    "`disagg driver serve` listens",
                    field="address",
                ) from None
            if code is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._error(exc) from None
            raise FabricUnavailableError(
                f"fabric {self._name!r} (driver remote): no driver answered at {self.address} within "
                f"{wait_s:g}s; is `disagg driver serve ... --listen {self.address}` running there?"
            ) from None
        return answer

    def __repr__(self) -> str:
        return f"RemoteFabric({self._name!r}, {self.address!r})"

    # -- Fabric ----------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    def capabilities(self) -> Capabilities:
        return self._served_here(self.call_timeout_s)

    @property
    def events_heard(self) -> bool:
        """Whether a watch stream is open (`subscribe`): while none is (not yet opened, broken, refused, its
        headers never came, or silent after one given up for its driver's missed heartbeats), the driver's events
        reach no handler, whatever it declares, and the composer discovers the fabric's health on each pass
        instead, and every few seconds on a serving fabric manager's timer (`FabricComposer.poll_unheard`)."""
        with self._lock:
            watcher = self._watcher
        return watcher is not None and watcher.connected

    def discover(self) -> Topology:
        topology = self._discover()[0]
        # No stream has told anything yet: its first resync starts from this, unless it already took what it
        # compares with (this answer may be newer than the resync's discovery: the change would go backwards).
        if self._snapshot is None and not self._resyncing:
            known = _Snapshot.of(topology)
            with self._lock:
                if self._snapshot is None and not self._resyncing:
                    self._discovered = known
        return topology

    def bindings(self) -> Sequence[Binding]:
        answer = self._call(self._stub.ListBindings, pb.ListBindingsRequest(), None)
        return self._read(lambda: wire.bindings_from_wire(answer.bindings), "bindings")

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        answer = self._call(self._stub.Bind, wire.bind_request_to_wire(device, host, ctx), ctx)
        asked = Binding(device, host)
        if not answer.HasField("binding"):
            return asked
        binding = binding_from_wire(answer.binding)
        if binding != asked:
            raise self._not_asked("a bind", f"{binding.device!r} to {binding.host!r}", f"{device!r} to {host!r}")
        return binding

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        self._call(self._stub.Unbind, wire.unbind_request_to_wire(binding, ctx), ctx)

    def device(self, device: str) -> RemoteDevice:
        self._device_info(device)
        return RemoteDevice(self, device)

    def pool(self, pool: str) -> RemotePool:
        """A pool as last discovered (pools seldom change; the driver refuses calls on one that is gone). One that
        discovery does not list is handed out too, for the driver to judge each call: a driver may leave out of
        discovery a pool it still has (its device failed before it gave its geometry), and a release answered
        "not found" here, not by the driver, would count memory still carved as released."""
        info = self._pools.get(pool)
        if info is None:
            self._invalidate()
            info = next((p for p in self.discover().pools if p.id == pool), None)
        return RemotePool(self, info, pool)

    def subscribe(self, handler: EventHandler) -> Subscription:
        """Deliver events to ``handler`` from the watcher thread; waits (up to the connect timeout) until the
        stream is open, so that every change after this returns is reported. A fabric that has never answered
        does not wait: the constructor already waited the connect timeout for it, and start-up must not pay it
        twice. What changes before its stream opens is reported by the stream's first resync, as the
        differences from the last `discover` answered before it (the composer's view of the fabric)."""
        if not callable(handler):
            raise TypeError("an event handler must be callable")
        subscription = _Subscription(self, handler)
        with self._lock:
            if self._closed:
                raise FabricUnavailableError(f"fabric {self._name!r} (driver remote) is closed")
            self._handlers.append(subscription)
            if self._watcher is None:
                self._watcher = EventWatcher(
                    self._name,
                    self._open_stream,
                    self._resync,
                    self._deliver,
                    address=self.address,
                    headers_within_s=self.call_timeout_s,
                    heartbeat_s=self.event_heartbeat_s,
                )
            watcher = self._watcher
        never_answered = self._capabilities is None
        if never_answered or watcher.on_watcher_thread():
            return subscription
        if not watcher.wait_connected(self.connect_timeout_s):
            log.warning(
                "fabric %s: no event stream from %s yet; events are delivered once it connects",
                self._name,
                self.address,
            )
        return subscription

    def close(self) -> None:
        """Stop the watcher thread and close the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watcher, self._watcher = self._watcher, None
            self._handlers.clear()
        if watcher is not None:
            watcher.stop()
        self._channel.close()

    # -- FaultInjection ----------------------------------------------------------------------------------------

    def fail_device(self, device: str, message: str = "") -> None:
        self._inject(wire.Fault(wire.FaultKind.FAIL_DEVICE, device, message=message))

    def repair_device(self, device: str) -> None:
        self._inject(wire.Fault(wire.FaultKind.REPAIR_DEVICE, device))

    def set_link(self, a: str, b: str, up: bool) -> None:
        self._inject(wire.Fault(wire.FaultKind.LINK_UP if up else wire.FaultKind.LINK_DOWN, a, b))

    def flaky_bind(self, device: str | None, failures: int) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise InvalidRequestError("failures must be an integer >= 0", field="failures")
        if failures > wire.MAX_FAULT_COUNT:  # the service refuses more, and the field holds 32 bits only
            raise InvalidRequestError(f"failures: at most {wire.MAX_FAULT_COUNT}", field="failures")
        if device is not None and (not isinstance(device, str) or not device):  # the wire's "" is any device
            raise InvalidRequestError(f"device must be a non-empty string or None, not {device!r}", field="device")
        self._inject(wire.Fault(wire.FaultKind.FLAKY_BIND, device or "", count=failures))

    def _inject(self, fault: wire.Fault) -> None:
        """Inject ``fault``; then wait until the events it caused are handled, if the driver numbers them."""
        request = wire.fault_to_wire(fault)
        self._served_here(self.call_timeout_s)
        try:
            _, call = self._stub.InjectFault.with_call(request, timeout=self.call_timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except ValueError:  # the channel was closed
            raise self._closed_error() from None
        finally:
            self._invalidate()
        sequence = wire.event_sequence(wire.metadata_value(call.trailing_metadata(), wire.EVENT_SEQUENCE_KEY))
        with self._lock:
            watcher = self._watcher
        if sequence is not None and watcher is not None and not watcher.on_watcher_thread():
            watcher.wait_for(*sequence, timeout=min(self.call_timeout_s, FAULT_EVENTS_WAIT_S))

    # -- internals ---------------------------------------------------------------------------------------------

    def _timeout(self, ctx: CallContext | None) -> tuple[float, float | None]:
        """The gRPC timeout of a call with ``ctx``, and how long ago its deadline passed (None if it has not):
        the default call timeout without a deadline (or with one that never comes, `remaining_of`)."""
        remaining = remaining_of(ctx.deadline) if ctx is not None else None
        if remaining is None:
            return self.call_timeout_s, None
        if remaining <= 0:
            return min(self.call_timeout_s, PASSED_DEADLINE_TIMEOUT_S), -remaining
        return remaining, None

    def _call(self, method: grpc.UnaryUnaryMultiCallable[Req, Resp], request: Req, ctx: CallContext | None) -> Resp:
        """Make the call on an endpoint that serves this fabric (`_served_here`), within ``ctx``'s deadline; one
        that passed is sent for the driver to refuse (`wire.DEADLINE_PASSED_KEY`)."""
        self._served_here(self._timeout(ctx)[0])
        if ctx is not None and ctx.epoch > self._epoch:
            with self._lock:
                self._epoch = max(self._epoch, ctx.epoch)
        timeout, passed = self._timeout(ctx)  # again: the check may have taken a round trip of the time left
        metadata: tuple[tuple[str, str], ...] = self._metadata
        if passed is not None:
            if not self._late_calls:  # it would take the short timeout for the deadline, and carry the call out
                raise DeadlineExceededError(f"fabric {self._name}: the call's deadline passed before it was sent")
            metadata = (*metadata, (wire.DEADLINE_PASSED_KEY, wire.deadline_passed_to_metadata(passed)))
        with self._answered():
            answer = method(request, timeout=timeout, metadata=metadata)
        return answer

    @contextlib.contextmanager
    def _answered(self) -> Iterator[None]:
        """A call's failure as the SDK error the driver raised (`_error`), or the fabric closed."""
        try:
            yield
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except ValueError:  # grpcio's answer on a closed channel
            if self._closed:
                raise self._closed_error() from None
            raise

    def _closed_error(self) -> FabricUnavailableError:
        return FabricUnavailableError(f"fabric {self._name!r} (driver remote at {self.address}) is closed")

    def _error(self, exc: grpc.RpcError) -> DisaggError:
        """The SDK error for a failed call, as the driver raised it; a failure of the transport, or a crash of
        a driver that sent no SDK error, names the endpoint. An error no driver raises (the fabric manager's own:
        a lead lost, a request id reused, no fit; `DRIVER_ERRORS`) is the driver's bug, in doubt as one that
        crashed: rebuilt as itself, it would tell the composer's caller that the fabric manager lost its lead or
        refused its request."""
        error = from_rpc_error(exc)
        if not isinstance(exc, grpc.Call) or server_status(exc) is not None:
            if type(error) in DRIVER_ERRORS:
                return error
            return DriverError(
                f"fabric {self._name!r}: the driver at {self.address} failed with {error.reason} ({error.message}), "
                "an error no driver raises (docs/driver-interface.md, Errors a driver raises)",
                metadata={OUTCOME: OUTCOME_UNKNOWN},
            )
        code = exc.code()
        if code is grpc.StatusCode.UNAVAILABLE:
            self._lost_connection()  # the channel may not know yet
            if error.message.startswith(NOT_CONNECTED):  # never sent: an answer, nothing changed
                return build(type(error), f"fabric {self._name!r} (driver remote at {self.address}): {error.message}")
        if code is grpc.StatusCode.CANCELLED:  # not by this client: the driver's server stopped during the call
            error = build(FabricUnavailableError, f"the driver's server cancelled the call ({error.message})")
        unknown = {OUTCOME: OUTCOME_UNKNOWN}  # no answer from the driver: the call may have happened
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            return DriverError(
                f"fabric {self._name!r}: the driver at {self.address} failed unexpectedly "
                f"({code.name}: {error.message})",
                metadata=unknown,
            )
        return build(
            type(error), f"fabric {self._name!r} (driver remote at {self.address}): {error.message}", metadata=unknown
        )

    def _not_asked(self, call: str, answered: str, asked: str) -> DriverError:
        """A driver's answer that is not what the call asked for (another binding, another allocation, an empty
        message): the call may have changed the hardware, and the caller would record what it does not hold, so
        its outcome is unknown and the composer undoes what it asked for."""
        return DriverError(
            f"fabric {self._name!r}: the driver at {self.address} answered {call} of {asked} with {answered}",
            metadata={OUTCOME: OUTCOME_UNKNOWN},
        )

    def _read(self, convert: Callable[[], T], what: str) -> T:
        """Convert an answer; a malformed one is the driver's fault, reported as the fabric unavailable."""
        try:
            return convert()
        except InvalidRequestError as exc:
            raise FabricUnavailableError(
                f"fabric {self._name!r}: the driver at {self.address} sent malformed {what}: {exc.message}"
            ) from None

    def _invalidate(self) -> None:
        with self._lock:
            self._generation += 1
            self._cache = None

    def _discover(self) -> tuple[Topology, dict[str, DeviceInfo], tuple[str, int] | None]:
        """The topology, its devices by id, and the driver's instance and count of events published once it
        answered (`_Snapshot.window`): None from the cache, or from a driver that does not send it."""
        with self._lock:
            cache = self._cache
            generation = self._generation
            caching = self._watcher is not None and self._watcher.connected
        self._served_here(self.call_timeout_s)
        if cache is not None and caching and time.monotonic() < cache[0]:
            return cache[1], cache[2], None
        with self._answered():
            answer, call = self._stub.Discover.with_call(
                pb.DiscoverRequest(), timeout=self.call_timeout_s, metadata=self._metadata
            )
        published = wire.event_sequence(wire.metadata_value(call.trailing_metadata(), wire.EVENT_SEQUENCE_KEY))
        topology = self._read(lambda: wire.check_topology(topology_from_wire(answer.topology)), "topology")
        if topology.fabric != self._name:  # another driver answers at the address now (a swapped unit or socket)
            raise self._another_fabric(topology.fabric)
        index = {d.id: d for d in topology.devices}
        with self._lock:
            self._pools = {p.id: p for p in topology.pools}
            if self._generation == generation:
                self._cache = (time.monotonic() + DISCOVER_TTL_S, topology, index)
        return topology, index, published

    def _device_info(self, device: str) -> DeviceInfo:
        info = self._discover()[1].get(device)
        if info is None:
            raise UnknownDeviceError(device, f"fabric {self._name!r} has no device {device!r}")
        return info

    # -- events ------------------------------------------------------------------------------------------------

    def _unsubscribe(self, subscription: _Subscription) -> None:
        with self._lock:
            if subscription in self._handlers:
                self._handlers.remove(subscription)

    def _open_stream(self) -> EventCall:
        # grpcio's streaming call is also a `grpc.Future` (``done``), which its type stubs do not say.
        self._reconnecting()  # the resync that follows asks which fabric is served, if this connects anew
        request = pb.WatchFabricEventsRequest(heartbeat_ms=round(self.event_heartbeat_s * 1000))
        return cast(EventCall, self._stub.WatchFabricEvents(request, metadata=self._metadata))

    def _resync(self, first: bool) -> None:
        """After (re)connecting: rediscover; tell the handlers what changed while disconnected or, on the first
        connection, since the last `discover` answered (a lazy fabric's driver may have answered the composer
        well before the watcher's first stream opened). Then the fresh discovery is what they know: a stream
        event it already shows is dropped (`_Snapshot`).

        What it compares with is taken before it discovers, and from then on `discover` leaves it alone: a
        `discover` answered after the resync's own would be newer, and the change it saw would be reported
        backwards (a device the composer just saw FAILED announced OK), then again by the stream. A resync that
        fails lets `discover` take it again, since it told nothing."""
        with self._lock:
            self._resyncing = True
            before = self._snapshot if self._snapshot is not None else self._discovered
        try:
            self._tell_epoch()
            self._invalidate()
            topology, _, window = self._discover()
            now = _Snapshot.of(topology)
            events: list[FabricEvent] = []
            if before is not None:
                why = "seen on connecting to" if first else "seen on reconnecting to"
                events = before.changes(self._name, now, f"{why} the driver at {self.address}")
            reported: set[tuple[FabricEventKind, str]] = {
                (e.kind, e.subject)
                for e in events
                if e.kind in (FabricEventKind.DEVICE_ADDED, FabricEventKind.DEVICE_REMOVED)
            }
            if reported:
                if window is None:  # a driver that does not send it with the answer (older, or another language)
                    window = self._published()  # at once: the later, the more a genuine event is taken for a copy
                if window is not None:
                    now = attrs.evolve(now, reported=reported, window=window)
            for event in events:
                self._notify(event)
            with self._lock:
                self._snapshot, self._discovered = now, None
        finally:
            with self._lock:
                self._resyncing = False

    def _tell_epoch(self) -> None:
        """Tell the driver connected to anew the highest epoch sent to this fabric before, first of all: one that
        restarted without saved state knows none, and would take a deposed manager's older epoch until this
        manager's next change reached it. A refusal (a newer manager told it first) is this manager's next call's
        to meet, and is logged here; any other failure fails the resync, which is tried again, telling it first
        again: a resync that went on would leave the driver untold while its events flowed."""
        with self._lock:
            epoch, capabilities = self._epoch, self._capabilities
        if not epoch or capabilities is None or not capabilities.supports(Feature.FENCING):
            return
        try:
            self.unbind(epoch_announcement(self._name), CallContext.with_timeout(self.call_timeout_s, epoch=epoch))
        except StaleEpochError as exc:
            log.warning(
                "fabric %s: the driver at %s refused epoch %d: %s", self._name, self.address, epoch, exc.message
            )

    def _published(self) -> tuple[str, int] | None:
        """The driver's instance and count of events published so far, from the initial metadata of a watch
        stream opened for it and cancelled at once, for a driver that does not send it with its Discover answer
        (an event published between that answer and this read can be taken for a copy); None when the driver
        does not number its events, refuses the stream (its cap), or does not answer."""
        self._reconnecting()
        try:
            call = cast(
                EventCall,
                self._stub.WatchFabricEvents(
                    pb.WatchFabricEventsRequest(), timeout=self.call_timeout_s, metadata=self._metadata
                ),
            )
        except ValueError:  # the channel was closed
            return None
        try:
            return wire.event_sequence(wire.metadata_value(call.initial_metadata(), wire.EVENT_SEQUENCE_KEY))
        except grpc.RpcError:
            return None
        finally:
            call.cancel()

    def _deliver(self, event: FabricEvent, number: tuple[str, int] | None = None) -> None:
        """Hand a stream event, numbered ``number`` by the driver, to the handlers, unless it tells them
        nothing new."""
        self._invalidate()
        if event.kind is FabricEventKind.RESYNC_REQUIRED:
            self._rebase_health()
        elif self._snapshot is not None and not self._snapshot.apply(event, number):
            return
        self._notify(event)

    def _rebase_health(self) -> None:
        """Before a RESYNC_REQUIRED reaches the handlers, which read the fabric again (the composer its devices'
        health too, from this discovery while it is cached): the health the snapshot holds of each device becomes
        this discovery's. Left as the stream last told it, a device told FAILED that the handlers then read
        healthy would have its next failure dropped as telling them nothing new. A discovery that fails leaves
        it: the handlers' would fail too, and learn nothing."""
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None:
            return
        try:
            topology = self._discover()[0]
        except DisaggError as exc:
            log.warning("fabric %s: cannot read the devices' health on its resync event: %s", self._name, exc.message)
            return
        found = {d.id: d.health for d in topology.devices}
        health = {device: found.get(device, told) for device, told in snapshot.health.items()}
        with self._lock:
            if self._snapshot is snapshot:
                self._snapshot = attrs.evolve(snapshot, health=health)

    def _notify(self, event: FabricEvent) -> None:
        with self._lock:
            handlers = tuple(self._handlers)
        for subscription in handlers:
            with self._lock:
                active = subscription in self._handlers
            if not active:
                continue
            try:
                subscription.handler(event)
            except Exception:
                log.exception("event handler %r failed on %s", subscription.handler, event)


class RemotePool(Pool):
    """A pool of a `RemoteFabric`; ``info`` is the pool as discovered when the handle was made, None when
    discovery did not list it (every call then goes to the driver, which answers whether it has the pool)."""

    def __init__(self, fabric: RemoteFabric, info: PoolInfo | None, pool: str) -> None:
        self._fabric = fabric
        self._info = info
        self._id = pool

    @property
    def id(self) -> str:
        return self._id

    def info(self) -> PoolInfo:
        if self._info is None:
            raise NotFoundError("pool", self._id, f"fabric {self._fabric.name!r} lists no pool {self._id!r}")
        return self._info

    def allocations(self) -> Sequence[Allocation]:
        fabric = self._fabric
        answer = fabric._call(fabric._stub.ListAllocations, pb.ListAllocationsRequest(pool=self.id), None)
        return fabric._read(
            lambda: wire.check_within(wire.allocations_from_wire(answer.allocations, self.id), self._info),
            "allocations",
        )

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        """An amount of 0 is sent, for the driver to refuse; a negative one is refused here (the wire cannot
        carry it: `wire.allocate_request_to_wire`)."""
        fabric = self._fabric
        request = wire.allocate_request_to_wire(self.id, allocation_id, host, amount_bytes, ctx)
        answer = fabric._call(fabric._stub.Allocate, request, ctx)
        carved = wire.pool_allocation_from_wire(answer.allocation, self.id)
        asked = (allocation_id, self.id, host)
        if (carved.id, carved.pool, carved.host) != asked or carved.amount_bytes < amount_bytes:
            raise fabric._not_asked(
                "an allocation",
                f"{carved.id!r} of pool {carved.pool!r}, {carved.amount_bytes} bytes for {carved.host!r}",
                f"{allocation_id!r} of pool {self.id!r}, {amount_bytes} bytes for {host!r}",
            )
        try:
            wire.check_within((carved,), self._info)
        except InvalidRequestError as exc:
            raise fabric._not_asked("an allocation", exc.message, f"{allocation_id!r} of pool {self.id!r}") from None
        return carved

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        fabric = self._fabric
        fabric._call(fabric._stub.Release, wire.release_request_to_wire(self.id, allocation_id, ctx), ctx)


class RemoteDevice(Device):
    """A handle on one device of a `RemoteFabric`; `describe` answers from discovery."""

    def __init__(self, fabric: RemoteFabric, device: str) -> None:
        self._fabric = fabric
        self._id = device

    @property
    def id(self) -> str:
        return self._id

    def describe(self) -> DeviceInfo:
        return self._fabric._device_info(self._id)

    def sanitize(self, ctx: CallContext) -> None:
        fabric = self._fabric
        fabric._call(fabric._stub.SanitizeDevice, wire.sanitize_request_to_wire(self._id, ctx), ctx)
