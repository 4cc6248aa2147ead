"""``grpc.health.v1`` for the fabric manager: grpcio's health servicer whose Watch streams end at shutdown.

A Watch stream never ends by itself, so during a graceful shutdown it would hold the server until the grace
period runs out. `end_watches` tells every watcher NOT_SERVING (through `enter_graceful_shutdown`) and then
ends its stream with OK, so that it goes looking for another server at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health

SendResponse = Callable[[Any], None]


class HealthService(health.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self._watch_lock = threading.Lock()
        self._watchers: set[SendResponse] = set()

    def Watch(  # noqa: N802 (the RPC's name)
        self, request: Any, context: grpc.ServicerContext, send_response_callback: SendResponse | None = None
    ) -> Any:
        if send_response_callback is None:  # a server without non-blocking streams
            return super().Watch(request, context, None)
        send = self._once(send_response_callback)
        with self._watch_lock:
            self._watchers.add(send)
        context.add_callback(lambda: self._forget(send))
        return super().Watch(request, context, send)

    def _once(self, send_response: SendResponse) -> SendResponse:
        """Forward responses until the stream is ended (None), then nothing: it may be ended only once."""
        lock = threading.Lock()
        ended = False

        def send(response: Any) -> None:
            nonlocal ended
            with lock:
                if ended:
                    return
                ended = response is None
                send_response(response)

        return send

    def _forget(self, send: SendResponse) -> None:
        with self._watch_lock:
            self._watchers.discard(send)

    def end_watches(self) -> None:
        """NOT_SERVING for every service from now on, then end every Watch stream."""
        self.enter_graceful_shutdown()
        with self._watch_lock:
            watchers = list(self._watchers)
            self._watchers.clear()
        for send in watchers:
            send(None)
