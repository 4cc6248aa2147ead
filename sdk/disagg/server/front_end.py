"""The gRPC front end: grpcio's asyncio server in a process of its own, handing every fabric-manager call to the
composer's process over a link (`disagg.server.link`), as the bytes that came.

Why a process: on one process, one event loop ran gRPC's work for every call and the composer's for every change
under one interpreter lock, and a durable Compose at 32 clients stayed at half a no-op call's rate however little
the composer's part cost (docs/benchmarks.md, stops 40-45). Here gRPC's work runs beside the composer, on the
machine's other core. Health and reflection are answered here; health mirrors what the composer's process sets.

Started by `disagg.server.front.ProcessFrontEnd` as ``python -m disagg.server.front_end SPEC`` (SPEC: JSON with the
link's descriptor, the parent's pid, the listeners and the server's options). It ends when its parent does: Linux
kills it as the parent dies (``PR_SET_PDEATHSIG``), and a link closed from the other end ends it at once. Ctrl-C
and SIGTERM are the parent's to act on: it stops this process gracefully, draining the calls in flight.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.server.errors import guarded_handlers
from disagg.server.health import NOT_SERVING, HealthService
from disagg.server.link import (
    CALL,
    CALL_HEAD,
    CANCEL,
    COUNT,
    CREDIT,
    END,
    HEADERS,
    HEALTH,
    LISTENING,
    MESSAGE,
    PING,
    PONG,
    REPLY,
    STOP,
    STOPPED,
    LinkBrokenError,
    LinkProtocol,
    deadline_of,
    decode_metadata,
    read_end,
)
from disagg.server.loop import event_loop_factory
from disagg.wire.sockets import bind_unix_socket

log = logging.getLogger("disagg.server.front_end")

SERVICE = fm.DESCRIPTOR.services_by_name["FabricManagerService"]
METHODS = list(SERVICE.methods)
"""The service's methods; a call names its method by index in this list, the same in both processes."""
PR_SET_PDEATHSIG = 1
PARENTS_SIGNALS = {signal.SIGINT, signal.SIGTERM}
"""Ctrl-C and SIGTERM, which the parent acts on, for this process too (`main`)."""
CODES = {code.value[0]: code for code in grpc.StatusCode}
HEARTBEAT_S = 1.0
"""How often the front end asks whether the composer's loop still runs (`PING`)."""
UNANSWERED_BEATS = 3
"""Pings left unanswered after which health says NOT_SERVING until the composer answers again: this process still
answers a client's keepalive pings, so only health tells a client with other replicas not to wait for one that
stopped (SIGSTOP, a hung loop), within about the time those pings took to notice on one process. Counted in beats,
not seconds, so that a pause of both processes (Ctrl-Z) is not taken for one of the composer's alone."""

Handler = Callable[[bytes, "grpc.aio.ServicerContext[bytes, bytes]"], Awaitable[Any]]


class FrontLink(LinkProtocol):
    """The front end's side of the link: opens calls, and routes what comes back to the call it answers."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._next = 0
        self._unary: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        self.health = HealthService()
        self.stop_asked: asyncio.Future[float | None] = loop.create_future()
        self._mirrored: dict[str, int] = {}
        """What the composer's process set, said again once it answers after `UNANSWERED_BEATS`."""
        self._unanswered = 0

    def _open(self, index: int, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> int:
        call = self._next
        while True:  # an id comes round again after 2**32 calls: a watch may hold it still
            call = (call + 1) & 0xFFFFFFFF or 1
            if call not in self._unary and call not in self._streams:
                break
        self._next = call
        head = CALL_HEAD.pack(index, deadline_of(context.time_remaining(), time.monotonic()))
        self.send(CALL, call, head + request)
        return call

    def unary(self, index: int) -> Handler:
        async def forward(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            call = self._open(index, request, context)
            answer: asyncio.Future[tuple[int, bytes]] = self.loop.create_future()
            self._unary[call] = answer
            try:
                kind, payload = await answer
            except asyncio.CancelledError:
                if self._unary.pop(call, None) is not None:
                    self.send(CANCEL, call)
                raise
            if kind == REPLY:
                return payload
            code, details, trailing = read_end(payload)
            try:
                await context.abort(CODES[code], details, trailing)
            except grpc.aio.InternalError as exc:  # gone meanwhile: as `disagg.server.errors` ends it, cancelled
                raise asyncio.CancelledError from exc
            raise AssertionError("abort returned")  # pragma: no cover - grpcio's abort raises

        return forward

    def stream(self, index: int) -> Handler:
        async def forward(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
            call = self._open(index, request, context)
            queue = self._streams[call] = asyncio.Queue()
            try:
                while True:
                    kind, payload = await queue.get()
                    if kind == MESSAGE:
                        await context.write(payload)
                        self.send(CREDIT, call, COUNT.pack(1))
                    elif kind == HEADERS:
                        await context.send_initial_metadata(decode_metadata(json.loads(payload)))
                    else:
                        code, details, trailing = read_end(payload)
                        if code:
                            await context.abort(CODES[code], details, trailing)
                        if trailing:
                            context.set_trailing_metadata(trailing)
                        return
            except (asyncio.CancelledError, grpc.aio.InternalError) as exc:
                # The client went away or its deadline passed (a write gRPC refused finds the same): the composer's
                # process stops the call's work, and the call ends as cancelled, as on one process.
                if self._streams.pop(call, None) is not None:
                    self.send(CANCEL, call)
                if isinstance(exc, grpc.aio.InternalError):
                    raise asyncio.CancelledError from exc
                raise
            finally:
                self._streams.pop(call, None)

        return forward

    def frame(self, kind: int, call: int, payload: bytes) -> None:
        if kind in (REPLY, END):
            answer = self._unary.pop(call, None)
            if answer is not None:
                if not answer.done():
                    answer.set_result((kind, payload))
                return
        if kind in (MESSAGE, HEADERS, END):
            queue = self._streams.get(call)
            if queue is not None:
                if kind == END:
                    del self._streams[call]
                queue.put_nowait((kind, payload))
            return
        if kind == REPLY:
            return  # the call was cancelled here before its answer came
        if kind == HEALTH:
            service, status = json.loads(payload)
            if status is None:
                self.health.end_watches()
            else:
                self._mirrored[service] = status
                if self._unanswered <= UNANSWERED_BEATS:  # else NOT_SERVING until it answers (`beat`)
                    self.health.set(service, status)
        elif kind == PONG:
            if self._unanswered > UNANSWERED_BEATS:
                log.warning("the composer's process answers again: health as it sets it")
                for service, status in self._mirrored.items():
                    self.health.set(service, status)
            self._unanswered = 0
        elif kind == STOP:
            if not self.stop_asked.done():
                self.stop_asked.set_result(json.loads(payload))
        else:
            raise LinkBrokenError(f"frame kind {kind} from the composer's process")

    def beat(self) -> None:
        """Ping the composer's process every `HEARTBEAT_S`; NOT_SERVING after `UNANSWERED_BEATS` unanswered."""
        if self.closed:
            return
        if self._unanswered == UNANSWERED_BEATS:
            log.warning(
                "the composer's process has not answered for %g s: NOT_SERVING until it does",
                HEARTBEAT_S * UNANSWERED_BEATS,
            )
            for service in self._mirrored:
                self.health.set(service, NOT_SERVING)
        self._unanswered += 1
        self.send(PING, 0)
        self.loop.call_later(HEARTBEAT_S, self.beat)

    def lost(self, why: str) -> None:
        """The composer's process is gone (or asked this one to end and closed the link): end now. Its clients'
        connections close with the process, and they find the next server as they would after a crash."""
        log.debug("the link to the composer's process closed: %s", why)
        sys.stderr.flush()
        os._exit(0)


def _handlers(link: FrontLink) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
    """Every method of the service, forwarded as bytes: no decoding here, nor encoding."""
    handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {}
    for index, method in enumerate(METHODS):
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(link.stream(index))
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(link.unary(index))
    return handlers


def _bind(server: grpc.aio.Server, listener: dict[str, Any]) -> int:
    target: str = listener["target"]
    if listener["unix_path"] is not None:  # closed to other users, as on one process
        return bind_unix_socket(Path(listener["unix_path"]), lambda: server.add_insecure_port(target))
    return server.add_insecure_port(target)


async def serve(spec: dict[str, Any]) -> None:
    """Serve until the composer's process asks for a stop, then stop with the grace it gives and say so."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=spec["fd"])
    _, link = await loop.connect_accepted_socket(lambda: FrontLink(loop), sock)
    server = grpc.aio.server(options=[tuple(option) for option in spec["options"]])
    handlers = _handlers(link)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
    # Health and reflection through the error mapping of one process (a request that does not decode is
    # INVALID_ARGUMENT, not UNKNOWN), wrapped once: no interceptor asked at every forwarded call.
    names = (SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    for add, servicer in (
        (health_pb2_grpc.add_HealthServicer_to_server, link.health),
        (reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.aio.ReflectionServicer(names)),
    ):
        service, guarded = guarded_handlers(add, servicer)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)
    ports: list[int] = []
    for index, listener in enumerate(spec["listeners"]):
        try:
            ports.append(_bind(server, listener))
        except Exception as exc:  # RuntimeError from grpcio, ConfigError from the socket's permissions
            link.send_json(LISTENING, 0, {"failed": index, "why": str(exc)})
            await server.stop(None)
            link.close("the front end could not listen")
            return
    await server.start()
    link.send_json(LISTENING, 0, {"ports": ports})
    link.beat()
    gc.collect()
    gc.freeze()
    grace = await link.stop_asked
    await server.stop(grace)
    link.send(STOPPED, 0)
    link.close("stopped")


def _die_with_parent(parent: int) -> None:
    """Be killed as the parent dies (it may be killed at any moment: the crash tests SIGKILL it), and end now if
    it died already."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    _die_with_parent(spec["parent"])
    for signum in PARENTS_SIGNALS:  # one that came as it started, blocked since (`ProcessFrontEnd.start`), drops
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENTS_SIGNALS)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(spec))
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
