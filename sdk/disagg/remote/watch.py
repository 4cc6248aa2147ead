"""The client side of WatchFabricEvents: one thread per remote fabric keeps a stream open and delivers events.

The thread opens the stream, waits for its initial metadata (the driver has then registered it), and
delivers each event to the fabric's handlers, in order. When the stream breaks (the driver restarted, or
dropped a watcher that fell behind) it reconnects with a bounded exponential backoff; since the service
cannot replay what was missed, the first thing it does after reconnecting is ask the fabric to `resync`,
which rediscovers and reports the differences as events.

Events are counted against the number the driver sends in the stream's initial metadata, so that
`wait_for` can tell when every event published up to a given number has been handled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import grpc

from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import DisaggError, InvalidRequestError
from disagg.model import FabricEvent
from disagg.wire import driver as wire

log = logging.getLogger("disagg.remote")

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
JOIN_TIMEOUT_S = 5.0


class EventCall(Protocol):
    """What a WatchFabricEvents call answers: an iterator of responses that is also a `grpc.Call`."""

    def __iter__(self) -> Iterator[pb.WatchFabricEventsResponse]: ...

    def __next__(self) -> pb.WatchFabricEventsResponse: ...

    def initial_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def code(self) -> grpc.StatusCode | None: ...


class EventWatcher:
    """Keeps one watch stream open until `stop`.

    ``open_stream`` starts a WatchFabricEvents call; ``resync(first)`` is called on the watcher's thread
    after each connection and answers the events to deliver before the stream's own (none on the first);
    ``deliver`` hands one event to the handlers.
    """

    def __init__(
        self,
        name: str,
        open_stream: Callable[[], EventCall],
        resync: Callable[[bool], Sequence[FabricEvent]],
        deliver: Callable[[FabricEvent], None],
    ) -> None:
        self._open_stream = open_stream
        self._resync = resync
        self._deliver = deliver
        self._state = threading.Condition()
        self._stopping = False
        self._connected = False
        self._instance = ""
        self._seen = 0
        self._call: EventCall | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        with self._state:
            return self._connected

    def on_watcher_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def wait_connected(self, timeout: float) -> bool:
        """Wait until a stream is open; False when ``timeout`` passed first."""
        with self._state:
            return self._state.wait_for(lambda: self._connected or self._stopping, timeout) and self._connected

    def wait_for(self, instance: str, published: int, timeout: float) -> bool:
        """Wait until the events numbered up to ``published`` by ``instance`` are handled.

        Returns at once, False, when no stream of that instance is open (it cannot tell); False on timeout.
        """
        with self._state:
            return self._state.wait_for(
                lambda: self._stopping or not self._connected or self._instance != instance or self._seen >= published,
                timeout,
            ) and (self._connected and self._instance == instance and self._seen >= published)

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
        first = True
        while True:
            with self._state:
                if self._stopping:
                    return
            try:
                if self._watch_once(first):
                    first = False
                    backoff = BACKOFF_MIN_S
            except Exception:  # a handler's bug must not end the watcher
                log.exception("the event watcher failed; watching again")
            with self._state:
                if self._state.wait_for(lambda: self._stopping, backoff):
                    return
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _watch_once(self, first: bool) -> bool:
        """Open one stream and deliver from it until it ends; True when it was connected at all."""
        call = self._open_stream()
        with self._state:
            if self._stopping:
                call.cancel()
                return False
            self._call = call
        connected = False
        try:
            header = wire.metadata_value(call.initial_metadata(), wire.EVENT_SEQUENCE_KEY)
            if call.done():  # refused at once (the driver's cap on streams, a stopping server): not connected
                log.debug("the driver ended the event stream at once (%s); watching again", call.code())
                return False
            sequence = wire.event_sequence(header) or ("", 0)
            missed = self._resync(first)
            with self._state:
                self._instance, self._seen = sequence
                self._connected = connected = True
                self._state.notify_all()
            for event in missed:
                self._deliver(event)
            for response in call:
                try:
                    event = wire.fabric_event_from_wire(response.event)
                except InvalidRequestError as exc:
                    log.warning("the driver sent a malformed event, skipped: %s", exc.message)
                else:
                    self._deliver(event)
                with self._state:
                    self._seen += 1
                    self._state.notify_all()
            log.debug("the event stream ended; watching again")
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            log.debug("the event stream broke (%s); watching again", code)
        except DisaggError as exc:
            log.debug("resynchronising after reconnecting failed (%s); watching again", exc.message)
        finally:
            with self._state:
                self._connected = False
                self._call = None
                self._state.notify_all()
            call.cancel()
        return connected
