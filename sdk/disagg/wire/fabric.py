"""Model values to and from the messages of ``disagg.fabric.v1.FabricManagerService``.

``*_from_wire`` functions validate the request fields they read (names, sizes, enums, limits) and raise
`InvalidRequestError` with the field's path, so the server refuses bad input at the edge.
"""

from __future__ import annotations

import base64
import contextlib
import math
import re
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar

from disagg.errors import InvalidRequestError, UnsupportedError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces.fabric import MAX_ID, id_text
from disagg.model import (
    MAX_RESERVATION_TTL_S,
    Affinity,
    Capabilities,
    ComposeMode,
    Composition,
    CompositionRequest,
    CompositionState,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    Health,
    HostRequest,
    MemoryPick,
    Plan,
    PoolInfo,
    Reservation,
    ResourceRequest,
    Revision,
    Selector,
    SelectorOp,
    selector_refusal,
    spread_refusal,
)
from disagg.model.composition import (
    MAX_LATENCY_NS,
    MAX_RESOURCE_LINES,
    MAX_SELECTOR_KEY,
    MAX_SELECTOR_TEXT,
    MAX_SELECTORS,
    SELECTOR_INT_RANGE,
    conflict_refusal,
    request_limit_refusal,
    selector_value_refusal,
    selectors_conflict,
)
from disagg.wire.types import (
    KIND_FROM_WIRE,
    KIND_TO_WIRE,
    allocation_from_wire,
    allocation_to_wire,
    attribute_from_wire,
    attribute_to_wire,
    capabilities_to_wire,
    enum_from_wire,
    health_from_wire,
    kind_from_wire,
    pool_info_to_wire,
)

if TYPE_CHECKING:
    from disagg.composer import KindUsage

MAX_RESOURCES = MAX_RESOURCE_LINES
MAX_SELECTOR_VALUE = MAX_SELECTOR_TEXT
MAX_NAME = 63
MAX_OWN_ID = 128
"""The longest id a request names that no driver reported (`check_id`'s default): a request id, the one a
client makes up, and a composition's id or name, a reservation's id, an etag, a fabric's name, all far shorter
as the fabric manager makes them. The ids of devices, hosts and allocations are as long as a driver may report
them (`MAX_ID`, from `disagg.interfaces`), checked with `check_driver_id`."""
MAX_PAGE_KEY = MAX_ID
"""The longest key a page token of devices or reservations carries: a device id as a driver may report it."""
MAX_PAGE_TOKEN = 4 * 1024 * 1024
"""The longest page token of compositions: gRPC's default limit on a message the server receives (the fabric
manager sets no other), so a longer one never arrives. Their key is a composition's name, which may be any text
the model and the ledger hold (a `CompositionRequest` made in process, a record of an older release), not only
the names the wire takes: the server lists them, so it takes their tokens back."""
ANY_TEXT_KEYS = frozenset({"compositions"})
"""The listings whose keys may be any non-empty text (`MAX_PAGE_TOKEN`)."""
MAX_TTL_S = MAX_RESERVATION_TTL_S
MAX_REMOVE = 1024
WATCH_OPEN = ("disagg-watch", "open")
"""The initial metadata a server sends as it opens a watch, before the log's events: a client whose watch breaks
after it knows the watch was served, and counts the break as the first of a new row of failures, not as one more
failed attempt to reopen it (a quiet watch, its server restarted more times than the retry policy's attempts)."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
MAX_REMEMBERED = 1_024
"""How many resource lines, host requests and Composes' lines with their hosts are remembered as read
(`_remember`)."""
MAX_REMEMBERED_BYTES = 256
"""The longest encoding of a resource line or a host request, or of a Compose's line and host together, that is
remembered: a few selectors. A longer one (many selectors, long values, unknown fields) is read each time, so that
what is remembered stays small."""
V = TypeVar("V")

OP_TO_WIRE = {
    SelectorOp.EQ: fm.SELECTOR_OP_EQ,
    SelectorOp.NE: fm.SELECTOR_OP_NE,
    SelectorOp.GE: fm.SELECTOR_OP_GE,
    SelectorOp.LE: fm.SELECTOR_OP_LE,
    SelectorOp.GT: fm.SELECTOR_OP_GT,
    SelectorOp.LT: fm.SELECTOR_OP_LT,
}
OP_FROM_WIRE = {v: k for k, v in OP_TO_WIRE.items()}
AFFINITY_TO_WIRE = {Affinity.NONE: fm.AFFINITY_NONE, Affinity.SAME_SWITCH: fm.AFFINITY_SAME_SWITCH}
AFFINITY_FROM_WIRE = {v: k for k, v in AFFINITY_TO_WIRE.items()}
MODE_TO_WIRE = {
    ComposeMode.PREVIEW: fm.COMPOSE_MODE_PREVIEW,
    ComposeMode.RESERVE: fm.COMPOSE_MODE_RESERVE,
    ComposeMode.APPLY: fm.COMPOSE_MODE_APPLY,
}
MODE_FROM_WIRE = {v: k for k, v in MODE_TO_WIRE.items()}
STATE_TO_WIRE = {
    CompositionState.COMPOSING: fm.COMPOSITION_STATE_COMPOSING,
    CompositionState.COMPOSED: fm.COMPOSITION_STATE_COMPOSED,
    CompositionState.DEGRADED: fm.COMPOSITION_STATE_DEGRADED,
    CompositionState.DECOMPOSING: fm.COMPOSITION_STATE_DECOMPOSING,
    CompositionState.FAILED: fm.COMPOSITION_STATE_FAILED,
    CompositionState.UNKNOWN: fm.COMPOSITION_STATE_UNKNOWN,
}
STATE_FROM_WIRE = {v: k for k, v in STATE_TO_WIRE.items()}
EVENT_TO_WIRE = {
    EventType.DEVICE_HEALTH_CHANGED: fm.EVENT_TYPE_DEVICE_HEALTH_CHANGED,
    EventType.DEVICE_ADDED: fm.EVENT_TYPE_DEVICE_ADDED,
    EventType.DEVICE_REMOVED: fm.EVENT_TYPE_DEVICE_REMOVED,
    EventType.LINK_STATE_CHANGED: fm.EVENT_TYPE_LINK_STATE_CHANGED,
    EventType.COMPOSITION_CREATED: fm.EVENT_TYPE_COMPOSITION_CREATED,
    EventType.COMPOSITION_STATE_CHANGED: fm.EVENT_TYPE_COMPOSITION_STATE_CHANGED,
    EventType.COMPOSITION_UPDATED: fm.EVENT_TYPE_COMPOSITION_UPDATED,
    EventType.COMPOSITION_DELETED: fm.EVENT_TYPE_COMPOSITION_DELETED,
    EventType.COMPOSITION_HEALED: fm.EVENT_TYPE_COMPOSITION_HEALED,
    EventType.RESERVATION_CREATED: fm.EVENT_TYPE_RESERVATION_CREATED,
    EventType.RESERVATION_EXPIRED: fm.EVENT_TYPE_RESERVATION_EXPIRED,
    EventType.RESERVATION_RELEASED: fm.EVENT_TYPE_RESERVATION_RELEASED,
    EventType.ROLLBACK_INCOMPLETE: fm.EVENT_TYPE_ROLLBACK_INCOMPLETE,
    EventType.DEVICE_CORDONED: fm.EVENT_TYPE_DEVICE_CORDONED,
    EventType.DEVICE_UNCORDONED: fm.EVENT_TYPE_DEVICE_UNCORDONED,
    EventType.BINDING_QUARANTINED: fm.EVENT_TYPE_BINDING_QUARANTINED,
    EventType.ALLOCATION_QUARANTINED: fm.EVENT_TYPE_ALLOCATION_QUARANTINED,
}
EVENT_FROM_WIRE = {v: k for k, v in EVENT_TO_WIRE.items()}


def check_name(value: str, field: str) -> str:
    """A composition's name as the wire carries one: 1-63 letters, digits, '.', '_' or '-', starting with a
    letter or digit. One of the shape of the composer's ids is the composer's to refuse
    (`disagg.model.id_name_refusal`), after it has looked up the request id: a retry of a change an earlier release
    made under such a name gets its first answer."""
    if not NAME.fullmatch(value):
        raise InvalidRequestError(
            f"{field}: {value!r} is not a valid name (1-{MAX_NAME} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit)",
            field=field,
        )
    return value


def check_id(value: str, field: str, *, required: bool = True, longest: int = MAX_OWN_ID) -> str:
    """``value`` if it is an id of 1 to ``longest`` printable characters without spaces (or empty, unless
    ``required``); by default one no driver reported (`MAX_OWN_ID`), as the CLI holds ``--request-id`` to it."""
    if (required and not value) or len(value) > longest or not id_text(value):
        raise InvalidRequestError(f"{field}: give an id of 1 to {longest} printable characters", field=field)
    return value


def check_driver_id(value: str, field: str) -> str:
    """A device's, host's or allocation's id, as long as a driver may report one (`MAX_ID`): a device listed is
    one a client can name back."""
    return check_id(value, field, longest=MAX_ID)


def selector_to_wire(sel: Selector) -> fm.Selector:
    """The selector's message. A whole number beyond int64 goes as a double: only an answer holds one (a request
    is checked first, `check_selector_values`), a composition an earlier version recorded, which must be listed."""
    value = sel.value
    if type(value) is int and value not in SELECTOR_INT_RANGE:
        wire = pb.AttributeValue(double_value=math.inf if value > 0 else -math.inf)
        with contextlib.suppress(OverflowError):
            wire.double_value = float(value)
        return fm.Selector(key=sel.key, op=OP_TO_WIRE[sel.op], value=wire)
    return fm.Selector(key=sel.key, op=OP_TO_WIRE[sel.op], value=attribute_to_wire(value))


def selector_from_wire(msg: fm.Selector, field: str, *, resource: bool = False) -> Selector:
    """A selector of a host (``resource`` False) or of a resource line, refused as the text and document forms
    refuse it (`disagg.model.selector_refusal`). (Its value is held to a request's limits by
    `check_selector_values`: an answer may hold one a request may not, a number that is not finite or a longer
    string, made through the Python API or by an earlier version.)"""
    if not msg.key or len(msg.key) > MAX_SELECTOR_KEY:
        raise InvalidRequestError(
            f"{field}.key: a selector needs a key of 1 to {MAX_SELECTOR_KEY} characters", field=f"{field}.key"
        )
    refusal = selector_refusal(msg.key, resource=resource)
    if refusal:
        raise InvalidRequestError(f"{field}.key: {refusal}", field=f"{field}.key")
    op = enum_from_wire(OP_FROM_WIRE, msg.op, f"{field}.op", "selector operator")
    return Selector(msg.key, op, attribute_from_wire(msg.value, f"{field}.value"))


def check_selector_values(lines: Sequence[ResourceRequest], field: str, host: HostRequest | None = None) -> None:
    """Refuse, in a request read from the wire (a Compose's, the lines an UpdateComposition adds), a selector
    value a request may not hold (`selector_value_refusal`, as the text and document forms refuse it: a number
    that is not finite, text longer than `MAX_SELECTOR_VALUE`) and selectors that no value meets together
    (`selectors_conflict`). A request's other numbers were bounded by their
    proto fields as it was read; one about to be sent is checked whole (`check_request_values`). Not where an
    answer is read: a composition made before the limits (or through the Python API, which takes any) must
    still be listed and read by every client."""
    for n, line in enumerate(lines):
        if line.selectors:
            _check_values(line.selectors, f"{field}[{n}].selectors")
    if host is not None and host.selectors:
        _check_values(host.selectors, "host.selectors")


def _check_values(selectors: Sequence[Selector], parent: str) -> None:
    """`check_selector_values` for the selectors of the request field ``parent``."""
    for m, sel in enumerate(selectors):
        why = selector_value_refusal(sel.value)
        if why:
            raise InvalidRequestError(f"{parent}[{m}].value: {why}", field=f"{parent}[{m}].value")
    conflict = selectors_conflict(selectors)
    if conflict is not None:
        chosen, why = conflict
        refusal = conflict_refusal([str(selectors[m]) for m in chosen], why)
        raise InvalidRequestError(f"{parent}[{chosen[-1]}]: {refusal}", field=f"{parent}[{chosen[-1]}]")


def check_request_values(lines: Sequence[ResourceRequest], field: str, host: HostRequest | None = None) -> None:
    """`check_selector_values`, and first every other number of a request the Python client is about to send
    (`disagg.model.composition.request_limit_refusal`: no proto field has bounded it yet), so that a caller
    gets the server's refusal, not protobuf's ``ValueError``."""
    refusal = request_limit_refusal(lines, host, field)
    if refusal is not None:
        where, why = refusal
        raise InvalidRequestError(f"{where}: {why}", field=where)
    check_selector_values(lines, field, host)


_LINES_READ: dict[bytes, ResourceRequest] = {}
_HOSTS_READ: dict[bytes, HostRequest] = {}
_PARTS_READ: dict[tuple[bytes, bytes], tuple[tuple[ResourceRequest, ...], HostRequest]] = {}
"""A Compose's one resource line and its host, read and checked together, by their encodings
(`compose_request_from_wire`)."""
K = TypeVar("K", bound=Hashable)


def _remember(read: dict[K, V], encoding: K, size: int, value: V) -> V:
    """``value``, a valid message read from ``encoding`` (``size`` bytes), remembered in ``read``: the same bytes
    read the same (the field's path names only an error), and a model value is immutable, so one read serves every
    request that sends them. Clients send a few kinds of lines and hosts again and again, and reading one costs a
    Compose more than finding its bytes, mostly in building the model's frozen value. At most `MAX_REMEMBERED` are
    remembered, then all are forgotten at once (as `disagg.composer.placement.Placer` forgets its matches)."""
    if size <= MAX_REMEMBERED_BYTES:
        if len(read) >= MAX_REMEMBERED:
            read.clear()
        read[encoding] = value
    return value


def _selectors_from_wire(msgs: Sequence[fm.Selector], parent: str, *, resource: bool) -> tuple[Selector, ...]:
    """The selectors of the request field ``parent``; its ``.selectors`` name is spelt out only when there are
    selectors to check (most requests have none, and this runs per Compose)."""
    if not msgs:
        return ()
    field = f"{parent}.selectors"
    if len(msgs) > MAX_SELECTORS:
        raise InvalidRequestError(f"{field}: at most {MAX_SELECTORS} selectors", field=field)
    return tuple(selector_from_wire(s, f"{field}[{n}]", resource=resource) for n, s in enumerate(msgs))


def resource_to_wire(r: ResourceRequest) -> fm.ResourceRequest:
    msg = fm.ResourceRequest()
    resource_into(msg, r)
    return msg


def resource_into(msg: fm.ResourceRequest, r: ResourceRequest) -> None:
    """Fill ``msg`` with ``r`` in place (see `plan_into`). A field left at proto3's default is not set: the
    message is the same, and every Compose answers with its request's lines."""
    msg.kind = KIND_TO_WIRE[r.kind]
    if r.count:
        msg.count = r.count
    if r.amount_bytes:
        msg.amount_bytes = r.amount_bytes
    if r.selectors:
        msg.selectors.extend([selector_to_wire(s) for s in r.selectors])
    msg.affinity = AFFINITY_TO_WIRE[r.affinity]
    if r.spread:
        msg.spread = r.spread
    if r.max_latency_ns is not None:  # an earlier version recorded larger bounds: one past 584 years is no bound
        msg.max_latency_ns = min(r.max_latency_ns, MAX_LATENCY_NS)


def resource_from_wire(msg: fm.ResourceRequest, field: str) -> ResourceRequest:
    """The resource line ``msg``, the request field ``field``; one sent before is found by its bytes (`_remember`,
    per Compose)."""
    encoding = msg.SerializeToString()
    line = _LINES_READ.get(encoding)
    if line is not None:
        return line
    return _remember(_LINES_READ, encoding, len(encoding), _resource_from_wire(msg, field))


def _resource_from_wire(msg: fm.ResourceRequest, field: str) -> ResourceRequest:
    affinity = Affinity.NONE
    if msg.affinity != fm.AFFINITY_UNSPECIFIED:
        affinity = enum_from_wire(AFFINITY_FROM_WIRE, msg.affinity, f"{field}.affinity", "affinity")
    spread = msg.spread
    if spread and (refusal := spread_refusal(spread)) is not None:
        raise InvalidRequestError(f"{field}.spread: {refusal}", field=f"{field}.spread")
    kind = KIND_FROM_WIRE.get(msg.kind)  # the field's name is spelt out only for an error: this runs per Compose
    if kind is None:
        kind = kind_from_wire(msg.kind, f"{field}.kind")
    try:
        return ResourceRequest(
            kind,
            msg.count,
            msg.amount_bytes,
            _selectors_from_wire(msg.selectors, field, resource=True),
            msg.max_latency_ns if msg.HasField("max_latency_ns") else None,
            affinity,
            spread or None,
        )
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from None


def resources_from_wire(
    msgs: Sequence[fm.ResourceRequest], field: str, *, required: bool
) -> tuple[ResourceRequest, ...]:
    """The resource lines of the request field ``field``, read by index: iterating a repeated field of protobuf's
    messages ends on an IndexError raised and caught, which costs more than reading a line (per Compose)."""
    count = len(msgs)
    if required and not count:
        raise InvalidRequestError(f"{field}: at least one resource is needed", field=field)
    if count > MAX_RESOURCES:
        raise InvalidRequestError(f"{field}: at most {MAX_RESOURCES} resources", field=field)
    if count == 1:  # most requests: no list to build
        return (resource_from_wire(msgs[0], f"{field}[0]"),)
    return tuple([resource_from_wire(msgs[n], f"{field}[{n}]") for n in range(count)])


def host_request_to_wire(h: HostRequest) -> fm.HostRequest:
    """The host request's message; a negative minimum, which a reservation made through the Python API may
    hold (a request is checked first), goes as the 0 it means."""
    return fm.HostRequest(
        name=h.name or "",
        min_cores=max(h.min_cores, 0),
        min_memory_bytes=max(h.min_memory_bytes, 0),
        selectors=[selector_to_wire(s) for s in h.selectors],
    )


def host_request_from_wire(msg: fm.HostRequest, field: str = "host") -> HostRequest:
    """The host request ``msg``, the request field ``field``; one sent before is found by its bytes (`_remember`,
    per Compose)."""
    encoding = msg.SerializeToString()
    host = _HOSTS_READ.get(encoding)
    if host is not None:
        return host
    return _remember(_HOSTS_READ, encoding, len(encoding), _host_request_from_wire(msg, field))


def _host_request_from_wire(msg: fm.HostRequest, field: str) -> HostRequest:
    if msg.name:
        check_driver_id(msg.name, f"{field}.name")
    return HostRequest(
        name=msg.name or None,
        min_cores=msg.min_cores,
        min_memory_bytes=msg.min_memory_bytes,
        selectors=_selectors_from_wire(msg.selectors, field, resource=False),
    )


def compose_request_to_wire(
    request: CompositionRequest,
    mode: ComposeMode = ComposeMode.APPLY,
    *,
    reservation_ttl_s: float = 0.0,
    request_id: str = "",
) -> fm.ComposeRequest:
    return fm.ComposeRequest(
        name=request.name,
        host=host_request_to_wire(request.host),
        resources=[resource_to_wire(r) for r in request.resources],
        mode=MODE_TO_WIRE[mode],
        reservation_ttl_s=reservation_ttl_s,
        request_id=request_id,
    )


def compose_mode_from_wire(value: int, field: str = "mode") -> ComposeMode:
    """The compose mode; UNSPECIFIED is refused, so that a request that forgets it never binds hardware."""
    if value == fm.COMPOSE_MODE_UNSPECIFIED:
        raise InvalidRequestError(
            f"{field}: give the compose mode (PREVIEW, RESERVE or APPLY); it has no default", field=field
        )
    return enum_from_wire(MODE_FROM_WIRE, value, field, "compose mode")


def ttl_from_wire(value: float) -> float:
    if value == 0:
        return 60.0
    if not 0 < value <= MAX_TTL_S:
        raise InvalidRequestError(
            f"reservation_ttl_s: must be above 0 and at most {MAX_TTL_S:g}", field="reservation_ttl_s"
        )
    return value


def compose_request_from_wire(msg: fm.ComposeRequest) -> CompositionRequest:
    """The request of a Compose. One of a single resource line (most) whose line and host were read and checked
    together before is found by their two encodings in one look-up (`_PARTS_READ`, as `_remember` says): the reads
    and the selectors' check, which passed for those bytes, would find the same values and refuse nothing."""
    lines = msg.resources
    if len(lines) == 1:
        key = (lines[0].SerializeToString(), msg.host.SerializeToString())
        parts = _PARTS_READ.get(key)
        if parts is None:
            parts = _remember(_PARTS_READ, key, len(key[0]) + len(key[1]), _request_parts(msg))
    else:
        parts = _request_parts(msg)
    resources, host = parts
    return CompositionRequest(check_name(msg.name, "name"), resources, host)


def _request_parts(msg: fm.ComposeRequest) -> tuple[tuple[ResourceRequest, ...], HostRequest]:
    """A Compose's resource lines and host, read and checked (`check_selector_values`)."""
    resources = resources_from_wire(msg.resources, "resources", required=True)
    host = host_request_from_wire(msg.host)
    check_selector_values(resources, "resources", host)
    return resources, host


def plan_to_wire(plan: Plan) -> fm.Plan:
    msg = fm.Plan()
    plan_into(msg, plan)
    return msg


def plan_into(msg: fm.Plan, plan: Plan) -> None:
    """Fill ``msg`` (a field of the response being built) with ``plan``: building it in place saves the copy
    that assigning a built message makes, on every Compose."""
    msg.host = plan.host
    add_device = msg.devices.add
    for p in plan.devices:
        add_device(device=p.device, resource=p.resource, latency_ns=p.latency_ns)
    if plan.memory:  # reading a repeated field costs as much as adding to it: only when there is memory to add
        add_memory = msg.memory.add
        for m in plan.memory:
            add_memory(pool=m.pool, amount_bytes=m.amount_bytes, resource=m.resource, latency_ns=m.latency_ns)


def plan_from_wire(msg: fm.Plan) -> Plan:
    return Plan(
        host=msg.host,
        devices=tuple(DevicePick(p.device, p.resource, p.latency_ns) for p in msg.devices),
        memory=tuple(MemoryPick(m.pool, m.amount_bytes, m.resource, m.latency_ns) for m in msg.memory),
    )


def composition_to_wire(c: Composition) -> fm.Composition:
    msg = fm.Composition()
    composition_into(msg, c)
    return msg


def composition_into(msg: fm.Composition, c: Composition) -> None:
    """Fill ``msg`` with ``c``, in place (see `plan_into`)."""
    msg.id = c.id
    msg.name = c.name
    msg.host = c.host
    msg.state = STATE_TO_WIRE[c.state]
    add_resource = msg.resources.add
    for r in c.resources:
        resource_into(add_resource(), r)
    add_device = msg.devices.add
    for p in c.devices:
        add_device(device=p.device, resource=p.resource, latency_ns=p.latency_ns)
    if c.allocations:
        msg.allocations.extend([allocation_to_wire(a) for a in c.allocations])
    msg.generation = c.generation
    msg.etag = c.etag
    if c.message:  # proto3's default, as in `resource_into`
        msg.message = c.message


def composition_from_wire(msg: fm.Composition) -> Composition:
    return Composition(
        id=msg.id,
        name=msg.name,
        host=msg.host,
        state=enum_from_wire(STATE_FROM_WIRE, msg.state, "composition.state", "composition state"),
        resources=tuple(resource_from_wire(r, f"composition.resources[{n}]") for n, r in enumerate(msg.resources)),
        devices=tuple(DevicePick(p.device, p.resource, p.latency_ns) for p in msg.devices),
        allocations=tuple(allocation_from_wire(a) for a in msg.allocations),
        generation=msg.generation,
        message=msg.message,
    )


def reservation_to_wire(r: Reservation) -> fm.Reservation:
    return fm.Reservation(
        id=r.id,
        name=r.request.name,
        plan=plan_to_wire(r.plan),
        expires_at=r.expires_at,
        host=host_request_to_wire(r.request.host),
        resources=[resource_to_wire(line) for line in r.request.resources],
    )


def reservation_from_wire(msg: fm.Reservation, field: str = "reservation") -> Reservation:
    """A reservation with the whole request it holds a plan for (name, host request and resource lines)."""
    request = CompositionRequest(
        name=check_name(msg.name, f"{field}.name"),
        resources=resources_from_wire(msg.resources, f"{field}.resources", required=True),
        host=host_request_from_wire(msg.host, f"{field}.host"),
    )
    return Reservation(
        id=check_id(msg.id, f"{field}.id"), request=request, plan=plan_from_wire(msg.plan), expires_at=msg.expires_at
    )


def event_to_wire(ev: Event) -> fm.Event:
    return fm.Event(
        revision=ev.revision,
        type=EVENT_TO_WIRE[ev.type],
        subject=ev.subject,
        message=ev.message,
        time=ev.time,
        data=dict(ev.data),
    )


def event_from_wire(msg: fm.Event) -> Event:
    """An event the server sent. Its revision is a `Revision` carrying the event's time, so that a watch resumed
    from it sends the time, and a log reset or restored since is refused rather than followed (the pattern
    docs/client.md shows: ``watch(after_revision=event.revision)``). A type this release does not know is an
    `UnsupportedError`: the server is newer, and nothing the caller sent was wrong."""
    event_type = EVENT_FROM_WIRE.get(msg.type)
    if event_type is None:
        raise UnsupportedError(
            f"event {msg.revision} has type {msg.type}, which this client does not know (a fabric manager newer "
            "than this disagg release sends the event types it added): upgrade the client to watch its events",
            metadata={"revision": str(msg.revision), "type": str(msg.type)},
        )
    return Event(
        revision=Revision(msg.revision, msg.time),
        type=event_type,
        subject=msg.subject,
        message=msg.message,
        time=msg.time,
        data=dict(msg.data),
    )


def page_size_from_wire(value: int, field: str = "page_size") -> int:
    if value == 0:
        return 100
    if not 1 <= value <= 1000:
        raise InvalidRequestError(f"{field}: must be from 1 to 1000", field=field)
    return value


def page_token_to_wire(collection: str, last_key: str) -> str:
    """An opaque cursor for the page after ``last_key`` of ``collection`` (``devices``, ``compositions``,
    ``reservations``)."""
    return base64.urlsafe_b64encode(f"{collection}:{last_key}".encode()).decode().rstrip("=")


def page_token_from_wire(token: str, collection: str, field: str = "page_token") -> str | None:
    """The last key of the previous page, or None for the first page; a token this server did not give for
    ``collection`` is an `InvalidRequestError`."""
    if not token:
        return None
    bad = InvalidRequestError(f"{field}: not a page token of this listing; pass next_page_token as given", field=field)
    if len(token) > _max_page_token(collection):
        raise bad
    try:
        text = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True).decode()
    except ValueError:  # binascii.Error, UnicodeDecodeError, and base64's own for a character beyond ASCII
        raise bad from None
    prefix, _, key = text.partition(":")
    if prefix != collection or not key:
        raise bad
    if collection not in ANY_TEXT_KEYS and (len(key) > MAX_PAGE_KEY or not key.isprintable()):
        raise bad
    return key


def _max_page_token(collection: str) -> int:
    """The length of the longest token `page_token_to_wire` gives for ``collection``: for ids, a key of
    `MAX_PAGE_KEY` characters of four UTF-8 bytes each, in unpadded base64; for names, `MAX_PAGE_TOKEN`. Longer
    is refused before it is decoded."""
    if collection in ANY_TEXT_KEYS:
        return MAX_PAGE_TOKEN
    size = len(collection.encode()) + 1 + 4 * MAX_PAGE_KEY
    return -(-4 * size // 3)


def kind_filter_from_wire(value: int, field: str = "kind") -> DeviceKind | None:
    """A device-kind filter: None for UNSPECIFIED (every kind)."""
    return None if value == pb.DEVICE_KIND_UNSPECIFIED else kind_from_wire(value, field)


def health_filter_from_wire(value: int, field: str = "health") -> Health | None:
    """A health filter: None for UNSPECIFIED (any health)."""
    return None if value == pb.HEALTH_UNSPECIFIED else health_from_wire(value, field)


def remove_from_wire(values: Sequence[str], field: str = "remove") -> tuple[str, ...]:
    if len(values) > MAX_REMOVE:
        raise InvalidRequestError(f"{field}: at most {MAX_REMOVE} ids", field=field)
    return tuple(check_driver_id(v, f"{field}[{n}]") for n, v in enumerate(values))


def etag_from_wire(value: str, field: str = "etag") -> str | None:
    """An etag guard: None when empty (no guard)."""
    return check_id(value, field) if value else None


def kind_usage_to_wire(usage: KindUsage) -> fm.KindUsage:
    return fm.KindUsage(
        kind=KIND_TO_WIRE[usage.kind],
        total=usage.total,
        free=usage.free,
        used=usage.used,
        unhealthy=usage.unhealthy,
    )


def pool_usage_to_wire(pool: PoolInfo, free_bytes: int) -> fm.PoolUsage:
    return fm.PoolUsage(pool=pool_info_to_wire(pool), free_bytes=free_bytes)


def fabric_info_to_wire(
    name: str, *, driver: str, plugin: str, distribution: str, version: str, capabilities: Capabilities
) -> fm.FabricInfo:
    return fm.FabricInfo(
        name=name,
        driver=driver,
        plugin=plugin,
        distribution=distribution,
        version=version,
        capabilities=capabilities_to_wire(capabilities),
    )
