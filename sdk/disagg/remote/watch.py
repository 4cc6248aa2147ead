"""The client side of WatchFabricEvents: one thread per remote fabric keeps a stream open and delivers events.

The thread opens the stream, waits for its initial metadata (the driver has then registered it), and
delivers each event to the fabric's handlers, in order. It waits for that metadata ``headers_within_s`` at most
(the fabric's call timeout), then cancels the stream and watches again, as after one refused: a driver that
hangs before it sends them (a deadlock, a grpc-go handler that sends nothing before its first event) held the
watcher on that stream for ever, while no event could come. When the stream breaks (the driver restarted, or
dropped a watcher that fell behind) it reconnects with a bounded exponential backoff; since the service
cannot replay what was missed, the first thing it does after reconnecting is ask the fabric to `resync`,
which rediscovers and reports the differences as events. Only then is the watcher connected. A stream left for
a malformed event is followed by a new one after a wait that doubles with each such stream
(`MalformedBackoff`): a driver that sends nothing else would otherwise have the whole fabric rediscovered
twenty times a second. A stream whose driver promised heartbeats and went silent is given up (`_Silence`), and
the next is connected only from its first message: each new stream of a driver still hung sends its headers at
once, and taken as connected at once it had the driver's events heard most of the time.

Events are counted against the number the driver sends in the stream's initial metadata, so that
`wait_for` can tell when every event published up to a given number has been handled, and each event is
handed on with its number (``(instance, n)``, None from a driver that does not number its events), so that the
fabric can tell the events published before its resync's discovery was answered from those after. A waiter does not sit
out the backoff: it has the watcher try at once, and gives up as soon as an attempt begun after it fails to
connect (the driver refused the stream, or the resync failed), since no event can come then.

A watcher that cannot get events (every resync fails, or the driver refuses every stream or sends no headers on
it) says so at WARNING, at most once every `WARN_EVERY_S` for each cause: the fabric's calls may still work, so
nothing else would show that the composer no longer hears of failures.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import attrs
import grpc

from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import DisaggError, InvalidRequestError
from disagg.model import FabricEvent
from disagg.wire import driver as wire

log = logging.getLogger("disagg.remote")

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
JOIN_TIMEOUT_S = 5.0
WARN_EVERY_S = 60.0
"""The least time between two warnings that the watcher gets no events."""
MALFORMED_QUIET_S = 30.0
"""How long without a malformed event before the wait after one is `BACKOFF_MIN_S` again."""
NOT_CONNECTED = "failed to connect"
"""What grpcio's details of a call say when no connection could be made: the driver is down (restarting), a cause
of its own, whose warnings must not hide one the driver answers with once it is back."""
HEARTBEATS_MISSED = 3
"""A stream whose driver promised heartbeats is given up after this many intervals without a message."""


class _Ending(enum.Enum):
    """How one stream of `EventWatcher._watch_once` ended."""

    UNCONNECTED = "unconnected"
    """Refused, or its resync failed: no event came."""
    ENDED = "ended"
    """It broke or ended after connecting."""
    MALFORMED = "malformed"
    """Left for a malformed event (`EventWatcher._event`)."""


@attrs.define
class MalformedBackoff:
    """The wait before a new stream after one was left for a malformed event: `BACKOFF_MIN_S` after a quiet
    `MALFORMED_QUIET_S`, else twice the last, up to `BACKOFF_MAX_S`. Each new stream rediscovers the whole
    fabric; a well-formed event between two malformed ones does not reset it, or a driver that sends both would
    keep the rediscoveries as frequent."""

    delay_s: float = 0.0
    last: float = -math.inf
    """When the last malformed event left a stream (``time.monotonic()``)."""

    def next(self, now: float) -> float:
        quiet = now - self.last >= MALFORMED_QUIET_S
        self.delay_s = BACKOFF_MIN_S if quiet else min(self.delay_s * 2, BACKOFF_MAX_S)
        self.last = now
        return self.delay_s


class _Silence:
    """Cancels a stream that has carried nothing for ``limit_s``: its driver promised a heartbeat at least every
    ``limit_s`` / `HEARTBEATS_MISSED`, so it is hung (or the path to it is), and no failure it sees is told. A
    thread of its own while the stream is read, since reading it blocks without a timeout."""

    def __init__(self, call: EventCall, limit_s: float, name: str) -> None:
        self._call = call
        self.limit_s = limit_s
        self._last = time.monotonic()
        self._ended = threading.Event()
        self.broke = False
        """Whether it cancelled the stream."""
        self._thread = threading.Thread(target=self._run, name=f"silence-{name}", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def hold(self) -> None:
        """Time nothing until `heard` again: the watcher is handing an event on, and reads no message meanwhile
        (a handler that waits long must not make the driver look hung)."""
        self._last = math.inf

    def stop(self) -> None:
        self._ended.set()

    def _run(self) -> None:
        while not self._ended.wait(min(max(self._last + self.limit_s - time.monotonic(), 0.0), self.limit_s)):
            if time.monotonic() - self._last >= self.limit_s:
                self.broke = True
                self._call.cancel()
                return


class EventCall(Protocol):
    """What a WatchFabricEvents call answers: an iterator of responses that is also a `grpc.Call`."""

    def __iter__(self) -> Iterator[pb.WatchFabricEventsResponse]: ...

    def __next__(self) -> pb.WatchFabricEventsResponse: ...

    def initial_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def code(self) -> grpc.StatusCode | None: ...

    def details(self) -> str | None: ...


class EventWatcher:
    """Keeps one watch stream open until `stop`.

    ``open_stream`` starts a WatchFabricEvents call; ``resync(first)`` is called on the watcher's thread
    after each connection and tells the handlers what changed while disconnected, before the stream's own
    events; ``deliver(event, number)`` hands one stream event to the handlers, with the driver's number of it
    (``(instance, n)``: the n-th event the driver published) or None when the driver does not number them.
    """

    def __init__(
        self,
        name: str,
        open_stream: Callable[[], EventCall],
        resync: Callable[[bool], None],
        deliver: Callable[[FabricEvent, tuple[str, int] | None], None],
        *,
        address: str,
        headers_within_s: float,
        heartbeat_s: float = 0.0,
    ) -> None:
        self._name = name
        self._address = address
        self._headers_within_s = headers_within_s
        self._heartbeat_s = heartbeat_s
        """The heartbeat interval the streams ask for (0: none): silence is timed only when asked and promised."""
        self._open_stream = open_stream
        self._resync = resync
        self._deliver = deliver
        self._state = threading.Condition()
        self._stopping = False
        self._connected = False
        self._instance = ""
        self._seen = 0
        self._resyncs = 0
        """Resyncs begun; ``_synced`` is the number of the last one whose events were all delivered."""
        self._synced = 0
        self._attempts = 0
        """Connection attempts begun; ``_failed`` is the number of the last one that did not connect."""
        self._failed = 0
        self._hurry = False
        """A waiter wants the next attempt now, not after the backoff."""
        self._next_warning: dict[str, float] = {}
        """By cause (`_no_events`): when its next warning may be logged."""
        self._unwarned: dict[str, int] = {}
        self._call: EventCall | None = None
        self._doubted = False
        """The last stream was given up for silence: the next, if it promises heartbeats, is open only from its
        first message (the watcher's thread's alone)."""
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        """Whether a stream is open and resynchronised: only then do the handlers hear the driver's events."""
        with self._state:
            return self._connected

    def on_watcher_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def wait_connected(self, timeout: float) -> bool:
        """Wait until a stream is open; False when ``timeout`` passed first."""
        with self._state:
            return self._state.wait_for(lambda: self._connected or self._stopping, timeout) and self._connected

    def wait_for(self, instance: str, published: int, timeout: float) -> bool:
        """Wait until the events numbered up to ``published`` by ``instance`` are handled; False when
        ``timeout`` passed first or the watcher stopped.

        While the watcher is reconnecting (a fault injected right after a driver restart), or still on a stream
        of another instance, it waits for the stream of ``instance``; a resync begun after this call started
        also answers, since its discovery saw what the events told. The watcher then tries at once rather than
        after its backoff, and an attempt begun after this call started that does not connect (the driver
        refused the stream, the resync failed) answers False at once: no event can come before the next one.
        """
        with self._state:
            resyncs, attempts = self._resyncs, self._attempts

            def handled() -> bool:
                current = self._connected and self._instance == instance and self._seen >= published
                return current or self._synced > resyncs

            if not (self._connected and self._instance == instance):  # not on the stream its events come on
                self._hurry = True
                self._state.notify_all()
            return (
                self._state.wait_for(lambda: self._stopping or handled() or self._failed > attempts, timeout)
                and handled()
            )

    def stop(self) -> None:
        """Cancel the stream and end the thread. Idempotent; safe from a handler (it then does not wait)."""
        with self._state:
            self._stopping = True
            call = self._call
            self._state.notify_all()
        if call is not None:
            call.cancel()
        if not self.on_watcher_thread():
            self._thread.join(JOIN_TIMEOUT_S)

    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        malformed = MalformedBackoff()
        first = True
        while True:
            with self._state:
                if self._stopping:
                    return
            ending = _Ending.UNCONNECTED
            try:
                ending = self._watch_once(first)
            except Exception:  # a handler's bug must not end the watcher
                log.exception("the event watcher failed; watching again")
            if ending is not _Ending.UNCONNECTED:
                first = False
                backoff = BACKOFF_MIN_S
            wait = malformed.next(time.monotonic()) if ending is _Ending.MALFORMED else backoff
            with self._state:
                if self._state.wait_for(lambda: self._stopping or self._hurry, wait) and self._stopping:
                    return
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _watch_once(self, first: bool) -> _Ending:
        """Open one stream and deliver from it until it ends; how it ended."""
        with self._state:
            self._attempts += 1
            attempt = self._attempts
            self._hurry = False
        try:
            call = self._open_stream()
        except BaseException:
            self._give_up(attempt)
            raise
        with self._state:
            if self._stopping:
                call.cancel()
                return _Ending.UNCONNECTED
            self._call = call
        connected = False
        ending = _Ending.UNCONNECTED
        silence: _Silence | None = None
        try:
            metadata, late = self._headers(call)
            with self._state:
                if self._stopping:  # cancelled by `stop`, not refused
                    return _Ending.UNCONNECTED
            if late:
                self._no_events(
                    f"the driver at {self._address} sent no headers on its event stream within "
                    f"{self._headers_within_s:g}s (the fabric's call_timeout_s), so the stream was given up: a driver "
                    "must send a WatchFabricEvents stream's headers at once, before its first event (a grpc-go "
                    "driver calls stream.SendHeader first: grpc-go holds them until the first event otherwise; "
                    "docs/remote-drivers.md)",
                    "headers",
                )
                return _Ending.UNCONNECTED
            header = wire.metadata_value(metadata, wire.EVENT_SEQUENCE_KEY)
            if call.done():  # refused at once (the driver's cap on streams, a stopping server): not connected
                self._no_events(
                    f"the driver at {self._address} refused the event stream ({call.code()}: {call.details()})",
                    "down" if NOT_CONNECTED in (call.details() or "") else "refused",
                )
                return _Ending.UNCONNECTED
            numbered = wire.event_sequence(header)
            sequence = numbered or ("", 0)
            instance, number = sequence
            promised = self._beat(wire.heartbeat_promised(wire.metadata_value(metadata, wire.HEARTBEAT_KEY)))
            with self._state:
                self._resyncs += 1
                resync = self._resyncs
            self._resync(first)
            with self._state:  # only now: a waiter must not return before the resync's events are handled
                self._instance, self._seen = sequence
                self._synced = resync
                if not (self._doubted and promised):
                    self._connected = connected = True
                    ending = _Ending.ENDED
                self._state.notify_all()
            silence = _Silence(call, promised * HEARTBEATS_MISSED, self._name) if promised else None
            for response in call:
                if silence is not None:
                    silence.heard()
                if not connected:  # a driver given up for silence speaks again: its events are heard from now
                    self._doubted = False
                    with self._state:
                        self._connected = connected = True
                        self._state.notify_all()
                    ending = _Ending.ENDED
                if not response.HasField("event"):  # a heartbeat: the driver still watches
                    continue
                number += 1  # the stream brings every event published after it registered, in order
                event = self._event(response.event)
                if event is None:  # watched again: the new stream's resync rediscovers what the event meant to tell
                    ending = _Ending.MALFORMED
                    break
                if silence is not None:
                    silence.hold()
                self._deliver(event, (instance, number) if numbered is not None else None)
                if silence is not None:
                    silence.heard()
                with self._state:
                    self._seen += 1
                    self._state.notify_all()
            log.debug("the event stream ended; watching again")
        except grpc.RpcError as exc:
            if silence is not None and silence.broke:
                self._doubted = True
                self._no_events(
                    f"the driver at {self._address} sent nothing on its event stream for {silence.limit_s:g}s, though "
                    f"it promised a heartbeat every {silence.limit_s / HEARTBEATS_MISSED:g}s: it may be hung, so the "
                    "stream was given up",
                    "silent",
                )
            else:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                log.debug("the event stream broke (%s); watching again", code)
        except DisaggError as exc:
            self._no_events(f"resynchronising after connecting failed ({exc.message})", "resync")
        finally:
            if silence is not None:
                silence.stop()
            with self._state:
                self._connected = False
                self._call = None
                self._state.notify_all()
            call.cancel()
            if not connected:
                self._give_up(attempt)
        return ending

    def _beat(self, promised: float | None) -> float | None:
        """The interval a stream's silence is timed by: the driver's promise, never shorter than what was asked (a
        driver may only lengthen it), and none when nothing was asked (a promise then breaks the contract)."""
        return max(promised, self._heartbeat_s) if promised and self._heartbeat_s > 0 else None

    def _headers(self, call: EventCall) -> tuple[Sequence[tuple[str, str | bytes]] | None, bool]:
        """The stream's initial metadata, and whether ``headers_within_s`` passed first: the call is then
        cancelled. grpcio's wait for them takes no timeout, and a driver that hangs before it sends them (a
        deadlock, a grpc-go handler that sends nothing until its first event) held the watcher for ever."""
        late = threading.Event()

        def give_up() -> None:
            late.set()
            call.cancel()

        timer = threading.Timer(self._headers_within_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            metadata = call.initial_metadata()
        finally:
            timer.cancel()
        return metadata, late.is_set()

    def _event(self, msg: pb.FabricEvent) -> FabricEvent | None:
        """A stream event as this fabric's (a driver may leave its fabric unnamed: the stream is of this one);
        None for one that does not decode or names another fabric. Skipping it would lose the change it tells,
        so the stream is left for a new one, whose resync rediscovers the fabric."""
        try:
            event = wire.fabric_event_from_wire(msg)
        except InvalidRequestError as exc:
            why = exc.message
        else:
            if event.fabric == self._name:
                return event
            if not event.fabric:
                return attrs.evolve(event, fabric=self._name)
            why = f"it names fabric {event.fabric!r}, not {self._name!r}"
        log.warning(
            "fabric %s: the driver sent a malformed event (%s); watching again to rediscover what changed",
            self._name,
            why,
        )
        return None

    def _give_up(self, attempt: int) -> None:
        """Attempt number ``attempt`` did not connect: a waiter for events stops waiting."""
        with self._state:
            self._failed = attempt
            self._state.notify_all()

    def _no_events(self, why: str, cause: str) -> None:
        """Log that a stream was opened but gives no events: at WARNING at most once every `WARN_EVERY_S` for each
        ``cause`` (a driver down while it restarts, refusing, must not hide for a minute that it then serves another
        fabric, which the resync says)."""
        now = time.monotonic()
        if now < self._next_warning.get(cause, 0.0):
            self._unwarned[cause] = self._unwarned.get(cause, 0) + 1
            log.debug("fabric %s: %s; watching again", self._name, why)
            return
        unwarned = self._unwarned.pop(cause, 0)
        since = f" ({unwarned} more times since the last warning)" if unwarned else ""
        self._next_warning[cause] = now + WARN_EVERY_S
        log.warning(
            "fabric %s: %s; no events are delivered until it succeeds (retrying every %gs at most)%s",
            self._name,
            why,
            BACKOFF_MAX_S,
            since,
        )
