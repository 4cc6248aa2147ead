"""WatchEvents: the retained log after a revision, then live events, in revision order with no gap and no
duplicate.

The store is the truth and a watcher's live buffer only a fast path. A watcher registers its buffer with the
composer *before* it reads the log, so every event is in the log, the buffer, or both; an event already sent
is skipped by revision. The composer calls listeners under its lock, so a buffer never blocks: when it is
full it drops events and says so, and the watcher reads the missed ones from the log instead.

An event is sent once the ledger holds it durably (`Store.await_event`): live events reach the buffer as they
are made, before their commit, and a crash could take back one not yet on disk; after the restart its
revision would be missing from the log, or reused by another event, and a watcher that had seen it would
resume with a gap.

Revisions rise by exactly one per event, so a hole in what the log returns means the store no longer holds
those events (the in-memory ledger keeps the newest N): the watch then ends with OUT_OF_RANGE
(`RevisionCompactedError`) rather than skip silently. A revision ahead of the newest one (the log was reset,
for example an in-memory ledger after a restart) is refused the same way; one past any a ledger can hold
(`MAX_REVISION`) is INVALID_ARGUMENT.
"""

from __future__ import annotations

import collections
import math
import random
import threading
from collections.abc import Callable, Generator

from disagg.composer import FabricComposer
from disagg.errors import (
    InvalidRequestError,
    OverloadedError,
    RevisionCompactedError,
    not_serving,
)
from disagg.model import Event
from disagg.model.events import MAX_REVISION
from disagg.server.context import RpcContext

LOG_PAGE = 1000
"""Events read from the log at once."""
POLL_S = 1.0
"""The longest a watcher sleeps before it looks at its call again."""
WATCH_STALL_S = 30.0
"""How long one event's send may wait for a client that does not read (its flow-control window full) before its
watch is ended and its slot freed. A paused or vanished client is caught sooner by keepalive (15 s); this catches
one whose connection answers pings but whose code stopped reading."""
WATCH_RETRY_S = 1.0
"""A watch refused at the limit asks its client to wait this long to twice it (`OverloadedError.retry_delay_s`)
before it tries again: a slot frees only as a watcher leaves, which a retry within milliseconds would not see, and
the jitter spreads the clients refused together so that they do not all come back at once."""


class EventBuffer:
    """Live events for one watcher, bounded; `offer` never blocks."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._cond = threading.Condition()
        self._events: collections.deque[Event] = collections.deque()
        self._overflowed = False
        self._ended = False
        self._stopping = ""

    def offer(self, event: Event) -> None:
        """Called by the composer under its lock."""
        with self._cond:
            if self._ended:
                return
            if len(self._events) >= self._capacity:
                self._overflowed = True
            else:
                self._events.append(event)
            self._cond.notify()

    def end(self, *, stopping: str = "") -> None:
        """Wake the watcher for the last time: its call ended, or the server stops serving (``stopping``: why)."""
        with self._cond:
            self._ended = True
            self._stopping = self._stopping or stopping
            self._cond.notify()

    def take(self, timeout: float) -> tuple[list[Event], bool]:
        """Wait up to ``timeout`` for events; returns them and whether some were dropped since the last take."""
        with self._cond:
            if not (self._events or self._overflowed or self._ended):
                self._cond.wait(timeout)
            events = list(self._events)
            self._events.clear()
            overflowed, self._overflowed = self._overflowed, False
            return events, overflowed

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def stopping(self) -> str:
        """Why the server stopped serving the watch; empty while it serves it."""
        return self._stopping


def stalled_watch(stall_s: float, revision: int) -> OverloadedError:
    """The end of a watch whose client read nothing for ``stall_s`` seconds after the event at ``revision``."""
    return OverloadedError(
        f"this watch was ended: its client read none of the events sent for {stall_s:g} s, and the fabric manager "
        f"holds no watch for a client that does not read; watch again from revision {revision}",
        metadata={"revision": str(revision)},
    )


SHUTTING_DOWN = "the fabric manager is shutting down"
"""Why a watch ends, or is refused, when its server stops."""


class Watches:
    """The open watches of a server: at most ``limit`` at once, each holding a worker thread; all are ended
    when the server stops."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: set[EventBuffer] = set()
        self._stopping = ""

    def open(self, capacity: int) -> EventBuffer:
        with self._lock:
            if self._stopping:
                raise not_serving(self._stopping)
            if len(self._open) >= self.limit:
                delay = WATCH_RETRY_S * (1 + random.random())
                raise OverloadedError(
                    f"the fabric manager serves at most {self.limit} event watches at once; retry in {delay:.1f} s",
                    metadata={"limit": str(self.limit)},
                    retry_delay_s=delay,
                )
            buffer = EventBuffer(capacity)
            self._open.add(buffer)
            return buffer

    def close(self, buffer: EventBuffer) -> None:
        with self._lock:
            self._open.discard(buffer)

    def stop(self, why: str = SHUTTING_DOWN) -> None:
        """End every open watch (with UNAVAILABLE saying ``why``) and refuse new ones."""
        with self._lock:
            self._stopping = self._stopping or why
            buffers = list(self._open)
        for buffer in buffers:
            buffer.end(stopping=self._stopping)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


def watch_events(
    composer: FabricComposer,
    after: int,
    context: RpcContext,
    watches: Watches,
    *,
    capacity: int = 1024,
    after_time: float = 0.0,
    opened: Callable[[], None] | None = None,
) -> Generator[Event, None, None]:
    """Events with a revision above ``after`` (0: the whole retained log), then live ones, until the call
    ends. Raises `RevisionCompactedError` for a gap, or for a log reset since the event at ``after`` (of time
    ``after_time``, when known) was read, and `FabricUnavailableError` when the server stops. ``opened`` is
    called once the watch is served (checked, and holding its slot), before it reads the log."""
    if not math.isfinite(after_time) or after_time < 0:
        raise InvalidRequestError(f"after_time: a time in seconds, 0 or more, not {after_time!r}", field="after_time")
    if after > MAX_REVISION:
        raise InvalidRequestError(
            f"after_revision: {after} is past any revision a ledger can hold (at most {MAX_REVISION}); watch from "
            "a revision a listing or an event answered, or 0 for the whole retained log",
            field="after_revision",
        )
    newest = composer.revision
    if after > newest:
        raise RevisionCompactedError(
            f"revision {after} is ahead of the event log, whose newest revision is {newest}: the log was reset; "
            f"list again and watch from {newest}",
            metadata={"newest": str(newest)},
        )
    if after and after_time:
        _check_same_log(composer, after, after_time, newest)
    buffer = watches.open(capacity)
    remove = composer.add_listener(buffer.offer)
    try:
        context.add_callback(buffer.end)
        if opened is not None:
            opened()
        cursor = yield from _replay(composer, after, buffer, first=after == 0)
        if cursor == 0 and not buffer.ended:
            # Nothing retained at all: the next event follows the newest revision. A watch stopped before it read
            # the log says to watch again from where it began, not past what it never sent.
            cursor = newest
        while not buffer.ended:
            events, overflowed = buffer.take(POLL_S)
            if buffer.stopping:
                break
            if not context.is_active():
                return
            if overflowed:
                cursor = yield from _replay(composer, cursor, buffer)
                continue
            for event in events:
                if event.revision <= cursor:
                    continue
                if event.revision != cursor + 1:
                    cursor = yield from _replay(composer, cursor, buffer)
                    continue
                composer.store.await_event(event.revision)
                yield event
                cursor = event.revision
        if buffer.stopping:
            raise not_serving(f"{buffer.stopping}; watch again from revision {cursor}", {"revision": str(cursor)})
    finally:
        remove()
        watches.close(buffer)


def _check_same_log(composer: FabricComposer, after: int, after_time: float, newest: int) -> None:
    """Refuse a resume whose event at ``after`` the log now holds with another time: the log was reset (an
    in-memory ledger restarted) or restored from a backup since, and its revisions name other events, which a
    resume from ``after`` would skip. One whose event is just past the retention is refused too: it cannot be
    compared, and the log shows no gap after it (`_replay`). One further past is the gap's to refuse."""
    held = composer.events(after - 1, 1)
    if not held:  # the newest event, counted a moment before the ledger holds it: nothing to compare yet
        return
    if held[0].revision == after + 1:
        raise RevisionCompactedError(
            f"event {after} is no longer retained (the oldest is {after + 1}), so whether the event log was reset "
            f"or restored since it was read cannot be told: list again and watch from {newest}",
            metadata={"oldest": str(after + 1), "after": str(after)},
        )
    if held[0].revision == after and held[0].time != after_time:
        raise RevisionCompactedError(
            f"the event log was reset or restored since revision {after} was read (its event there is another "
            f"one now): list again and watch from {newest}",
            metadata={"newest": str(newest), "after": str(after)},
        )


def _replay(
    composer: FabricComposer, cursor: int, buffer: EventBuffer, *, first: bool = False
) -> Generator[Event, None, int]:
    """Send the log after ``cursor``, checking that revisions follow on; returns the last revision sent.

    With ``first``, the log's oldest retained event may be any revision (a watch of the whole log)."""
    while not buffer.ended:
        batch = composer.events(cursor, LOG_PAGE)
        for event in batch:
            if not first and event.revision != cursor + 1:
                lost = (
                    f"event {cursor + 1} is"
                    if event.revision == cursor + 2
                    else f"events {cursor + 1} to {event.revision - 1} are"
                )
                raise RevisionCompactedError(
                    f"{lost} no longer retained; the oldest is {event.revision}: list again and watch from the "
                    "current revision",
                    metadata={"oldest": str(event.revision), "after": str(cursor)},
                )
            first = False
            composer.store.await_event(event.revision)
            yield event
            cursor = event.revision
        if len(batch) < LOG_PAGE:
            break
    return cursor
