"""Ordered delivery of fabric events to subscribers, outside the fabric's lock.

The fabric posts an event while it holds its lock, so the queue order is the order in which the hardware
changed. Delivery happens after the lock is released, so that a handler may call back into the fabric (the
composer unbinds a failed device from its health handler). One thread at a time drains the queue, which keeps
every handler's view in order even when several threads change the fabric at once. A handler that raises is
logged and does not stop delivery to the others.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from disagg.interfaces import EventHandler, Subscription
from disagg.model import FabricEvent

log = logging.getLogger("disagg_sim")


class _Subscription(Subscription):
    def __init__(self, dispatcher: EventDispatcher, handler: EventHandler) -> None:
        self._dispatcher = dispatcher
        self.handler = handler
        self.active = True

    def cancel(self) -> None:
        """Stop delivery, including of events already queued. Idempotent."""
        self._dispatcher.remove(self)


class EventDispatcher:
    """Subscriptions and a queue of events waiting for delivery."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delivery = threading.Lock()
        self._delivering_thread: int | None = None
        self._subscriptions: list[_Subscription] = []
        self._queue: deque[tuple[FabricEvent, tuple[_Subscription, ...]]] = deque()

    def subscribe(self, handler: EventHandler) -> Subscription:
        if not callable(handler):
            raise TypeError("an event handler must be callable")
        sub = _Subscription(self, handler)
        with self._lock:
            self._subscriptions.append(sub)
        return sub

    def remove(self, sub: _Subscription) -> None:
        with self._lock:
            sub.active = False
            if sub in self._subscriptions:
                self._subscriptions.remove(sub)

    def post(self, event: FabricEvent) -> None:
        """Queue ``event`` for the handlers subscribed now. Cheap; call it under the fabric's lock."""
        with self._lock:
            if self._subscriptions:
                self._queue.append((event, tuple(self._subscriptions)))

    def deliver(self) -> None:
        """Deliver queued events in order. Call it without the fabric's lock held.

        A handler that changes the fabric posts more events; they are delivered by the loop already running
        on this thread, after the current one, rather than recursively out of order.
        """
        if self._delivering_thread == threading.get_ident():
            return
        with self._delivery:
            self._delivering_thread = threading.get_ident()
            try:
                while True:
                    with self._lock:
                        if not self._queue:
                            return
                        event, subs = self._queue.popleft()
                    self._tell(event, subs)
            finally:
                self._delivering_thread = None

    @staticmethod
    def _tell(event: FabricEvent, subs: tuple[_Subscription, ...]) -> None:
        """Give ``event`` to each subscriber still active. One that raises is logged; one that raises what is not
        an `Exception` (a CancelledError, an interrupt) is raised again once the others have the event, which is
        off the queue: they would never get it."""
        stopped: BaseException | None = None
        for sub in subs:
            if not sub.active:
                continue
            try:
                sub.handler(event)
            except Exception:
                log.exception("event handler %r failed on %s", sub.handler, event)
            except BaseException as exc:
                stopped = stopped or exc
        if stopped is not None:
            raise stopped
