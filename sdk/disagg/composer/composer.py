"""`FabricComposer`: places, binds, recomposes, heals and decomposes across one or more fabrics.

Planning and claiming happen under one lock, so two requests never plan the same device; driver calls
happen outside it, so a slow bind does not stall placement for everyone else. A claim is taken before
execution and given back if execution fails, so a device is never offered twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Executor as ThreadPool
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, TypeVar, cast

import attrs

from disagg import codec, failpoints
from disagg.composer import requests, steps
from disagg.composer.execution import ExecutionFailedError, Executor, Leftovers, MemoryStep, driver_error
from disagg.composer.hardware import HardwareView
from disagg.composer.ids import IdMaker
from disagg.composer.index import Inventory, Repeat, repeated_ids, reported_ids
from disagg.composer.ledgerlock import LedgerLock
from disagg.composer.placement import Line, Pin, Placer, added_lines, describe_line
from disagg.composer.steps import DURABLE, Acquire, Call, Steps, Until
from disagg.errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
    RequestAnswerLostError,
    RequestIdReusedError,
    RollbackIncompleteError,
    StaleEpochError,
)
from disagg.interfaces import CallContext, Composer, ComposeResult, Fabric, Subscription, epoch_announcement
from disagg.interfaces.fabric import MAX_ID
from disagg.interfaces.placement import PlacementPolicy
from disagg.model import (
    MAX_RESERVATION_TTL_S,
    Affinity,
    Allocation,
    Binding,
    ChangeKind,
    ComposeMode,
    Composition,
    CompositionRequest,
    CompositionState,
    Device,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    MemoryPick,
    PendingChange,
    Plan,
    PoolInfo,
    PriorState,
    Reservation,
    ResourceRequest,
    Revision,
    Topology,
    id_name_refusal,
)
from disagg.model.composition import MAX_RESOURCE_LINES, reservation_ttl_refusal, revise
from disagg.model.devices import MAX_FABRIC_NAME
from disagg.policies import BestFit
from disagg.store import MemoryStore, RequestRecord, Store
from disagg.store.base import REQUEST_RETENTION, UNDECODABLE, undecodable

log = logging.getLogger("disagg.composer")

EventListener = Callable[[Event], None]
FRESH_ID_TRIES = 100
"""Ids made for one new record before giving up, should every one be in use (an id maker that repeats itself)."""
_ASKING: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("disagg_request", default=("", ""))
"""The request id and digest of the change this thread or asyncio task is running (`_once`), or empty strings. Read
as ``_ASKING.get()`` where it is needed, six times a Compose: a method of the composer around it was a frame each."""
_STATE_VALUE = {state: state.value for state in CompositionState}
"""Each state's text, for the event that tells of a change of state: `Enum.value` is a Python property, two frames."""
_RETRYING_RECORDED: contextvars.ContextVar[bool] = contextvars.ContextVar("disagg_retrying_recorded", default=False)
"""Set while a request id known only from a composition record runs again (`_seed_requests`): its change was
carried out before, so the change must find its work and answer with it, never carry it out again."""


APPLY_FINGERPRINT_TTL_S = 60.0
"""The reservation time to live in the request-id fingerprint of an APPLY, whatever time to live it was sent
with: it means nothing to an APPLY, so a retry that sends another one is the same request. It is the default
every client sends, so the fingerprint an earlier release recorded for an APPLY sent with the default is the
same digest; one recorded with another time to live is matched through `FabricComposer._once`'s
``recorded_before``."""


T = TypeVar("T")
ENDED_RESERVATION_MEMORY = 1_000
"""How many ended reservations the composer remembers the end of, newest kept, to say it to a late apply."""
ENDED_RESERVATION_EVENTS = 10_000
"""How many of the ledger's newest events a start reads for how reservations ended (`FabricComposer._recall_ends`):
the end of one older than those is no longer told after a restart."""
REQUEST_ID_MEMORY = REQUEST_RETENTION
"""How many request ids the composer remembers in memory: as many as the ledger keeps, since a retry is looked up
in memory only, and an id the ledger holds but memory forgot would be carried out again."""
_STANDING = (CompositionState.COMPOSED, CompositionState.DEGRADED)
_BINDING = ""
"""The pool of a quarantine record that is a binding no composition records (its item the device), not memory."""
_RECORDED = object()
"""The answer of a request id known only from the composition record its change left (`_seed_requests`)."""


_ENDED_BY_TIME = "expired: its time to live ran out; reserve again"
"""How a reservation that expired ended, as a late apply is told (`FabricComposer._end_of`)."""


def _applied_as(comp_id: str) -> str:
    """How a reservation applied as ``comp_id`` ended, as a late apply is told."""
    return f"was applied as {comp_id}: read it, or retry that apply with its request id"


def _released_while_applied(comp_id: str) -> str:
    """How a reservation released while its apply (as ``comp_id``) ran ended, as a late apply is told."""
    return f"was released while its apply as {comp_id} ran, which holds its plan unless it failed"


def _ended_by(event: Event) -> str | None:
    """How the reservation ``event`` ended tells, as the run that emitted it told a late apply (`_end_of`), or
    None for an event that ends none. The reason of a release is what its message says after the name (a name
    holds no space)."""
    if event.type is EventType.RESERVATION_EXPIRED:
        return _ENDED_BY_TIME
    if event.type is not EventType.RESERVATION_RELEASED:
        return None
    applied = event.data.get("composition")
    if applied:
        return _applied_as(applied)
    because = event.message.partition(" given back")[2]
    return f"was released{because if because.startswith(': ') else ''}; reserve again"


_ANSWERED = steps.Latch()
"""What a request id with a known answer waits on: nothing, it is set (one for all of them)."""
_ANSWERED.set()


def _finished_by(comp: Composition, request_id: str, fp: str) -> bool:
    """Whether the change with this request id and digest finished whole on ``comp`` (its record says so)."""
    return comp.request_id == request_id and comp.request_fingerprint == fp and comp.pending is None


def _began_from(comp: Composition, change: PendingChange) -> Composition | None:
    """The record an addition to a live composition that recovery undoes began from, rebuilt from ``comp``, the
    COMPOSING record the change wrote as it began (one generation past it): its state was ``change.restore`` and
    the rest as it is. None when the change kept no generations, or anything wrote the record since (a failure
    gave it its reason, `FabricComposer._say_meanwhile`): that may have changed the state to return to and the
    message, and what it began from is not known."""
    held = change.generations_before
    if not held or comp.state is not CompositionState.COMPOSING or comp.generation != held[-1] + 1:
        return None
    assert change.restore is not None
    return revise(comp, state=change.restore, generation=held[-1], pending=None, equivalent_generations=held[:-1])


NAMED_MEANWHILE_TRIES = 8
"""How often a change whose key named nothing, and then a composition it did not hold, looks it up again
(`FabricComposer._holding`): each time a compose took the name and was decomposed again meanwhile."""


EQUIVALENT_GENERATIONS_KEPT = 16
"""How many earlier generations a record that changes rolled back left as they were keeps valid etags of (the
newest): a client that holds an older one is refused as stale, and reads the composition again."""


class _Unheld(str):
    """A change's key that named no composition as the change began (`FabricComposer._holding`)."""

    __slots__ = ()


class _NamedMeanwhileError(Exception):
    """A change's key named no composition as it began, and names one it does not hold now (`_find_held`)."""


class _SettledError(Exception):
    """Raised through `FabricComposer._once` by a call that failed after it had changed something: its request
    id keeps ``error`` as the answer, so that a retry raises it again instead of repeating what was done."""

    def __init__(self, error: DisaggError) -> None:
        super().__init__(error.message)
        self.error = error
        self.recorded = False
        """Written as the answer already, in the transaction of the change's own record (`_remove`)."""


def _again(error: DisaggError) -> DisaggError:
    """A fresh copy of a remembered error, to raise once more (each raise gets its own traceback)."""
    again = type(error).__new__(type(error))
    Exception.__init__(again, *error.args)
    again.__dict__.update(error.__dict__)
    return again


@attrs.frozen
class KindUsage:
    """How many devices of one kind exist, are free, are in use, and are unhealthy."""

    kind: DeviceKind
    total: int
    free: int
    used: int
    unhealthy: int


@attrs.frozen
class PoolUsage:
    pool: str
    device: str
    total_bytes: int
    free_bytes: int


C = TypeVar("C", bound=Callable[..., Any])


def _durably(method: C) -> C:
    """Answer only once everything the call wrote to the ledger is durable (the ledger may group commits). A
    change run as steps needs none: `steps.run` answers so itself. Called inside a hold of the composer's lock
    (a query that `snapshot` reads), it does not wait: the hold's writes are queued only as it ends, and every
    change would wait meanwhile; the holder waits (`snapshot` for the revision it answers with)."""

    @functools.wraps(method)
    def durable(self: FabricComposer, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            if not self._lock.held_here():
                self.store.sync()

    return cast(C, durable)


def _left_bound(comp_id: str, leftovers: Leftovers) -> DisaggError:
    """The error of a removal from ``comp_id`` that left ``leftovers`` part of it (all in its metadata)."""
    names = _named(leftovers.ids)
    metadata = {"composition": comp_id, "bound": _listed(leftovers.ids)}
    if leftovers.timed_out:
        return DeadlineExceededError(
            f"the deadline stopped the removal of {names} from {comp_id}: they are still part of it; remove them "
            "again to retry",
            metadata=metadata,
        )
    return DisaggError(
        f"could not remove {names} from {comp_id}: they are still part of it; remove them again to retry",
        metadata=metadata,
    )


def _request_fields(request_id: str, fp: str) -> dict[str, str]:
    """A composition record's fields that name the request of the change that finished on it; empty for a change
    without one (a heal too), so that the record no longer names an earlier request, whose retry, its answer lost,
    would take this change's work for its own (`_finished_by`) rather than be refused as lost."""
    return {"request_id": request_id, "request_fingerprint": fp}


def _beside(devices: Sequence[DevicePick], replaced: Mapping[str, DevicePick]) -> tuple[DevicePick, ...]:
    """``devices`` with each one ``replaced`` names followed by its replacement: a heal's composition between
    binding the replacements and unbinding the devices they replace."""
    return tuple(q for p in devices for q in ((p, replaced[p.device]) if p.device in replaced else (p,)))


def _composed(answer: object) -> bool:
    """A Compose that made a composition: the composition carries its request id and digest, so a retry after
    a restart finds it (`FabricComposer._made_by_request`) even when the answer's own record was lost."""
    return isinstance(answer, ComposeResult) and answer.mode is ComposeMode.APPLY and answer.composition is not None


def _declares_health_events(fabric: Fabric) -> bool:
    """Whether ``fabric``'s driver declares HEALTH_EVENTS; one that cannot say does not (its discovery tells
    whether it can be used)."""
    try:
        return fabric.capabilities().supports(Feature.HEALTH_EVENTS)
    except Exception:  # a driver's bug too
        return False


def _heard(fabric: Fabric) -> bool:
    """Whether ``fabric``'s events reach the composer now (`Fabric.events_heard`); one that cannot say is not
    heard, and so is asked for its devices' health."""
    try:
        return fabric.events_heard
    except Exception:  # a driver's bug too
        return False


def _being_made(comp: Composition) -> bool:
    """Whether ``comp`` is a new composition whose compose is in flight, or was when a crash interrupted it."""
    return comp.pending is not None and comp.pending.kind is ChangeKind.ADD and comp.pending.restore is None


def _removing(comp: Composition) -> bool:
    """Whether ``comp`` records a removal in flight."""
    return comp.pending is not None and comp.pending.kind is ChangeKind.REMOVE


def _pending_extras(comp: Composition) -> tuple[list[DevicePick], list[Allocation]]:
    """What the composition's change in flight names beyond the composition's own devices and memory: an ADD's
    additions (a REMOVE names only what is its own)."""
    if comp.pending is None:
        return [], []
    have = {p.device for p in comp.devices}
    ids = {a.id for a in comp.allocations}
    return (
        [p for p in comp.pending.devices if p.device not in have],
        [a for a in comp.pending.allocations if a.id not in ids],
    )


def _holdings(comp: Composition) -> tuple[list[DevicePick], list[Allocation]]:
    """The devices and memory a composition may hold on the hardware: its own, and those of its change in
    flight (an ADD's may be bound already, or left bound by a rollback that failed). It claims all of them in
    the index, and a decompose releases all of them."""
    picks, allocs = _pending_extras(comp)
    return [*comp.devices, *picks], [*comp.allocations, *allocs]


def _held_otherwise(alloc: Allocation, host: str, found: Allocation | None) -> bool:
    """Whether the hardware, which holds ``found`` under ``alloc``'s id (None: nothing), lacks ``alloc`` as
    ``host``'s at its recorded size: gone, or carved under its id for another host or at another size, as
    `HardwareView.holds` judges an interrupted compose's."""
    return found is None or found.host != host or found.amount_bytes != alloc.amount_bytes


@attrs.define(eq=False)
class _Touched:
    """What the changes of compositions touched while a reconcile read the hardware: the compositions, and the
    devices and (pool, allocation id) their records held before or after. The read may show any of these half
    changed (bound by a compose that has since rolled back), so that pass judges none of them and the next one
    does; everything else it read, it judges."""

    compositions: set[str] = attrs.field(factory=set)
    devices: set[str] = attrs.field(factory=set)
    allocations: set[tuple[str, str]] = attrs.field(factory=set)

    def add(self, comp: Composition) -> None:
        picks, allocs = _holdings(comp)
        self.compositions.add(comp.id)
        self.devices.update(p.device for p in picks)
        self.allocations.update((a.pool, a.id) for a in allocs)


HEAL_RETRY_MAX_S = 600.0
NAMED = 5
"""The most ids (devices, allocations, pools, fabrics) of one list that a message kept in a record names, then
how many more (`_named`): a composition's message, an event's, a request's stored answer. Named in full, the
failed or missing devices of a large composition grew its record past what the etcd ledger takes in one
(`Store.record_limit`), which failed the ledger and stopped the leader. Each device's own event names it."""
TEXT_KEPT = 1024
"""The most characters of a driver's own text (a fault event's message, an error's) that a record or an event
keeps (`_clipped`), as the driver protocol bounds the message of a fault it injects."""
"""The longest a reconcile waits before it tries again a heal whose binds failed with the same inputs."""


@attrs.define
class _FailedHeal:
    """A heal whose binds failed: what it was tried with (the failed devices and the spares on the switches its
    host reaches, `FabricComposer._heal_inputs`), how many times in a row it failed with them, when it last did
    (the composer's clock), and how many reconcile passes have passed it over since."""

    inputs: tuple[frozenset[str], frozenset[str]]
    failures: int
    at: float
    passes: int = 0


def check_expected_etag(expected_etag: str | None) -> None:
    """Refuse an empty etag guard in the Python API: an etag is never empty, so "" could only ever be stale,
    while None asks for no guard. The wire cannot tell "" from a guard not sent (proto3), so there "" means no
    guard; refused here, a caller gets one answer whether it calls a local composer or a server."""
    if expected_etag == "":
        raise InvalidRequestError(
            "expected_etag is empty: an etag is never empty; leave it out (None) for no guard", field="expected_etag"
        )


def _parts(devices: int, allocations: int) -> str:
    """How many devices and allocations a change added or removed, as its event says it: "2 devices and 1
    allocation", "1 allocation"; "nothing" when a removal left everything held."""
    counts = ((devices, "device"), (allocations, "allocation"))
    return " and ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts if n) or "nothing"


def _named(ids: Sequence[str], separator: str = ", ") -> str:
    """``ids`` as a message kept in a record names them: the first `NAMED`, then how many more. An error's
    metadata lists them so too, separated by commas alone (`_listed`)."""
    if len(ids) <= NAMED:
        return separator.join(ids)
    return f"{separator.join(ids[:NAMED])} and {len(ids) - NAMED} more"


def _listed(ids: Sequence[str]) -> str:
    """``ids`` as an error's ``metadata["bound"]`` lists them (`_named`, comma-separated): the error may be a
    request's answer, kept in a record of its own for its retries, and listed in full the parts a removal of a
    large composition left grew it past what the etcd ledger takes in one (`Store.record_limit`). The
    composition's record names them all."""
    return _named(ids, ",")


def _clipped(text: str) -> str:
    """A driver's ``text`` as a record or an event keeps it: its first `TEXT_KEPT` characters."""
    return text if len(text) <= TEXT_KEPT else f"{text[:TEXT_KEPT]}... ({len(text) - TEXT_KEPT} characters more)"


_LONGEST_CLIPPED = f"{'x' * TEXT_KEPT}... ({10**12} characters more)"
"""A driver's text as long as `_clipped` keeps any: what a change's failure is measured with (`_failed_as`)."""


_LONGEST_REPEATED = "\\" * MAX_ID
"""An id as long as a record may name one that a fabric repeats (`_repeaters`): `MAX_ID` backslashes, each
written as four bytes (``repr`` doubles it, the record escapes both); what a composition is measured with
(`FabricComposer._grown`)."""


_LONGEST_FABRIC = "\U0001d4b3" * MAX_FABRIC_NAME
"""A fabric name as long as a record may write one: `MAX_FABRIC_NAME` characters of four bytes each."""


_LONGEST_ASIDE = (
    f"it reports switch id {_LONGEST_REPEATED!r}, which fabric {', '.join([_LONGEST_FABRIC] * NAMED)} and "
    f"{10**12} more reports too"
)
"""The longest reason `FabricComposer._repeaters` may give a fabric set aside: `_LONGEST_REPEATED` as a switch's
id, other fabrics reporting it too (`_named`), of names as long as any (`_LONGEST_FABRIC`), what a composition is
measured with (`FabricComposer._grown`). It named the fabrics configured then: one configured later, with a longer
name, gave a longer reason than a composition had room for."""


def _away_why(unreachable: Sequence[str], aside: Sequence[tuple[str, str]], gone: Sequence[str]) -> str:
    """Why fabrics cannot be used now (`FabricComposer._why_away`): those ``unreachable`` (`_named`), the first
    `NAMED` of those set aside with why (``aside``), then how many more, and those not loaded (``gone``). Each
    reason set aside may be some hundreds of bytes (it names an id): listed in full, a composition on many such
    fabrics grew its record past what the etcd ledger takes."""
    why = [f"fabric {_named(unreachable)} cannot be reached"] if unreachable else []
    why += [f"fabric {f} is set aside: {reason}" for f, reason in aside[:NAMED]]
    if len(aside) > NAMED:
        why.append(f"{len(aside) - NAMED} more fabrics are set aside")
    if gone:
        why.append(f"fabric {_named(gone)} is not loaded (not in the configuration)")
    return "; ".join(why)


def _written_length(text: str) -> int:
    """The bytes ``text`` takes in a record: its UTF-8, each backslash and quote escaped (ids hold no control
    characters)."""
    return len(text.encode()) + text.count("\\") + text.count('"')


def _incomplete_why(left: str, cause: str) -> str:
    """A composition's message once a change's rollback left ``left`` (`_named`) on the hardware, ``cause`` the
    driver's text (`_clipped`)."""
    return f"rollback incomplete: {left} still held (the change failed: {cause})"


def _incomplete_error(comp_id: str, cause: str, reason: str, leftovers: Sequence[str]) -> RollbackIncompleteError:
    """The answer of a change to ``comp_id`` whose rollback left ``leftovers``, its driver's error the ``reason``
    and the text ``cause`` (`_clipped`)."""
    return RollbackIncompleteError(
        f"{cause}; undoing the change left {_named(leftovers)} held by {comp_id}, which is FAILED: decompose it to "
        "release them",
        metadata={"composition": comp_id, "bound": _listed(leftovers), "cause": reason},
    )


def _longest_parts(comp: Composition) -> list[str]:
    """The ids of what ``comp`` holds and what its pending change names, the longest first."""
    pending = comp.pending
    ids = [*comp.device_ids, *(a.id for a in comp.allocations)]
    if pending is not None:
        ids += [p.device for p in pending.devices] + [a.id for a in pending.allocations]
    return sorted(dict.fromkeys(ids), key=len, reverse=True)


def _left_answer_of(comp: Composition) -> DisaggError:
    """The longest answer of the removal ``comp`` records in flight when it leaves parts bound (`_left_bound`):
    stopped by the deadline, every part it removes left, the longest first."""
    assert comp.pending is not None
    pending = comp.pending
    ids = sorted([*(p.device for p in pending.devices), *(a.id for a in pending.allocations)], key=_written_length)
    return _left_bound(comp.id, Leftovers(tuple(reversed(ids)), timed_out=True))


def _failed_answer_of(comp: Composition) -> RollbackIncompleteError:
    """The answer of the change ``comp`` records in flight when it fails as `FabricComposer._failed_as` leaves it:
    every part it adds left."""
    pending = comp.pending
    left = [] if pending is None else [p.device for p in pending.devices] + [a.id for a in pending.allocations]
    return _incomplete_error(comp.id, _LONGEST_CLIPPED, "DRIVER_ERROR", left)


def _waited_past(comp_id: str) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"the deadline passed while this change waited for another change of composition {comp_id}; nothing was "
        "changed",
        metadata={"subject": comp_id},
    )


class FabricComposer(Composer):
    """The composer over a set of loaded fabrics. Call `start` before use and `close` at the end."""

    def __init__(
        self,
        fabrics: Mapping[str, Fabric],
        *,
        policy: PlacementPolicy | None = None,
        store: Store | None = None,
        epoch: int = 1,
        auto_heal: bool = True,
        call_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
        new_id: Callable[[str], str] | None = None,
    ) -> None:
        if not fabrics:
            raise InvalidRequestError("a composer needs at least one fabric")
        self.fabrics = dict(fabrics)
        self.policy = policy or BestFit()
        self.store = store or MemoryStore()
        self.epoch = epoch
        self.auto_heal = auto_heal
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        """Wall time: the time of events and of a reservation's ``expires_at``, which outlive this run."""
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        """What a reservation expires by within this run (`_reservation_deadlines`): a step of the wall clock (NTP,
        `date -s`) must neither hold one for longer nor expire all at once. A test that injects only ``clock``
        moves both."""
        self._new_id = new_id or IdMaker()
        self._lock = LedgerLock(self.store, self._settle_events)
        """Each outermost hold writes to the ledger in one transaction (`LedgerLock`)."""
        self._compositions: dict[str, Composition] = {}
        self._reservations: dict[str, Reservation] = {}
        self._reservation_deadlines: dict[str, float] = {}
        """Per reservation held, the instant of ``monotonic`` at which it expires."""
        self._ended_reservations: OrderedDict[str, str] = OrderedDict()
        """Per reservation that ended in this run, how (`_end_of`): an apply of it is refused saying so."""
        self._applying_deadlines: dict[str, float] = {}
        """Per composition an apply in flight is making of a reservation, that reservation's deadline: an apply
        undone gives it back for the rest of that time (`_give_back`)."""
        self._listeners: list[EventListener] = []
        self._unheard: list[Event] = []
        """The events of the lock's hold, told to the listeners once the ledger took them (`_settle_events`)."""
        self._subscriptions: list[Subscription] = []
        self._revision = 0
        self._revision_time = 0.0
        """The time of the event at ``_revision`` (`snapshot` answers it with the revision)."""
        self._ledger_time = 0.0
        """The time of the newest event the ledger held at start, which an earlier run's clock wrote: a wall clock
        behind it now went back (or that run's was ahead), and what is left of a reservation is counted from it
        (`_deadline_from_record`)."""
        self._watches: list[_Touched] = []
        """One per reconcile reading the hardware now: every change to a composition's record, with an event or
        without (a rollback puts a composition back silently), notes there what it touched (`_note_touched`)."""
        self._failed_heals: dict[str, _FailedHeal] = {}
        """Per composition, the heal whose binds failed last time, which a reconcile does not try again with the
        same inputs until a back-off passes (`_heal_waits`)."""
        self._cordoned: set[str] = set()
        self._unreachable: set[str] = set()
        """Fabrics whose discovery failed; their compositions are UNKNOWN until they answer."""
        self._unannounced: dict[str, str] = {}
        """Fabrics that did not take this manager's epoch when it was announced, with why: unreachable until they
        do."""
        self._returned: set[str] = set()
        """Fabrics that answered again at a rebuild whose compositions `retry_unreachable` has not settled yet."""
        self._set_aside: dict[str, str] = {}
        """Fabrics whose report repeats an id (`_index`), with why: counted unreachable until it no longer does."""
        self._loaded = False
        """Set once `start` has loaded the ledger and built the index: what the calls that change anything need
        (`_check_started`)."""
        self._busy: dict[str, threading.Lock] = {}
        """Per composition, held by the change in flight (`_held`)."""
        self._heard: dict[str, int] = {}
        """Per fabric, the events heard from it and the discoveries that asked it, counted: an answer it gave
        before the last of them is older than what the index took from it (`retry_unreachable`)."""
        self._quarantined: dict[str, str] = {}
        """Devices reconciliation found bound with no record, with the host each was bound to as last reported
        (empty: reported before a restart, whose ledger record names no host); cordoned, and reported once a
        host."""
        self._quarantined_memory: set[tuple[str, str]] = set()
        """(pool, allocation id) carved with no record: reported once, and durably (the ledger keeps it), so that a
        restart does not report it again."""
        self._strays: dict[tuple[str, str], Allocation] = {}
        """The quarantined allocations the hardware holds now, by (pool, id): kept out of placement (claimed in the
        index, again after every rebuild) until the hardware frees them."""
        self._held_otherwise: dict[tuple[str, str], tuple[Allocation, int]] = {}
        """The allocations a composition records that the hardware holds under the same id for another host or at
        another size, as the last pass read them, by (pool, id): the hardware's allocation, and the bytes of it
        claimed in the index beyond the record's (again after every rebuild). A release by the id would free
        memory that is not the composition's: `_release` quarantines it instead."""
        self._names: dict[str, str] = {}
        """Name to the id of the composition or reservation that holds it; names are unique among both."""
        self._requests: OrderedDict[str, tuple[str, object, steps.Latch]] = OrderedDict()
        """Request id to (digest of the request, first answer or None while running, set when answered)."""
        self._requests_running = 0
        """How many of `_requests` are still running (no answer): the ledger holds none of them, so they take no
        place among the answers memory keeps (`_forget_oldest_requests`)."""
        self._answers_pushed_out = False
        """Whether the ledger held as many answers as it keeps when this composer started: an id known then only
        from a record (`_seed_requests`) may have had its answer pushed out by newer ones, not lost in a crash."""
        self._inv = Inventory([])
        self._placer = Placer(self._inv, self.policy)
        self._executor = Executor(self.fabrics, self._context)
        self._started = False
        self._healer: ThreadPoolExecutor | None = None
        """Heals that may wait on hardware, off the thread that delivers the fabric's events (`_heal_soon`)."""
        self._heals: set[Future[int]] = set()
        """The heals handed to ``_healer`` that have not ended (`wait_for_heals`)."""
        self._closing = False
        """Set by `cancel_start` and `close`, without the lock: no heal starts after it, on fabrics it closes, and a
        `start` running stops at its next step (`_stop_if_closing`)."""
        self._early: list[FabricEvent] | None = None
        """While `start` runs: the fabric events that came meanwhile, in order, applied as it ends."""
        self.lead: Callable[[], bool] | None = None
        """With high availability, once leading: whether this replica surely still leads (`Leadership.leading`),
        asked before each heal it starts of its own accord (`_heal_all`), and before a resync event brings back a
        fabric counted unreachable (`_resync`), which recovers the changes interrupted there. Its driver calls
        carry an epoch that a new leader may have replaced once the lease may have run out, and a driver without
        FENCING takes them."""

    # ----------------------------------------------------------------- life cycle

    @_durably
    def start(self) -> None:
        """Subscribe to fabric events, discover every fabric, rebuild the index and reload the ledger; then apply
        the events that came meanwhile. Subscribed first: a device that failed after its discovery and before a
        later subscription sent its event to no one, and nothing else reads device health again.

        Raises `FabricUnavailableError` when the composer is closing (`cancel_start`), checked between the fabrics
        it discovers and before each later step: it makes no driver call or ledger read after that."""
        self._stop_if_closing()
        with self._lock:
            self._early = []
        for fabric in self.fabrics.values():
            self._subscriptions.append(fabric.subscribe(self._on_fabric_event))
        with self._lock:
            self._stop_if_closing()
            state = self.store.load()
            self._revision = state.last_revision
            newest = self.store.events_after(state.last_revision - 1, 1) if state.last_revision else []
            self._revision_time = newest[0].time if newest and newest[0].revision == state.last_revision else 0.0
            self._ledger_time = self._revision_time
            self._compositions = {c.id: c for c in state.compositions}
            self._reservations = {r.id: r for r in state.reservations}
            self._reservation_deadlines = {r.id: self._deadline_from_record(r) for r in state.reservations}
            self._recall_ends()
            self._names = {c.name: c.id for c in state.compositions}
            self._names.update({r.request.name: r.id for r in state.reservations})
            self._cordoned = set(state.cordons)
            self._quarantined = {item: "" for pool, item in state.quarantined if pool == _BINDING}
            self._quarantined_memory = {q for q in state.quarantined if q[0] != _BINDING}
            for record in state.requests:
                try:
                    answer = requests.decode(record.answer)
                except UNDECODABLE as exc:  # a damaged or hand-edited record: the operator's to restore
                    raise undecodable("", f"the answer to request id {record.id!r}", exc) from exc
                value = _SettledError(answer) if isinstance(answer, DisaggError) else answer
                self._requests[record.id] = (record.fingerprint, value, _ANSWERED)
            self._answers_pushed_out = len(state.requests) >= REQUEST_RETENTION
            self._rebuild()  # stops between two fabrics when closing (`_discover_all`)
            self._stop_if_closing()
            self._mark_unknown()
            self._settle_known()
            # Before expiry: a reservation that ran out while no fabric manager ran still tells its request id, whose
            # answer a crash may have lost (`_seed_requests`).
            self._seed_from(list(self._reservations.values()))
            # Before recovery: a composition's record that names a finished change may be all that tells of its
            # request id; should recovery delete or replace it (finish a decompose or a removal), the id turns into
            # REQUEST_ANSWER_LOST (`_lose_seed`) rather than be forgotten, and its retry carried out again. One being
            # made names its own change, which recovery finishes and answers, or undoes.
            self._seed_from([c for c in self._compositions.values() if not _being_made(c)])
            self._expire_locked()
            self._loaded = True
        later: tuple[Callable[[], object], ...] = (
            self._recover,
            self._seed_requests,
            self.reconcile,
            self._apply_early_events,
        )
        for step in later:
            self._stop_if_closing()
            step()

    def cancel_start(self) -> None:
        """Have a `start` running in another thread stop at its next step, raising `FabricUnavailableError`: a
        server that stops without waiting for it any longer; no heal starts after it either. Takes no lock (that
        start holds the composer's while it discovers). A driver call already made is the driver's to end; the
        composer is to be closed after."""
        self._closing = True

    def stand_down(self) -> None:
        """Act on nothing of its own accord any more, for a server that stopped serving (another replica leads, or
        the ledger failed): no fabric's event is applied (a heal one started would call the drivers with an epoch
        a new leader replaced), no heal starts, and a `start` running stops at its next step. Its fabrics and its
        ledger stay open until `close`."""
        self.cancel_start()
        subscriptions, self._subscriptions = self._subscriptions, []
        for sub in subscriptions:
            sub.cancel()

    def _stop_if_closing(self) -> None:
        if self._closing:
            raise FabricUnavailableError("the composer was closed while it started")

    def _check_started(self) -> None:
        """Refuse, before anything is written, a call that needs the ledger loaded on a composer whose `start`
        has not loaded it: a reconcile would take every binding for an orphan and cordon it, and its events
        would take revisions the ledger has given already. Refuse too, with its reason, every change once the
        ledger failed as a whole (`Store.failure`): none could be made durable, and what this composer holds may
        differ from the disk until a restart recovers from it and the hardware."""
        if not self._loaded:
            raise FabricUnavailableError("the composer has not been started: call start() first; nothing was changed")
        if failure := self.store.failure:
            raise FabricUnavailableError(
                f"the ledger takes no more writes ({failure}); nothing was changed: restart the composer, which "
                "recovers from the ledger and the hardware"
            )

    def _apply_early_events(self) -> None:
        """Apply the events that came while `start` ran, then those that come while they are applied, in order;
        the composer is started once none is left. Each batch heals once its last event is applied: a device
        that failed and came back meanwhile is healthy by then, and is kept, not replaced."""
        while True:
            with self._lock:
                early, self._early = self._early or [], []
                if not early:
                    self._early = None
                    self._started = True
                    return
            sick: list[str] = []
            for event in early:
                sick += [c for c in self._apply_event(event) if c not in sick]
            self._heal_soon(sick)

    # ----------------------------------------------------------------- one change of a composition at a time

    def _held(self, key: str, run: Callable[[str], T]) -> T:
        """`_holding` for a change that waits for nothing else, in this thread."""
        return steps.run(self._holding(key, lambda target: steps.finished(run(target))), self.store)

    def _holding(self, key: str, change: Callable[[str], Steps[T]], deadline: float | None = None) -> Steps[T]:
        """Run ``change`` holding composition ``key`` (an id or a name) against every other change of it,
        driver calls included, so that concurrent changes of one composition end as some serial order would.
        ``change`` is given the id the key named when the change began: a name may name another composition by
        the time the lock is taken (the first decomposed and a new one composed under its name), which this lock
        does not hold. A key that names no composition is not held: ``change`` is given it as `_Unheld` and
        answers for it, unless a compose takes the name before the change looks it up (`_find_held`): the change
        then starts again, holding that composition, so that it waits for the compose instead of changing a
        composition whose binds are under way. Raises
        `ConflictError` when another change holds it for longer than the call timeout, and
        `DeadlineExceededError`, with nothing changed, when the caller's ``deadline`` (a ``time.monotonic()``
        instant) passes first: a change whose caller has gone would only fail its driver calls, roll back and
        leave a newer etag and events behind, refusing other clients' guarded updates for nothing."""
        for _ in range(NAMED_MEANWHILE_TRIES):
            with self._lock:
                comp = self._compositions.get(key) or self._compositions.get(self._names.get(key, ""))
                lock = self._busy.setdefault(comp.id, threading.Lock()) if comp is not None else None
            if comp is not None and lock is not None:
                break
            try:
                return (yield from change(_Unheld(key)))
            except _NamedMeanwhileError:
                continue  # a compose took the name since: held, as any composition, before it is changed
        else:
            raise ConflictError(f"{key} was composed and decomposed again while this change waited for it; retry")
        wait = self.call_timeout_s if deadline is None else min(self.call_timeout_s, deadline - time.monotonic())
        if not (yield Acquire(lock, max(0.0, wait))):
            if deadline is not None and time.monotonic() >= deadline:
                raise _waited_past(comp.id)
            raise ConflictError(
                f"composition {comp.id} is busy with another change; retry", metadata={"subject": comp.id}
            )
        if deadline is not None and time.monotonic() >= deadline:
            self._let_go(comp.id, lock)
            raise _waited_past(comp.id)
        try:
            return (yield from change(comp.id))
        finally:
            self._let_go(comp.id, lock)

    def _find_held(self, target: str) -> Composition:
        """The composition a change run by `_holding` is given (``target``), looked up as it starts: NotFoundError
        when there is none, and `_NamedMeanwhileError`, before anything is changed, when ``target`` named nothing as
        the change began and names a composition now, which this change does not hold. Under the lock."""
        comp = self.find(target)
        if isinstance(target, _Unheld):
            raise _NamedMeanwhileError(comp.id)
        return comp

    async def run_async(self, change: Steps[T], threads: ThreadPool) -> T:
        """Run a change (`compose_steps`, `decompose_steps`) on the running event loop: it waits for the ledger
        without a thread, and hands blocking driver calls to ``threads``. Answers once its writes are durable,
        as the blocking methods do (`steps.LoopRun`)."""
        return await steps.run_async(change, self.store, threads)

    def _driver_call(self, fn: Callable[[], T], fabrics: Iterable[str]) -> Call:
        """A step of driver calls on ``fabrics``: blocking unless every one of them says its calls never wait. A
        loop rather than `any` over a generator, whose frame every Compose made."""
        known = self.fabrics
        for name in fabrics:
            fabric = known.get(name)
            if fabric is not None and fabric.calls_block:
                return Call(fn)
        return Call(fn, blocking=False)

    def _let_go(self, comp_id: str, lock: threading.Lock) -> None:
        """Release a composition's lock, and forget it when the composition is gone. A composition that is
        still there needs no composer lock: whichever change removes it later forgets its lock then. One that a
        fabric gone meanwhile holds something of becomes UNKNOWN first (`_mark_unknown` left it to its change)."""
        if self._unreachable:
            with self._lock:
                comp = self._compositions.get(comp_id)
                if comp is not None:
                    self._mark_unknown_one(comp)
        lock.release()
        if comp_id in self._compositions:
            return
        with self._lock:
            if comp_id not in self._compositions and self._busy.get(comp_id) is lock:
                del self._busy[comp_id]

    def fence_drivers(self) -> None:
        """Tell every driver that declares FENCING this manager's epoch at once, before any real call: an
        unbind of a binding that does not exist, which changes nothing but is a mutating call, and a driver
        remembers the highest epoch of every mutating call it receives. A replica that just took the lead calls
        it, so that the replica it replaced is refused from that moment, not from this one's first bind; a fabric
        that cannot be reached then is told when it answers again (`retry_unreachable`)."""
        self._announce_epoch(self.fabrics)

    def _fence(self, name: str, ctx: CallContext) -> None:
        """Tell fabric ``name`` this manager's epoch, where it fences (an unbind of its fence binding)."""
        fabric = self.fabrics[name]
        if fabric.capabilities().supports(Feature.FENCING):
            fabric.unbind(epoch_announcement(name), ctx)

    def _answers(self, name: str) -> Topology | None:
        """The topology fabric ``name``, unreachable, discovers now, having taken the epoch; None if it does not
        answer. Asked outside the lock, and the rebuild under it takes this answer rather than asking again: a
        driver that hangs until its timeout would otherwise hold every change and every report of a failure
        elsewhere for that long (a failure is to degrade its compositions within a second)."""
        try:
            self._fence(name, self._context())
        except Exception:  # a driver's bug too: it stays unreachable, as `_discover_all` counts it
            return None
        return self._discovered(name)

    def _announce_epoch(self, names: Iterable[str]) -> None:
        """Announce the epoch to ``names``; one that does not take it is remembered (`_unannounced`) and counts
        as unreachable until it does: a deposed manager's older epoch would be accepted there meanwhile."""
        ctx = self._context()
        for name in names:
            try:
                self._fence(name, ctx)
            except Exception as raised:  # a driver's bug too: that fabric waits, the others are served
                exc = raised if isinstance(raised, DisaggError) else driver_error(name, raised)
                log.warning("could not announce epoch %d to fabric %s: %s", self.epoch, name, exc.message)
                self._unannounced[name] = _epoch_refused(exc)
            else:
                self._unannounced.pop(name, None)

    # ----------------------------------------------------------------- recovery and reconciliation

    def _recover(self, only: set[str] | None = None) -> None:
        """Finish or undo what a crash interrupted: a new composition whose every binding and allocation the
        hardware holds is finished (its answer may have been given: `_bind_new`); any other pending ADD is
        undone (a new composition deleted, a changed one put back as it was); a pending REMOVE and a
        DECOMPOSING composition (with whatever change it keeps) are finished. What cannot be undone leaves the
        composition FAILED, naming it.

        ``only``: just these compositions (those of a fabric that answers again, while every other change
        may be in flight). Each is recovered holding it against every other change of it (`_recover_one`)."""
        hardware = HardwareView(self.fabrics)
        with self._lock:
            # Settled once its fabric answers (`retry_unreachable`) when it touches one that does not.
            chosen = [
                c
                for c in self._compositions.values()
                if (only is None or c.id in only) and not self._touches_unreachable(c)
            ]
        for comp in chosen:
            if comp.state is CompositionState.DECOMPOSING:
                # First: a FAILED composition keeps the pending ADD its refused rollback left, and is decomposed
                # with it (`_holdings`); undone as an interrupted change, it would stand again, half released.
                log.warning("finishing the decompose of %s that a restart interrupted", comp.id)
                finish = self._holding(comp.id, lambda target: self._decompose(target, None, stage="recovery"))
                try:
                    steps.run(finish, self.store)
                except DisaggError as exc:
                    log.error("could not finish the decompose of %s: %s", comp.id, exc.message)
            elif comp.state is CompositionState.FAILED:
                # Its pending change names what a refused rollback left: it stays claimed, the composition FAILED,
                # until a decompose releases it (docs/durability.md), however the hardware stands now.
                continue
            elif comp.pending is not None or comp.state is CompositionState.COMPOSING:
                try:
                    self._held(comp.id, functools.partial(self._recover_one, comp, hardware))
                except ConflictError as exc:  # the change that holds it settles it
                    log.warning("not recovering %s: %s", comp.id, exc.message)

    def _recover_one(self, seen: Composition, hardware: HardwareView, comp_id: str) -> None:
        """Recover one composition as `_recover` reads it (``seen``), holding it (`_held`): at run time a
        decompose may come while the hardware is read or released, and the two must not both write the record
        and give its claims back. Its record is read again once held: one that changed since, or is gone, was
        settled by the change that did it, and is left alone. An existing composition stands again with what the
        hardware lost of it meanwhile (`_lost_on`) in its state, so that it is not COMPOSED for a moment before a
        reconciliation degrades it."""
        with self._lock:
            comp = self._compositions.get(comp_id)
            if comp is None or comp.generation != seen.generation or self._touches_unreachable(comp):
                return
        change = comp.pending
        if change is not None and self._finished_on_hardware(comp, change, hardware):
            return
        if change is None or change.kind is ChangeKind.REMOVE or change.restore is not None:
            lost = self._lost_on(comp, hardware)
            comp = comp if lost is None else revise(comp, missing=lost)
        if change is not None:
            self._recover_change(comp, change)
            return
        # Nothing was in flight on the hardware: a removal alone cut off before its plan, by an older release.
        with self._lock:
            self._set_standing(comp)

    def _lost_on(self, comp: Composition, hardware: HardwareView) -> tuple[str, ...] | None:
        """What the hardware no longer holds of ``comp``'s own devices and memory (its `Composition.missing`),
        judged as reconciliation judges it: a device not bound to its host, an allocation not carved for its host
        at its size (`_held_otherwise`), or carved from a pool its fabric no longer reports. None when a fabric of
        it cannot be read now."""
        try:
            lost = [
                p.device for p in comp.devices if hardware.bound(self._fabric_of(p.device)).get(p.device) != comp.host
            ]
            lost += [
                a.id
                for a in comp.allocations
                if a.pool not in self._inv.pools
                or _held_otherwise(a, comp.host, hardware.carved(self._fabric_of_pool(a.pool), a.pool).get(a.id))
            ]
        except DisaggError as exc:
            log.warning("cannot read the hardware of %s: %s", comp.id, exc.message)
            return None
        return tuple(lost)

    def _finished_on_hardware(self, comp: Composition, change: PendingChange, hardware: HardwareView) -> bool:
        """Finish a new composition whose pending ADD the hardware holds whole, as COMPOSED (or DEGRADED), with
        the allocations as the hardware has them; returns whether it did. Compose answers once its plan is
        durable and every driver call has succeeded, before its COMPOSED record is on disk, so a crash between
        the two must find the composition again, not undo it."""
        if change.kind is not ChangeKind.ADD or change.restore is not None:
            return False
        try:
            held = hardware.holds(
                comp.host,
                [(self._fabric_of(p.device), p.device) for p in change.devices],
                [(self._fabric_of_pool(a.pool), a) for a in change.allocations],
            )
        except DisaggError as exc:
            log.warning("cannot read the hardware of %s (%s): undoing its interrupted compose", comp.id, exc.message)
            return False
        if held is None:
            return False
        log.warning("a restart interrupted the compose of %s after the hardware held all of it: finishing it", comp.id)
        with self._lock:
            self._unclaim_addition(comp)  # the planned memory, claimed with the composition: claim the hardware's
            for alloc in held:
                if alloc.pool in self._inv.pools:
                    self._inv.claim_memory(alloc.pool, alloc.amount_bytes)
            done = self._set_standing(comp, allocations=held, pending=None)
            if change.request_id and change.request_id not in self._requests:  # the answer the crash lost
                result = ComposeResult(ComposeMode.APPLY, self._plan_of(done), composition=done)
                self._answered(change.request_id, change.fingerprint, result)
        return True

    def _recover_change(self, comp: Composition, change: PendingChange) -> None:
        verb = "undo" if change.kind is ChangeKind.ADD else "finish"
        log.warning("a restart interrupted a change of %s: %s it", comp.id, verb)
        leftovers = self._release(comp.host, change.devices, change.allocations, stage="recovery")
        with self._lock:
            if leftovers:
                names = _named(leftovers.ids)
                log.warning("after a restart, could not %s %s of %s", verb, ", ".join(leftovers.ids), comp.id)
                self._emit(EventType.ROLLBACK_INCOMPLETE, comp.id, f"after a restart, could not {verb} {names}")
                # The record holds the change, and may be at the edge of what the ledger takes (a removal's
                # first): the words shorter, or none, when it would not take them (`_fits`, which measures it as
                # UNKNOWN too); FAILED is written either way, no longer than the record the crash left.
                counted = f"interrupted change: {len(leftovers.ids)} parts still held"
                for message in (f"interrupted change: {names} still held", counted):
                    if self._fits(comp, state=CompositionState.FAILED, message=message):
                        break
                else:
                    message = ""
                self._set(comp, state=CompositionState.FAILED, message=message)
                return
            if change.kind is ChangeKind.ADD and change.request_id:
                self._requests.pop(change.request_id, None)  # undone: a retry runs again
                self.store.delete_request(change.request_id)
            if change.kind is ChangeKind.ADD and change.restore is None:
                self._unclaim_composition(comp)
                self._forget(comp, "rolled back after a restart interrupted it")
                self._give_back(comp.id, change)
                return
            if change.kind is ChangeKind.ADD:
                assert change.restore is not None
                self._unclaim_addition(comp)
                # A standing composition is judged again, as `_fail_addition` does: a device may have failed
                # while the change ran or no manager did, which no event judged.
                if change.restore in _STANDING:
                    self._set_standing(comp, _began_from(comp, change), message=comp.message, pending=None)
                else:
                    self._set(comp, state=change.restore, pending=None)
                return
            # Finished as the change would have finished it, the record naming its request (a heal's names none).
            mark = _request_fields(change.request_id, change.fingerprint)
            comp = self._without(comp, {p.device for p in change.devices}, change.allocations, **mark)
            if change.request_id:
                self._answered(change.request_id, change.fingerprint, comp)  # finished: a retry gets it

    @_durably
    def reconcile(self) -> int:
        """Hold the ledger against the hardware, which is the truth; returns how many things it changed.

        A binding or allocation that no composition records is quarantined (the device cordoned, the memory
        kept out of placement) and reported, never silently removed; a composition whose device or memory the
        hardware no longer holds, or whose device discovery reports unhealthy, becomes DEGRADED (with auto-heal,
        one whose only trouble is unhealthy devices is then healed). A fabric whose driver sends no health events
        (`_tells_health`) is discovered again, outside the lock, and the health it reports applied as its events
        would have (`_take_health`), and the pools' capacities it reports taken (`_take_pools`). Compositions
        with a change in flight are
        left alone, and so are fabrics that cannot be read now. What a change touched while the hardware was read
        (its composition, the devices and memory its record held before or after) is set aside for the next pass
        (`_Touched`), so that a change racing with the read is never mistaken for an orphan or a loss, while
        everything else is judged: on a busy fabric manager every pass still judges. A second pass over a
        converged system changes nothing.
        """
        changes, healable, degraded = self._reconcile_pass()
        if self.auto_heal:
            # Every composition that healing can mend: one degraded by this pass, one whose device failed while no
            # composer ran, and one whose heal found no replacement before (a device freed or repaired since may
            # be one now). A heal that still finds none changes nothing, so a converged system stays as it is.
            changes += self._heal_all(healable, retry=lambda c: c not in degraded and self._started)
        return changes

    @_durably
    def _resync(self, event: FabricEvent) -> None:
        """Reconcile ``event``'s fabric alone, at once (its driver says its state may have changed behind the
        manager: RESYNC_REQUIRED), its devices' health and pools' capacities (`_take_pools`) read with its
        bindings and allocations. Run on the thread
        that delivers the fabric's events, before the next: a health event after it must find the lost bindings
        missing already, or it would stand their composition COMPOSED again. The heal it leaves runs beside the
        events (`_heal_soon`), as a failure event's does."""
        if self._closing:
            return
        why = f"fabric {event.fabric} asked to be read again ({event.message or event.subject})"
        log.info("%s; reconciling it now", why)
        try:
            settled = None
            if self._counted_away(event.fabric) and self._back_now(event):
                settled = self._bring_back(event.fabric)
            _, healable, degraded = self._reconcile_pass(frozenset({event.fabric}), why)
        except DisaggError as exc:  # the ledger failed: nothing can be judged now, nor made durable
            log.warning("fabric %s was not read again on its resync event: %s", event.fabric, exc.message)
            return
        if self.auto_heal:
            # What it settled as `retry_unreachable` heals it: failures told while UNKNOWN healed nothing.
            back = sorted(settled or ())
            self._heal_soon(
                list(dict.fromkeys(healable + back)),
                retry=lambda c: c not in degraded and c not in back and self._started,
            )

    @_durably
    def poll_unheard(self) -> int:
        """Reconcile each fabric that declares HEALTH_EVENTS but whose events are not heard now (`Fabric.events_heard`:
        a remote driver's event stream broken, refused, or without headers), those fabrics alone, as `_resync`
        reconciles one: a failure its events would have told within a second is otherwise seen only at the next
        reconcile pass. A server calls it on its timer, every few seconds; returns how many things it changed.
        A fabric whose events are heard is not asked (they tell its failures), nor one that does not declare them
        (every pass discovers it), nor one counted unreachable (`retry_unreachable` asks it). Once the stream is
        open again, its watcher reports what changed meanwhile as events: nothing told while unheard is lost."""
        names = frozenset(
            name
            for name, fabric in self.fabrics.items()
            if not _heard(fabric) and _declares_health_events(fabric) and not self._counted_away(name)
        )
        if not names:
            return 0
        why = "its events are not heard now (its driver's event stream is not open)"
        changes, healable, degraded = self._reconcile_pass(names, why)
        if self.auto_heal:
            # Only what it degraded, as after the events that would have told it: a heal that failed before is
            # retried by the passes, whose back-off counts passes, and a poll every few seconds would shorten it.
            changes += self._heal_all([c for c in healable if c in degraded])
        return changes

    def _back_now(self, event: FabricEvent) -> bool:
        """Whether ``event``'s fabric, counted unreachable, is brought back now: not once this replica may no
        longer lead (`lead`), as the timer's retry of it would not start; the leader's brings it back."""
        if self._leads():
            return True
        log.warning(
            "not bringing fabric %s back on its resync event: this replica's lease may have run out by its clock, "
            "and another replica may lead now; the leader recovers its compositions",
            event.fabric,
        )
        return False

    def _leads(self) -> bool:
        """Whether this replica may act of its own accord: no high availability, or a lease surely held (`lead`)."""
        return self.lead is None or self.lead()

    def _counted_away(self, name: str) -> bool:
        """Whether fabric ``name`` counts unreachable, or answered again at a rebuild whose compositions
        `retry_unreachable` has not settled yet: a reconcile pass skips the one and judges none of the other's
        UNKNOWN compositions."""
        with self._lock:
            return name in self._unreachable or name in self._returned

    def _reconcile_pass(self, only: frozenset[str] | None = None, why: str = "") -> tuple[int, list[str], set[str]]:
        """`reconcile` without its heals, of the fabrics ``only`` (every one when None), whose devices' health it
        then discovers whatever their driver declares (``why`` says so in the health events); returns how many
        things it changed, the compositions a heal can mend (those of ``only``), and those it degraded."""
        self._check_started()
        with self._lock:
            watch = _Touched()  # from now until the judgement, every change of a composition notes what it touches
            self._watches.append(watch)
            pools: dict[str, list[str]] = {}
            for entry in self._inv.pools.values():
                pools.setdefault(entry.info.fabric, []).append(entry.info.id)
            # One counted unreachable has no pools in the index: read, it would seem to hold no memory at all.
            away = set(self._unreachable) | (set(self.fabrics) - only if only is not None else set())
            heard = dict(self._heard)
        try:
            bound, carved, read, pools_read = self._read_hardware(pools, away)
            # Discovered: one not read, to tell a driver that stopped from a listing that failed; and one that
            # tells no failure, to learn its devices' health. One that answers neither counts as unreachable; one
            # whose hardware was read answers this pass, and only its health waits for the next (`_unlearnt`).
            unheard = {
                name for name in self.fabrics if name not in away and (only is not None or not self._tells_health(name))
            }
            asked = [name for name in self.fabrics if name not in away and (name not in read or name in unheard)]
            found = {name: topology for name in asked if (topology := self._discovered(name)) is not None}
            lost = {name for name in asked if name not in found and name not in read}
            reported = self._health_reported({name: t for name, t in found.items() if name in unheard})
            self._unlearnt(name for name in asked if name not in found and name in read)
        except BaseException:
            with self._lock:
                self._unwatch(watch)
            raise
        with self._lock:
            self._unwatch(watch)  # under the lock the judgement holds: no change comes in between
            lost_now = self._lose(lost, heard)
            # Recorded before the judgement, which then words each verdict with it, and the compositions a health
            # touched held to it after: one verdict a composition, never COMPOSED on the way to DEGRADED.
            told, sickened, touched = self._take_health(reported, heard, why)
            # Before the memory is judged, which then releases the reservations of a pool that shrank below them.
            resized = self._take_pools(found, heard)
            if watch.compositions:
                log.debug(
                    "reconcile: %d compositions (%d devices, %d allocations) changed while the hardware was read; "
                    "the next pass judges them",
                    len(watch.compositions),
                    len(watch.devices),
                    len(watch.allocations),
                )
            changes = lost_now + resized + self._quarantine_bindings(bound, watch.devices, read)
            recorded_as = {
                (a.pool, a.id): (c.host, a.amount_bytes) for c in self._compositions.values() for a in _holdings(c)[1]
            }
            changes += self._quarantine_memory(carved, set(recorded_as) | watch.allocations, pools_read)
            self._note_held_otherwise(carved, recorded_as, watch.allocations, pools_read)
            changes += self._drop_unhealthy_reservations()
            judged, degraded, healable = self._judge_standing(bound, carved, read, watch.compositions, touched)
            for comp_id in touched:  # what the judgement left: a change in flight, a race with the read, a reason more
                if (comp := self._compositions.get(comp_id)) is not None:
                    self._reassess(comp)
            changes += judged + told
            # Healed as after the event that would have told it: at once, with no back-off.
            degraded.update(sickened)
            healable += [c for c in dict.fromkeys(sickened) if c not in healable]
            if only is not None:  # asked, whether or not its hardware could be read: its health was discovered
                healable = [c for c in healable if self._on_fabrics(c, only)]
        return changes, healable, degraded

    def _tells_health(self, name: str) -> bool:
        """Whether fabric ``name``'s driver declares HEALTH_EVENTS and its events are heard now
        (`Fabric.events_heard`: a remote driver's event stream is open): its events are the source of its
        devices' health, and a pass need not discover it again to learn it. One that cannot say is asked
        (`_discovered`). Outside the lock."""
        fabric = self.fabrics[name]
        return _declares_health_events(fabric) and _heard(fabric)

    def _discovered(self, name: str) -> Topology | None:
        """What fabric ``name`` discovers now (for a pass, or a retry of one unreachable, `_answers`); None when it
        does not answer (a driver that dies sends no event to say so). Outside the lock."""
        try:
            return self.fabrics[name].discover()
        except Exception:  # a driver's bug too: it cannot be used
            return None

    @staticmethod
    def _unlearnt(names: Iterable[str]) -> None:
        """Say that the fabrics ``names``, whose hardware a pass read, did not answer its discovery: their bindings
        and memory were judged, and their devices' health is learnt at the next pass that discovers them. Counted
        unreachable instead, a transient failure of a walk that a listing outlived would make their compositions
        UNKNOWN and back, with records and events each way."""
        for name in names:
            log.warning(
                "reconcile: fabric %s was read but not discovered; its devices' health is asked again at the next pass",
                name,
            )

    def _health_reported(self, found: Mapping[str, Topology]) -> dict[str, list[Device]]:
        """By fabric, the devices whose health ``found`` (what a pass discovered of fabrics that send no health
        events) reports otherwise than the index: compared outside the lock, which a fabric of 100,000 devices
        would hold for milliseconds on every pass, and compared again under it (`_take_health`). A device whose
        index entry changed meanwhile was told by an event of its fabric, which that compares too."""
        devices = self._inv.devices
        return {
            name: [d for d in topology.devices if (known := devices.get(d.id)) is None or known.health is not d.health]
            for name, topology in found.items()
        }

    def _take_health(
        self, reported: Mapping[str, Sequence[Device]], heard: Mapping[str, int], why: str = ""
    ) -> tuple[int, list[str], list[str]]:
        """Record the health of each device of ``reported`` (`_health_reported`) that the index holds otherwise,
        as a DEVICE_HEALTH event of it would (`_record_health`): a failure such a fabric does not tell is
        otherwise seen only at its next event, return or restart. Its compositions are left for the pass to judge
        with it (`_reassess`). Returns how many devices changed, the compositions a failure leaves to heal, and
        every composition a change touches. A fabric unreachable now, or heard from since the pass began
        (``heard``: an event, a rebuild that asked it), is left as that left it: this answer may be older. Under
        the lock."""
        changed, sickened, touched = 0, [], []
        for name, devices in reported.items():
            if name in self._unreachable or self._heard.get(name) != heard.get(name):
                continue
            for device in devices:
                known = self._inv.devices.get(device.id)
                if known is None or known.fabric != name or known.health is device.health:
                    continue
                changed += 1
                because = why or f"fabric {name} sends no health events"
                said = f"reconciliation found it {device.health.value}; {because}"
                affected = self._record_health(name, device.id, device.health, said)
                touched += affected
                if device.health is not Health.OK:
                    sickened += affected
        return changed, sickened, list(dict.fromkeys(touched))

    def _take_pools(self, found: Mapping[str, Topology], heard: Mapping[str, int]) -> int:
        """Take the pools that ``found`` (what a pass discovered) reports otherwise than the index, as a rebuild
        would, every claim kept: a pool of another capacity is resized (`Inventory.resize_pool`), one gone from
        the report that holds no claim leaves the index, and one new to it that no record names (`_recorded_pools`)
        enters it, of a device indexed as carved. A fabric's pools may change so (a cxl-switch DCD's region pools
        give back the bytes of an older release's device pool, which leaves its report with the last allocation
        in it, docs/cxl-fm-api.md), and a rebuild comes only with a device or link event. The index's topology
        of the fabric takes them too, or a rebuild for another fabric's event would index the old one again. A
        pool of another device, kind or fabric now waits for a rebuild; so do one gone that holds a claim (its
        compositions find its memory missing once the hardware no longer lists it) and one new that a record
        names (a rebuild claims it, and the next pass reads it). Skipped as in `_take_health` for a fabric
        unreachable or heard from since the pass began. Returns how many pools changed. Under the lock."""
        changed = 0
        named = self._recorded_pools()
        for name, topology in found.items():
            indexed = self._inv.topologies.get(name)
            if indexed is None or name in self._unreachable or self._heard.get(name) != heard.get(name):
                continue
            taken = self._resized(topology)
            reported = {pool.id for pool in topology.pools}
            gone = {
                pool.id
                for pool in indexed.pools
                if pool.id not in reported
                and pool.id in self._inv.pools
                and pool.id not in named
                and self._inv.unclaimed(pool.id)
            }
            for pool_id in sorted(gone):
                self._inv.drop_pool(pool_id)
                log.info("reconcile: pool %s is no longer reported and holds nothing; it is offered no more", pool_id)
            new = []
            for pool in topology.pools:
                if pool.id not in named and pool.fabric == name and self._inv.add_pool(pool):
                    new.append(pool)
                    log.info(
                        "reconcile: pool %s is reported with %d bytes; it is offered",
                        pool.id,
                        pool.capacity.total_bytes,
                    )
            if taken or gone or new:
                pools = (*(taken.get(p.id, p) for p in indexed.pools if p.id not in gone), *new)
                self._inv.topologies[name] = attrs.evolve(indexed, pools=pools)
                changed += len(taken) + len(gone) + len(new)
        return changed

    def _resized(self, topology: Topology) -> dict[str, PoolInfo]:
        """Resize each pool of the index that ``topology`` reports with another description of the same device,
        kind and fabric, its claims kept (`Inventory.resize_pool`); returns those, by id. Under the lock."""
        taken: dict[str, PoolInfo] = {}
        for pool in topology.pools:
            state = self._inv.pools.get(pool.id)
            if state is None or state.info == pool:
                continue
            was = state.info
            if (was.fabric, was.device, was.kind) != (pool.fabric, pool.device, pool.kind):
                continue
            self._inv.resize_pool(pool)
            taken[pool.id] = pool
            log.info(
                "reconcile: pool %s reports %d bytes (%d before); its claims are kept",
                pool.id,
                pool.capacity.total_bytes,
                was.capacity.total_bytes,
            )
        return taken

    def _recorded_pools(self) -> set[str]:
        """The pools that a record names memory in, as a build claims it (`_claim_all`): a composition's and its
        change in flight's, a reservation's plan, quarantined memory, and memory held beyond its record. Under
        the lock."""
        pools = {a.pool for comp in self._compositions.values() for a in _holdings(comp)[1]}
        pools.update(m.pool for res in self._reservations.values() for m in res.plan.memory)
        pools.update(a.pool for a in self._strays.values())
        pools.update(a.pool for a, _ in self._held_otherwise.values())
        return pools

    def _lose(self, names: set[str], heard: Mapping[str, int]) -> int:
        """Count the fabrics of ``names`` that answered before as unreachable (`_discovered`): their compositions
        become UNKNOWN, their devices leave the index, and `retry_unreachable` asks them again, as at start-up.
        Nothing else tells of a driver that stopped: an event asks only its own fabric (`_apply_event`). One heard
        from since the pass began (``heard``: an event, a rebuild that asked it) is left as that left it: the
        pass's failed discovery is older. Returns how many. Under the lock."""
        fresh = sorted(
            name for name in names if name not in self._unreachable and self._heard.get(name) == heard.get(name)
        )
        for name in fresh:
            log.warning("fabric %s cannot be reached any more; its compositions are UNKNOWN", name)
        if fresh:
            self._unreachable.update(fresh)
            self._rebuild(retry=set(), asked=set())
            self._mark_unknown()
        return len(fresh)

    def _read_hardware(
        self, pools: Mapping[str, Sequence[str]], away: set[str]
    ) -> tuple[dict[str, str], dict[tuple[str, str], Allocation], set[str], set[str]]:
        """For `reconcile`, outside the lock: every binding (device -> host) and every allocation of ``pools``
        (by pool and id) of the fabrics but ``away``, the fabrics read whole, and the pools read (those of
        ``pools`` in them: a pool the index no longer has, its fabric's report having left it out, is not). One
        that cannot be read is left out, and the log says why."""
        hardware = HardwareView(self.fabrics)
        bound: dict[str, str] = {}
        carved: dict[tuple[str, str], Allocation] = {}
        read: set[str] = set()
        pools_read: set[str] = set()
        for name in self.fabrics:
            if name in away:
                continue
            try:
                bound.update(hardware.bound(name))
                for pool_id in pools.get(name, ()):
                    carved.update(((a.pool, a.id), a) for a in hardware.carved(name, pool_id).values())
            except DisaggError as exc:
                log.warning("reconcile: cannot read fabric %s: %s", name, exc.message)
                continue
            read.add(name)
            pools_read.update(pools.get(name, ()))
        return bound, carved, read, pools_read

    def _quarantine_bindings(self, bound: Mapping[str, str], aside: set[str], read: set[str]) -> int:
        """Quarantine each binding ``bound`` (as `reconcile` read it) holds that no composition records, but
        those of ``aside``, touched by a change while it was read; returns how many it reported or forgot. A
        quarantined device found bound to another host than the one reported is reported again, with that host:
        the report is what an operator unbinds by. One its fabric (of ``read``) no longer binds is forgotten, as
        memory the hardware freed is, and bound again it is a new quarantine; its cordon stays, for an operator
        to lift. Under the lock."""
        expected = {p.device: c.host for c in self._compositions.values() for p in _holdings(c)[0]}
        changes = 0
        for device in sorted(self._quarantined):
            if device in bound or device in aside or self._fabric_of(device) not in read:
                continue
            del self._quarantined[device]
            self.store.delete_quarantine(_BINDING, device)
            self._note_quarantined(device)
            log.info("quarantined device %s is no longer bound on the hardware; it stays cordoned", device)
            changes += 1
        for device, host in sorted(bound.items()):
            reported = self._quarantined.get(device)
            if expected.get(device) == host or reported == host or device in aside:
                continue
            if reported == "":  # reported before a restart, to the host it is bound to now as far as is known
                self._quarantined[device] = host
                continue
            # Kept in the ledger as a quarantine, apart from the cordon: one an operator had made would
            # otherwise pass for a quarantine reported before a restart, and this one go unreported.
            self._quarantined[device] = host
            self._note_quarantined(device)
            res = self._reservations.get(self._inv.owner.get(device) or "")
            if res is not None:  # its apply would fail on this binding, and the reservation be held for nothing
                self._drop_reservation(
                    res, EventType.RESERVATION_RELEASED, f"{device} is bound to {host} on the hardware"
                )
                changes += 1
            if reported is None:
                self.store.put_quarantine(_BINDING, device)
            if device not in self._cordoned:
                self._cordoned.add(device)
                self.store.put_cordon(device)
                if device in self._inv.devices:
                    self._inv.cordon(device)
            self._emit(
                EventType.BINDING_QUARANTINED,
                device,
                f"bound to {host} on the hardware, but no composition records it; cordoned: unbind it "
                "through the device's own management, then uncordon it",
                host=host,
            )
            changes += 1
        return changes

    def _note_quarantined(self, device: str = "", allocation: tuple[str, str] | None = None) -> None:
        """Tell each other reconcile reading the hardware now that this pass quarantined, or forgot the quarantine
        of, ``device`` or ``allocation``: judged from what it read before, it would undo this pass's verdict, and
        report it again at the next. Under the lock."""
        for watch in self._watches:
            if device:
                watch.devices.add(device)
            if allocation is not None:
                watch.allocations.add(allocation)

    def _judge_standing(
        self,
        bound: Mapping[str, str],
        carved: Mapping[tuple[str, str], Allocation],
        read: set[str],
        aside: set[str],
        told: Collection[str] = (),
    ) -> tuple[int, set[str], list[str]]:
        """Hold each standing composition with no change in flight against what `reconcile` read of the fabrics
        ``read``, but those of ``aside``, changed while it was read: what the hardware no longer holds, or holds
        for another host or at another size, is missing. Returns how many it changed (one of ``told``, whose
        device's health the pass recorded, only for what it lost or got back: its health is counted with the
        device), those it degraded, and those a heal can mend. Under the lock."""
        changes = 0
        degraded: set[str] = set()
        healable: list[str] = []
        for comp in list(self._compositions.values()):
            if comp.id in aside or comp.pending is not None or comp.state not in _STANDING:
                continue
            lost = [
                p.device for p in comp.devices if self._fabric_of(p.device) in read and bound.get(p.device) != comp.host
            ]
            lost += [
                a.id
                for a in comp.allocations
                if self._fabric_of_pool(a.pool) in read and _held_otherwise(a, comp.host, carved.get((a.pool, a.id)))
            ]
            # What a fabric not read now lost before stays lost; what a read fabric holds again is back.
            lost += [m for m in comp.missing if m not in lost and self._fabric_of_id(comp, m) not in read]
            now = comp
            if set(lost) != set(comp.missing) or self._standing(comp) is not comp.state:
                # Unhealthy too: a device that failed while the fabric manager was down sent no event.
                now = self._set_standing(comp, missing=tuple(lost))
                changes += 1 if set(lost) != set(comp.missing) or comp.id not in told else 0
                if now.state is CompositionState.DEGRADED:
                    degraded.add(now.id)
            if self._unhealthy(now) and not now.missing and not self._sick_memory(now):
                # Healing replaces unhealthy devices; it cannot bring a lost one back, nor move memory.
                healable.append(now.id)
        return changes, degraded, healable

    def _on_fabrics(self, comp_id: str, fabrics: frozenset[str]) -> bool:
        """Whether composition ``comp_id`` holds a device or memory of one of ``fabrics``. Under the lock."""
        comp = self._compositions.get(comp_id)
        devices, allocations = _holdings(comp) if comp is not None else ([], [])
        return any(self._fabric_of(p.device) in fabrics for p in devices) or any(
            self._fabric_of_pool(a.pool) in fabrics for a in allocations
        )

    def _heal_soon(self, composition_ids: list[str], retry: Callable[[str], bool] = lambda _: False) -> None:
        """Heal after a failure event (`_heal_all`): at once when no fabric's calls wait, else in a thread of the
        composer's own. A heal binds and may wait for a busy composition: on the thread that delivers a fabric's
        events it held up that fabric's next failures, which must degrade their compositions within a second."""
        if not composition_ids:
            return
        if not any(f.calls_block for f in self.fabrics.values()):
            self._heal_all(composition_ids, retry)
            return
        with self._lock:
            if self._closing:  # the next start-up heals what this one could not
                log.warning("not healing %s: the composer is closing", ", ".join(composition_ids))
                return
            if self._healer is None:
                self._healer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disagg-heal")
            heal = self._healer.submit(self._heal_all, composition_ids, retry)
            self._heals.add(heal)
        heal.add_done_callback(self._heal_ended)

    def _heal_ended(self, heal: Future[int]) -> None:
        with self._lock:
            self._heals.discard(heal)

    def wait_for_heals(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the heals that failure events started so far to end; returns
        whether they all did. They run beside the events when a driver's calls may wait (`_heal_soon`): a
        script that fails a device and then reads its composition waits for them first."""
        with self._lock:
            pending = list(self._heals)
        return not wait_all(pending, timeout=timeout_s).not_done

    def _heal_all(self, composition_ids: Iterable[str], retry: Callable[[str], bool] = lambda _: False) -> int:
        """Heal each composition (auto-heal); one that cannot be healed now stays DEGRADED, and says why. Returns
        how many were healed. A heal tried again (``retry``) that still finds no replacement is logged at debug
        level only: its composition says so already, and a reconcile tries it on every pass. One whose binds
        failed is not tried again with the same inputs until its back-off passes (`_heal_waits`). None starts once
        this replica may no longer lead (`lead`)."""
        healed = 0
        ids = list(composition_ids)
        for n, comp_id in enumerate(ids):
            if not self._leads():
                log.warning(
                    "not healing %s: this replica's lease may have run out by its clock, and another replica may "
                    "lead now; the leader heals them",
                    ", ".join(ids[n:]),
                )
                break
            if retry(comp_id) and self._heal_waits(comp_id):
                log.debug("not healing %s again yet: its binds failed with the same failed devices and spares", comp_id)
                continue
            try:
                if self.heal(comp_id).state is not CompositionState.DEGRADED:
                    healed += 1
            except NoFitError as exc:
                log.log(
                    logging.DEBUG if retry(comp_id) else logging.WARNING, "healing %s failed: %s", comp_id, exc.message
                )
            except DisaggError as exc:
                log.warning("healing %s failed: %s", comp_id, exc.message)
        return healed

    def _heal_inputs(self, comp: Composition, bad: Sequence[DevicePick]) -> tuple[frozenset[str], frozenset[str]]:
        """What a heal of ``comp`` is tried with: its unhealthy devices ``bad``, and the free devices of their
        kinds on the switches its host reaches, among which placement finds the replacements. A device freed,
        repaired, added or uncordoned there changes them. Under the lock."""
        kinds = {comp.resources[p.resource].kind for p in bad}
        spares = frozenset(
            device
            for switch in self._inv.reach_map.get(comp.host, {})
            for kind in kinds
            for bucket in self._inv.by_switch_kind.get((switch, kind), ())
            for device in bucket.free
        )
        return frozenset(p.device for p in bad), spares

    def _note_failed_heal(self, comp_id: str, inputs: tuple[frozenset[str], frozenset[str]]) -> None:
        """Remember that the binds of a heal with ``inputs`` failed (`_heal_waits`), once more in a row when the
        last failure had the same inputs. Under the lock."""
        last = self._failed_heals.get(comp_id)
        failures = last.failures + 1 if last is not None and last.inputs == inputs else 1
        for gone in [c for c in self._failed_heals if c not in self._compositions]:
            del self._failed_heals[gone]
        self._failed_heals[comp_id] = _FailedHeal(inputs, failures, self.clock())

    def _heal_waits(self, comp_id: str) -> bool:
        """Whether a reconcile passes over the heal of ``comp_id`` this time: its binds failed last time, it would
        be tried with the same inputs (`_heal_inputs`), and its back-off has not passed: 2, 4, 8, ... passes after
        its first, second, third failure in a row, at most `HEAL_RETRY_MAX_S`. Tried again at once it would most
        likely fail the same way, and each pass would revise the composition for nothing."""
        with self._lock:
            last = self._failed_heals.get(comp_id)
            comp = self._compositions.get(comp_id)
            if last is None or comp is None or self._heal_inputs(comp, self._unhealthy(comp)) != last.inputs:
                return False
            last.passes += 1
            return last.passes < 2 ** min(last.failures, 16) and self.clock() - last.at < HEAL_RETRY_MAX_S

    def _fabric_of(self, device: str) -> str:
        """The fabric of a device: from the index, else from its id (one of a fabric that is not discovered)."""
        dev = self._inv.devices.get(device)
        return dev.fabric if dev is not None else device.partition("/")[0]

    def _fabric_of_id(self, comp: Composition, part: str) -> str:
        """The fabric of one of ``comp``'s devices or allocations, by its id."""
        alloc = next((a for a in comp.allocations if a.id == part), None)
        return self._fabric_of_pool(alloc.pool) if alloc is not None else self._fabric_of(part)

    def _fabric_of_pool(self, pool: str) -> str:
        entry = self._inv.pools.get(pool)
        return entry.info.fabric if entry is not None else pool.partition("/")[0]

    def close(self) -> None:
        self.cancel_start()  # first: a start running holds the lock until it stops
        for sub in self._subscriptions:
            sub.cancel()
        self._subscriptions.clear()
        with self._lock:
            healer = self._healer
        if healer is not None:
            healer.shutdown(wait=True, cancel_futures=True)
        for fabric in self.fabrics.values():
            fabric.close()
        self.store.close()

    def __enter__(self) -> FabricComposer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _context(self, deadline: float | None = None) -> CallContext:
        """The context of one driver call: the call timeout, cut short by the caller's ``deadline``, and the
        request id of the change it serves (empty without one), which a driver may log or key its work by."""
        limit = time.monotonic() + self.call_timeout_s
        return CallContext(
            epoch=self.epoch,
            deadline=deadline if deadline is not None and deadline < limit else limit,
            request_id=_ASKING.get()[0],
        )

    def _rebuild(
        self,
        retry: set[str] | None = None,
        answered: Mapping[str, Topology] | None = None,
        asked: set[str] | None = None,
    ) -> None:
        """Build a fresh index from discovery and take the ledger's claims again. What an unreachable fabric
        holds is not in the index and is claimed once it answers (its next rebuild). Should anything fail, the
        index before stays: a half-built one would offer what others hold. ``retry``, ``answered`` and
        ``asked``: as `_discover_all`."""
        before = self._inv, self._placer
        self._inv = self._index(self._discover_all(retry, answered or {}, asked))
        self._placer = Placer(self._inv, self.policy)
        try:
            self._claim_all()
        except BaseException:
            self._inv, self._placer = before
            raise

    def _index(self, topologies: list[Topology]) -> Inventory:
        """The index of ``topologies``. At run time a fabric whose report repeats a device, switch or pool id
        (`repeated_ids`) is set aside, counted unreachable until its report no longer does, and the other
        fabrics are indexed: refused whole, the index stayed as it was for good, and every later event of every
        fabric was refused with it. At start-up, with no index before it to tell which report changed, the
        repeat is refused (`ConfigError`): the configuration's, or a driver's, to fix."""
        try:
            index, aside = Inventory(topologies), {}
        except ConfigError:
            aside = self._repeaters(topologies) if self._inv.topologies else {}
            if not aside:
                raise
            index = Inventory([Topology(fabric=t.fabric) if t.fabric in aside else t for t in topologies])
        for name, why in aside.items():
            if self._set_aside.get(name) != why:
                log.error(
                    "fabric %s is set aside, its compositions UNKNOWN, until its topology no longer repeats an id: %s",
                    name,
                    why,
                )
        self._unreachable.update(aside)
        self._set_aside = aside
        return index

    def _repeaters(self, topologies: Sequence[Topology]) -> dict[str, str]:
        """The fabrics to set aside for the ids ``topologies`` repeat (`_set_aside_for`), with why."""
        aside: dict[str, str] = {}
        for repeat in repeated_ids(topologies):
            reporters = list(dict.fromkeys(repeat.fabrics))
            for name in self._set_aside_for(repeat, reporters):
                others = _named([f for f in reporters if f != name])
                also = f", which fabric {others} reports too" if others else " twice"
                aside.setdefault(name, f"it reports {repeat.what} id {repeat.id!r}{also}")
        return aside

    def _set_aside_for(self, repeat: Repeat, reporters: list[str]) -> set[str]:
        """Which of ``reporters`` (the fabrics that report ``repeat``'s id, once each) to set aside: one that
        reports it twice itself; and, of two or more, those whose own ``<fabric>/`` prefix the id lacks when
        it carries one of theirs; else those whose report in the last good index lacked it (their report
        changed since), when another's had it; else all of them, as none can be told apart."""
        selves = {f for f in reporters if repeat.fabrics.count(f) > 1}
        if len(reporters) == 1:
            return selves
        strangers = [f for f in reporters if not repeat.id.startswith(f"{f}/")]
        if len(strangers) < len(reporters):
            return selves | set(strangers)
        before = self._inv.topologies
        newcomers = [f for f in reporters if f not in before or repeat.id not in reported_ids(before[f])]
        if 0 < len(newcomers) < len(reporters):
            return selves | set(newcomers)
        return set(reporters)

    def _claim_all(self) -> None:
        """Claim in a fresh index what the ledger records and the quarantined memory the hardware holds; a
        memory claim never raises (`Inventory.claim_memory`), or one stray beyond the free bytes would fail
        every rebuild and drop the event that asked for it."""
        for comp in self._compositions.values():
            self._claim_composition(comp)
        for res in self._reservations.values():
            self._claim_reserved(res)
        for device in self._cordoned:
            if device in self._inv.devices:
                self._inv.cordon(device)
        for alloc in self._strays.values():
            if alloc.pool in self._inv.pools:
                self._inv.claim_memory(alloc.pool, alloc.amount_bytes)
        for alloc, extra in self._held_otherwise.values():
            if alloc.pool in self._inv.pools:
                self._inv.claim_memory(alloc.pool, extra)

    def _discover_all(
        self,
        retry: set[str] | None = None,
        answered: Mapping[str, Topology] | None = None,
        asked: set[str] | None = None,
    ) -> list[Topology]:
        """Every fabric's topology; one that cannot be reached counts as empty and is remembered as
        unreachable (its compositions become UNKNOWN, `retry_unreachable` tries it again). When no fabric
        answers at all, the first error is raised: there is nothing to serve. ``retry``: the unreachable fabrics
        to ask again (None: all); the others count as empty still, unasked: a rebuild runs under the lock, and a
        driver that hangs until its timeout would hold every change and report meanwhile. ``answered``: what
        unreachable fabrics answered just before, outside the lock, having taken the epoch (`_answers`), taken
        as their discovery instead of asking them again. ``asked``: the reachable fabrics to ask (None: all);
        the others keep the topology the index has of them, with the health their events gave its devices
        since (`_as_indexed`), for the same reason: an event of one fabric, or another's return, asked every
        fabric under the lock, and one slow discovery (a walk of real hardware takes seconds) held every failure
        report of every fabric for as long, where a failure is to degrade its compositions within a second."""
        topologies: list[Topology] = []
        first: DisaggError | None = None
        for name, fabric in self.fabrics.items():
            if self._early is not None:  # starting, under the lock: a server stopping stops it (`cancel_start`)
                self._stop_if_closing()
            if retry is not None and name in self._unreachable and name not in retry:
                topologies.append(Topology(fabric=name))
                continue
            if (
                asked is not None
                and name not in asked
                and name not in self._unreachable
                and name in self._inv.topologies
            ):
                topologies.append(self._as_indexed(name))
                continue
            if answered and name in answered and name in self._unreachable:
                self._unannounced.pop(name, None)
                topologies.append(answered[name])
                self._returned.add(name)
                self._unreachable.discard(name)
                continue
            self._heard[name] = self._heard.get(name, 0) + 1
            if name in self._unannounced or name in self._unreachable:
                # Told before anything else reaches it: a deposed manager may still try.
                self._announce_epoch([name])
            try:
                if name in self._unannounced:
                    raise FabricUnavailableError(
                        f"fabric {name} has not taken epoch {self.epoch} yet: {self._unannounced[name]}"
                    )
                topologies.append(fabric.discover())
            except Exception as raised:  # a driver's bug too: that fabric is unreachable, the others are served
                exc = raised if isinstance(raised, DisaggError) else driver_error(name, raised)
                if name not in self._unreachable:
                    log.warning("fabric %s cannot be reached: %s; its compositions are UNKNOWN", name, exc.message)
                self._unreachable.add(name)
                topologies.append(Topology(fabric=name))
                first = first or exc
            else:
                if name in self._unreachable:
                    self._returned.add(name)
                self._unreachable.discard(name)
        if first is not None and len(self._unreachable) == len(self.fabrics):
            raise first
        return topologies

    def _as_indexed(self, name: str) -> Topology:
        """Fabric ``name``'s topology as the index has it: as last discovered, its devices as the index holds them
        now (the health their events reported since). Under the lock."""
        topology = self._inv.topologies[name]
        devices = self._inv.devices
        return attrs.evolve(topology, devices=tuple(devices.get(d.id, d) for d in topology.devices))

    def _fabrics_of(self, comp: Composition) -> set[str]:
        """The fabrics of whatever ``comp`` may hold (`_holdings`)."""
        picks, allocs = _holdings(comp)
        return {self._fabric_of(p.device) for p in picks} | {self._fabric_of_pool(a.pool) for a in allocs}

    def _touches_unreachable(self, comp: Composition) -> bool:
        return bool(self._away(comp))

    def _away(self, comp: Composition) -> list[str]:
        """The fabrics of ``comp`` that cannot be used now, sorted: unreachable, set aside (`_set_aside`), or not
        loaded at all (dropped from the configuration while the ledger still records what it holds there)."""
        return sorted(f for f in self._fabrics_of(comp) if f in self._unreachable or f not in self.fabrics)

    def _why_away(self, fabrics: Sequence[str]) -> str:
        """Why ``fabrics`` (`_away`) cannot be used now, for an UNKNOWN composition's message and a refusal."""
        unreachable = [f for f in fabrics if f in self.fabrics and f not in self._set_aside]
        aside = [f for f in fabrics if f in self._set_aside]
        gone = [f for f in fabrics if f not in self.fabrics]
        return _away_why(unreachable, [(f, self._set_aside[f]) for f in aside], gone)

    def _mark_unknown(self) -> None:
        """Compositions on an unreachable fabric become UNKNOWN: neither trusted nor released. The state each
        had is kept with it (`PriorState`), for `_settle_known`. One with a change in flight is left to that
        change, which owns its record and marks it as it ends (`_let_go`): recovery must never take a live
        change for one a crash interrupted. Under the lock."""
        for comp in list(self._compositions.values()):
            if not self._changing(comp.id):
                self._mark_unknown_one(comp)

    def _mark_unknown_one(self, comp: Composition) -> None:
        """``comp`` becomes UNKNOWN when a fabric of it cannot be used (`_away`), its message saying why; one
        UNKNOWN already says why again when that changed (its fabric answers, but is now set aside). A record a
        change left (a crash's, `pending`) may be at the edge of what the ledger takes: why, then the message kept
        to return to, are left out when the ledger would not take them (`_fits`); the state is written still, as
        a change's records were measured with room for it (`_past_limit`)."""
        away = self._away(comp)
        if not away:
            return
        why = self._why_away(away)
        if comp.state is not CompositionState.UNKNOWN:
            for message, prior in ((why, comp.message), ("", comp.message), ("", "")):
                before = PriorState(comp.state, prior)
                if self._fits(comp, state=CompositionState.UNKNOWN, message=message, before_unknown=before):
                    break
            self._set(comp, state=CompositionState.UNKNOWN, message=message, before_unknown=before)
        elif comp.message != (message := why if self._fits(comp, message=why) else ""):
            self._set(comp, message=message)

    def _settle_known(self, hardware: HardwareView | None = None) -> set[str]:
        """UNKNOWN compositions whose every fabric answers go back to the state they had before, for recovery
        to go on from (a DECOMPOSING one is finished, a change in flight finished or undone, a FAILED one stays
        FAILED); one that stood, with no change in flight, is judged against the hardware first (`_lost_on`), so
        that the first state written after UNKNOWN is the right one, and one whose hardware cannot be read now
        stays UNKNOWN, for the next `retry_unreachable`. Returns the ids settled. Under the lock. A record
        written as UNKNOWN before the state was kept counts as COMPOSED."""
        settled: set[str] = set()
        hardware = hardware or HardwareView(self.fabrics)
        for comp in list(self._compositions.values()):
            if comp.state is not CompositionState.UNKNOWN or self._touches_unreachable(comp):
                continue
            prior = comp.before_unknown or PriorState(CompositionState.COMPOSED)
            if comp.pending is not None or prior.state not in _STANDING:
                settled.add(comp.id)
                self._set(comp, state=prior.state, message=prior.message)
                continue
            lost = self._lost_on(comp, hardware)
            if lost is None:
                self._returned.update(self._fabrics_of(comp))
                continue
            settled.add(comp.id)
            self._stand_again(comp, prior, lost)
        return settled

    def _stand_again(self, comp: Composition, prior: PriorState, lost: tuple[str, ...]) -> None:
        """Settle an UNKNOWN ``comp`` that stood before (``prior``) in one record, with ``lost`` as what the
        hardware no longer holds of it: its state and message from before when they still hold (held against
        the device health by `_reassess`), else the state and reason `_set_standing` gives. Under the lock."""
        if self._standing(revise(comp, missing=lost)) is prior.state:
            self._reassess(self._set(comp, state=prior.state, message=prior.message, missing=lost))
        else:
            self._set_standing(comp, missing=lost)

    @_durably
    def retry_unreachable(self) -> bool:
        """Try the unreachable fabrics again (a set-aside one too, `_index`); when one answers, rebuild, settle
        its compositions (recovery, then COMPOSED or DEGRADED as the hardware holds them) and reconcile. Returns
        whether any answered. A server calls it on a timer."""
        settled = self._bring_back()
        if settled is None:
            return False
        self.reconcile()
        if self.auto_heal:  # failures reported while they were UNKNOWN healed nothing, and reconcile heals only its own
            self._heal_all(sorted(settled))
        return True

    def _bring_back(self, only: str = "") -> set[str] | None:
        """`retry_unreachable` up to its reconcile, asking fabric ``only`` alone when given: the other unreachable
        ones, whose drivers may hang until their timeout, are not asked, nor is their hardware read. Returns the
        compositions it settled and recovered, or None when no fabric answered again."""
        self._check_started()
        with self._lock:
            gone = set(self._unreachable)
            unreachable, returned = sorted(n for n in gone if not only or n == only), bool(self._returned)
            wanted = self._unknown_hardware()
            heard = dict(self._heard)
        answered = {name: found for name in unreachable if (found := self._answers(name)) is not None}
        if not returned and not answered:
            return None
        # What settling the UNKNOWN compositions judges, read before the lock as the fabrics were asked, so that a
        # driver that answers and then hangs holds up nothing else either.
        hardware = HardwareView(self.fabrics)
        away = gone - set(answered)
        hardware.read_ahead(wanted[0] - away, {key for key in wanted[1] if key[0] not in away})
        with self._lock:
            if not self._unreachable and not self._returned:
                return None
            # A fabric heard from since it answered (an event, a rebuild that asked it: a device that failed, or
            # the fabric gone again) is left as that left it: its answer is older, and the next retry asks again.
            answered = {name: found for name, found in answered.items() if self._heard.get(name) == heard.get(name)}
            if self._unreachable:
                # Those that did not answer stay as they are; those that are reachable are not asked again.
                self._rebuild(set(answered), answered, asked=set())
                self._mark_unknown()  # one this rebuild found gone, or set aside
            back, self._returned = self._returned - self._unreachable, set()
            if not back:
                return None
            log.info("fabric %s answers again", ", ".join(sorted(back)))
            settle = self._settle_known(hardware)
        self._recover(settle)
        return settle

    def _unknown_hardware(self) -> tuple[set[str], set[tuple[str, str]]]:
        """The fabrics whose bindings, and the pools (fabric and pool) whose allocations, settling the UNKNOWN
        compositions reads (`_lost_on`), a fabric the configuration no longer loads among them (`read_ahead` reads
        none such, and its compositions wait). Under the lock."""
        fabrics: set[str] = set()
        pools: set[tuple[str, str]] = set()
        for comp in self._compositions.values():
            if comp.state is CompositionState.UNKNOWN:
                fabrics.update(self._fabric_of(p.device) for p in comp.devices)
                pools.update((self._fabric_of_pool(a.pool), a.pool) for a in comp.allocations)
        return fabrics, pools

    def _claim_composition(self, comp: Composition) -> None:
        """Claim the host and whatever the composition may hold (`_holdings`) in a freshly built index."""
        picks, allocs = _holdings(comp)
        self._claim_known(comp.id, comp.host, picks, [(a.pool, a.amount_bytes) for a in allocs])

    def _claim_reserved(self, res: Reservation) -> None:
        """Claim a reservation's plan in a freshly built index."""
        memory = [(m.pool, m.amount_bytes) for m in res.plan.memory]
        self._claim_known(res.id, res.plan.host, res.plan.devices, memory)

    def _claim_known(
        self, owner: str, host: str, picks: Iterable[DevicePick], memory: Iterable[tuple[str, int]]
    ) -> None:
        """Claim for ``owner`` what the index holds of a host, devices and (pool, bytes) of memory: what an
        unreachable fabric holds is not in it, and is claimed at the rebuild after it answers."""
        if host in self._inv.hosts:
            self._inv.claim_host(host, owner)
        for pick in picks:
            if pick.device in self._inv.devices:
                self._inv.claim_device(pick.device, owner)
        for pool, amount in memory:
            if pool in self._inv.pools:
                self._inv.claim_memory(pool, amount)

    def _out_of_reach(self, plan: Plan) -> list[str]:
        """The fabrics of ``plan`` that the index lacks now (they cannot be reached), sorted."""
        parts = [self._fabric_of(p.device) for p in plan.devices if p.device not in self._inv.devices]
        parts += [self._fabric_of_pool(m.pool) for m in plan.memory if m.pool not in self._inv.pools]
        if plan.host not in self._inv.hosts:
            parts.append(f"host {plan.host}")
        return sorted(set(parts))

    def _unclaim_composition(self, comp: Composition) -> None:
        """Give back what `_claim_composition` took: its devices, its memory, its host."""
        picks, allocs = _holdings(comp)
        for pick in picks:
            self._inv.release_device(pick.device)
        for alloc in allocs:
            self._inv.release_memory(alloc.pool, alloc.amount_bytes)
        self._inv.release_host(comp.host)

    def _unclaim_addition(self, comp: Composition) -> None:
        """Give back the claims of a pending ADD beyond what the composition itself holds (it was undone)."""
        picks, allocs = _pending_extras(comp)
        for pick in picks:
            self._inv.release_device(pick.device)
        for alloc in allocs:
            self._inv.release_memory(alloc.pool, alloc.amount_bytes)

    def _forget(self, comp: Composition, why: str) -> None:
        """Delete a composition whose claims are given back, and say so; under the lock."""
        self._note_touched(self._compositions.pop(comp.id), comp)
        self._lose_seed(comp)
        self._names.pop(comp.name, None)
        self.store.delete_composition(comp.id)
        self._emit(EventType.COMPOSITION_DELETED, comp.id, why)

    def _claim_plan(self, plan: Plan, owner: str, *, host: bool = True) -> None:
        if host:
            self._inv.claim_host(plan.host, owner)
        for pick in plan.devices:
            self._inv.claim_device(pick.device, owner)
        for mem in plan.memory:
            self._inv.claim_memory(mem.pool, mem.amount_bytes)

    def _unclaim_plan(self, plan: Plan, *, host: bool = True) -> None:
        for pick in plan.devices:
            self._inv.release_device(pick.device)
        for mem in plan.memory:
            self._inv.release_memory(mem.pool, mem.amount_bytes)
        if host:
            self._inv.release_host(plan.host)

    # ----------------------------------------------------------------- events

    def _emit(self, type_: EventType, subject: str, message: str = "", **data: str) -> Event:
        self._revision += 1
        event = Event(self._revision, type_, subject, message, self.clock(), data)
        self._revision_time = event.time
        self.store.append_event(event)
        if self._lock.depth:
            self._unheard.append(event)
        else:  # not under the lock: a hold of its own
            with self._lock:
                self._unheard.append(event)
        return event

    def _settle_events(self, taken: bool) -> None:
        """The lock's hold ends, and the ledger took its writes (``taken``) or refused them: tell the listeners of
        its events, or of none, which the ledger does not hold."""
        if not self._unheard:
            return
        events, self._unheard = self._unheard, []
        while taken and events:
            for event in events:
                for listener in list(self._listeners):
                    try:
                        listener(event)
                    except Exception:
                        log.exception("event listener failed")
            events, self._unheard = self._unheard, []  # a listener's own change: written as it was made

    def _quarantine_memory(
        self, carved: dict[tuple[str, str], Allocation], recorded: set[tuple[str, str]], pools_read: set[str]
    ) -> int:
        """Keep memory the hardware has carved and no composition records out of placement, reporting each once
        (an `ALLOCATION_QUARANTINED` event, and a ledger record so that a restart does not report it again); give
        it back to placement once the hardware no longer holds it, as read from its pool (``pools_read``): a pool
        its fabric's report left out is not read, and its quarantine is kept, for a rebuild to claim again when
        the pool is back. Returns how many it reported or gave back. Under the lock."""
        changes = 0
        for key, alloc in sorted(carved.items()):
            if key not in recorded and key not in self._strays:
                changes += self._quarantine_stray(key, alloc)
        changes += self._release_overdrawn_reservations()
        for key in sorted(self._quarantined_memory):
            if key in carved or key in recorded or key[0] not in pools_read:
                continue
            self._quarantined_memory.discard(key)
            self.store.delete_quarantine(*key)
            self._note_quarantined(allocation=key)
            freed = self._strays.pop(key, None)
            if freed is not None and freed.pool in self._inv.pools:
                self._inv.release_memory(freed.pool, freed.amount_bytes)
            log.info("pool %s: quarantined allocation %s is no longer on the hardware; given back", *key)
            changes += 1
        return changes

    def _quarantine_stray(self, key: tuple[str, str], alloc: Allocation) -> bool:
        """Keep ``alloc`` (by pool and id), which the hardware holds and no composition records, out of placement,
        and report it unless it was before a restart; returns whether it reported it. Under the lock."""
        if alloc.pool in self._inv.pools:
            # It may be more than the index has free (a ledger restored from a backup still records memory the
            # hardware freed): the claim leaves none free, and the pass degrades the composition.
            self._inv.claim_memory(alloc.pool, alloc.amount_bytes)
        self._strays[key] = alloc  # only once claimed: a rebuild claims the strays again
        if key in self._quarantined_memory:
            return False  # reported before a restart
        self._quarantined_memory.add(key)
        self.store.put_quarantine(*key)
        self._note_quarantined(allocation=key)
        self._emit(
            EventType.ALLOCATION_QUARANTINED,
            alloc.id,
            f"{alloc.amount_bytes} bytes of pool {alloc.pool} carved for {alloc.host} on the hardware, "
            "but no composition records them; kept out of placement until the hardware frees them",
            pool=alloc.pool,
            host=alloc.host,
        )
        return True

    def _note_held_otherwise(
        self,
        carved: Mapping[tuple[str, str], Allocation],
        recorded_as: Mapping[tuple[str, str], tuple[str, int]],
        aside: set[tuple[str, str]],
        pools_read: set[str],
    ) -> None:
        """Remember the allocations compositions record (``recorded_as``: host and bytes by pool and id) that the
        hardware (``carved``, of ``pools_read``) holds under the same id for another host or at another size
        (`_held_otherwise`), claiming in the index what it holds beyond the record, and forget those it no
        longer holds so; those of ``aside`` (touched by a change while the hardware was read) wait for the next
        pass. The composition is DEGRADED by the pass (`_judge_standing`). Under the lock."""
        otherwise = {
            key: alloc
            for key, alloc in carved.items()
            if key in recorded_as and (alloc.host, alloc.amount_bytes) != recorded_as[key]
        }
        for key, alloc in sorted(otherwise.items()):
            if key in aside:
                continue
            want = recorded_as[key]
            extra = max(0, alloc.amount_bytes - want[1])
            if self._held_otherwise.get(key) == (alloc, extra):
                continue
            self._forget_held_otherwise(key)
            if alloc.pool in self._inv.pools:
                self._inv.claim_memory(alloc.pool, extra)
            self._held_otherwise[key] = (alloc, extra)
            log.warning(
                "pool %s: allocation %s is carved for %s (%d bytes) on the hardware, not as its composition records "
                "it (%s, %d bytes): it is never released for the composition",
                alloc.pool,
                alloc.id,
                alloc.host,
                alloc.amount_bytes,
                *want,
            )
        for key in sorted(self._held_otherwise):
            if key[0] in pools_read and key not in aside and key not in otherwise:
                self._forget_held_otherwise(key)

    def _forget_held_otherwise(self, key: tuple[str, str]) -> Allocation | None:
        """Forget `_held_otherwise`'s ``key``, giving its extra claim back; returns the hardware's allocation it
        held. Under the lock."""
        held = self._held_otherwise.pop(key, None)
        if held is None:
            return None
        alloc, extra = held
        if alloc.pool in self._inv.pools:
            self._inv.release_memory(alloc.pool, extra)
        return alloc

    def _overdrawn(self, pool: str) -> bool:
        """Whether the claims on ``pool`` hold more than it has: bytes, or an MLD's logical devices."""
        state = self._inv.pools.get(pool)
        return state is not None and (state.excess_bytes > 0 or (state.free_lds is not None and state.free_lds < 0))

    def _release_overdrawn_reservations(self) -> int:
        """Release the reservations that hold memory of a pool whose claims now hold more than it has (the hardware
        carved some of it for what no composition records), the one that would hold longest first, until none is:
        an apply could only fail, and the reservation would keep its host and devices from placement for nothing,
        as one whose device the hardware bound for another host would (`_quarantine_bindings`). Returns how many.
        Under the lock."""
        released = 0
        holding = [r for r in self._reservations.values() if any(self._overdrawn(m.pool) for m in r.plan.memory)]
        for res in sorted(holding, key=lambda r: (-self._reservation_deadlines[r.id], r.id)):
            short = sorted({m.pool for m in res.plan.memory if self._overdrawn(m.pool)})
            if not short:
                continue
            self._drop_reservation(
                res,
                EventType.RESERVATION_RELEASED,
                f"pool {_named(short)} has less free on the hardware than it holds: memory was carved there for "
                "what no composition records",
            )
            released += 1
        return released

    def add_listener(self, listener: EventListener) -> Callable[[], None]:
        """Call ``listener`` for every new event, under the composer's lock, once the ledger took the writes of the
        change that made it (`LedgerLock`): it must not block."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def events(self, after: int = 0, limit: int = 1000) -> Sequence[Event]:
        return self.store.events_after(after, limit)

    @property
    def revision(self) -> int:
        return self._revision

    def snapshot(self, read: Callable[[], T]) -> tuple[T, Revision]:
        """``read()`` and the event revision its answer reflects, taken together under the composer's lock; the
        revision carries the time of its event, which tells this log from one reset or restored since.

        Every change emits its event under the same lock, so the answer includes exactly the events up to that
        revision: a watch from it (`events`, or the server's WatchEvents) misses no later change and repeats no
        earlier one. ``read`` may call the composer's own queries (`compositions`, `devices`, `usage`, ...);
        it must not block, since every change waits for it.

        It returns once the ledger holds every event up to that revision (`Store.await_event`), as a watch sends
        only such events: a revision a crash could still take back would be given to other events after the
        restart, and a watch from it would miss them and the changes the crash undid, without an error.
        """
        with self._lock:
            answer, revision = read(), Revision(self._revision, self._revision_time)
        self.store.await_event(revision)
        return answer, revision

    def _record(self, comp: Composition) -> None:
        """Keep ``comp`` as its composition's record, in memory and in the ledger; under the lock."""
        before = self._compositions.get(comp.id)
        if self._watches:  # a reconcile reads the hardware now: rare, and a call less a record when none does
            self._note_touched(before, comp)
        if before is not None and before.request_id != comp.request_id:
            self._lose_seed(before)
        self._compositions[comp.id] = comp
        self.store.put_composition(comp)

    def _lose_seed(self, record: Composition | Reservation) -> None:
        """``record``, all that told of its request id (a seed: a crash lost its answer, or newer ones pushed it out
        of the ledger, `_seed_requests`), is replaced or deleted: the id's answer becomes `RequestAnswerLostError`,
        in the ledger, so that a retry after another restart is refused still rather than carried out again. Under
        the lock."""
        entry = self._requests.get(record.request_id) if record.request_id else None
        if entry is None or entry[1] is not _RECORDED:
            return
        lost = self._answer_lost(
            record.request_id, "what it made has since been decomposed, released or changed by another request"
        )
        self._answered(record.request_id, entry[0], _SettledError(lost))

    def _answer_lost(self, request_id: str, since: str) -> RequestAnswerLostError:
        """The refusal of ``request_id``, known only from a record (`_seed_requests`) that ``since`` says no
        longer names its change. With the ledger's answers full when it started, newer ones may have pushed that
        answer out, as normal operation does: the refusal does not blame a crash then."""
        if self._answers_pushed_out:
            why = (
                f"request id {request_id!r} has no answer among those of the newest {REQUEST_RETENTION:,} request "
                "ids the ledger keeps (newer request ids pushed it out, unless a crash lost it just after its change)"
            )
        else:
            why = f"request id {request_id!r} was carried out before a restart that lost its answer"
        return RequestAnswerLostError(
            f"{why}, and {since}: it is not carried out again; read the composition, and use a new request id for "
            "anything left",
            metadata={"request_id": request_id},
        )

    def _unwatch(self, watch: _Touched) -> None:
        """Stop noting changes for ``watch``, this reconcile's own: by identity, for another running at once may
        hold a watch equal to it (both empty)."""
        self._watches = [w for w in self._watches if w is not watch]

    def _note_touched(self, *records: Composition | None) -> None:
        """Tell each reconcile reading the hardware now what these records (a composition's before and after a
        change) hold: it sets them aside (`_Touched`). Under the lock."""
        for watch in self._watches:
            for comp in records:
                if comp is not None:
                    watch.add(comp)

    def _fits(self, comp: Composition, **changes: object) -> bool:
        """Whether the ledger takes ``comp`` with ``changes`` as `_set` writes it (`_past_limit`): what the
        composer says of its own accord (a reason, a note, a driver's text) into a record a change may have left
        at the edge of what the ledger takes is measured first, for a record the ledger cannot take fails it as a
        whole and stops the leader. Under the lock."""
        now = self._compositions.get(comp.id, comp)
        new = revise(comp, generation=max(comp.generation, now.generation) + 1, **changes)
        return self._past_limit(lambda: ((new,), None)) is None

    def _set(self, comp: Composition, restoring: Composition | None = None, /, **changes: object) -> Composition:
        """Record ``comp`` with ``changes`` at a new generation, and tell watchers. Under the lock. A change rolled
        back completely passes the record it began from as ``restoring``: when the new record equals it, the etags
        that held for it hold for the new one too (`Composition.equivalent_generations`); any other change ends
        them."""
        if (
            changes.get("before_unknown", comp.before_unknown) is not None
            and changes.get("state", comp.state) is not CompositionState.UNKNOWN
        ):
            changes["before_unknown"] = None
        # Past the record as it is now too: a change that ends from the record it began with (a recovery) after
        # a failure gave it its reason meanwhile (`_say_meanwhile`) must not reuse that record's etag.
        now = self._compositions.get(comp.id, comp)
        new = revise(comp, generation=max(comp.generation, now.generation) + 1, equivalent_generations=(), **changes)
        if restoring is not None and revise(new, generation=restoring.generation) == restoring:
            new = revise(new, equivalent_generations=restoring.etag_generations[-EQUIVALENT_GENERATIONS_KEPT:])
        self._record(new)
        if new.state is not comp.state:
            before, after = _STATE_VALUE[comp.state], _STATE_VALUE[new.state]
            self._emit(
                EventType.COMPOSITION_STATE_CHANGED,
                new.id,
                f"{before} -> {after}" + (f": {new.message}" if new.message else ""),
                old=before,
                new=after,
            )
        elif new.message != comp.message:  # what a composition says of itself is part of a listing too
            self._emit(EventType.COMPOSITION_UPDATED, new.id, new.message, etag=new.etag)
        return new

    # ----------------------------------------------------------------- reservations

    def _expire_locked(self) -> None:
        if not self._reservations:  # most calls: no clock read, no list comprehension's frame
            return
        now = self.monotonic()
        for res in [r for r in self._reservations.values() if self._reservation_deadlines[r.id] <= now]:
            self._drop_reservation(res, EventType.RESERVATION_EXPIRED)

    def _deadline_from_record(self, res: Reservation) -> float:
        """The instant of ``monotonic`` at which ``res``, read from the ledger (at start, or given back by a
        recovery), expires: what is left of its wall-clock time to live, counted from now, or from the ledger's
        newest event when the wall clock is behind that (set back since, or a failover to a replica whose clock
        is behind): counted from now, a 60 s reservation was held for as long as the clock was behind, up to a
        day. Its making was an event, so what is left is then at most its own time to live. Within the run that
        follows, the wall clock no longer counts. Never more than the longest time to live a reservation has."""
        now = max(self.clock(), self._ledger_time)
        return self.monotonic() + min(res.expires_at - now, MAX_RESERVATION_TTL_S)

    def _hold_reservation(self, res: Reservation, deadline: float) -> None:
        """Hold ``res`` until ``deadline`` (of ``monotonic``): its plan claimed, its name taken, its record
        written; under the lock."""
        self._claim_plan(res.plan, res.id)
        self._ended_reservations.pop(res.id, None)  # held again: an apply undone gave it back
        self._reservations[res.id] = res
        self._reservation_deadlines[res.id] = deadline
        self._names[res.request.name] = res.id
        self.store.put_reservation(res)

    def _recall_ends(self) -> None:
        """Remember how the reservations the ledger's newest events (`ENDED_RESERVATION_EVENTS`) tell of ended, as
        the runs that saw them end did: a late apply after a restart is told so too. At start, under the lock. A
        release while the apply of it ran leaves no event of its own: the apply's composition tells it, rolled back
        with no later event of the reservation (held again, expired, released), or its record's apply interrupted
        by a restart naming no reservation any more; one that stands reads as applied."""
        applied: dict[str, str] = {}  # composition id: the reservation applied as it
        after = max(0, self._revision - ENDED_RESERVATION_EVENTS)
        for event in self.store.events_after(after, ENDED_RESERVATION_EVENTS):
            how = _ended_by(event)
            if how is not None:
                self._end_of(event.subject, how)
                if comp_id := event.data.get("composition"):
                    applied[comp_id] = event.subject
            elif event.type is EventType.RESERVATION_CREATED:  # held again: an apply undone gave it back
                self._ended_reservations.pop(event.subject, None)
            elif (
                event.type is EventType.COMPOSITION_DELETED
                and (res_id := applied.pop(event.subject, ""))
                and event.message.startswith("rolled back")  # not applied after all (decomposed: it was)
            ):
                self._end_of(res_id, _released_while_applied(event.subject))
        for comp_id, res_id in applied.items():
            comp = self._compositions.get(comp_id)
            if comp is not None and comp.pending is not None and comp.pending.reservation is None:
                self._end_of(res_id, _released_while_applied(comp_id))

    def _end_of(self, reservation_id: str, how: str) -> None:
        """Remember how the reservation ``reservation_id`` ended ("was released: why; reserve again"), for an
        apply that comes after (`_not_held`); the newest `ENDED_RESERVATION_MEMORY` are kept. Under the lock."""
        self._ended_reservations[reservation_id] = how
        self._ended_reservations.move_to_end(reservation_id)
        if len(self._ended_reservations) > ENDED_RESERVATION_MEMORY:
            self._ended_reservations.popitem(last=False)

    def _drop_reservation(self, res: Reservation, why: EventType, because: str = "") -> None:
        expired = why is EventType.RESERVATION_EXPIRED
        released = "was released" + (f": {because}" if because else "") + "; reserve again"
        self._end_of(res.id, _ENDED_BY_TIME if expired else released)
        self._unclaim_plan(res.plan)
        self._lose_seed(res)
        del self._reservations[res.id]
        del self._reservation_deadlines[res.id]
        self._names.pop(res.request.name, None)
        self.store.delete_reservation(res.id)
        self._emit(
            why, res.id, f"reservation for {res.request.name!r} given back" + (f": {because}" if because else "")
        )

    def _drop_unhealthy_reservations(self, only: str | None = None) -> int:
        """Release the reservations (or only ``only``) whose plan holds a device that is not healthy: their plan can
        no longer be applied, and they would hold the host and the other devices until their time ran out.
        Returns how many; under the lock."""
        dropped = 0
        for res in [r for r in self._reservations.values() if only is None or r.id == only]:
            because = self._unhealthy_in(res.plan)
            if because:
                self._drop_reservation(res, EventType.RESERVATION_RELEASED, because)
                dropped += 1
        return dropped

    def _unhealthy_in(self, plan: Plan) -> str:
        """What of ``plan`` (its devices, its pools) is not healthy, or no longer reported by its fabric, which
        answers; empty when nothing is. A part on a fabric that cannot be reached now is neither: it may come back
        as it was. Under the lock."""
        sick: list[str] = []
        gone: list[str] = []
        for pick in plan.devices:
            dev = self._inv.devices.get(pick.device)
            if dev is None and self._fabric_of(pick.device) not in self._unreachable:
                gone.append(pick.device)
            elif dev is not None and dev.health is not Health.OK:
                sick.append(pick.device)
        for pool in sorted({m.pool for m in plan.memory}):
            if pool not in self._inv.pools and self._fabric_of_pool(pool) not in self._unreachable:
                gone.append(f"pool {pool}")
            elif self._sick_pool(pool):
                sick.append(pool)
        said = [f"{_named(sick)} {'is' if len(sick) == 1 else 'are'} not healthy"] if sick else []
        said += [f"{_named(gone)} {'is' if len(gone) == 1 else 'are'} no longer reported"] if gone else []
        return "; ".join(said)

    @_durably
    def tick(self) -> None:
        """Expire reservations whose time to live has passed; a server calls it on a timer."""
        with self._lock:
            self._expire_locked()

    @_durably
    def reservations(self) -> Sequence[Reservation]:
        with self._lock:
            self._expire_locked()
            return sorted(self._reservations.values(), key=lambda r: r.id)

    @_durably
    def release_reservation(self, reservation_id: str) -> None:
        """Give a reservation's plan back to placement. Idempotent. While an apply of it runs, the apply goes on,
        and should it be undone the reservation is not held again (its record says so, for recovery too)."""
        self._check_started()
        with self._lock:
            self._expire_locked()  # one whose time ran out before the timer's tick expired, not released
            res = self._reservations.get(reservation_id)
            if res is not None:
                self._drop_reservation(res, EventType.RESERVATION_RELEASED)
                return
            self._refuse_other_kind(reservation_id, "reservation")
            applying = next(
                (
                    c
                    for c in self._compositions.values()
                    if c.pending is not None
                    and c.pending.reservation is not None
                    and c.pending.reservation.id == reservation_id
                ),
                None,
            )
            if applying is not None and applying.pending is not None:
                # No event: the apply's `ReservationReleased` ended the reservation for watchers, and an apply
                # undone now gives nothing back, so what they hold stays true.
                kept = revise(applying, pending=attrs.evolve(applying.pending, reservation=None))
                self._record(kept)
                self._end_of(reservation_id, _released_while_applied(kept.id))
                log.info(
                    "reservation %s released while it was being applied as %s: should the apply be undone, it is "
                    "not held again",
                    reservation_id,
                    kept.id,
                )

    def apply_reservation(
        self, reservation_id: str, *, request_id: str | None = None, deadline: float | None = None
    ) -> Composition:
        """Bind a reserved plan; see `apply_reserved`."""
        composition = self.apply_reserved(reservation_id, request_id=request_id, deadline=deadline).composition
        assert composition is not None
        return composition

    def apply_reserved(
        self, reservation_id: str, *, request_id: str | None = None, deadline: float | None = None
    ) -> ComposeResult:
        """Bind a reserved plan, all or nothing; the result carries the plan and the composition.

        With a ``request_id``, a retry returns the first answer (the reservation is gone by then); driver calls
        stop at ``deadline`` (a ``time.monotonic()`` instant). Raises `NotFoundError` when the reservation
        expired or never existed.
        """
        return steps.run(self.apply_steps(reservation_id, request_id=request_id, deadline=deadline), self.store)

    def apply_steps(
        self, reservation_id: str, *, request_id: str | None = None, deadline: float | None = None
    ) -> Steps[ComposeResult]:
        """`apply_reserved` as steps, for `run_async`."""
        self._check_started()
        return self._once(request_id, ("apply", reservation_id), self._apply(reservation_id, deadline))

    def _apply(self, reservation_id: str, deadline: float | None) -> Steps[ComposeResult]:
        with self._lock:
            self._expire_locked()
            res = self._reservations.get(reservation_id)
            if res is None:
                made = self._made_by_mark()
                if made is not None:  # this very apply finished before a crash lost its answer
                    return ComposeResult(ComposeMode.APPLY, self._plan_of(made), composition=made)
                self._check_not_done_before()
                raise self._not_held(reservation_id)
            sick = self._unhealthy_in(res.plan)
            if sick:  # found by a rebuild since, before a reconcile released it: it can never be applied
                self._drop_reservation(res, EventType.RESERVATION_RELEASED, sick)
                released = NotFoundError("reservation", res.id, f"reservation {res.id!r} was released: {sick}")
                raise self._settled(released, *_ASKING.get())
            away = self._out_of_reach(res.plan)
            if away:
                raise FabricUnavailableError(
                    f"reservation {res.id} cannot be applied now: {', '.join(away)} cannot be reached; it stays "
                    "reserved, retry once the fabric answers",
                    metadata={"reservation": res.id},
                )
            # Refused while the reservation still stands: it stays reserved, the ledger as it was.
            comp = self._composing(res.request, res.plan, res)
            self._lose_seed(res)
            del self._reservations[res.id]
            expires = self._reservation_deadlines.pop(res.id)
            self._names.pop(res.request.name, None)
            self.store.delete_reservation(res.id)
            self._unclaim_plan(res.plan)
            self._end_of(res.id, _applied_as(comp.id))
            comp = self._begin(comp, res.plan, reservation=res)
            self._applying_deadlines[comp.id] = expires
        try:
            yield DURABLE
            failpoints.hit("compose.after_reserve")
            return (yield from self._bind_new(comp, res.plan, deadline))
        finally:
            with self._lock:
                self._applying_deadlines.pop(comp.id, None)

    def _not_held(self, reservation_id: str) -> NotFoundError:
        """The refusal of an apply of a reservation that is not held: how it ended, where this run saw it end (an
        apply under another request id, whose client may not have had its answer, names the composition)."""
        how = self._ended_reservations.get(reservation_id, "expired, was released or never existed")
        return NotFoundError("reservation", reservation_id, f"reservation {reservation_id!r} {how}")

    # ----------------------------------------------------------------- compose

    def _check_name(self, name: str) -> None:
        refusal = id_name_refusal(name)
        if refusal is not None:
            raise InvalidRequestError(f"name: {refusal}", field="name")
        holder = self._names.get(name)
        if holder is not None:
            raise AlreadyExistsError(f"the name {name!r} is taken by {holder}", metadata={"holder": holder})

    @_durably
    def preview(self, request: CompositionRequest) -> Plan:
        with self._lock:
            self._expire_locked()
            return self._placer.place(request)

    def compose(
        self,
        request: CompositionRequest,
        mode: ComposeMode = ComposeMode.APPLY,
        *,
        reservation_ttl_s: float = 60.0,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> ComposeResult:
        """See `Composer.compose`. With a ``request_id``, a retry of the same request returns the first answer
        and binds nothing again, and the same id with another request raises `RequestIdReusedError`; a PREVIEW
        changes nothing, so its ``request_id`` is neither looked up nor kept. Driver calls stop at ``deadline``, a
        ``time.monotonic()`` instant (the rollback of a failed plan does not)."""
        change = self.compose_steps(
            request, mode, reservation_ttl_s=reservation_ttl_s, request_id=request_id, deadline=deadline
        )
        return steps.run(change, self.store)

    def compose_steps(
        self,
        request: CompositionRequest,
        mode: ComposeMode = ComposeMode.APPLY,
        *,
        reservation_ttl_s: float = 60.0,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> Steps[ComposeResult]:
        """`compose` as steps, for `run_async`."""
        self._check_started()
        if mode is ComposeMode.PREVIEW:  # nothing to make once; the id stays free for a change (docs/protocol.md)
            request_id = None
        if mode is not ComposeMode.APPLY:
            # One time to live however it is written: 60 and 60.0 are the same request (the wire's is a double).
            ttl = float(reservation_ttl_s) if type(reservation_ttl_s) is int else reservation_ttl_s
            fingerprint: object = (request, mode, ttl)
            recorded_before: object | None = None
        else:  # the time to live means nothing to an APPLY: a retry with another one is the same request
            fingerprint = (request, mode, APPLY_FINGERPRINT_TTL_S)
            recorded_before = (request, mode, reservation_ttl_s)
        return self._once(
            request_id,
            fingerprint,
            self._compose(request, mode, reservation_ttl_s, deadline),
            found_again=_composed,
            recorded_before=recorded_before,
        )

    def _once(
        self,
        request_id: str | None,
        fingerprint: object,
        run: Steps[T],
        *,
        found_again: Callable[[object], bool] = lambda answer: False,
        recorded_before: object | None = None,
    ) -> Steps[T]:
        """Run the change ``run`` once per request id: a retry with the same fingerprint gets the first answer
        (waiting for it while it is in progress, up to the call timeout, then `ConflictError`), another fingerprint
        `RequestIdReusedError`. A failure forgets the id, so that a retry runs again, unless ``run`` raised it
        as `_SettledError` (it failed after changing something): then the error is the answer a retry gets.
        ``run`` is given as a generator not started (no closure to make it, a frame fewer): it starts only as the
        first call of its id, and a retry answered otherwise drops it unstarted.
        Answers are written to the ledger, so a retry after a restart gets them too. An answer that
        ``found_again`` accepts (a retry after a restart finds it from the records of the change itself, as
        `_made_by_request` finds a composition) is given without waiting for its own record to be on disk.

        A retry is answered only once the first call may answer (its ``done`` is set): a retry given an answer
        still queued for the disk would be contradicted after a crash, when the same id answers anew.

        ``recorded_before`` is the fingerprint an earlier release took of the same request, where this one
        takes another (`APPLY_FINGERPRINT_TTL_S`): an id recorded with its digest (an answer in the ledger, a
        composition's record) is the same request, and runs on under that digest, so that the change finds its
        own work by it after a crash (`_made_by_request`). It is digested only when the recorded one differs."""
        if request_id is None:
            try:
                return (yield from run)
            except _SettledError as settled:
                raise settled.error from None
        fp = requests.digest(fingerprint)
        while True:
            with self._lock:
                entry = self._requests.get(request_id)
                if entry is not None and entry[0] != fp and recorded_before is not None:
                    fp = entry[0] if entry[0] == requests.digest(recorded_before) else fp
                seed = entry if entry is not None and entry[1] is _RECORDED else None
                if entry is None or (seed is not None and entry[0] == fp):
                    # New, or known only from the record of the change it made (`_seed_requests`): run it, and
                    # the change finds its own work there and answers with it (`_made_by_request`).
                    done = steps.Latch()
                    self._requests[request_id] = (fp, None, done)
                    self._requests.move_to_end(request_id)  # a seed taken over is the newest now, as its answer
                    self._requests_running += 1
                    break
            seen, result, done = entry
            if seen != fp:
                raise RequestIdReusedError(
                    f"request id {request_id!r} was used for another request", metadata={"request_id": request_id}
                )
            if done.is_set() and isinstance(result, _SettledError):
                raise _again(result.error)
            if done.is_set() and result is not None:
                return cast(T, result)
            if not (yield Until(done, self.call_timeout_s)):
                # Still running: running it again beside it would answer for it wrongly (the name it takes is
                # taken, its composition busy), so this attempt ends and a later one gets the answer.
                raise ConflictError(
                    f"request id {request_id!r} is still being answered after {self.call_timeout_s:g}s; retry",
                    metadata={"request_id": request_id},
                )
        asking = _ASKING.set((request_id, fp))
        retrying = _RETRYING_RECORDED.set(seed is not None)
        try:
            answer = yield from run
        except _SettledError as settled:
            if not settled.recorded:
                self._answer(request_id, fp, settled, seed, done)
            yield from self._answer_durably(request_id, seed, done)
            raise settled.error from None
        except BaseException:
            self._unanswered(request_id, seed, done)
            raise
        finally:
            try:
                _ASKING.reset(asking)
                _RETRYING_RECORDED.reset(retrying)
            except ValueError:
                # Closed in another context: an abandoned change (its loop stopped while a step waited) that
                # the garbage collector ends where it collects it. Its own context is gone with it; that one's
                # variables are not this change's to reset.
                pass
        if found_again(answer):
            if self._requests.get(request_id, (None, None))[1] is None:  # not given by the change (`_bind_new`)
                self._answer(request_id, fp, answer, seed, done, found_again=True)
            done.set()
        else:
            self._answer(request_id, fp, answer, seed, done)
            yield from self._answer_durably(request_id, seed, done)
        return answer

    def _forget_oldest_requests(self) -> None:
        """Forget the oldest answered request ids beyond `REQUEST_ID_MEMORY`, as the ledger gains an answer and
        drops its oldest; under the lock. Ids still running are not counted: one that fails leaves no answer, and
        had it pushed one out, the ledger would still hold that answer while its retry ran again. An id whose first
        call is still running (its ``done`` unset) is kept however old: forgotten, its retry would run as a new
        request beside it, and be refused for the name its own first call holds."""
        excess = len(self._requests) - self._requests_running - REQUEST_ID_MEMORY
        if excess > 0:
            answered = (request_id for request_id, (_, _, done) in self._requests.items() if done.is_set())
            for request_id in list(itertools.islice(answered, excess)):
                del self._requests[request_id]

    def _answer(
        self,
        request_id: str,
        fp: str,
        answer: object,
        seed: tuple[str, object, steps.Latch] | None,
        done: steps.Latch,
        *,
        found_again: bool = False,
    ) -> None:
        """`_answered`, under the lock; an answer found again from the change's own records is given at once and
        its record need not be waited for. Should the ledger refuse the record (it failed), the id is forgotten
        as `_unanswered` does: its retries would otherwise wait for an answer that never comes."""
        try:
            with self.store.asynchronous_commit() if found_again else contextlib.nullcontext(), self._lock:
                self._answered(request_id, fp, answer, _ANSWERED if found_again else done)
        except BaseException:
            self._unanswered(request_id, seed, done)
            raise

    def _answer_durably(
        self, request_id: str, seed: tuple[str, object, steps.Latch] | None, done: steps.Latch
    ) -> Steps[None]:
        """Wait until the first answer to ``request_id`` is on disk, then let its retries have it. Should it never
        get there (the ledger failed), the id is forgotten (or its seed kept) instead: a retry is not given an
        answer a restart may take back."""
        try:
            yield DURABLE
        except BaseException:
            self._unanswered(request_id, seed, done)
            raise
        done.set()

    def _unanswered(self, request_id: str, seed: tuple[str, object, steps.Latch] | None, done: steps.Latch) -> None:
        """The call of ``request_id`` ended without an answer to keep: a retry runs again, or, for an id known
        from a composition record, still finds that record's change (another request under it is refused)."""
        with self._lock:
            if self._requests.get(request_id, (None, ""))[1] is None:
                self._requests_running -= 1
            if seed is not None:
                self._requests[request_id] = seed
            else:
                self._requests.pop(request_id, None)
        done.set()

    def _seed_requests(self) -> None:
        """Remember the request id of each composition's last finished change, and of the Compose that made each
        reservation, with its digest, where the ledger holds no answer for it: a crash after the change's commit
        and before its answer's lost that answer, and the same id with another request must still be refused, not
        carried out as a new change."""
        with self._lock:
            self._seed_from([*self._compositions.values(), *self._reservations.values()])

    def _seed_from(self, made: Sequence[Composition | Reservation]) -> None:
        """`_seed_requests` from the records ``made``; under the lock."""
        for record in made:
            if record.request_id and record.request_id not in self._requests:
                self._requests[record.request_id] = (record.request_fingerprint, _RECORDED, _ANSWERED)
                # Oldest first: new requests push a seed out of memory before an answer the ledger holds.
                self._requests.move_to_end(record.request_id, last=False)

    def _check_not_done_before(self) -> None:
        """Refuse to carry out again the change of a retried request id that the ledger knows from a composition
        record, where that record no longer says so (`RequestAnswerLostError`): the change finished before a
        crash lost its answer, and the composition has been decomposed or changed by another request since.
        Call where the change would otherwise start, under the lock, once it has not found its own work."""
        if _RETRYING_RECORDED.get():
            request_id, _ = _ASKING.get()
            raise self._answer_lost(
                request_id,
                "its composition has since been decomposed or changed by another request (or is being changed now)",
            )

    def _answered(self, request_id: str, fp: str, answer: object, done: steps.Latch = _ANSWERED) -> None:
        """Remember the first answer to ``request_id``, in memory and in the ledger; call under the lock. A retry
        gets it once ``done`` is set: by the call that answers, once its answer is durable (`_once`). The record
        is queued first: refused, it leaves the entry as it was."""
        value = answer.error if isinstance(answer, _SettledError) else answer
        assert isinstance(value, requests.Answer)  # its union made once: written out here, it was made every call
        self.store.put_request(RequestRecord(request_id, fp, requests.encode(value), self.clock()))
        if self._requests.get(request_id, (None, ""))[1] is None:
            self._requests_running -= 1
        self._requests[request_id] = (fp, answer, done)
        self._requests.move_to_end(request_id)  # memory forgets in the order the ledger answered
        self._forget_oldest_requests()

    def _compose(
        self, request: CompositionRequest, mode: ComposeMode, reservation_ttl_s: float, deadline: float | None
    ) -> Steps[ComposeResult]:
        refused = reservation_ttl_refusal(reservation_ttl_s)
        if refused is not None:
            raise InvalidRequestError(refused, field="reservation_ttl_s")
        with self._lock:
            self._expire_locked()
            made = self._made_by_request(request)
            if isinstance(made, Composition) and mode is ComposeMode.APPLY:
                return ComposeResult(mode, self._plan_of(made), composition=made)
            if isinstance(made, Reservation) and mode is ComposeMode.RESERVE:
                return ComposeResult(mode, made.plan, reservation=made)
            self._check_not_done_before()
            if mode is not ComposeMode.PREVIEW:
                self._check_name(request.name)
            plan = self._placer.place(request)
            if mode is ComposeMode.PREVIEW:
                return ComposeResult(mode, plan)
            if mode is ComposeMode.RESERVE:
                expires = self.clock() + reservation_ttl_s
                res = Reservation(self._fresh_id("r", self._reservations), request, plan, expires, *_ASKING.get())
                self._check_records_fit(request.name, plan, functools.partial(self._reserved_records, res, mode))
                self._hold_reservation(res, self.monotonic() + reservation_ttl_s)
                self._emit(EventType.RESERVATION_CREATED, res.id, f"for {request.name!r}", host=plan.host)
                return ComposeResult(mode, plan, reservation=res)
            comp = self._begin(self._composing(request, plan), plan)
        yield DURABLE  # write-ahead: the ledger knows the plan before any driver call
        failpoints.hit("compose.after_reserve")
        return (yield from self._bind_new(comp, plan, deadline, with_answer=True))

    def _made_by_request(self, request: CompositionRequest) -> Composition | Reservation | None:
        """The finished composition, or the reservation, that this thread's request id already made under
        ``request``'s name, when its answer was lost (a crash after the commit and before the answer was
        recorded). One look-up for both, a name holding one or the other: every Compose makes it."""
        request_id, fp = _ASKING.get()
        holder = self._names.get(request.name) if request_id else None
        if holder is None:
            return None
        comp = self._compositions.get(holder)
        if comp is not None:
            return comp if _finished_by(comp, request_id, fp) else None
        res = self._reservations.get(holder)
        return res if res is not None and (res.request_id, res.request_fingerprint) == (request_id, fp) else None

    def _plan_of(self, comp: Composition) -> Plan:
        """The plan a new composition was composed by, for a retry whose first answer a crash lost: its devices,
        and its memory picks rebuilt from its allocations. Placement carves each memory line, in the order of
        the lines, from pool after pool until the line's amount is covered, one allocation per pool; under the
        lock."""
        memory: list[MemoryPick] = []
        allocations = iter(comp.allocations)
        for index, line in enumerate(comp.resources):
            covered = 0
            while line.carved and covered < line.amount_bytes and (alloc := next(allocations, None)) is not None:
                covered += alloc.amount_bytes
                pool = self._inv.pools.get(alloc.pool)
                latency = self._inv.latency(comp.host, pool.device) if pool is not None else None
                memory.append(MemoryPick(alloc.pool, alloc.amount_bytes, index, latency or 0))
        return Plan(comp.host, comp.devices, tuple(memory))

    def _made_by_mark(self) -> Composition | None:
        """The finished composition that this thread's request id made (an apply, which has no name to look it
        up by once its reservation is gone). Looks at every composition: only on the way to a refusal."""
        request_id, fp = _ASKING.get()
        if not request_id:
            return None
        return next((c for c in self._compositions.values() if _finished_by(c, request_id, fp)), None)

    def _fresh_id(self, prefix: str, held: Mapping[str, object]) -> str:
        """A new id (``new_id``) that no record in ``held`` has: a second record under one id would replace the
        first in the ledger. Under the lock."""
        for _ in range(FRESH_ID_TRIES):
            made = self._new_id(prefix)
            if made not in held:
                return made
        raise RuntimeError(f"the composer's id maker gave {FRESH_ID_TRIES} ids in a row that are in use")

    def _composing(
        self, request: CompositionRequest, plan: Plan, reservation: Reservation | None = None
    ) -> Composition:
        """The first record of a new composition of ``request`` by ``plan``, refused when the ledger could not take
        it or what follows it (`_check_records_fit`); neither claimed nor written (`_begin`). Under the lock."""
        comp = self._new_composition(self._fresh_id("c", self._compositions), request, plan, reservation)
        self._check_records_fit(comp.name, plan, lambda: self._new_records(comp, plan))
        return comp

    def _new_composition(
        self, comp_id: str, request: CompositionRequest, plan: Plan, reservation: Reservation | None
    ) -> Composition:
        """A new composition ``comp_id``, COMPOSING, with ``plan`` (from ``reservation``, if one) pending."""
        request_id, fp = _ASKING.get()
        return Composition(
            id=comp_id,
            name=request.name,
            host=plan.host,
            state=CompositionState.COMPOSING,
            resources=request.resources,
            devices=plan.devices,
            pending=self._adding(comp_id, plan, restore=None, reservation=reservation),
            request_id=request_id,
            request_fingerprint=fp,
        )

    def _begin(self, comp: Composition, plan: Plan, reservation: Reservation | None = None) -> Composition:
        """Claim ``plan`` for the new composition ``comp`` (`_composing`) and record it. Under the lock."""
        self._claim_plan(plan, comp.id)
        held = self._busy[comp.id] = threading.Lock()
        held.acquire()  # new, so free: the compose holds it until _bind_new ends
        self._record(comp)
        if reservation is not None:  # it left the listing: a client that watches from one learns so, and as what
            self._emit(
                EventType.RESERVATION_RELEASED,
                reservation.id,
                f"reservation for {reservation.request.name!r} applied as {comp.id}",
                composition=comp.id,
            )
        self._names[comp.name] = comp.id
        self._emit(EventType.COMPOSITION_CREATED, comp.id, f"{comp.name!r} on {comp.host}", host=comp.host)
        return comp

    def _reserved_records(
        self, res: Reservation, mode: ComposeMode
    ) -> tuple[tuple[Composition | Reservation, ...], ComposeResult]:
        """The records a reservation ``res`` writes, and those its apply writes (a composition whose first record
        carries the reservation, `_new_records`), and its Compose's answer: a reservation that fits and whose apply
        does not could never be applied."""
        placeholder = "c" + res.id[1:]  # as long as the composition's id: the apply makes it
        applying, _ = self._new_records(self._new_composition(placeholder, res.request, res.plan, res), res.plan)
        return (res, *applying), ComposeResult(mode, res.plan, reservation=res)

    @staticmethod
    def _new_records(comp: Composition, plan: Plan) -> tuple[tuple[Composition, ...], ComposeResult]:
        """The records a new composition ``comp`` writes (COMPOSING, then COMPOSED) and its Compose's answer."""
        planned = comp.pending.allocations if comp.pending is not None else ()
        after = attrs.evolve(comp, state=CompositionState.COMPOSED, allocations=planned, pending=None)
        return (comp, after), ComposeResult(ComposeMode.APPLY, plan, composition=after)

    def _changed_records(
        self, comp: Composition, add: Sequence[ResourceRequest], adding: PendingChange | None, remove: Collection[str]
    ) -> tuple[tuple[Composition, ...], Composition]:
        """The records a recompose of ``comp`` writes, and its answer: its pending addition ``adding`` of the lines
        ``add``, and the composition grown, with the pending removal of what ``remove`` names, if any; the answer
        is the composition without it. A pending removal names what it removes beside all the composition holds,
        so a removal grows the record it begins with too. Each at the state and generation it is written at."""
        records: list[Composition] = []
        grown = attrs.evolve(comp, state=CompositionState.COMPOSING, generation=comp.generation + 1)
        if adding is not None:
            records.append(attrs.evolve(grown, pending=adding))
            grown = attrs.evolve(
                grown,
                generation=grown.generation + 1,
                resources=comp.resources + tuple(add),
                devices=comp.devices + adding.devices,
                allocations=comp.allocations + adding.allocations,
            )
        request_id, fp = _ASKING.get()
        done = attrs.evolve(grown, state=comp.state, request_id=request_id, request_fingerprint=fp)
        if not remove:
            return (*records, done), done
        records.append(attrs.evolve(grown, pending=self._removal(grown, set(remove))))
        devices = tuple(p for p in grown.devices if p.device not in remove)
        allocations = tuple(a for a in grown.allocations if a.id not in remove)
        return tuple(records), attrs.evolve(
            done, generation=done.generation + 1, devices=devices, allocations=allocations
        )

    @staticmethod
    def _healed_records(
        comp: Composition, bad: Sequence[DevicePick], adding: PendingChange
    ) -> tuple[tuple[Composition, ...], None]:
        """The records a heal of ``comp`` writes as it binds the replacements ``adding`` of ``bad`` (paired in
        order) and as it unbinds ``bad``, at the generation that one is written at: each names both, the second
        twice (its devices hold the failed ones beside their replacements until they are unbound). It answers no
        request."""
        replaced = {p.device: n for p, n in zip(bad, adding.devices, strict=True)}
        devices = _beside(comp.devices, replaced)
        removing = PendingChange(ChangeKind.REMOVE, tuple(bad))
        unbinding = revise(
            comp, generation=comp.generation + 1, devices=devices, pending=removing, **_request_fields("", "")
        )
        return (attrs.evolve(comp, pending=adding), unbinding), None

    def _past_limit(
        self,
        made: Callable[
            [], tuple[Sequence[Composition | Reservation], ComposeResult | Composition | DisaggError | None]
        ],
        grown: bool = False,
    ) -> tuple[int, int] | None:
        """The size of the largest of the records ``made()`` gives, with the answer to this thread's request
        (`RequestRecord`) when it gives one, and the ledger's `Store.record_limit`, when that record is larger;
        else None. A ledger without a limit (SQLite, memory) has nothing made to measure. Under the lock. A change
        that ``grown`` a composition has the composition it leaves (its answer's too) measured as a reconcile may
        make it (`_grown`): what the hardware reports is written into a record nobody can refuse."""
        limit = self.store.record_limit
        if limit is None:
            return None
        records, answer = made()
        every: list[Composition | Reservation | RequestRecord] = list(records)
        every += [
            self._unknown_as(r)
            for r in records
            if isinstance(r, Composition) and r.pending is not None and r.state is not CompositionState.UNKNOWN
        ]
        if grown:
            left = answer.composition if isinstance(answer, ComposeResult) else answer
            if isinstance(left, Composition) and left not in every:
                every.append(left)
            adding = [r for r in every if isinstance(r, Composition) and r.pending is not None]
            every = [self._grown(r) if isinstance(r, Composition) and r.pending is None else r for r in every]
            every += [self._failed_as(r) for r in adding]
            if answer is not None:
                every += [RequestRecord(*_ASKING.get(), requests.encode(_failed_answer_of(r)), 0.0) for r in adding]
        if answer is not None:
            every.append(RequestRecord(*_ASKING.get(), requests.encode(answer), 0.0))
            removing = [r for r in records if isinstance(r, Composition) and _removing(r)]
            every += [RequestRecord(*_ASKING.get(), requests.encode(_left_answer_of(r)), 0.0) for r in removing]
        size = max(len(codec.record(record).encode()) for record in every)
        return (size, limit) if size > limit else None

    @staticmethod
    def _unknown_as(comp: Composition) -> Composition:
        """``comp``, a record of a change in flight, as UNKNOWN in the fewest words (`_mark_unknown_one`): a crash
        may leave it for recovery while its fabric is away, and the state must be written then. The state kept
        before is the longest there is (DECOMPOSING), so that the room covers a FAILED record's decompose too."""
        prior = PriorState(CompositionState.DECOMPOSING, comp.message)
        return revise(comp, state=CompositionState.UNKNOWN, message="", before_unknown=prior)

    @staticmethod
    def _failed_as(comp: Composition) -> Composition:
        """``comp``, a record of a change in flight, as the change's failure may leave it: FAILED, its rollback
        incomplete, every part of it named as left (the longest, `_named`), in as many of the driver's words as
        a record keeps (`_clipped`): written after the hardware changed, it cannot be refused then."""
        return revise(
            comp, state=CompositionState.FAILED, message=_incomplete_why(_named(_longest_parts(comp)), _LONGEST_CLIPPED)
        )

    def _grown(self, comp: Composition) -> Composition:
        """``comp`` as the hardware's reports may make it: all it holds missing, each part of it named as missing,
        unreachable and unhealthy at once (the longest of its ids named, `_named`), that reason kept as the state
        before UNKNOWN too, all of it on a fabric that cannot be reached. No larger record tells of its parts."""
        ids = [*comp.device_ids, *(a.id for a in comp.allocations)]
        parts = sorted([*ids, *(f"pool {a.pool}" for a in comp.allocations)], key=len, reverse=True)
        why = "; ".join(
            f"{said} {_named(parts)}" for said in ("the hardware no longer holds", "unreachable:", "unhealthy:")
        )
        fabrics = sorted(self._fabrics_of(comp), key=len, reverse=True)
        away = _away_why(fabrics, [(f, _LONGEST_ASIDE) for f in fabrics], fabrics)
        why = max(why, away, key=_written_length)
        return revise(
            comp, state=CompositionState.DEGRADED, message=why, before_unknown=PriorState(comp.state, why), missing=ids
        )

    def _check_records_fit(
        self,
        name: str,
        plan: Plan,
        made: Callable[[], tuple[Sequence[Composition | Reservation], ComposeResult | Composition]],
        removing: int = 0,
        adding: str = "resources",
    ) -> None:
        """Refuse a change of ``name`` to hold ``plan``, and to remove ``removing`` of its parts, when the ledger
        could not take one of the records ``made()`` gives, or its request's answer, which it gives with them
        (`_past_limit`, the composition grown by ``plan`` measured as a reconcile may make it). Checked before
        anything is claimed, bound or written: the ledger fails as a whole on a record it cannot take, which stops
        the server, and a client's retry of the request stopped the next replica to lead in turn. Refused, an
        addition names the request's field ``adding`` (a Compose's ``resources``, a Recompose's ``add``), a removal
        alone ``remove``. Under the lock."""
        if self.store.record_limit is None:  # SQLite, memory: no limit to measure against (`_past_limit`)
            return
        past = self._past_limit(made, grown=bool(plan.devices or plan.memory))
        if past is None:
            return
        size, limit = past
        if plan.devices or plan.memory or not removing:
            change = f"hold {len(plan.devices)} more devices and {len(plan.memory)} more allocations"
            ask, field = "ask for fewer in one composition", adding
            if removing:
                change += f", and name the {removing} parts it removes,"
        else:
            change = f"name the {removing} parts it removes beside all it holds"
            ask, field = "remove fewer at a time", "remove"
        raise InvalidRequestError(
            f"{name!r} would {change} in a record of about {size} bytes, more than the etcd ledger holds in one "
            f"record ({limit}): {ask}",
            field=field,
        )

    def _adding(
        self,
        comp_id: str,
        plan: Plan,
        *,
        restore: CompositionState | None,
        start: int = 0,
        reservation: Reservation | None = None,
        before: Composition | None = None,
    ) -> PendingChange:
        """The record of binding ``plan``, written before the first driver call (see `PendingChange`); for an
        addition to ``before``, with the generations whose etags it held."""
        planned: tuple[Allocation, ...] = ()
        if plan.memory:  # most plans carve none: no generator's frame
            planned = tuple(
                Allocation(s.allocation_id, s.pick.pool, plan.host, s.pick.amount_bytes)
                for s in self._memory_steps(comp_id, plan, start)
            )
        held = () if before is None else before.etag_generations
        return PendingChange(ChangeKind.ADD, plan.devices, planned, restore, *_ASKING.get(), reservation, held)

    def _memory_steps(self, comp_id: str, plan: Plan, start: int = 0) -> list[MemoryStep]:
        """The allocations of ``plan``; read outside the lock too, so the fabric is found whether or not a
        rebuild since dropped the pool from the index (its fabric gone away meanwhile)."""
        if not plan.memory:  # most plans: no list comprehension's frame, twice a Compose
            return []
        return [
            MemoryStep(f"{comp_id}-m{start + n}", self._fabric_of_pool(m.pool), m) for n, m in enumerate(plan.memory)
        ]

    def _device_steps(self, picks: Iterable[DevicePick]) -> list[tuple[str, DevicePick]]:
        """The binds of ``picks`` with their fabrics, found as `_memory_steps` finds its pools'."""
        return [(self._fabric_of(p.device), p) for p in picks]

    def _bind_new(
        self, comp: Composition, plan: Plan, deadline: float | None = None, *, with_answer: bool = False
    ) -> Steps[ComposeResult]:
        """Bind and carve a new composition's ``plan``, and record it COMPOSED; ``with_answer`` (a Compose, whose
        answer a retry may have once the composition is recorded: `_composed`), its request id's answer too, in
        the same hold. Returns the APPLY's answer, made once: the one recorded is the one returned. Lets go of the
        composition's lock (`_begin`) however it ends: here rather than in a change around it, a generator fewer
        per Compose."""
        try:
            devices, memory = self._device_steps(plan.devices), self._memory_steps(comp.id, plan)
            try:
                allocations = yield self._driver_call(
                    lambda: self._executor.apply(comp.host, devices, memory, deadline=deadline, stage="compose"),
                    [f for f, _ in devices] + [m.fabric for m in memory],
                )
            except ExecutionFailedError as failed:
                with self._lock:
                    left = self._fail_new(comp, plan, failed)
                    error = self._failed_answer(comp.id, failed, left, *_ASKING.get())
                raise error from None
            failpoints.hit("compose.before_commit")
            # The plan is durable and the hardware holds all of it: the answer need not wait for this record too,
            # since recovery finishes a new composition that the hardware holds whole (`_finished_on_hardware`).
            # One commit to wait for per Compose instead of two (docs/durability.md).
            with self.store.asynchronous_commit(), self._lock:
                # A device that failed while the binds ran was reported to a composition not yet COMPOSED, which
                # took its reason (`_say_meanwhile`): its record as it is now is judged.
                comp = self._set_standing(self._compositions[comp.id], allocations=allocations, pending=None)
                answer = ComposeResult(ComposeMode.APPLY, plan, composition=comp)
                request_id, fp = _ASKING.get()
                if with_answer and request_id:  # its answer with its record, in one hold (`_once` finds it given)
                    self._answered(request_id, fp, answer)
            failpoints.hit("compose.after_commit")
            return answer
        finally:
            self._let_go(comp.id, self._busy[comp.id])

    def _failed_answer(
        self, comp_id: str, failed: ExecutionFailedError, left: bool, request_id: str, fp: str
    ) -> Exception:
        """What a change to ``comp_id`` whose driver calls failed raises: the error, or, when its rollback
        ``left`` part of it on the hardware (the composition FAILED), `RollbackIncompleteError` naming what is
        left, as the answer of its request (``request_id``, digest ``fp``), written in this hold, with the FAILED
        record: it changed something, so a retry gets this answer rather than running again (the name taken by
        what it left), and it is not the driver's error, which may say "retry" (UNAVAILABLE: a client would
        retry it until its deadline, getting this answer each time). Under the lock."""
        if not left:
            return failed.error
        error = failed.error
        incomplete = _incomplete_error(comp_id, _clipped(error.message), error.reason, failed.leftovers)
        return self._settled(incomplete, request_id, fp)

    def _settled(self, error: DisaggError, request_id: str, fp: str) -> _SettledError:
        """``error`` as the answer of ``request_id`` (digest ``fp``), written in this hold when the request is
        being answered (`_once`), as `_SettledError`. Under the lock."""
        settled = _SettledError(error)
        entry = self._requests.get(request_id) if request_id else None
        if entry is not None:
            self._answered(request_id, fp, settled, entry[2])
            settled.recorded = True
        return settled

    def _rollback_incomplete(self, comp: Composition, failed: ExecutionFailedError) -> bool:
        """When the rollback of a failed addition left part of it on the hardware, the composition is FAILED,
        keeping the pending change that names those parts, so that a decompose releases them; returns whether it
        did. Its message leaves out the driver's text (up to `TEXT_KEPT`), then what is held, when the ledger would
        not take it in the record (`_fits`: the pending change may have left it at the edge); its event and the
        request's answer say it all. Said with nothing, it is no larger than the record it follows (FAILED is
        shorter than COMPOSING, DEGRADED or COMPOSED). Under the lock."""
        if not failed.leftovers:
            return False
        left, cause = _named(failed.leftovers), _clipped(failed.error.message)
        log.warning("could not undo %s of %s", ", ".join(failed.leftovers), comp.id)
        self._emit(EventType.ROLLBACK_INCOMPLETE, comp.id, f"could not undo {left}: {cause}")
        # Named in the message: what the rollback left is in the pending change, which is not on the wire.
        held = f"rollback incomplete: {left} still held"
        told = (_incomplete_why(left, cause), held, "rollback incomplete")
        why = next((m for m in told if self._fits(comp, state=CompositionState.FAILED, message=m)), "")
        self._set(comp, state=CompositionState.FAILED, message=why)
        return True

    def _fail_addition(
        self,
        comp: Composition,
        plan: Plan,
        failed: ExecutionFailedError,
        state: CompositionState,
        before: Composition | None = None,
    ) -> bool:
        """An addition to a live composition (recompose, heal) failed: the composition goes back to ``state``,
        or is FAILED when the rollback was incomplete (then True). Under the lock. A standing ``state`` is judged again
        (`_set_standing`): a device may have failed while the composition was COMPOSING, which no event judged.
        Judged as it stood (a heal's, which never leaves DEGRADED), it is put back with its etag: clients saw
        nothing change (`_heal`). Back as it was ``before`` the change (a recompose's), the etag it had then holds
        again, for the change's retry and for the clients that read it (`_set`)."""
        if self._rollback_incomplete(comp, failed):
            return True
        self._unclaim_plan(plan, host=False)
        why = self._standing_why(comp)
        if state not in _STANDING:
            self._set(comp, state=state, pending=None)
        elif (comp.state, comp.message) == (CompositionState.DEGRADED if why else CompositionState.COMPOSED, why):
            self._record(revise(comp, pending=None))
        else:
            self._set_standing(comp, before, message=comp.message, pending=None)
        return False

    def _fail_new(self, comp: Composition, plan: Plan, failed: ExecutionFailedError) -> bool:
        """A new composition's binds failed: it is forgotten, or FAILED when its rollback was incomplete (then
        True). Under the lock."""
        # As it is now: a release while it ran took its reservation out, a failure gave it its reason.
        now = self._compositions.get(comp.id, comp)
        if self._rollback_incomplete(now, failed):
            return True
        self._unclaim_plan(plan)
        self._forget(now, f"rolled back: {_clipped(failed.error.message)}")
        self._give_back(now.id, now.pending)
        return False

    def _give_back(self, comp_id: str, change: PendingChange | None) -> None:
        """Give the reservation an undone apply (that made ``comp_id``) took back, for the rest of its time to
        live; under the lock."""
        res = change.reservation if change is not None else None
        if res is None:
            return
        deadline = self._applying_deadlines.pop(comp_id, None)
        if deadline is None:  # a recovery's: the apply was taken in an earlier run
            deadline = self._deadline_from_record(res)
        if deadline <= self.monotonic():
            self._end_of(res.id, _ENDED_BY_TIME)
            self._emit(EventType.RESERVATION_EXPIRED, res.id, f"reservation for {res.request.name!r} given back")
            return
        inv = self._inv
        free = (
            res.request.name not in self._names
            and res.plan.host in inv.hosts  # one no longer reported cannot be held (a restart found it gone)
            and inv.host_owner.get(res.plan.host) is None
            and all(inv.owner.get(p.device) is None for p in res.plan.devices)
            and all(m.pool in inv.pools and inv.pools[m.pool].free_bytes >= m.amount_bytes for m in res.plan.memory)
        )
        if not free:  # what it held is another's now (a restart found the hardware otherwise): it cannot be held
            taken = "its apply was undone, and what it held is taken now"
            self._end_of(res.id, f"was released: {taken}; reserve again")
            self._emit(
                EventType.RESERVATION_RELEASED, res.id, f"reservation for {res.request.name!r} given back: {taken}"
            )
            return
        # A device of it failed while the apply ran (the failure found no reservation to release then): it could
        # not be applied again, and would hold its host and devices until its time ran out.
        sick = self._unhealthy_in(res.plan)
        if sick:
            self._end_of(res.id, f"was released: {sick}; reserve again")
            self._emit(
                EventType.RESERVATION_RELEASED, res.id, f"reservation for {res.request.name!r} given back: {sick}"
            )
            return
        self._hold_reservation(res, deadline)
        self._emit(
            EventType.RESERVATION_CREATED,
            res.id,
            f"for {res.request.name!r}, again: its apply was undone",
            host=res.plan.host,
        )

    # ----------------------------------------------------------------- queries

    def _refuse_other_kind(self, key: str, wanted: str) -> None:
        """Refuse ``key``, given to release a ``wanted`` ("composition" or "reservation") that it does not name,
        when it names something live of the other kind, or a reservation by its name: answered as an unknown id
        is (done), the call released nothing, and the reservation held its plan until its time to live ran out.
        Under the lock."""
        named = self._names.get(key, "")
        res = self._reservations.get(key) or self._reservations.get(named)
        comp = self._compositions.get(key) or self._compositions.get(named)
        if wanted == "composition" and res is not None:
            why = f"is reservation {res.id}" if key == res.id else f"names reservation {res.id}"
            hint = "ReleaseReservation gives its plan back (by its id), and Compose with its reservation_id applies it"
        elif wanted == "reservation" and res is not None:
            why, hint = f"names reservation {res.id}", "ReleaseReservation takes its id"
        elif wanted == "reservation" and comp is not None:
            why = f"is composition {comp.id}" if key == comp.id else f"names composition {comp.id}"
            hint = "Decompose releases what it holds"
        else:
            return
        raise InvalidRequestError(f"{key!r} {why}, not a {wanted} id: {hint}", field="id")

    def find(self, key: str) -> Composition:
        """A composition by id or by name."""
        with self._lock:
            comp = self._compositions.get(key) or self._compositions.get(self._names.get(key, ""))
            if comp is None:
                raise NotFoundError("composition", key)
            return comp

    def get(self, composition_id: str) -> Composition:
        return self.find(composition_id)

    def compositions(self) -> Sequence[Composition]:
        with self._lock:
            return sorted(self._compositions.values(), key=lambda c: (c.name, c.id))

    def topologies(self) -> Sequence[Topology]:
        with self._lock:
            return list(self._inv.topologies.values())

    def device(self, device_id: str) -> Device:
        with self._lock:
            dev = self._inv.devices.get(device_id)
            if dev is None:
                raise NotFoundError("device", device_id)
            return dev

    def devices(self) -> Sequence[Device]:
        with self._lock:
            devices = self._inv.devices
            return [devices[d] for d in self._inv.device_ids]

    def owner_of(self, device_id: str) -> str | None:
        with self._lock:
            return self._inv.owner.get(device_id)

    def holders(self) -> dict[str, str]:
        """Every held device's id, to the composition or reservation holding it (`owner_of` for them all)."""
        with self._lock:
            return dict(self._inv.owner)

    def cordoned_devices(self) -> set[str]:
        """The ids of the cordoned devices (`is_cordoned` for them all)."""
        with self._lock:
            return set(self._cordoned)

    def usage(self) -> tuple[list[KindUsage], list[PoolUsage]]:
        """Per kind: devices in all, free, used and unhealthy; per pool: bytes in all and free."""
        with self._lock:
            carved = {p.info.device for p in self._inv.pools.values()}
            counts: dict[DeviceKind, list[int]] = {}
            for dev in self._inv.devices.values():
                if dev.id in carved:
                    continue
                c = counts.setdefault(dev.kind, [0, 0, 0, 0])
                c[0] += 1
                c[1] += self._inv.is_free(dev.id)
                c[2] += dev.id in self._inv.owner
                c[3] += dev.health is not Health.OK
            kinds = [KindUsage(k, *v) for k, v in sorted(counts.items(), key=lambda kv: kv[0].value)]
            pools = [
                PoolUsage(p.info.id, p.info.device, p.info.capacity.total_bytes, p.free_bytes)
                for p in sorted(self._inv.pools.values(), key=lambda p: p.info.id)
            ]
            return kinds, pools

    @_durably
    def cordon(self, device_id: str) -> Device:
        """Keep a device out of placement; a composition that holds it keeps it. The device behind a CXL pool
        keeps the pool out: no memory is carved from it, what is carved stays. Idempotent."""
        self._check_started()
        with self._lock:
            dev = self.device(device_id)
            if device_id not in self._cordoned:
                self._cordoned.add(device_id)
                self._inv.cordon(device_id)
                self.store.put_cordon(device_id)
                self._emit(EventType.DEVICE_CORDONED, device_id)
            return dev

    @_durably
    def uncordon(self, device_id: str) -> Device:
        """Offer a cordoned device to placement again. Idempotent."""
        self._check_started()
        with self._lock:
            dev = self.device(device_id)
            if device_id in self._cordoned:
                self._cordoned.discard(device_id)
                if self._quarantined.pop(device_id, None) is not None:
                    self.store.delete_quarantine(_BINDING, device_id)
                # A pass reading the hardware now may have read the binding the operator has just undone: judged
                # from that read, it would quarantine and cordon the device again. It leaves it to the next pass.
                self._note_quarantined(device_id)
                self._inv.uncordon(device_id)
                self.store.delete_cordon(device_id)
                self._emit(EventType.DEVICE_UNCORDONED, device_id)
            return dev

    def is_cordoned(self, device_id: str) -> bool:
        with self._lock:
            return device_id in self._cordoned

    # ----------------------------------------------------------------- recompose / decompose

    def recompose(
        self,
        composition_id: str,
        *,
        add: Sequence[ResourceRequest] = (),
        remove: Sequence[str] = (),
        expected_etag: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> Composition:
        """See `Composer.recompose`; driver calls stop at ``deadline``, a ``time.monotonic()`` instant.

        With a ``request_id``, a retry of the same change (the same id or name, ``add``, ``remove`` and
        ``expected_etag``) returns the first answer and changes nothing again, and the same id with another
        change raises `RequestIdReusedError`; ids share one space with `compose`'s. A failure that changed
        nothing forgets the id; one that changed something (resources added, then a removal that left some
        bound) stays the answer, so a retry cannot add twice.
        """
        change = self.recompose_steps(
            composition_id,
            add=add,
            remove=remove,
            expected_etag=expected_etag,
            request_id=request_id,
            deadline=deadline,
        )
        return steps.run(change, self.store)

    def recompose_steps(
        self,
        composition_id: str,
        *,
        add: Sequence[ResourceRequest] = (),
        remove: Sequence[str] = (),
        expected_etag: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> Steps[Composition]:
        """`recompose` as steps, for `run_async`: on the server's event loop a recompose that waits for its
        composition, its commits or its driver calls holds no worker thread."""
        self._check_started()
        check_expected_etag(expected_etag)
        add, remove = tuple(add), tuple(remove)
        return self._once(
            request_id,
            ("recompose", composition_id, add, remove, expected_etag),
            self._holding(
                composition_id,
                lambda target: self._recompose(target, add, remove, expected_etag, deadline),
                deadline,
            ),
        )

    def _recompose(
        self,
        composition_id: str,
        add: tuple[ResourceRequest, ...],
        remove: tuple[str, ...],
        expected_etag: str | None,
        deadline: float | None,
    ) -> Steps[Composition]:
        if not add and not remove:
            raise InvalidRequestError("a recomposition needs something to add or remove")
        request_id, fp = _ASKING.get()
        with self._lock:
            comp = self._find_held(composition_id)
            if request_id and _finished_by(comp, request_id, fp):
                return comp  # this very change finished before a crash lost its answer
            self._check_not_done_before()
            if expected_etag is not None and not comp.holds_etag(expected_etag):
                raise ConflictError(
                    f"composition {comp.id} is at {comp.etag}, not {expected_etag}",
                    metadata={"etag": comp.etag, "subject": comp.id},
                )
            if comp.state not in (CompositionState.COMPOSED, CompositionState.DEGRADED):
                raise ConflictError(
                    f"composition {comp.id} is {comp.state.value}; it cannot be changed now",
                    metadata={"subject": comp.id},
                )
            self._check_removal(comp, remove, bool(add))
            base = len(comp.resources)
            if add and base + len(add) > MAX_RESOURCE_LINES:
                raise InvalidRequestError(
                    f"add: composition {comp.id} has {base} resource lines, and a composition has at most "
                    f"{MAX_RESOURCE_LINES} (a removal keeps its line): compose a new one with the lines it needs",
                    field="add",
                )
            lines: list[Line] = [(base + i, r, Pin()) for i, r in enumerate(add)]
            self._placer.check_lines(add, "add")
            plan = Plan(comp.host)
            previous_state, before = comp.state, comp
            start = self._next_alloc_index(comp)
            if lines:
                found, why = self._placer.try_host(comp.host, lines, added_lines(base))
                if found is None:
                    raise NoFitError(why)
                plan = found
                first = self._adding(comp.id, plan, restore=previous_state, start=start, before=comp)
                measured = functools.partial(self._changed_records, comp, add, first, remove)
                self._check_records_fit(comp.name, plan, measured, len(remove), adding="add")
                self._claim_plan(plan, comp.id, host=False)
            else:
                # A removal alone writes its plan at once: a record COMPOSING with nothing pending, left by a
                # crash, would be judged anew by recovery, at a new generation, and the retry of a change that
                # never began refused as stale. Its plan on disk, recovery finishes it, and the retry finds its work.
                first = self._removal(comp, set(remove))
                measured = functools.partial(self._changed_records, comp, (), None, remove)
                self._check_records_fit(comp.name, plan, measured, len(remove))
            comp = self._set(comp, state=CompositionState.COMPOSING, pending=first)
            devices, memory = self._device_steps(plan.devices), self._memory_steps(comp.id, plan, start=start)
        yield DURABLE
        host = comp.host
        try:
            new_allocs: tuple[Allocation, ...] = yield self._driver_call(
                lambda: self._executor.apply(host, devices, memory, deadline=deadline, stage="recompose"),
                [f for f, _ in devices] + [m.fabric for m in memory],
            )
        except ExecutionFailedError as failed:
            with self._lock:  # its record as it is now: a failure meanwhile gave it its reason (`_say_meanwhile`)
                left = self._fail_addition(self._compositions[comp.id], plan, failed, previous_state, before)
                answer = self._failed_answer(comp.id, failed, left, request_id, fp)
            raise answer from None
        failpoints.hit("recompose.before_commit")
        # Only a change that fully happened is found again by its request id: a failed one may be retried.
        mark = _request_fields(request_id, fp)
        with self._lock:
            comp = self._compositions[comp.id]  # as it is now, as above
            # The additions go into one record with what follows them, the removal's plan or the end of the
            # change with its request id: the ledger may commit a group between two records, and after a crash
            # there the additions would be recorded without the request id, for a retry to add them again.
            changes: dict[str, object] = {
                "resources": comp.resources + add,
                "devices": comp.devices + plan.devices,
                "allocations": comp.allocations + new_allocs,
                "pending": None,
            }
            grown = attrs.evolve(comp, **changes)  # type: ignore[arg-type]
            if add and remove:
                changes["pending"] = self._removal(grown, set(remove))
                comp = self._set(comp, **changes)
            elif add:
                comp = self._set_standing(comp, **changes, **mark)
            # A removal alone wrote its plan as it began: nothing to record before its first unbind.
            if add:
                added = _parts(len(plan.devices), len(new_allocs))
                self._emit(EventType.COMPOSITION_UPDATED, comp.id, f"added {added}", etag=comp.etag)
        error: Exception | None = None
        if remove:
            comp, error = yield from self._remove(comp, deadline, mark, added=bool(add), before=before)
        yield DURABLE
        failpoints.hit("recompose.after_commit")
        if error is None:
            return comp
        raise error

    @staticmethod
    def _check_removal(comp: Composition, remove: tuple[str, ...], adding: bool) -> None:
        """Refuse a removal naming something ``comp`` does not hold, naming one thing twice, or taking all it holds
        when nothing is added: a composition needs at least one resource, and decompose is the way to end it."""
        known = set(comp.device_ids) | {a.id for a in comp.allocations}
        unknown = [(n, r) for n, r in enumerate(remove) if r not in known]
        if unknown:
            raise InvalidRequestError(
                f"composition {comp.id} holds no device or allocation {', '.join(r for _, r in unknown)}",
                field=f"remove[{unknown[0][0]}]",
            )
        again = next((n for n, r in enumerate(remove) if r in remove[:n]), None)
        if again is not None:
            raise InvalidRequestError(f"{remove[again]} is named twice", field=f"remove[{again}]")
        if remove and not adding and set(remove) == known:
            raise InvalidRequestError(
                f"removing everything composition {comp.id} holds would leave it nothing: decompose it instead",
                field="remove",
            )

    def _next_alloc_index(self, comp: Composition) -> int:
        return max((int(a.id.rsplit("-m", 1)[1]) + 1 for a in comp.allocations if "-m" in a.id), default=0)

    def _removal(self, comp: Composition, remove: set[str]) -> PendingChange:
        """The record of removing what ``remove`` names from ``comp``, written before the first driver call."""
        picks = tuple(p for p in comp.devices if p.device in remove)
        allocs = tuple(a for a in comp.allocations if a.id in remove)
        return PendingChange(ChangeKind.REMOVE, picks, allocs, None, *_ASKING.get())

    def _remove(
        self,
        comp: Composition,
        deadline: float | None,
        mark: Mapping[str, str],
        *,
        added: bool,
        before: Composition | None = None,
    ) -> Steps[tuple[Composition, Exception | None]]:
        """Unbind and release what ``comp``'s pending removal names, once that is durable; what could not be
        undone stays part of the composition, and the error that says so is returned (None when nothing was
        left). The record of the result carries ``mark`` (the request id and digest) when nothing was left. When
        something was left and the change still did something (it ``added``, or the removal took some of its
        parts), the error is the request's answer, returned as `_SettledError` and written with the record in one
        transaction: a crash between the two would leave the request id unknown to the record and to the answers,
        and a retry would add the lines again. A change that did nothing and left the composition as it was
        ``before`` it began leaves the etag it had then valid, for its retry (`_set`)."""
        assert comp.pending is not None and comp.pending.kind is ChangeKind.REMOVE
        picks, allocs = comp.pending.devices, comp.pending.allocations
        yield DURABLE
        host = comp.host
        fabrics = [self._fabric_of(p.device) for p in picks] + [self._fabric_of_pool(a.pool) for a in allocs]
        leftovers: Leftovers = yield self._driver_call(
            lambda: self._release(host, picks, allocs, deadline, stage="recompose"), fabrics
        )
        nothing_done = not added and len(leftovers.ids) == len(picks) + len(allocs)
        with self._lock:
            gone_devices = {p.device for p in picks} - set(leftovers.ids)
            gone_allocs = [a for a in allocs if a.id not in leftovers.ids]
            now = self._compositions[comp.id]  # a failure meanwhile gave it its reason (`_say_meanwhile`)
            restoring = before if nothing_done else None
            comp = self._without(now, gone_devices, gone_allocs, restoring, **(mark if not leftovers else {}))
            removed = _parts(len(gone_devices), len(gone_allocs))
            self._emit(EventType.COMPOSITION_UPDATED, comp.id, f"removed {removed}", etag=comp.etag)
            if not leftovers:
                return comp, None
            error = _left_bound(comp.id, leftovers)
            if nothing_done:
                return comp, error  # nothing happened: a retry runs again
            return comp, self._settled(error, mark.get("request_id", ""), mark.get("request_fingerprint", ""))

    def _without(
        self,
        comp: Composition,
        devices: set[str],
        allocs: Sequence[Allocation],
        restoring: Composition | None = None,
        /,
        **changes: str,
    ) -> Composition:
        """``comp`` without ``devices`` and ``allocs``, which the hardware no longer holds, and with the state
        its devices' health gives it and ``changes``, in one record; under the lock. ``restoring``: see `_set`; a
        removal that removed nothing keeps the message too (a heal's note after the reason), or the record would
        not be as it was."""
        if restoring is not None:
            changes.setdefault("message", comp.message)
        for device in devices:
            self._inv.release_device(device)
        for alloc in allocs:
            self._inv.release_memory(alloc.pool, alloc.amount_bytes)
        gone = {a.id for a in allocs} | devices
        return self._set_standing(
            comp,
            restoring,
            devices=tuple(p for p in comp.devices if p.device not in gone),
            allocations=tuple(a for a in comp.allocations if a.id not in gone),
            missing=tuple(m for m in comp.missing if m not in gone),
            pending=None,
            **changes,
        )

    def _release(
        self,
        host: str,
        picks: Sequence[DevicePick],
        allocs: Sequence[Allocation],
        deadline: float | None = None,
        *,
        stage: str = "",
    ) -> Leftovers:
        """Release ``allocs`` and unbind ``picks`` from ``host`` (`Executor.undo`); returns what is still held.

        Each goes to the fabric its id names, listed in the index or not: a rebuild while a change runs drops a
        fabric that stopped answering from the index, not its bindings and allocations from the hardware. What
        lies on a fabric that cannot be reached now is not tried, and counts as still held, so that the record
        keeps it until that fabric answers (a removal of it reports it bound, as one a driver refused)."""
        with self._lock:
            away = set(self._unreachable)
            pools = {a.pool: self._fabric_of_pool(a.pool) for a in allocs}
        now = self._held_now(pools, away)
        with self._lock:
            allocs = [a for a in allocs if not self._kept_held_otherwise(a, now)]
            carved = [(self._fabric_of_pool(a.pool), a.pool, a.id) for a in allocs]
            bound = [(self._fabric_of(p.device), Binding(p.device, host)) for p in picks]
        left = self._executor.undo(
            [b for b in bound if b[0] not in away],
            [c for c in carved if c[0] not in away],
            deadline=deadline,
            stage=stage,
        )
        newest_first = [(c[0], c[2]) for c in reversed(carved)] + [(f, b.device) for f, b in reversed(bound)]
        untried = [part for fabric, part in newest_first if fabric in away]
        if untried:
            fabrics = sorted({fabric for fabric, _ in newest_first if fabric in away})
            log.warning("fabric %s cannot be reached: %s left held", ", ".join(fabrics), ", ".join(untried))
        still = {*left.ids, *untried}
        return Leftovers(tuple(part for _, part in newest_first if part in still), left.timed_out)

    def _held_now(self, pools: Mapping[str, str], away: set[str]) -> dict[tuple[str, str], Allocation] | None:
        """What the hardware holds in ``pools`` (pool -> fabric) now, by pool and id, read before a release: None
        when a pool cannot be read (the release then judges by the last pass, `_held_otherwise`). Outside the
        lock."""
        held: dict[tuple[str, str], Allocation] = {}
        for pool, fabric in pools.items():
            if fabric in away:
                continue
            try:
                held.update(((a.pool, a.id), a) for a in self.fabrics[fabric].pool(pool).allocations())
            except Exception:  # a driver's bug too: the release meets it, or is refused, as before
                return None
        return held

    def _kept_held_otherwise(self, alloc: Allocation, held: Mapping[tuple[str, str], Allocation] | None) -> bool:
        """Whether ``alloc``, about to be released, is held on the hardware under its id for another host or at
        another size: as ``held`` (`_held_now`) shows it, or as the last pass saw it (`_held_otherwise`) when the
        pool could not be read. Then it is not released, which would free memory that is not its composition's,
        but quarantined and reported now as memory no composition records (the composition lets it go). Under
        the lock."""
        key = (alloc.pool, alloc.id)
        noted = self._forget_held_otherwise(key)
        hardware = noted if held is None else held.get(key)
        if hardware is None or (hardware.host, hardware.amount_bytes) == (alloc.host, alloc.amount_bytes):
            return False
        log.warning(
            "pool %s: not releasing %s, which the hardware holds for %s: quarantined",
            alloc.pool,
            alloc.id,
            hardware.host,
        )
        self._quarantine_stray(key, hardware)
        return True

    def decompose(self, composition_id: str, *, deadline: float | None = None) -> None:
        """See `Composer.decompose`; driver calls stop at ``deadline``, a ``time.monotonic()`` instant.

        When something stays bound the composition is left FAILED, naming it, and another decompose finishes
        the job: raises `DeadlineExceededError` when the deadline stopped a driver call, else `DisaggError`.
        A change of the composition in flight finishes first (`_holding`).
        """
        steps.run(self.decompose_steps(composition_id, deadline=deadline), self.store)

    def decompose_steps(self, composition_id: str, *, deadline: float | None = None) -> Steps[None]:
        """`decompose` as steps, for `run_async`."""
        self._check_started()
        return self._holding(composition_id, lambda target: self._decompose(target, deadline), deadline)

    def _decompose(self, composition_id: str, deadline: float | None, *, stage: str = "decompose") -> Steps[None]:
        """Decompose ``composition_id``; its releases are ``stage``'s (`failpoints`): recovery's when it finishes a
        decompose a crash interrupted."""
        with self._lock:
            try:
                comp = self._find_held(composition_id)
            except NotFoundError:
                self._refuse_other_kind(composition_id, "composition")
                return
            away = self._away(comp)
            if away:
                # What it holds there cannot be released, nor known to be: the record must stay to release it later.
                raise FabricUnavailableError(
                    f"composition {comp.id} cannot be decomposed now: {self._why_away(away)}; it is kept, and can "
                    "be decomposed once the fabric is served again",
                    metadata={"composition": comp.id},
                )
            comp = self._set(comp, state=CompositionState.DECOMPOSING, **self._decomposing(comp))
        yield DURABLE
        picks, allocs = _holdings(comp)
        fabrics = [self._fabric_of(p.device) for p in picks] + [self._fabric_of_pool(a.pool) for a in allocs]
        leftovers: Leftovers = yield self._driver_call(
            lambda: self._release(comp.host, picks, allocs, deadline, stage=stage), fabrics
        )
        failpoints.hit("decompose.before_commit")
        with self._lock:
            if leftovers:
                names = _named(leftovers.ids)
                self._keep_only(
                    comp, picks, allocs, set(leftovers.ids), f"could not release {names}; decompose again to retry"
                )
                metadata = {"composition": comp.id, "bound": _listed(leftovers.ids)}
                if leftovers.timed_out:
                    raise DeadlineExceededError(
                        f"the deadline stopped the decompose of {comp.id} with {names} still bound; it is FAILED: "
                        "decompose again to retry",
                        metadata=metadata,
                    )
                raise DisaggError(
                    f"decompose of {comp.id} left {names} bound; it is FAILED: decompose again to retry",
                    metadata=metadata,
                )
            self._unclaim_composition(comp)
            self._forget(comp, f"{comp.name!r} decomposed")

    def _decomposing(self, comp: Composition) -> dict[str, object]:
        """What ``comp`` leaves out as it becomes DECOMPOSING, five bytes longer than FAILED, when the ledger would
        not take it whole (`_fits`): its message, then the bookkeeping a composition going away needs no more (the
        request id of its last change, what the hardware no longer held). A FAILED record an older release left at
        the edge, with no message to leave out, went past the limit and failed the ledger. Refused when even that
        would not fit, nothing changed. Under the lock."""
        state = CompositionState.DECOMPOSING
        less: list[dict[str, object]] = [{}, {"message": ""}, {"message": "", "missing": (), **_request_fields("", "")}]
        for left_out in less:
            if self._fits(comp, state=state, **left_out):
                return left_out
        now = revise(comp, state=state, generation=comp.generation + 1, **left_out)
        raise ConflictError(
            f"composition {comp.id} cannot be decomposed: as DECOMPOSING its record would be about "
            f"{len(codec.record(now).encode())} bytes, more than the etcd ledger holds in one record "
            f"({self.store.record_limit}); nothing was changed: release what it holds on the hardware by hand, "
            "then delete its record from the ledger",
            metadata={"subject": comp.id},
        )

    def _keep_only(
        self, comp: Composition, picks: Sequence[DevicePick], allocs: Sequence[Allocation], kept: set[str], why: str
    ) -> None:
        """A decompose left ``kept`` (device and allocation ids) on the hardware: the composition is FAILED
        holding just those, saying ``why`` when the ledger takes it in the record (`_fits`: its DECOMPOSING record
        may be at the edge), and what was released goes back to placement. Under the lock."""
        for pick in picks:
            if pick.device not in kept:
                self._inv.release_device(pick.device)
        for alloc in allocs:
            if alloc.id not in kept:
                self._inv.release_memory(alloc.pool, alloc.amount_bytes)
        changes: dict[str, object] = {
            "state": CompositionState.FAILED,
            "devices": tuple(p for p in picks if p.device in kept),
            "allocations": tuple(a for a in allocs if a.id in kept),
            "pending": None,
        }
        self._set(comp, message=why if self._fits(comp, message=why, **changes) else "", **changes)

    # ----------------------------------------------------------------- health

    def _standing(self, comp: Composition) -> CompositionState:
        """The state of a composition with no change in flight: DEGRADED when the hardware no longer holds part
        of it (`Composition.missing`), its host no longer reaches a device or a pool it carves memory from over
        links that are up, a device is unhealthy, or a pool it carves memory from is (`_standing_why`)."""
        return CompositionState.DEGRADED if self._standing_why(comp) else CompositionState.COMPOSED

    def _standing_why(self, comp: Composition) -> str:
        """Why `_standing` is DEGRADED, as its message; empty when it is COMPOSED. Every path that settles a
        composition judges it by this one rule, so that none undoes another's verdict."""
        return self._why(comp.host, comp.devices, comp.allocations, comp.missing)

    def _why(
        self, host: str, devices: Sequence[DevicePick], allocations: Sequence[Allocation], missing: Sequence[str]
    ) -> str:
        """`_standing_why` of a composition with these fields (`_set_standing` judges one before making it): a
        device or pool that is not healthy (`_unhealthy_of`, `_sick_of`) is named unhealthy, a healthy one whose
        switch the host no longer reaches unreachable. One pass over each, in loops rather than comprehensions: a
        Compose judges its composition once, and each comprehension was a frame of its own."""
        why = [f"the hardware no longer holds {_named(missing)}"] if missing else []
        index = self._inv
        reach = index.reach_map.get(host, {})
        away: list[str] = []
        sick: list[str] = []
        for p in devices:
            dev = index.devices.get(p.device)
            if dev is None or dev.health is not Health.OK:
                sick.append(p.device)
            elif dev.switch not in reach:
                away.append(p.device)
        if allocations:
            cut_off: dict[str, None] = {}  # memory too: a pool whose switch the host no longer reaches, named once
            for a in allocations:
                pool = index.pools.get(a.pool)
                if pool is None or pool.device.health is not Health.OK:
                    sick.append(a.id)
                elif pool.device.switch not in reach:
                    cut_off[a.pool] = None
            away += [f"pool {p}" for p in cut_off]
        why += [f"unreachable: {_named(away)}"] if away else []
        why += [f"unhealthy: {_named(sick)}"] if sick else []
        return "; ".join(why)

    def _set_standing(self, comp: Composition, restoring: Composition | None = None, /, **changes: Any) -> Composition:
        """`_set` ``changes`` with the state the result stands at and the message that says why, so that no
        change leaves a DEGRADED composition's reason behind once it is COMPOSED, nor the other way round. Under
        the lock. Judged from the fields the result will have, without making it twice (per Compose). A ``message``
        given (a rolled-back change's, the one it had) is kept when it says that reason first, with what a heal
        found after it, as `_reassess` keeps it: the composition is as it was."""
        get = changes.get
        why = self._why(
            get("host", comp.host),
            get("devices", comp.devices),
            get("allocations", comp.allocations),
            get("missing", comp.missing),
        )
        state = CompositionState.DEGRADED if why else CompositionState.COMPOSED
        given = changes.pop("message", why)
        message = given if given == why or (why and given.startswith(f"{why}; ")) else why
        return self._set(comp, restoring, state=state, message=message, **changes)

    def _unhealthy(self, comp: Composition) -> list[DevicePick]:
        return self._unhealthy_of(comp.devices)

    def _unhealthy_of(self, devices: Sequence[DevicePick]) -> list[DevicePick]:
        return [p for p in devices if (dev := self._inv.devices.get(p.device)) is None or dev.health is not Health.OK]

    def _sick_pool(self, pool: str) -> bool:
        """Whether the device backing ``pool`` is not healthy: the memory carved from it is at risk."""
        state = self._inv.pools.get(pool)
        return state is not None and state.device.health is not Health.OK

    def _sick_memory(self, comp: Composition) -> list[str]:
        """The ids of ``comp``'s allocations whose pool is not healthy (`_sick_pool`), or no longer reported by
        discovery (as a device that is not is unhealthy, `_unhealthy`). Healing cannot replace them: memory in
        use is not moved."""
        return self._sick_of(comp.allocations)

    def _sick_of(self, allocations: Sequence[Allocation]) -> list[str]:
        return [a.id for a in allocations if a.pool not in self._inv.pools or self._sick_pool(a.pool)]

    def _on_fabric_event(self, event: FabricEvent) -> None:
        with self._lock:
            self._heard[event.fabric] = self._heard.get(event.fabric, 0) + 1
            if self._early is not None:  # starting: applied once the ledger and the index are built
                self._early.append(event)
                return
        self._heal_soon(self._apply_event(event))

    def _apply_event(self, event: FabricEvent) -> list[str]:
        """Apply one fabric event; returns the compositions it leaves to heal (auto-heal, a device failed)."""
        if event.kind is FabricEventKind.RESYNC_REQUIRED:
            self._resync(event)
            return []
        if event.kind is FabricEventKind.DEVICE_HEALTH and event.health is not None:
            affected = self._health_changed(event.fabric, event.subject, event.health, event.message)
            return affected if self.auto_heal and event.health is not Health.OK else []
        with self._lock:
            # The event's fabric alone is asked: the unreachable others are the timer's to ask, without the lock,
            # and the reachable others told of every change of theirs by events of their own.
            self._rebuild(retry={event.fabric}, asked={event.fabric})
            self._mark_unknown()
            self._drop_unhealthy_reservations()  # a device removed, or found unhealthy by the rebuild
            self._emit(
                EventType.LINK_STATE_CHANGED
                if event.kind in (FabricEventKind.LINK_DOWN, FabricEventKind.LINK_UP)
                else EventType.DEVICE_ADDED
                if event.kind is FabricEventKind.DEVICE_ADDED
                else EventType.DEVICE_REMOVED,
                _clipped(event.subject),
                _clipped(event.message),
                fabric=event.fabric,
            )
            for comp in list(self._compositions.values()):
                self._reassess(comp)
        return []

    def _reassess(self, comp: Composition) -> None:
        """A standing composition (COMPOSED or DEGRADED) goes to the state `_standing` gives it now, and a
        DEGRADED one whose message no longer begins with why (a second device failed) says it again. One that a
        change in flight holds COMPOSING is told at once too (`_say_meanwhile`). A heal's records stay DEGRADED
        with the change in them (`pending`), measured with the message the heal began with: on a ledger with a
        record limit, a longer reason, or one it would not take (`_fits`), is left out of them, the state written
        still; the heal says it as it ends, in a smaller record (`_set_standing`), and each device's own event
        names it."""
        if comp.state is CompositionState.COMPOSING and self._changing(comp.id):
            self._say_meanwhile(comp)
            return
        if comp.state not in _STANDING:
            return
        why = self._standing_why(comp)
        state = CompositionState.DEGRADED if why else CompositionState.COMPOSED
        if state is comp.state and (not why or comp.message == why or comp.message.startswith(f"{why}; ")):
            return
        limited = self.store.record_limit is not None  # a ledger without a limit takes the reason as it comes
        if (
            limited
            and comp.pending is not None
            and (_written_length(why) > _written_length(comp.message) or not self._fits(comp, state=state, message=why))
        ):
            if state is not comp.state:
                self._set(comp, state=state)
            return
        self._set_standing(comp)

    def _changing(self, comp_id: str) -> bool:
        """Whether a change of the composition is in flight now (it holds the composition, `_holding`). A
        COMPOSING record that none holds is one a crash interrupted: recovery settles it. Under the lock."""
        busy = self._busy.get(comp_id)
        return busy is not None and busy.locked()

    def _say_meanwhile(self, comp: Composition) -> None:
        """Give a composition whose change is in flight (COMPOSING) the reason `_standing_why` finds now, as its
        message, and have its change return to DEGRADED should it be undone: a device that fails while a
        recompose binds for seconds is seen within one, not when the change ends. The change goes on; as it
        ends it reads the record again and judges it (`_set_standing`, `_fail_addition`). What the change is
        adding counts too (`_holdings`): a device it bound a moment ago may be the one that failed. A reason the
        ledger would not take in the record (`_fits`: a removal's names what it removes beside all the composition
        holds, and may be at the edge) is left out: the state to return to is written still, the change says why
        as it ends, in a smaller record, and each device's own event names it. Under the lock."""
        devices, allocations = _holdings(comp)
        why = self._standing_why(revise(comp, devices=tuple(devices), allocations=tuple(allocations)))
        said = comp.message == why or (bool(why) and comp.message.startswith(f"{why}; "))
        pending = comp.pending
        if pending is not None and pending.restore in _STANDING:
            back = CompositionState.DEGRADED if why else CompositionState.COMPOSED
            pending = attrs.evolve(pending, restore=back)
        message = comp.message if said or not self._fits(comp, message=why, pending=pending) else why
        if message != comp.message or pending != comp.pending:
            self._set(comp, message=message, pending=pending)

    def _health_changed(self, fabric: str, device: str, health: Health, message: str) -> list[str]:
        """Record a device's health, as ``fabric`` reports it (`_record_health`); degrade or restore the
        compositions using it. Returns their ids."""
        with self._lock:
            affected = self._record_health(fabric, device, health, message)
            for comp_id in affected:
                self._reassess(self._compositions[comp_id])
            return affected

    def _record_health(self, fabric: str, device: str, health: Health, message: str) -> list[str]:
        """Record a device's health, as ``fabric`` reports it, and say so; returns the compositions using it,
        for the caller to judge. A fabric reports only on its own devices: one set aside for repeating another's
        id (`_index`) must not fail or repair the other's device of that id. Under the lock."""
        known = self._inv.devices.get(device)
        if known is not None and known.fabric != fabric:
            log.warning(
                "ignored fabric %s's health report on device %s, which is fabric %s's", fabric, device, known.fabric
            )
            return []
        old = self._inv.set_health(device, health)
        if old is None or old.health is health:
            return []
        self._emit(EventType.DEVICE_HEALTH_CHANGED, device, _clipped(message), old=old.health.value, new=health.value)
        owner = self._inv.owner.get(device)
        if owner in self._reservations and health is not Health.OK:
            self._drop_unhealthy_reservations(owner)
            return []
        # Those of its switch alone: a pass that finds thousands failed applies each under one hold.
        pools = {s.info.id for s in self._inv.pools_by_switch.get(old.switch, ()) if s.device.id == device}
        if pools and health is not Health.OK:
            self._drop_unhealthy_reservations()
        users = (
            [c for c in self._compositions.values() if any(a.pool in pools for a in _holdings(c)[1])]
            if pools  # a device behind no pool (most are) is used by its owner alone: no scan
            else []
        )
        comp = self._compositions.get(owner) if owner else None
        return [c.id for c in users] + ([comp.id] if comp is not None else [])

    def heal(self, composition_id: str) -> Composition:
        """Replace each unhealthy device of a composition with one that meets the same request line."""
        self._check_started()
        return self._held(composition_id, self._heal)

    def _replacement_lines(self, comp: Composition, bad: list[DevicePick]) -> tuple[list[DevicePick], list[Line]]:
        """One placement line per resource line with unhealthy devices, asking as many devices as it lost and
        pinned by its healthy ones (their switch, their failure domains): placed together, the replacements of
        one line keep to one switch and to distinct domains among themselves too. Returns ``bad`` in the order
        of the lines' picks, so that the two pair off."""
        by_line: dict[int, list[DevicePick]] = {}
        for pick in bad:
            by_line.setdefault(pick.resource, []).append(pick)
        lines: list[Line] = []
        for resource, failed in by_line.items():
            r = comp.resources[resource]
            peers = [p for p in comp.devices if p.resource == resource and p not in failed]
            peer_devs = [self._inv.devices[p.device] for p in peers if p.device in self._inv.devices]
            switch = peer_devs[0].switch if r.affinity is Affinity.SAME_SWITCH and peer_devs else None
            used = (
                frozenset(d.failure_domains[r.spread] for d in peer_devs if r.spread in d.failure_domains)
                if r.spread
                else frozenset()
            )
            lines.append((resource, attrs.evolve(r, count=len(failed)), Pin(switch=switch, used_domains=used)))
        return [p for failed in by_line.values() for p in failed], lines

    def _not_healed(self, comp: Composition, why: str, told: str = "") -> NoFitError:
        """The error of a heal of ``comp`` left undone for ``why`` (told the caller as ``told``, if given), which
        the composition, DEGRADED, says after its reason (`_reassess` keeps that up to date), with an event. Said
        again, it changes nothing: every reconcile tries the heal again, and a restart must not revise its etag.
        A record too large for the ledger with it is not written: the reason alone stands. Under the lock."""
        message = f"{self._standing_why(comp)}; no replacement: {why}"
        if message != comp.message and self._fits(comp, message=message):
            self._set(comp, message=message)
        return NoFitError(f"cannot heal {comp.id}: {told or why}")

    def _undo_said(self, comp: Composition, changes: Mapping[str, object]) -> dict[str, str]:
        """The message of the record that undoes a heal's replacements, ``comp`` with ``changes``: the reason it
        stands DEGRADED for now (`_standing_why`, in as few words as `_named` gives), which the heal's records may
        have left out, when the ledger takes it there (`_fits`); else none, and the undo says it as it ends. It was
        said only then. Under the lock."""
        why = self._standing_why(revise(comp, **changes))
        said = comp.message == why or comp.message.startswith(f"{why}; ")
        return {"message": why} if why and not said and self._fits(comp, message=why, **changes) else {}

    def _heal(self, composition_id: str) -> Composition:
        with self._lock:
            comp = self._find_held(composition_id)
            if comp.state is not CompositionState.DEGRADED or comp.pending is not None:
                return comp  # a change a crash left half made is recovery's (`_recover`): it would be overwritten
            bad = self._unhealthy(comp)
            if not bad:
                return comp if self._standing(comp) is CompositionState.DEGRADED else self._set_standing(comp)
            bad, lines = self._replacement_lines(comp, bad)
            plan, why = self._placer.try_host(comp.host, lines)
            if plan is None:
                raise self._not_healed(comp, why)
            adding = self._adding(comp.id, plan, restore=comp.state)
            past = self._past_limit(functools.partial(self._healed_records, comp, bad, adding))
            if past is not None:  # nobody asked for it: no client to refuse, the ledger must not fail on it
                why = (
                    f"its record with {len(bad)} replacements would be{{}} more than the etcd ledger holds in one "
                    f"record ({past[1]} bytes): recompose it smaller, or decompose it"
                )
                raise self._not_healed(comp, why.format(""), why.format(f" about {past[0]} bytes,"))
            inputs = self._heal_inputs(comp, bad)  # before the claim takes the spares out of the free ones
            self._claim_plan(plan, comp.id, host=False)
            # The change in flight is the ledger's bookkeeping, not on the wire (`Composition.pending`): written
            # alone it keeps the etag, so that a heal whose binds fail leaves the composition as clients saw it
            # (`_fail_addition`), and a reconcile trying it again does not make their etags stale.
            comp = revise(comp, pending=adding)
            self._record(comp)
        self.store.sync()
        try:
            self._executor.apply(comp.host, self._device_steps(plan.devices), [], stage="heal")
        except ExecutionFailedError as failed:
            with self._lock:
                self._fail_addition(self._compositions[comp.id], plan, failed, comp.state)
                self._note_failed_heal(comp.id, inputs)
            raise failed.error from None
        failpoints.hit("heal.before_commit")
        replaced = {b.device: n for b, n in zip(bad, plan.devices, strict=True)}
        with self._lock:
            # As a recompose does: the replacements join the composition in the record that plans the removal
            # of the failed devices, on disk before the first unbind. A crash after it finishes the removal and
            # keeps the replacements; the pending ADD alone would be undone, the failed devices already unbound.
            now = self._compositions[comp.id]
            comp = self._set(
                now,
                devices=_beside(now.devices, replaced),
                pending=PendingChange(ChangeKind.REMOVE, tuple(bad)),
                **_request_fields("", ""),
            )
        self.store.sync()
        stuck = set(self._release(comp.host, bad, [], stage="heal").ids)
        done = {old: new for old, new in replaced.items() if old not in stuck}
        # A failed device that cannot be unbound stays in the composition, and its replacement is undone: that
        # removal replaces the pending one, on disk before its unbind, so that a crash finishes it rather than
        # the failed device's removal, which would keep a replacement the hardware no longer binds.
        undo = [replaced[device] for device in replaced if device in stuck]
        with self._lock:
            for device in done:
                self._inv.release_device(device)
            now = self._compositions[comp.id]
            missing = tuple(m for m in now.missing if m not in done)  # a replaced device is no longer missed
            devices = tuple(p for p in now.devices if p.device not in done)
            pending = PendingChange(ChangeKind.REMOVE, tuple(undo)) if undo else None
            changes: dict[str, object] = {"devices": devices, "missing": missing, "pending": pending}
            comp = self._set(now, **changes, **(self._undo_said(now, changes) if undo else {}))
            if done:
                healed = _named([f"{old} -> {new.device}" for old, new in done.items()])
                self._emit(EventType.COMPOSITION_HEALED, comp.id, healed)
            if not undo:
                self._failed_heals.pop(comp.id, None)
                comp = self._set_standing(comp)
            else:  # as a failed bind: tried again with the same inputs, the unbind would most likely be refused again
                self._note_failed_heal(comp.id, inputs)
        self.store.sync()
        kept: set[str] = set()
        if undo:
            # A replacement that cannot be undone either stays too, recorded, for a decompose to release.
            kept = set(self._release(comp.host, undo, [], stage="heal").ids)
            with self._lock:
                comp = self._without(self._compositions[comp.id], {new.device for new in undo} - kept, [])
            self.store.sync()
        failpoints.hit("heal.after_commit")
        if stuck:
            names = _named(sorted(stuck))
            raise DisaggError(
                f"could not unbind {names} from {comp.host}: kept in composition {comp.id}, which stays "
                f"{comp.state.value}; heal again, or decompose it",
                metadata={"composition": comp.id, "bound": _listed(sorted(stuck | kept))},
            )
        return comp


def request_summary(request: CompositionRequest) -> str:
    return ", ".join(describe_line(r) for r in request.resources)


def _epoch_refused(exc: DisaggError) -> str:
    """Why a driver did not take the epoch, with what to do when its refusal may be the etcd cluster's, not
    another replica's: a new or rebuilt cluster starts its epochs low again."""
    if not isinstance(exc, StaleEpochError):
        return exc.message
    return (
        f"{exc.message} (if no other fabric manager runs, as after a move to a new or rebuilt etcd cluster, set "
        "[state] epoch_base to that highest epoch: see docs/ha.md)"
    )
