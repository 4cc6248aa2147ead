"""The service side of WatchFabricEvents: one subscription to the fabric, fanned out to every watch stream.

Each stream has its own bounded queue, so a slow watcher never blocks the fabric (handlers must not block)
nor the other watchers; a watcher that falls `queue_size` events behind has its stream ended with
RESOURCE_EXHAUSTED and watches again. Events are numbered as they are published; a stream remembers the
number reached when it opened, which the service sends as initial metadata (see `disagg.wire.driver`).
"""

from __future__ import annotations

import enum
import threading
import uuid
from collections import deque

from disagg.interfaces import Fabric
from disagg.model import FabricEvent

DEFAULT_QUEUE_SIZE = 1024
DEFAULT_MAX_STREAMS = 8


class Signal(enum.Enum):
    """What a stream reads instead of an event."""

    END = "end"
    """The stream was closed (client gone) or the feed stopped (server stopping)."""
    OVERFLOW = "overflow"
    """The watcher fell too far behind; the stream must end."""


class EventStream:
    """One watcher's bounded queue of events."""

    def __init__(self, start: int, queue_size: int) -> None:
        self.start = start
        self._size = queue_size
        self._queue: deque[FabricEvent] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._overflow = False

    def put(self, event: FabricEvent) -> None:
        with self._ready:
            if self._closed or self._overflow:
                return
            if len(self._queue) >= self._size:
                self._overflow = True
                self._queue.clear()
            else:
                self._queue.append(event)
            self._ready.notify()

    def get(self, timeout: float) -> FabricEvent | Signal | None:
        """The next event, a `Signal`, or None when nothing came within ``timeout`` seconds."""
        with self._ready:
            if not self._queue and not self._closed and not self._overflow:
                self._ready.wait(timeout)
            if self._overflow:
                return Signal.OVERFLOW
            if self._queue:
                return self._queue.popleft()
            return Signal.END if self._closed else None

    def close(self) -> None:
        """End the stream; events still queued are dropped. Idempotent; safe from any thread."""
        with self._ready:
            self._closed = True
            self._queue.clear()
            self._ready.notify_all()


class TooManyStreamsError(Exception):
    """The feed already serves its maximum number of watch streams."""


class EventFeed:
    """Publishes one fabric's events, numbered, to every open `EventStream`."""

    def __init__(
        self, fabric: Fabric, *, queue_size: int = DEFAULT_QUEUE_SIZE, max_streams: int = DEFAULT_MAX_STREAMS
    ) -> None:
        self.instance = uuid.uuid4().hex[:16]
        """Tells this feed's numbering from that of an earlier run of the same endpoint."""
        self.queue_size = queue_size
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._streams: list[EventStream] = []
        self._published = 0
        self._stopped = False
        self._subscription = fabric.subscribe(self._publish)

    @property
    def published(self) -> int:
        """How many events the fabric has reported since the feed started."""
        with self._lock:
            return self._published

    def _publish(self, event: FabricEvent) -> None:
        with self._lock:  # numbering and queueing together, so that every stream sees the same order
            self._published += 1
            for stream in self._streams:
                stream.put(event)

    def open(self) -> EventStream:
        """A new stream of the events published from now on; `TooManyStreamsError` past ``max_streams``."""
        with self._lock:
            if self._stopped:
                stream = EventStream(self._published, self.queue_size)
                stream.close()
                return stream
            if len(self._streams) >= self.max_streams:
                raise TooManyStreamsError(f"at most {self.max_streams} watch streams at once")
            stream = EventStream(self._published, self.queue_size)
            self._streams.append(stream)
            return stream

    def close(self, stream: EventStream) -> None:
        stream.close()
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)

    def stop(self) -> None:
        """End every stream and stop listening to the fabric. Idempotent."""
        with self._lock:
            self._stopped = True
            streams, self._streams = self._streams, []
        for stream in streams:
            stream.close()
        self._subscription.cancel()
