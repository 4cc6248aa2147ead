"""Composition requests, plans and composed systems, after Redfish's CompositionService."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from disagg.model._enum import ModelEnum
from disagg.model._quick import quick_init
from disagg.model.devices import AttributeValue, DeviceKind
from disagg.model.textcase import spelled_within
from disagg.model.units import shown


@quick_init
@attrs.frozen
class Binding:
    """A whole device bound to a host (a vPPB bound to a port, in CXL FM API terms)."""

    device: str
    host: str


@attrs.frozen
class Extent:
    """A carved range of a pool's device physical address space (a DC extent or an LD range)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@attrs.frozen
class Allocation:
    """Memory carved from a pool for a host. ``id`` is chosen by the caller so that retries are idempotent."""

    id: str
    pool: str
    host: str
    amount_bytes: int
    extents: tuple[Extent, ...] = ()


class SelectorOp(ModelEnum):
    EQ = "="
    NE = "!="
    GE = ">="
    LE = "<="
    GT = ">"
    LT = "<"


_COMPARE: dict[SelectorOp, Callable[[Any, Any], Any]] = {
    SelectorOp.EQ: operator.eq,
    SelectorOp.NE: operator.ne,
    SelectorOp.GE: operator.ge,
    SelectorOp.LE: operator.le,
    SelectorOp.GT: operator.gt,
    SelectorOp.LT: operator.lt,
}


MAX_COUNT = 2**32 - 1
"""The most devices one resource line may ask for: the wire's ``uint32 count`` (and ``min_cores``)."""
MAX_BYTES = 2**64 - 1
"""The largest amount, in bytes, a request may give: the wire's ``uint64 amount_bytes``."""
MAX_LATENCY_NS = 2**64 - 1
"""The largest latency bound, in nanoseconds: the wire's ``uint64 max_latency_ns``."""
SELECTOR_INT_RANGE = range(-(2**63), 2**63)
"""The whole numbers a selector may compare with: the wire's ``int64 int_value``."""
MAX_RESOURCE_LINES = 64
"""The resource lines of a request, and of a composition that updates add lines to: with every line at its largest,
a composition read on the wire stays far within gRPC's 4 MiB (an update that grew it past that was made, and its
answer refused by the client as too large)."""
MAX_SELECTORS = 32
"""The selectors of a resource line, or of the host, a request may give."""
MAX_SELECTOR_KEY = 63
"""The longest key a selector may test, in characters: a label or attribute name."""
MAX_SELECTOR_TEXT = 256
"""The longest text a selector may compare with, in characters. With the wire's other limits it keeps the largest
valid Compose well under gRPC's default 4 MiB message cap, which a client in another language cannot raise on the
server: a request over it is a RESOURCE_EXHAUSTED with no details, which reads as a refusal to place."""


@attrs.frozen
class Selector:
    """A test on one attribute: ``model = H200``, ``gpu_memory >= 80 GiB``. Any value is taken: what a request
    may hold is `request_limit_refusal`'s, checked where requests are read, since the ledger rebuilds this class
    from records an earlier version wrote."""

    key: str
    op: SelectorOp
    value: AttributeValue

    def matches(self, actual: AttributeValue | None) -> bool:
        if actual is None:
            return self.op is SelectorOp.NE
        if isinstance(self.value, str) != isinstance(actual, str) or isinstance(self.value, bool) != isinstance(
            actual, bool
        ):
            return self.op is SelectorOp.NE  # text, truth and numbers never equal one another (True == 1 in Python)
        if isinstance(actual, str) and isinstance(self.value, str) and self.op in (SelectorOp.EQ, SelectorOp.NE):
            return bool(_COMPARE[self.op](actual.lower(), self.value.lower()))
        try:
            return bool(_COMPARE[self.op](actual, self.value))
        except TypeError:
            return False

    def __str__(self) -> str:
        return f"{self.key}{self.op.value}{self.value}"


SELECTOR_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
"""What a selector's key looks like: an attribute or failure-domain label name."""
FAILURE_DOMAIN_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
"""What ``spread`` may name, as the protocol takes it: 1-63 letters, digits, '.', '_' or '-', starting with a
letter or digit. Held to it wherever a request is read, so that a mistyped one (``spread=chassis=a``) is refused
alike by the local composer and a server, never taken for a label that no device has."""


def spread_refusal(label: str) -> str | None:
    """Why ``label`` cannot be a ``spread`` (`FAILURE_DOMAIN_LABEL`), or None: the one check the request
    language and the wire apply, each raising it with the field it read."""
    if FAILURE_DOMAIN_LABEL.fullmatch(label):
        return None
    return (
        f"{shown(label)} is not a failure-domain label (1-63 letters, digits, '.', '_' or '-', starting with a letter "
        "or digit)"
    )


RESOURCE_MODIFIERS = {
    "latency": "a latency limit is latency<=VALUE or latency<VALUE (e.g. latency<=600ns)",
    "affinity": "the only affinity is same-switch (write same-switch or affinity=same-switch)",
    "spread": "spread=LABEL names a failure-domain label",
    "count": "a count is written x8 or 8",
    "amount": "an amount is written with its unit, e.g. 512GiB",
}
"""Words of a resource line that are not device attributes: a selector on one is a mistyped modifier."""

PER_DEVICE_KEYS = frozenset({"serial", "id"})
"""Attributes that name one device: selectors choose among interchangeable devices, never one of them."""


def selector_refusal(key: str, *, resource: bool) -> str:
    """Why a selector may not test ``key`` (empty when it may): every request path (text, document, the Python
    model, the wire) refuses the same keys, so that a mistake is a refused request, never a request that cannot
    fit. ``resource``: the selector is on a resource line rather than on the host."""
    if not SELECTOR_KEY.fullmatch(key):
        return f"{shown(key)} is not an attribute name (a letter or '_' first, then letters, digits, '_', '.', '-')"
    if resource and key in RESOURCE_MODIFIERS:
        return RESOURCE_MODIFIERS[key]
    if resource and key in PER_DEVICE_KEYS:
        return f"selectors choose classes of devices; {key!r} names one device"
    return ""


class Affinity(ModelEnum):
    """Topology affinity of the devices of one resource request."""

    NONE = "none"
    SAME_SWITCH = "same-switch"


@attrs.frozen
class ResourceRequest:
    """One line of a request: ``count`` whole devices, or ``amount_bytes`` of memory carved from pools."""

    kind: DeviceKind
    count: int = 0
    amount_bytes: int = 0
    selectors: tuple[Selector, ...] = ()
    max_latency_ns: int | None = None
    affinity: Affinity = Affinity.NONE
    spread: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.count > 0) == (self.amount_bytes > 0):
            raise ValueError(f"a {self.kind.value} request needs exactly one of a count or an amount")
        if self.count < 0 or self.amount_bytes < 0:
            raise ValueError("count and amount must not be negative")
        if self.amount_bytes and self.kind is not DeviceKind.CXL_MEMORY:
            raise ValueError(f"an amount of bytes can only be carved from cxl-memory, not {self.kind.value}")
        if self.max_latency_ns is not None and self.max_latency_ns < 0:
            raise ValueError("max latency must not be negative")

    @property
    def carved(self) -> bool:
        return self.amount_bytes > 0

    def matches(self, attribute: Callable[[str], AttributeValue | None]) -> bool:
        return all(sel.matches(attribute(sel.key)) for sel in self.selectors)


@attrs.frozen
class HostRequest:
    """The host of a composition: named outright, or chosen by minimum cores, memory and selectors."""

    name: str | None = None
    min_cores: int = 0
    min_memory_bytes: int = 0
    selectors: tuple[Selector, ...] = ()


@quick_init
@attrs.frozen
class CompositionRequest:
    """What a client asks for: one host and the resources to bind to it, all or nothing."""

    name: str
    resources: tuple[ResourceRequest, ...]
    host: HostRequest = HostRequest()

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise ValueError("a composition needs a name")
        if not self.resources:
            raise ValueError("a composition needs at least one resource")


def _over(value: int, most: int, what: str) -> str:
    return f"{what} {value} is more than the most a request may give, {most}" if value > most else ""


def selector_value_refusal(value: AttributeValue) -> str:
    """Why a request may not compare with ``value`` (empty when it may): a whole number beyond int64, a number
    that is not finite or text longer than `MAX_SELECTOR_TEXT`, which the wire cannot carry or no device has."""
    if isinstance(value, bool):
        return ""
    if isinstance(value, str):
        if len(value) > MAX_SELECTOR_TEXT:
            return f"a selector compares with text of at most {MAX_SELECTOR_TEXT} characters, not {len(value)}"
        return ""
    if isinstance(value, int) and value not in SELECTOR_INT_RANGE:
        number = str(value) if value.bit_length() <= 256 else f"a number of {value.bit_length()} bits"
        return (
            f"{number} is beyond the whole numbers a selector compares with, "
            f"{SELECTOR_INT_RANGE.start} to {SELECTOR_INT_RANGE.stop - 1}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a number a device can have"
    return ""


def text_refusal(value: str) -> str:
    """Why ``value`` is no text a request may hold (empty when it may): one holding a lone surrogate, which is no
    UTF-8, and so nothing the wire carries. Python reads a command line's bytes that are not UTF-8 as such, and
    JSON writes one as ``\\ud800``; building the message raised a bare UnicodeEncodeError."""
    if value.isascii():
        return ""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"{value[:64]!r} holds {value[exc.start]!r}, which is not UTF-8 (a byte a terminal or file in another "
            "encoding gave?): write it as UTF-8 text"
        )
    return ""


def _selectors_refusal(selectors: tuple[Selector, ...]) -> tuple[str, str] | None:
    if len(selectors) > MAX_SELECTORS:
        return "selectors", f"at most {MAX_SELECTORS} selectors, not {len(selectors)}"
    for n, sel in enumerate(selectors):
        why = selector_value_refusal(sel.value) or (text_refusal(sel.value) if isinstance(sel.value, str) else "")
        if why:
            return f"selectors[{n}].value", why
    conflict = selectors_conflict(selectors)
    if conflict is not None:
        chosen, why = conflict
        return f"selectors[{chosen[-1]}]", conflict_refusal([str(selectors[m]) for m in chosen], why)
    return None


def _sort(value: AttributeValue) -> type:
    """What a selector's value is compared as: text, a truth or a number, which never equal one another."""
    return str if isinstance(value, str) else bool if isinstance(value, bool) else float


def _same(a: AttributeValue, b: AttributeValue) -> bool:
    """Whether an attribute equal to ``a`` is equal to ``b`` too, as `Selector.matches` compares them."""
    if _sort(a) is not _sort(b):
        return False
    return a.lower() == b.lower() if isinstance(a, str) and isinstance(b, str) else a == b


_LOWER = frozenset({SelectorOp.GE, SelectorOp.GT})
_UPPER = frozenset({SelectorOp.LE, SelectorOp.LT})
_STRICT = frozenset({SelectorOp.GT, SelectorOp.LT})
Bound = tuple[Any, bool]
"""A range's end, as `textcase.Bound`: the value, and whether the range stops short of it."""


def _bound(selectors: Sequence[Selector], ops: frozenset[SelectorOp], tightest: Callable[..., Any]) -> Bound | None:
    """The tightest end the selectors of ``ops`` give a range, strict if one of them stops short of it."""
    ends = [(sel.value, sel.op in _STRICT) for sel in selectors if sel.op in ops]
    if not ends:
        return None
    value = tightest(end for end, _ in ends)
    return value, any(strict for end, strict in ends if end == value)


def _within(value: Any, low: Bound | None, high: Bound | None) -> bool:
    """Whether ``value`` lies above ``low`` and below ``high`` (None: no end)."""
    if low is not None and (value < low[0] or (low[1] and value == low[0])):
        return False
    return high is None or not (value > high[0] or (high[1] and value == high[0]))


def _unmet(selectors: Sequence[Selector]) -> str:
    """Why no attribute meets every one of ``selectors``, all of one key (empty when one may). The values each
    admits are intersected: numbers as the real line (an attribute may be a decimal), truths as false and true,
    text as every string (ordered as written, equal without regard to case). Sound rather than complete: a range
    with no value but for points (``k>1 k<1.0000000000000002``) is left to find no fit, never a request refused that
    a device could meet."""
    musts = [sel for sel in selectors if sel.op is not SelectorOp.NE]
    if not musts:
        return ""  # a device without the attribute meets every !=
    sort = _sort(musts[0].value)
    if any(_sort(sel.value) is not sort for sel in musts):
        return "an attribute is text, a truth or a number, not two of them"
    excluded = [sel.value for sel in selectors if sel.op is SelectorOp.NE]
    low, high = _bound(musts, _LOWER, max), _bound(musts, _UPPER, min)
    if sort is str and low is None:
        low = "", False  # no text is below the empty one
    equal = [sel.value for sel in musts if sel.op is SelectorOp.EQ]
    if equal:
        if any(not _same(equal[0], value) for value in equal):
            return "an attribute has one value"
        if _excluded(equal[0], excluded):
            return "the value asked for is excluded"
        inside = spelled_within(equal[0], low, high) if isinstance(equal[0], str) else _within(equal[0], low, high)
        return "" if inside else "the value asked for is outside the range"
    if sort is bool:
        left: list[Any] = [value for value in (False, True) if _within(value, low, high)]
    elif low is None or high is None or low[0] < high[0]:
        return ""  # infinitely many values, which exclusions cannot all take
    else:
        left = [low[0]] if low[0] == high[0] and not (low[1] or high[1]) else []
    if not left:
        return "no value is within the range"
    return "every value the range leaves is excluded" if all(_excluded(v, excluded) for v in left) else ""


def _excluded(value: AttributeValue, excluded: Sequence[AttributeValue]) -> bool:
    """Whether a selector's ``!=`` of one of ``excluded`` refuses an attribute equal to ``value``."""
    return any(_same(value, other) for other in excluded)


def selectors_conflict(selectors: Sequence[Selector]) -> tuple[tuple[int, ...], str] | None:
    """Selectors of ``selectors``, all on one key, that no value meets together (`_unmet`), none of them
    needless, by their indexes (the last the one after which no value does), and why; None when every key can
    be met. Such a request can never fit: answered NoFitError, it read as a fabric short of devices. One given
    twice alike (``model=a model=a``) asks the same as once, and is taken, as ``k>=1 k>=2`` is."""
    for n, later in enumerate(selectors):
        chosen = [m for m in range(n + 1) if selectors[m].key == later.key]
        if not _unmet([selectors[m] for m in chosen]):
            continue
        for m in chosen[:-1]:  # each earlier one left out that is not needed to leave no value
            rest = [k for k in chosen if k != m]
            if _unmet([selectors[k] for k in rest]):
                chosen = rest
        return tuple(chosen), _unmet([selectors[k] for k in chosen])
    return None


def conflict_refusal(written: Sequence[str], why: str) -> str:
    """The refusal of selectors that no value meets together, named as written."""
    names = [shown(text) for text in written]
    if len(names) == 1:
        return f"{names[0]} can never be met ({why}): no device could ever match it"
    if len(names) == 2:
        return f"{names[0]} and {names[1]} contradict each other ({why}): no device could ever match both"
    listed = f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{listed} contradict one another ({why}): no device could ever match them all"


def resource_limit_refusal(line: ResourceRequest) -> tuple[str, str] | None:
    """The field of ``line`` (as the wire names it: ``count``, ``selectors[2].value``) that a request may not
    hold, and why; None when it may. See `request_limit_refusal`."""
    why = _over(line.count, MAX_COUNT, "a count of")
    if why:
        return "count", why
    why = _over(line.amount_bytes, MAX_BYTES, "an amount of bytes")
    if why:
        return "amount_bytes", why
    if line.max_latency_ns is not None:
        why = _over(line.max_latency_ns, MAX_LATENCY_NS, "a latency bound in ns")
        if why:
            return "max_latency_ns", why
    return _selectors_refusal(line.selectors) if line.selectors else None


def host_limit_refusal(host: HostRequest) -> tuple[str, str] | None:
    """The field of ``host`` (``min_cores``, ``selectors[0].value``) that a request may not hold, and why; None
    when it may. See `request_limit_refusal`."""
    if isinstance(host.name, str):
        why = text_refusal(host.name)
        if why:
            return "name", why
    for name, value, most, what in (
        ("min_cores", host.min_cores, MAX_COUNT, "a minimum of cores"),
        ("min_memory_bytes", host.min_memory_bytes, MAX_BYTES, "a minimum of memory in bytes"),
    ):
        if value < 0:
            return name, f"{what} must not be negative, not {value}"
        why = _over(value, most, what)
        if why:
            return name, why
    return _selectors_refusal(host.selectors) if host.selectors else None


def request_limit_refusal(
    resources: Sequence[ResourceRequest], host: HostRequest | None = None, field: str = "resources"
) -> tuple[str, str] | None:
    """The first field of a request's resource lines (named ``field``: ``resources``, or ``add`` for the lines a
    recompose adds) or host that a request may not hold, with why, as ``("resources[1].count", "...")``; None
    when every field may. A request's numbers are held to the proto fields that carry them (`MAX_COUNT`,
    `MAX_BYTES`, `MAX_LATENCY_NS`, `SELECTOR_INT_RANGE`), a selector's to finite ones, and selectors that
    no value meets together are refused (`selectors_conflict`), so that the local composer and a server refuse the
    same requests.

    Checked where a request is read (the text and document forms, the wire) and where the Python client turns
    one into a message: never by the model classes, which the ledger rebuilds from what an earlier version
    stored, nor where an answer is read."""
    for n, line in enumerate(resources):
        refusal = resource_limit_refusal(line)
        if refusal is not None:
            return f"{field}[{n}].{refusal[0]}", refusal[1]
    if host is not None:
        refusal = host_limit_refusal(host)
        if refusal is not None:
            return f"host.{refusal[0]}", refusal[1]
    return None


class ComposeMode(ModelEnum):
    """Redfish's Compose ``RequestType``: Preview, PreviewReserve, Apply."""

    PREVIEW = "preview"
    RESERVE = "reserve"
    APPLY = "apply"


class CompositionState(ModelEnum):
    """After Redfish ``CompositionState``."""

    COMPOSING = "COMPOSING"
    COMPOSED = "COMPOSED"
    DEGRADED = "DEGRADED"
    DECOMPOSING = "DECOMPOSING"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"
    """A driver it uses has not answered since the fabric manager started: nothing of it is released."""


@quick_init
@attrs.frozen
class DevicePick:
    """A device chosen for a resource request, with the fabric latency from the host."""

    device: str
    resource: int
    latency_ns: int


@attrs.frozen
class MemoryPick:
    """Memory to carve from one pool for a resource request."""

    pool: str
    amount_bytes: int
    resource: int
    latency_ns: int


@quick_init
@attrs.frozen
class Plan:
    """The outcome of placement: a host and what to bind or carve for it, in execution order."""

    host: str
    devices: tuple[DevicePick, ...] = ()
    memory: tuple[MemoryPick, ...] = ()


class ChangeKind(ModelEnum):
    ADD = "add"
    """Devices being bound and memory carved for a composition: undone after a crash."""
    REMOVE = "remove"
    """Devices being unbound and memory released from a composition: finished after a crash."""


@quick_init
@attrs.frozen
class PendingChange:
    """A change to a composition's hardware that was started and not yet recorded as done.

    It is written to the ledger before the first driver call, so that after a crash the fabric manager knows
    what it may have bound or released: an ADD is undone and a REMOVE finished, and the composition goes back
    to ``restore`` (None: it was being created, and is deleted).
    """

    kind: ChangeKind
    devices: tuple[DevicePick, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    restore: CompositionState | None = None
    request_id: str = ""
    """The client's request id for the change, if it gave one, with the digest of the request: recovery
    settles what a retry of it gets."""
    fingerprint: str = ""
    reservation: Reservation | None = None
    """The reservation an apply took: an apply that is undone (it failed, or a crash interrupted it) gives it
    back, for the rest of its time to live."""
    generations_before: tuple[int, ...] = ()
    """An addition to a live composition (a recompose's): the generations whose etags held for its record as it
    began (`Composition.holds_etag`), its own last. Recovery that undoes it, the record as the change wrote it,
    leaves the composition as it was, and they hold again (`Composition.equivalent_generations`)."""


@attrs.frozen
class PriorState:
    """The state and message a composition had before it became UNKNOWN: it goes back to them once every
    fabric it uses answers again, and recovery then finishes what that state says was in flight."""

    state: CompositionState
    message: str = ""


@quick_init
@attrs.frozen
class Composition:
    """A composed system: a host with devices bound and memory carved.

    ``generation`` rises on every change and serves as the etag for guarded updates.
    ``resources`` remembers each request line so that recomposition and healing keep its constraints.
    ``pending`` is the change in flight, if any (see `PendingChange`).
    """

    id: str
    name: str
    host: str
    state: CompositionState
    resources: tuple[ResourceRequest, ...]
    devices: tuple[DevicePick, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    generation: int = 1
    message: str = ""
    pending: PendingChange | None = attrs.field(default=None, eq=False)
    request_id: str = attrs.field(default="", eq=False)
    """The request id of the last change that finished on it (its compose, or a recompose), with the digest
    of that request: a retry whose answer a crash lost finds the change done. This, ``request_fingerprint``
    and ``pending`` are the ledger's bookkeeping: they are not on the wire, nor in comparisons."""
    request_fingerprint: str = attrs.field(default="", eq=False)
    before_unknown: PriorState | None = attrs.field(default=None, eq=False)
    """While UNKNOWN: the state it had before (ledger bookkeeping too). Kept in the record, so that a restart
    while a fabric cannot be reached does not lose a DECOMPOSING or FAILED composition to UNKNOWN."""
    missing: tuple[str, ...] = attrs.field(default=(), eq=False)
    """The device and allocation ids reconciliation found the hardware no longer holds (ledger bookkeeping):
    it stays DEGRADED while it names any, whatever device health says, until the hardware holds them again or
    a recompose removes them. Neither an event nor a heal can tell that they came back."""
    equivalent_generations: tuple[int, ...] = attrs.field(default=(), eq=False)
    """The earlier generations this record equals (ledger bookkeeping): changes begun from them were rolled back
    completely, so their etags guard an update still (`holds_etag`). Never those of the records written while
    the changes ran; the next change of the composition empties it."""

    @property
    def etag(self) -> str:
        """A weak etag of the composition's id and generation: the id too, so that a composition decomposed and
        composed again under the same name (at the same generation) does not match an etag read before."""
        return _etag(self.id, self.generation)

    @property
    def etag_generations(self) -> tuple[int, ...]:
        """The generations whose etags guard an update of this record (`holds_etag`), its own last: what a change
        begun from it, undone completely, leaves valid again."""
        return (*self.equivalent_generations, self.generation)

    def holds_etag(self, etag: str) -> bool:
        """Whether an update guarded by ``etag`` may change this record: its own etag, or that of an earlier
        generation it equals (`equivalent_generations`), which a client read before a change that failed and was
        undone, and which its retry with the same request id sends again."""
        return etag == self.etag or any(etag == _etag(self.id, g) for g in self.equivalent_generations)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(p.device for p in self.devices)


def _etag(comp_id: str, generation: int) -> str:
    return f'W/"{comp_id}.{generation}"'


MAX_RESERVATION_TTL_S = 86_400.0
"""The longest a plan may be held: a day. A reservation holds a host and devices out of placement."""


def reservation_ttl_refusal(seconds: float) -> str | None:
    """Why ``seconds`` cannot be a reservation's time to live (NaN too: it would never expire), or None."""
    if 0 < seconds <= MAX_RESERVATION_TTL_S:
        return None
    return (
        f"the reservation time to live must be above 0 and at most {MAX_RESERVATION_TTL_S:g} seconds, not {seconds!r}"
    )


@attrs.frozen
class Reservation:
    """A plan held for a time to live (Redfish ``CompositionReservation``)."""

    id: str
    request: CompositionRequest
    plan: Plan
    expires_at: float
    request_id: str = attrs.field(default="", eq=False)
    """The request id of the Compose that made it, with its digest: a retry after a crash that lost the answer
    finds the reservation by them (as a composition's record does for its last change). Only the ledger keeps
    them, so they take no part in comparing reservations (one read over the wire has neither)."""
    request_fingerprint: str = attrs.field(default="", eq=False)


_COMPOSITION_FIELDS = tuple(a.name for a in attrs.fields(Composition))
_FIELD_INDEX = {name: n for n, name in enumerate(_COMPOSITION_FIELDS)}
_ALL_FIELDS = operator.attrgetter(*_COMPOSITION_FIELDS)


def revise(comp: Composition, **changes: Any) -> Composition:
    """``attrs.evolve(comp, **changes)`` at a third of its cost (the composer revises a composition on every
    change): every field is read in one call and the class's own ``__init__`` builds the new one."""
    values = list(_ALL_FIELDS(comp))
    for name, value in changes.items():
        at = _FIELD_INDEX.get(name)
        if at is None:
            raise TypeError(f"Composition has no field {name!r}")
        values[at] = value
    return Composition(*values)


_ID_DIGITS = frozenset("0123456789abcdef")


def id_name_refusal(name: str) -> str | None:
    """Why ``name`` may not name a composition or reservation, when it has the shape of the ids the composer
    makes (``c-`` or ``r-`` and 12 lowercase hex digits), else None. A key is looked up as an id before it is
    looked up as a name (`FabricComposer.find`), so one named so would be taken for the one whose id it is: such
    names are refused by the composer, once it has looked up the request id."""
    if len(name) == 14 and name[:2] in ("c-", "r-") and _ID_DIGITS.issuperset(name[2:]):
        return (
            f"{name!r} has the shape of a composition or reservation id (c- or r- and 12 lowercase hex digits), "
            "and a lookup by id or name would find the one with that id: choose another name"
        )
    return None
