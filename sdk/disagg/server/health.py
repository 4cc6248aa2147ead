"""``grpc.health.v1`` on the asyncio server, set from any thread, with Watch streams that end at shutdown.

The status of each service is set by plain threads (start-up, the leadership thread stepping down) while the
calls live on the server's event loop, so `set` is thread-safe and hands each change to the watchers' loop.
A Watch stream never ends by itself, so during a graceful shutdown it would hold the server until the grace
period runs out: `end_watches` tells every watcher NOT_SERVING and then ends its stream with OK, so that it goes
looking for another server at once. From then on every service stays NOT_SERVING.

A gRPC front end in a process of its own (`disagg.server.front`) answers health there: `mirror_to` hands it every
status as it is set, in the order set, and the end of the watches.
"""

# ruff: noqa: N802  (the RPC methods carry the service's names, as grpcio calls them)

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
_END = -1
"""Put on a watcher's queue: end the stream."""


class _Watcher:
    def __init__(self, service: str, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop
        self.queue: asyncio.Queue[int] = asyncio.Queue()

    def tell(self, status: int) -> None:
        """From any thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, status)


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}
        self._watchers: set[_Watcher] = set()
        self._ended = False
        self._mirror: Callable[[str, int | None], None] | None = None

    def mirror_to(self, mirror: Callable[[str, int | None], None]) -> None:
        """Call ``mirror(service, status)`` with every status now and each set from now on, under this service's
        lock, so in order (None: the watches ended); it must not block."""
        with self._lock:
            self._mirror = mirror
            for service, status in self._status.items():
                mirror(service, status)
            if self._ended:
                mirror("", None)

    def set(self, service: str, status: int) -> None:
        """Set a service's status (``""`` is the whole server) and tell its watchers; ignored after
        `end_watches`."""
        with self._lock:
            if self._ended:
                return
            self._status[service] = status
            if self._mirror is not None:
                self._mirror(service, status)
            watchers = [w for w in self._watchers if w.service == service]
        for watcher in watchers:
            watcher.tell(status)

    def end_watches(self) -> None:
        """NOT_SERVING for every service from now on, then end every Watch stream."""
        with self._lock:
            self._ended = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            if self._mirror is not None:
                self._mirror("", None)
            watchers = list(self._watchers)
            self._watchers.clear()
        for watcher in watchers:
            watcher.tell(NOT_SERVING)
            watcher.tell(_END)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        watcher = _Watcher(request.service, asyncio.get_running_loop())
        with self._lock:
            ended = self._ended
            if not ended:
                self._watchers.add(watcher)
            status: int = self._status.get(request.service, SERVICE_UNKNOWN)
        try:
            yield health_pb2.HealthCheckResponse(status=status)
            if ended:
                return
            while (changed := await watcher.queue.get()) != _END:
                if changed != status:
                    status = changed
                    yield health_pb2.HealthCheckResponse(status=status)
        finally:
            with self._lock:
                self._watchers.discard(watcher)
