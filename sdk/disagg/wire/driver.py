"""Model values to and from the messages of ``disagg.driver.v1.FabricDriverService`` (the southbound service).

The service side reads requests with the ``*_from_wire`` functions, which validate every field they read and
raise `InvalidRequestError` naming it, so a malformed request never reaches the driver. The client side
builds requests with the ``*_to_wire`` functions and reads answers with the shared conversions of
`disagg.wire.types`.

Pieces of gRPC metadata extend the contract without changing it (see ``docs/remote-drivers.md``): a
driver may number the events it has published, send the number reached when a watch stream starts (initial
metadata) and after a fault injection (trailing metadata), so that the `remote` plugin can wait until its
handlers have seen every event a fault caused, as an in-process fabric delivers them before it returns; and
once a discovery read the topology (trailing metadata), so that a resync can tell an event's stream copy.
A driver that sends neither still works; its events are simply delivered later. The client names the fabric
it means in every call but GetCapabilities (`FABRIC_KEY`), so that a driver of another fabric at the same
address refuses the call; and to a driver that says it reads the mark (`LATE_CALLS_KEY`), it sends a call whose
deadline passed before it was sent, marked so (`DEADLINE_PASSED_KEY`), for the driver, not the client, to
refuse it as it refuses one in process.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote

import attrs

from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import CapacityExhaustedError, InvalidRequestError, StaleEpochError
from disagg.fabric.v1 import types_pb2
from disagg.interfaces import CallContext, FaultInjection, check_allocations, check_bindings
from disagg.interfaces.fabric import MAX_ID as INTERFACE_MAX_ID
from disagg.interfaces.fabric import check_id as interface_check_id
from disagg.interfaces.faults import MAX_FAULT_COUNT as INTERFACE_MAX_FAULT_COUNT
from disagg.model import Allocation, Binding, FabricEvent, FabricEventKind, Health, PoolInfo, Topology
from disagg.wire.deadlines import NO_DEADLINE_S
from disagg.wire.types import HEALTH_TO_WIRE, allocation_from_wire, binding_from_wire, enum_from_wire, health_from_wire

MAX_ID = INTERFACE_MAX_ID
MAX_REQUEST_ID = 128
MAX_UINT64 = 2**64 - 1
"""The largest epoch and amount of bytes a request carries (``uint64`` fields)."""
REQUEST_ID_DIGEST = 16
"""Hex digits of the SHA-256 digest that ends a request id cut to fit (`request_id_to_wire`)."""
MAX_MESSAGE = 1024
MAX_FAULT_COUNT = INTERFACE_MAX_FAULT_COUNT

EVENT_SEQUENCE_KEY = "disagg-event-sequence"
"""Metadata key: ``<stream instance>:<events published>`` (see the module docstring)."""
FABRIC_KEY = "disagg-fabric"
"""Metadata key: the fabric the client means, percent-encoded as gRPC encodes ``grpc-message``
(`fabric_to_metadata`). A driver serving another fabric refuses the call, UNAVAILABLE (`FabricUnavailableError`):
a driver restarted for another fabric at the address of this one must not take its calls."""
DEADLINE_PASSED_KEY = "disagg-deadline-passed"
"""Metadata key: the call's deadline passed this many seconds (a decimal number) before it was sent. gRPC
cannot carry a deadline in the past, so the call carries a short timeout and this; the driver takes the
deadline as passed and refuses the call (`DeadlineExceededError`), as it refuses one in process. Sent only to
a driver that answers GetCapabilities with `LATE_CALLS_KEY`."""
LATE_CALLS_KEY = "disagg-late-calls"
"""Trailing metadata of GetCapabilities, value ``judged``: the driver reads `DEADLINE_PASSED_KEY`. A driver that
does not say so (one written before the key, or in another language that reads no metadata) takes a call's gRPC
timeout for its deadline and would carry out a late call, so the client refuses such a call itself."""
LATE_CALLS_JUDGED = "judged"
HEARTBEAT_KEY = "disagg-heartbeat-ms"
"""Initial metadata of a WatchFabricEvents stream: the driver sends a heartbeat (a response without an event)
whenever the stream has carried nothing for this many milliseconds, as the request's ``heartbeat_ms`` asked (or
longer). Absent: it sends none, and the stream's silence tells nothing."""
MIN_HEARTBEAT_MS = 100
"""The shortest interval the SDK's service keeps, whatever a request asks: a heartbeat costs the driver a wake-up."""
MAX_HEARTBEAT_MS = 3_600_000
"""The longest interval a client takes from a driver's metadata; a longer one, or one that does not parse, is
no promise, and the stream's silence is not timed."""
_UNENCODED = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""What a metadata value carries as it is: printable ASCII but ``%`` (gRPC's ``grpc-message`` rule)."""

EVENT_KIND_TO_WIRE = {
    FabricEventKind.DEVICE_HEALTH: pb.FABRIC_EVENT_KIND_DEVICE_HEALTH,
    FabricEventKind.DEVICE_ADDED: pb.FABRIC_EVENT_KIND_DEVICE_ADDED,
    FabricEventKind.DEVICE_REMOVED: pb.FABRIC_EVENT_KIND_DEVICE_REMOVED,
    FabricEventKind.LINK_DOWN: pb.FABRIC_EVENT_KIND_LINK_DOWN,
    FabricEventKind.LINK_UP: pb.FABRIC_EVENT_KIND_LINK_UP,
    FabricEventKind.RESYNC_REQUIRED: pb.FABRIC_EVENT_KIND_RESYNC_REQUIRED,
}
EVENT_KIND_FROM_WIRE = {v: k for k, v in EVENT_KIND_TO_WIRE.items()}


class FaultKind(enum.Enum):
    """A fault a simulator or emulator can inject (`disagg.interfaces.FaultInjection`)."""

    FAIL_DEVICE = "fail-device"
    REPAIR_DEVICE = "repair-device"
    LINK_DOWN = "link-down"
    LINK_UP = "link-up"
    FLAKY_BIND = "flaky-bind"


FAULT_TO_WIRE = {
    FaultKind.FAIL_DEVICE: pb.FAULT_KIND_FAIL_DEVICE,
    FaultKind.REPAIR_DEVICE: pb.FAULT_KIND_REPAIR_DEVICE,
    FaultKind.LINK_DOWN: pb.FAULT_KIND_LINK_DOWN,
    FaultKind.LINK_UP: pb.FAULT_KIND_LINK_UP,
    FaultKind.FLAKY_BIND: pb.FAULT_KIND_FLAKY_BIND,
}
FAULT_FROM_WIRE = {v: k for k, v in FAULT_TO_WIRE.items()}


@attrs.frozen
class Fault:
    """One `FaultInjection` call as a value: ``target`` is a device or link end (empty for any device with
    FLAKY_BIND), ``peer`` the other link end, ``count`` the number of binds to fail."""

    kind: FaultKind
    target: str = ""
    peer: str = ""
    count: int = 0
    message: str = ""

    def apply(self, faults: FaultInjection) -> None:
        """Make the call this fault stands for."""
        if self.kind is FaultKind.FAIL_DEVICE:
            faults.fail_device(self.target, self.message)
        elif self.kind is FaultKind.REPAIR_DEVICE:
            faults.repair_device(self.target)
        elif self.kind in (FaultKind.LINK_DOWN, FaultKind.LINK_UP):
            faults.set_link(self.target, self.peer, self.kind is FaultKind.LINK_UP)
        else:
            faults.flaky_bind(self.target or None, self.count)


# -- validation -----------------------------------------------------------------------------------------------


def check_id(value: str, field: str, *, required: bool = True) -> str:
    """An id (`disagg.interfaces.check_id`: printable characters without spaces, at most `MAX_ID` long); empty
    only when not required."""
    if not value and not required:
        return value
    return interface_check_id(value, field)


def check_text(value: object, field: str) -> str:
    """``value`` as a request's string field: a `str` that UTF-8 can encode (protobuf sends nothing else); a bad
    type or a lone surrogate is an `InvalidRequestError` naming ``field``, as an in-process driver answers a bad
    argument, instead of protobuf's TypeError or UnicodeEncodeError."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}: give a string, not {value!r}", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{field}: {value!r} holds a lone surrogate, which is not text the wire can carry (UTF-8)", field=field
        ) from None
    return value


def fabric_to_metadata(fabric: str) -> str:
    """The `FABRIC_KEY` value naming ``fabric``: printable ASCII but ``%`` as it is, every other UTF-8 byte as
    ``%XX`` (a metadata value is ASCII only; a fabric name may not be)."""
    return quote(fabric, safe=_UNENCODED, errors="surrogatepass")


def fabric_from_metadata(value: str) -> str:
    """The fabric a `FABRIC_KEY` value names (`fabric_to_metadata`)."""
    return unquote(value, errors="replace")


def deadline_passed_to_metadata(ago_s: float) -> str:
    """The `DEADLINE_PASSED_KEY` value of a deadline that passed ``ago_s`` seconds ago."""
    return f"{min(max(ago_s, 0.0), NO_DEADLINE_S):.3f}"


def deadline_passed_from_metadata(value: str, now: float) -> float:
    """The deadline, a ``time.monotonic()`` instant at or before ``now``, that a `DEADLINE_PASSED_KEY` value
    says passed; a value that is not a number of seconds counts as one that passed just now."""
    try:
        ago = float(value)
    except ValueError:
        ago = 0.0
    return now - (ago if math.isfinite(ago) and ago > 0 else 0.0)


def check_message(value: str, field: str = "message") -> str:
    if len(value) > MAX_MESSAGE:
        raise InvalidRequestError(f"{field}: at most {MAX_MESSAGE} characters", field=field)
    return value


def context_from_wire(epoch: int, request_id: str, deadline: float | None) -> CallContext:
    """The `CallContext` of a request: its epoch and request id, and the deadline of the gRPC call."""
    if len(request_id) > MAX_REQUEST_ID or any(not c.isprintable() for c in request_id):
        raise InvalidRequestError(f"request_id: at most {MAX_REQUEST_ID} printable characters", field="request_id")
    return CallContext(epoch=epoch, deadline=deadline, request_id=request_id)


def request_id_to_wire(request_id: str) -> str:
    """The request id a request carries: ``request_id`` itself when it fits the service's rule (at most
    `MAX_REQUEST_ID` printable characters); otherwise its beginning (unprintable characters as ``?``), ``~`` and
    the first `REQUEST_ID_DIGEST` hex digits of its SHA-256. The composer's Python API passes any request id
    through and an in-process driver takes it, so a remote bind must not fail on it; the beginning keeps it
    recognisable in the driver's logs, the digest tells apart two ids with the same beginning."""
    if len(request_id) <= MAX_REQUEST_ID and request_id.isprintable():
        return request_id
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:REQUEST_ID_DIGEST]
    shown = "".join(c if c.isprintable() else "?" for c in request_id[: MAX_REQUEST_ID - REQUEST_ID_DIGEST - 1])
    return f"{shown}~{digest}"


def context_to_wire(ctx: CallContext) -> tuple[int, str]:
    """The epoch and request id a request carries. An epoch the ``uint64`` field cannot hold gets the SDK error
    an in-process driver gives instead of protobuf's `ValueError`: a negative one is older than any epoch a
    driver can have seen (`StaleEpochError`, as the simulator answers), one above `MAX_UINT64` is malformed, and
    so is one that is not an integer, or a request id that is not a string (`InvalidRequestError`)."""
    if isinstance(ctx.epoch, bool) or not isinstance(ctx.epoch, int):
        raise InvalidRequestError(f"epoch: give an integer, not {ctx.epoch!r}", field="epoch")
    if not isinstance(ctx.request_id, str):
        raise InvalidRequestError(f"request_id: give a string, not {ctx.request_id!r}", field="request_id")
    if ctx.epoch < 0:
        raise StaleEpochError(f"epoch {ctx.epoch} is older than any a driver can have seen; nothing was changed")
    if ctx.epoch > MAX_UINT64:
        raise InvalidRequestError(f"epoch: at most {MAX_UINT64}, not {ctx.epoch}", field="epoch")
    return ctx.epoch, request_id_to_wire(ctx.request_id)


# -- events ---------------------------------------------------------------------------------------------------


def fabric_event_to_wire(event: FabricEvent) -> pb.FabricEvent:
    msg = pb.FabricEvent(
        fabric=event.fabric, kind=EVENT_KIND_TO_WIRE[event.kind], subject=event.subject, message=event.message
    )
    if event.health is not None:
        msg.health = HEALTH_TO_WIRE[event.health]
    return msg


def fabric_event_from_wire(msg: pb.FabricEvent, field: str = "event") -> FabricEvent:
    kind = enum_from_wire(EVENT_KIND_FROM_WIRE, msg.kind, f"{field}.kind", "fabric event kind")
    health: Health | None = None
    if kind is FabricEventKind.DEVICE_HEALTH or msg.health:
        health = health_from_wire(msg.health, f"{field}.health")
    if not msg.subject:
        raise InvalidRequestError(f"{field}.subject: an event names its device or link", field=f"{field}.subject")
    return FabricEvent(fabric=msg.fabric, kind=kind, subject=msg.subject, health=health, message=msg.message)


def bindings_from_wire(msgs: Iterable[types_pb2.Binding]) -> tuple[Binding, ...]:
    """A ListBindings answer, held to the driver interface's contract (`disagg.interfaces.check_bindings`)."""
    return check_bindings(binding_from_wire(msg) for msg in msgs)


def pool_allocation_from_wire(msg: types_pb2.Allocation, pool: str) -> Allocation:
    """An allocation a driver answered for ``pool`` (an Allocate's, a listing's); one that names no pool is the
    pool's, as an event that names no fabric is the stream's: a driver in another language may leave it unset."""
    allocation = allocation_from_wire(msg)
    return allocation if allocation.pool else attrs.evolve(allocation, pool=pool)


def allocations_from_wire(msgs: Iterable[types_pb2.Allocation], pool: str) -> tuple[Allocation, ...]:
    """A ListAllocations answer of ``pool`` (`pool_allocation_from_wire`), held to the driver interface's contract
    (`disagg.interfaces.check_allocations`)."""
    return check_allocations((pool_allocation_from_wire(msg, pool) for msg in msgs), pool)


def check_topology(topology: Topology, field: str = "topology") -> Topology:
    """``topology`` if every device, host, switch and pool, each pool's device and each link's ends are named by an
    id (`check_id`): the service refuses any other in every request, so the composer would place a device it can
    never bind. Else `InvalidRequestError` naming the entry."""
    named = (
        *((f"devices[{n}].id", d.id) for n, d in enumerate(topology.devices)),
        *((f"hosts[{n}].id", h.id) for n, h in enumerate(topology.hosts)),
        *((f"switches[{n}].id", s.id) for n, s in enumerate(topology.switches)),
        *((f"pools[{n}].id", p.id) for n, p in enumerate(topology.pools)),
        *((f"pools[{n}].device", p.device) for n, p in enumerate(topology.pools)),
        *((f"links[{n}].{end}", getattr(link, end)) for n, link in enumerate(topology.links) for end in "ab"),
    )
    for where, value in named:
        check_id(value, f"{field}.{where}")
    return topology


def check_within(allocations: Sequence[Allocation], pool: PoolInfo | None) -> tuple[Allocation, ...]:
    """``allocations`` if a driver's answer of them fits ``pool`` (as discovered; None when discovery did not list
    it: nothing to hold them to): none holds more bytes than the pool, all together no more either, and their
    extents lie within the pool and overlap none other, as the conformance clause CARVE-NO-OVERLAP asks; else
    `InvalidRequestError` naming the entry. The composer records an allocation's bytes as the hardware's and
    claims them in its index: an allocation of 16 EiB left a pool of 2 TiB full for good."""
    if pool is None:
        return tuple(allocations)
    total = pool.capacity.total_bytes
    spans: list[tuple[int, int, str]] = []
    held = 0
    for n, allocation in enumerate(allocations):
        field = f"allocations[{n}]"
        if allocation.amount_bytes > total:
            raise InvalidRequestError(
                f"{field}.amount_bytes: {allocation.amount_bytes} bytes, more than pool {pool.id!r} holds ({total})",
                field=f"{field}.amount_bytes",
            )
        held += allocation.amount_bytes
        for m, extent in enumerate(allocation.extents):
            if extent.end > total:
                raise InvalidRequestError(
                    f"{field}.extents[{m}]: {extent.offset}+{extent.length} lies beyond pool {pool.id!r} ({total} "
                    "bytes)",
                    field=f"{field}.extents[{m}]",
                )
            if extent.length:
                spans.append((extent.offset, extent.end, f"{field}.extents[{m}]"))
    if held > total:
        raise InvalidRequestError(
            f"allocations: {held} bytes in all, more than pool {pool.id!r} holds ({total})", field="allocations"
        )
    for (_, end, first), (start, _, second) in itertools.pairwise(sorted(spans)):
        if start < end:
            raise InvalidRequestError(f"{second}: it overlaps {first}", field=second)
    return tuple(allocations)


def event_sequence(value: str) -> tuple[str, int] | None:
    """Parse ``<instance>:<count>`` from `EVENT_SEQUENCE_KEY` metadata; None when absent or malformed."""
    instance, sep, count = value.rpartition(":")
    if not sep or not instance or not (count.isascii() and count.isdigit()):
        return None
    return instance, int(count)


def heartbeat_interval_ms(asked: int) -> int:
    """The interval a driver keeps for a stream whose request asked ``asked`` milliseconds; 0: no heartbeats. At
    most `MAX_HEARTBEAT_MS`, which a client takes as a promise."""
    return min(max(asked, MIN_HEARTBEAT_MS), MAX_HEARTBEAT_MS) if asked > 0 else 0


def heartbeat_valid(seconds: object) -> bool:
    """Whether ``seconds`` is a heartbeat interval a client may ask for: 0 (none), or `MIN_HEARTBEAT_MS` to
    `MAX_HEARTBEAT_MS` in seconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return False
    return seconds == 0 or MIN_HEARTBEAT_MS <= seconds * 1000 <= MAX_HEARTBEAT_MS


def heartbeat_promised(value: str) -> float | None:
    """The heartbeat interval in seconds that `HEARTBEAT_KEY` metadata promises; None when absent, malformed, 0 or
    above `MAX_HEARTBEAT_MS`."""
    if not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_HEARTBEAT_MS)):
        return None
    ms = int(value)
    return ms / 1000 if 0 < ms <= MAX_HEARTBEAT_MS else None


def metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str:
    """The first value of ``key`` in gRPC metadata, or the empty string."""
    for k, v in metadata or ():
        if k == key:
            return v.decode("ascii", "replace") if isinstance(v, bytes) else v
    return ""


# -- faults ---------------------------------------------------------------------------------------------------


def fault_to_wire(fault: Fault) -> pb.InjectFaultRequest:
    return pb.InjectFaultRequest(
        kind=FAULT_TO_WIRE[fault.kind],
        target=check_text(fault.target, "target"),
        peer=check_text(fault.peer, "peer"),
        count=fault.count,
        message=check_text(fault.message, "message"),
    )


def fault_from_wire(msg: pb.InjectFaultRequest) -> Fault:
    kind = enum_from_wire(FAULT_FROM_WIRE, msg.kind, "kind", "fault kind")
    target = check_id(msg.target, "target", required=kind is not FaultKind.FLAKY_BIND)
    peer = ""
    if kind in (FaultKind.LINK_DOWN, FaultKind.LINK_UP):
        peer = check_id(msg.peer, "peer")
    elif msg.peer:
        raise InvalidRequestError(f"peer: only a link fault names a peer, not {kind.value}", field="peer")
    if msg.count and kind is not FaultKind.FLAKY_BIND:
        raise InvalidRequestError(f"count: only flaky-bind takes a count, not {kind.value}", field="count")
    if msg.count > MAX_FAULT_COUNT:
        raise InvalidRequestError(f"count: at most {MAX_FAULT_COUNT}", field="count")
    return Fault(kind, target, peer, msg.count, check_message(msg.message))


# -- requests: the client builds them, the service reads them back ----------------------------------------------


def bind_request_to_wire(device: str, host: str, ctx: CallContext) -> pb.BindRequest:
    device, host = check_text(device, "device"), check_text(host, "host")
    epoch, request_id = context_to_wire(ctx)
    return pb.BindRequest(device=device, host=host, epoch=epoch, request_id=request_id)


def bind_request_from_wire(msg: pb.BindRequest, deadline: float | None) -> tuple[str, str, CallContext]:
    return (
        check_id(msg.device, "device"),
        check_id(msg.host, "host"),
        context_from_wire(msg.epoch, msg.request_id, deadline),
    )


def unbind_request_to_wire(binding: Binding, ctx: CallContext) -> pb.UnbindRequest:
    if not isinstance(binding, Binding):
        raise InvalidRequestError(f"binding: give a Binding, not {binding!r}", field="binding")
    device, host = check_text(binding.device, "binding.device"), check_text(binding.host, "binding.host")
    epoch, request_id = context_to_wire(ctx)
    request = pb.UnbindRequest(epoch=epoch, request_id=request_id)
    request.binding.device = device
    request.binding.host = host
    return request


def unbind_request_from_wire(msg: pb.UnbindRequest, deadline: float | None) -> tuple[Binding, CallContext]:
    if not msg.HasField("binding"):
        raise InvalidRequestError("binding: the binding to take away is required", field="binding")
    binding = Binding(check_id(msg.binding.device, "binding.device"), check_id(msg.binding.host, "binding.host"))
    return binding, context_from_wire(msg.epoch, msg.request_id, deadline)


def allocate_request_to_wire(
    pool: str, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext
) -> pb.AllocateRequest:
    """An amount above `MAX_UINT64` is more than any pool holds: `CapacityExhaustedError`, as a driver answers.
    An amount of 0 is sent, for the driver to refuse; a negative one, which the ``uint64`` field cannot carry, or
    one that is not an integer, is an `InvalidRequestError` here."""
    pool, allocation_id, host = (
        check_text(pool, "pool"),
        check_text(allocation_id, "allocation_id"),
        check_text(host, "host"),
    )
    if isinstance(amount_bytes, bool) or not isinstance(amount_bytes, int) or amount_bytes < 0:
        raise InvalidRequestError(
            f"amount_bytes: must be a positive number of bytes, not {amount_bytes!r}", field="amount_bytes"
        )
    epoch, request_id = context_to_wire(ctx)
    if amount_bytes > MAX_UINT64:
        raise CapacityExhaustedError(
            f"pool {pool}: {amount_bytes} bytes asked, more than any pool holds (at most {MAX_UINT64} bytes)"
        )
    return pb.AllocateRequest(
        pool=pool, allocation_id=allocation_id, host=host, amount_bytes=amount_bytes, epoch=epoch, request_id=request_id
    )


def allocate_request_from_wire(
    msg: pb.AllocateRequest, deadline: float | None
) -> tuple[str, str, str, int, CallContext]:
    if msg.amount_bytes <= 0:
        raise InvalidRequestError("amount_bytes: must be a positive number of bytes", field="amount_bytes")
    return (
        check_id(msg.pool, "pool"),
        check_id(msg.allocation_id, "allocation_id"),
        check_id(msg.host, "host"),
        msg.amount_bytes,
        context_from_wire(msg.epoch, msg.request_id, deadline),
    )


def release_request_to_wire(pool: str, allocation_id: str, ctx: CallContext) -> pb.ReleaseRequest:
    pool, allocation_id = check_text(pool, "pool"), check_text(allocation_id, "allocation_id")
    epoch, request_id = context_to_wire(ctx)
    return pb.ReleaseRequest(pool=pool, allocation_id=allocation_id, epoch=epoch, request_id=request_id)


def release_request_from_wire(msg: pb.ReleaseRequest, deadline: float | None) -> tuple[str, str, CallContext]:
    return (
        check_id(msg.pool, "pool"),
        check_id(msg.allocation_id, "allocation_id"),
        context_from_wire(msg.epoch, msg.request_id, deadline),
    )


def sanitize_request_to_wire(device: str, ctx: CallContext) -> pb.SanitizeDeviceRequest:
    device = check_text(device, "device")
    epoch, request_id = context_to_wire(ctx)
    return pb.SanitizeDeviceRequest(device=device, epoch=epoch, request_id=request_id)


def sanitize_request_from_wire(msg: pb.SanitizeDeviceRequest, deadline: float | None) -> tuple[str, CallContext]:
    return check_id(msg.device, "device"), context_from_wire(msg.epoch, msg.request_id, deadline)
