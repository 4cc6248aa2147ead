"""Model values to and from the messages of ``disagg.driver.v1.FabricDriverService`` (the southbound service).

The service side reads requests with the ``*_from_wire`` functions, which validate every field they read and
raise `InvalidRequestError` naming it, so a malformed request never reaches the driver. The client side
builds requests with the ``*_to_wire`` functions and reads answers with the shared conversions of
`disagg.wire.types`.

Two pieces of gRPC metadata extend the contract without changing it (see ``docs/remote-drivers.md``): a
driver may number the events it has published, send the number reached when a watch stream starts (initial
metadata) and after a fault injection (trailing metadata), so that the `remote` plugin can wait until its
handlers have seen every event a fault caused, as an in-process fabric delivers them before it returns; and
once a discovery read the topology (trailing metadata), so that a resync can tell an event's stream copy.
A driver that sends neither still works; its events are simply delivered later.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import attrs

from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import CapacityExhaustedError, InvalidRequestError, StaleEpochError
from disagg.interfaces import CallContext, FaultInjection
from disagg.model import Binding, FabricEvent, FabricEventKind, Health
from disagg.wire.types import HEALTH_TO_WIRE, enum_from_wire, health_from_wire

MAX_ID = 256
"""Device, host, pool, allocation and link-end ids are at most this long."""
MAX_REQUEST_ID = 128
MAX_UINT64 = 2**64 - 1
"""The largest epoch and amount of bytes a request carries (``uint64`` fields)."""
REQUEST_ID_DIGEST = 16
"""Hex digits of the SHA-256 digest that ends a request id cut to fit (`request_id_to_wire`)."""
MAX_MESSAGE = 1024
MAX_FAULT_COUNT = 1_000_000

EVENT_SEQUENCE_KEY = "disagg-event-sequence"
"""Metadata key: ``<stream instance>:<events published>`` (see the module docstring)."""

EVENT_KIND_TO_WIRE = {
    FabricEventKind.DEVICE_HEALTH: pb.FABRIC_EVENT_KIND_DEVICE_HEALTH,
    FabricEventKind.DEVICE_ADDED: pb.FABRIC_EVENT_KIND_DEVICE_ADDED,
    FabricEventKind.DEVICE_REMOVED: pb.FABRIC_EVENT_KIND_DEVICE_REMOVED,
    FabricEventKind.LINK_DOWN: pb.FABRIC_EVENT_KIND_LINK_DOWN,
    FabricEventKind.LINK_UP: pb.FABRIC_EVENT_KIND_LINK_UP,
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
    """An id of printable characters without spaces, at most `MAX_ID` long; empty only when not required."""
    if (required and not value) or len(value) > MAX_ID or any(c.isspace() or not c.isprintable() for c in value):
        what = "an id" if required else "an id or nothing"
        raise InvalidRequestError(
            f"{field}: give {what} of at most {MAX_ID} printable characters without spaces", field=field
        )
    return value


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
    driver can have seen (`StaleEpochError`, as the simulator answers), one above `MAX_UINT64` is malformed."""
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


def event_sequence(value: str) -> tuple[str, int] | None:
    """Parse ``<instance>:<count>`` from `EVENT_SEQUENCE_KEY` metadata; None when absent or malformed."""
    instance, sep, count = value.rpartition(":")
    if not sep or not instance or not count.isdigit():
        return None
    return instance, int(count)


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
        target=fault.target,
        peer=fault.peer,
        count=fault.count,
        message=fault.message,
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
    epoch, request_id = context_to_wire(ctx)
    return pb.BindRequest(device=device, host=host, epoch=epoch, request_id=request_id)


def bind_request_from_wire(msg: pb.BindRequest, deadline: float | None) -> tuple[str, str, CallContext]:
    return (
        check_id(msg.device, "device"),
        check_id(msg.host, "host"),
        context_from_wire(msg.epoch, msg.request_id, deadline),
    )


def unbind_request_to_wire(binding: Binding, ctx: CallContext) -> pb.UnbindRequest:
    epoch, request_id = context_to_wire(ctx)
    request = pb.UnbindRequest(epoch=epoch, request_id=request_id)
    request.binding.device = binding.device
    request.binding.host = binding.host
    return request


def unbind_request_from_wire(msg: pb.UnbindRequest, deadline: float | None) -> tuple[Binding, CallContext]:
    if not msg.HasField("binding"):
        raise InvalidRequestError("binding: the binding to take away is required", field="binding")
    binding = Binding(check_id(msg.binding.device, "binding.device"), check_id(msg.binding.host, "binding.host"))
    return binding, context_from_wire(msg.epoch, msg.request_id, deadline)


def allocate_request_to_wire(
    pool: str, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext
) -> pb.AllocateRequest:
    """An amount above `MAX_UINT64` is more than any pool holds: `CapacityExhaustedError`, as a driver answers."""
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
    epoch, request_id = context_to_wire(ctx)
    return pb.ReleaseRequest(pool=pool, allocation_id=allocation_id, epoch=epoch, request_id=request_id)


def release_request_from_wire(msg: pb.ReleaseRequest, deadline: float | None) -> tuple[str, str, CallContext]:
    return (
        check_id(msg.pool, "pool"),
        check_id(msg.allocation_id, "allocation_id"),
        context_from_wire(msg.epoch, msg.request_id, deadline),
    )


def sanitize_request_to_wire(device: str, ctx: CallContext) -> pb.SanitizeDeviceRequest:
    epoch, request_id = context_to_wire(ctx)
    return pb.SanitizeDeviceRequest(device=device, epoch=epoch, request_id=request_id)


def sanitize_request_from_wire(msg: pb.SanitizeDeviceRequest, deadline: float | None) -> tuple[str, CallContext]:
    return check_id(msg.device, "device"), context_from_wire(msg.epoch, msg.request_id, deadline)
