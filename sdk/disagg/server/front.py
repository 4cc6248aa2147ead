"""The composer's side of a gRPC front end in a process of its own (`disagg.server.front_end`).

`ProcessFrontEnd` starts the front end, learns the ports it listens on, and answers the calls it forwards with the
same handlers, wrapped by the same error mapping (`disagg.server.errors`), as grpcio's server in this process
would: each call gets a `LinkedContext`, which gives a handler what grpcio's asyncio context gives it (the deadline,
whether the call is over, a callback when it ends, initial metadata, abort, a stream's writes). A call the client
cancels, or whose deadline passes, is cancelled here as grpcio cancels it. A stream's writes wait for the front end
to pass messages on (`disagg.server.link.STREAM_CREDIT`), so that a watch whose client stopped reading is caught
stalled here, as on one process. Health is mirrored to the front end as it is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import attrs
import grpc
import grpc.aio

from disagg.errors import ConfigError
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.server.errors import guarded_handlers
from disagg.server.front_end import METHODS, PARENTS_SIGNALS
from disagg.server.health import HealthService
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
    STREAM_CREDIT,
    LinkBrokenError,
    LinkProtocol,
    Metadata,
    encode_metadata,
    end_payload,
)
from disagg.server.listeners import Listener

log = logging.getLogger("disagg.server")

START_S = 60.0
"""The longest the front end may take to listen: an interpreter that imports grpcio takes well under a second."""
STOP_MARGIN_S = 5.0
"""How much longer than the grace a stopping front end may take before it is killed: its stop only waits for the
calls in flight, which the grace bounds."""
FRONT_END_GONE = "the gRPC front end's process ended"


class ServerStoppedError(RuntimeError):
    """`stop` came while `start` ran: the server is stopped, and serves nothing."""


class LinkedContext:
    """What a handler in the composer's process asks of a call the front end forwarded."""

    __slots__ = (
        "_call",
        "_callbacks",
        "_cancelled",
        "_credit",
        "_credited",
        "_deadline",
        "_done",
        "_link",
        "task",
    )

    def __init__(self, link: ComposerLink, call: int, deadline: float, streaming: bool) -> None:
        self._link = link
        self._call = call
        self._deadline = deadline
        self._done = False
        self._cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._credit = STREAM_CREDIT if streaming else 0
        self._credited: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def time_remaining(self) -> float | None:
        if math.isnan(self._deadline):
            return None
        return max(self._deadline - time.monotonic(), 0.0)

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            self._link.loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        for callback in self._callbacks:
            self._link.loop.call_soon(callback, self)
        self._callbacks.clear()
        if self._credited is not None and not self._credited.done():
            self._credited.cancel()

    def cancel(self) -> None:
        """The client went away, or its deadline passed: cancel the handler, as grpcio does."""
        self._cancelled = True
        if self.task is not None:
            self.task.cancel()
        self.finish()

    def credit(self, count: int) -> None:
        self._credit += count
        if self._credited is not None and not self._credited.done():
            self._credited.set_result(None)

    async def send_initial_metadata(self, metadata: Metadata) -> None:
        self._link.send_json(HEADERS, self._call, encode_metadata(metadata))

    async def write(self, message: bytes) -> None:
        while self._credit <= 0:
            if self._done:
                raise asyncio.CancelledError
            self._credited = self._link.loop.create_future()
            await self._credited
        self._credit -= 1
        self._link.send(MESSAGE, self._call, message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()) -> None:
        self._link.send(END, self._call, end_payload(code.value[0], details, trailing_metadata))
        self.finish()
        raise grpc.aio.AbortError(f"aborted with {code.name}")


class _SerializingContext(LinkedContext):
    """A stream's context: its handler writes response messages, sent as their bytes."""

    __slots__ = ("_serialize",)

    def __init__(self, link: ComposerLink, call: int, deadline: float, serialize: Callable[[Any], bytes]) -> None:
        super().__init__(link, call, deadline, True)
        self._serialize = serialize

    async def write(self, message: Any) -> None:
        await super().write(self._serialize(message))


@attrs.frozen
class LinkedMethod:
    """What the composer's side runs for one method: the handler as grpcio would call it, with its codecs."""

    behavior: Callable[[Any, Any], Awaitable[Any]]
    decode: Callable[[bytes], Any]
    encode: Callable[[Any], bytes]
    streaming: bool

    @classmethod
    def of(cls, handler: grpc.RpcMethodHandler[Any, Any]) -> LinkedMethod:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        assert behavior is not None and handler.request_deserializer is not None
        assert handler.response_serializer is not None
        return cls(
            cast(Callable[[Any, Any], Awaitable[Any]], behavior),
            handler.request_deserializer,
            handler.response_serializer,
            handler.response_streaming,
        )


class ComposerLink(LinkProtocol):
    """The composer's side of the link: runs each forwarded call's handler on this loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, methods: Sequence[LinkedMethod], on_lost: Callable[[str], None]
    ) -> None:
        super().__init__(loop)
        self._methods = methods
        self._calls: dict[int, LinkedContext] = {}
        self._on_lost = on_lost
        self.listening: asyncio.Future[dict[str, Any] | None] = loop.create_future()
        """What the front end said once it listened, or None when the link was lost first (`why`)."""
        self.why = ""
        self.stopped: asyncio.Future[None] = loop.create_future()

    def frame(self, kind: int, call: int, payload: bytes) -> None:
        if kind == CALL:
            index, deadline = CALL_HEAD.unpack_from(payload)
            method = self._methods[index]
            context = (
                _SerializingContext(self, call, deadline, method.encode)
                if method.streaming
                else LinkedContext(self, call, deadline, False)
            )
            self._calls[call] = context
            context.task = self.loop.create_task(self._answer(method, payload[CALL_HEAD.size :], context, call))
        elif kind == CANCEL:
            # Taken off here, not only as its task ends: a task cancelled before it first ran never runs its
            # ``finally`` (a CANCEL that came in the same read as its CALL).
            running = self._calls.pop(call, None)
            if running is not None:
                running.cancel()
        elif kind == CREDIT:
            running = self._calls.get(call)
            if running is not None:
                running.credit(COUNT.unpack(payload)[0])
        elif kind == PING:
            self.send(PONG, 0)
        elif kind == LISTENING:
            if not self.listening.done():
                self.listening.set_result(json.loads(payload))
        elif kind == STOPPED:
            if not self.stopped.done():
                self.stopped.set_result(None)
        else:
            raise LinkBrokenError(f"frame kind {kind} from the front end")

    async def _answer(self, method: LinkedMethod, raw: bytes, context: LinkedContext, call: int) -> None:
        try:
            response = await method.behavior(method.decode(raw), context)
            if not context.done():
                if method.streaming:
                    self.send(END, call, end_payload(0, "", ()))
                else:
                    self.send(REPLY, call, method.encode(response))
        except grpc.aio.AbortError:
            pass  # the END went out with the abort
        except asyncio.CancelledError:
            # Cancelled from the front end, which ended the call; anything else (this loop closing) ends it as
            # cancelled here, or the client would wait out its deadline.
            if not context.cancelled() and not context.done():
                self.send(END, call, end_payload(grpc.StatusCode.CANCELLED.value[0], "the call was cancelled", ()))
        except Exception:
            log.exception("a forwarded call failed outside its handler's error mapping")
            if not context.done():
                self.send(END, call, end_payload(grpc.StatusCode.INTERNAL.value[0], "internal error", ()))
        finally:
            self._calls.pop(call, None)
            context.finish()

    def serve(self, methods: Sequence[LinkedMethod]) -> None:
        """Answer calls from now on with ``methods`` (those in flight keep theirs)."""
        self._methods = methods

    def health(self, service: str, status: int | None) -> None:
        self.send_json(HEALTH, 0, [service, status])

    def lost(self, why: str) -> None:
        for context in list(self._calls.values()):
            context.cancel()
        self.why = why
        if not self.listening.done():
            self.listening.set_result(None)
        if not self.stopped.done():
            self.stopped.set_result(None)
        self._on_lost(why)


def linked_methods(service: fm_grpc.FabricManagerServiceServicer) -> list[LinkedMethod]:
    """``service``'s handlers in `METHODS` order, each wrapped by the error mapping the server's interceptor
    applies (`disagg.server.errors.guarded_handlers`)."""
    _, handlers = guarded_handlers(fm_grpc.add_FabricManagerServiceServicer_to_server, service)
    return [LinkedMethod.of(handlers[method.name]) for method in METHODS]


class ProcessFrontEnd:
    """The front end's process and the link to it, on the server's event loop."""

    def __init__(
        self, listeners: Sequence[Listener], options: Sequence[tuple[str, int]], on_lost: Callable[[str], None]
    ) -> None:
        self._listeners = listeners
        self._options = options
        self._on_lost = on_lost
        self._process: subprocess.Popen[bytes] | None = None
        self._link: ComposerLink | None = None
        self._stopping = False
        self._listening = False

    async def start(
        self, service: fm_grpc.FabricManagerServiceServicer, health: HealthService
    ) -> list[int] | tuple[int, str]:
        """Start the front end, ``health`` mirrored to it from then on, and wait until it listens: the port bound for
        each listener, or the index of the listener it could not bind with why."""
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        spec = {
            "fd": theirs.fileno(),
            "parent": os.getpid(),
            "listeners": [
                {"target": lst.target, "unix_path": None if lst.unix_path is None else str(lst.unix_path)}
                for lst in self._listeners
            ],
            "options": [list(option) for option in self._options],
        }
        # Started with Ctrl-C and SIGTERM blocked (a thread's mask is inherited) until it ignores them: one sent to
        # the process group as it starts, before Python could ignore it, killed it with a traceback.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, PARENTS_SIGNALS)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "disagg.server.front_end", json.dumps(spec)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        methods = linked_methods(service)
        _, self._link = await loop.connect_accepted_socket(lambda: ComposerLink(loop, methods, self._lost), mine)
        link = self._link

        def mirror(service: str, status: int | None) -> None:  # from any thread, in the order set
            loop.call_soon_threadsafe(link.health, service, status)

        health.mirror_to(mirror)
        try:
            listening = await asyncio.wait_for(asyncio.shield(self._link.listening), START_S)
        except TimeoutError:
            listening = None
        if listening is None:
            why = self._link.why or f"it did not listen within {START_S:g} s"
            stopped = self._stopping  # before `_end_process`, which sets it
            code = await self._end_process(0.0)
            if stopped:
                raise ServerStoppedError("the server was stopped while it started")
            raise ConfigError(f"the gRPC front end did not start (exit code {code}): {why}")
        if "failed" in listening:
            await self._end_process(START_S)
            return int(listening["failed"]), str(listening["why"])
        self._listening = True
        return [int(port) for port in listening["ports"]]

    def serve(self, service: fm_grpc.FabricManagerServiceServicer) -> None:
        """Answer calls with ``service``'s handlers from now on: the built servicer's, once the composer is built,
        instead of `_Forwarded`'s look-up at every call (a coroutine less a call). On the loop's thread."""
        if self._link is not None:
            self._link.serve(linked_methods(service))

    def _lost(self, why: str) -> None:
        if self._listening and not self._stopping:
            log.error("%s (%s): stopping", FRONT_END_GONE, why)
            self._on_lost(FRONT_END_GONE)

    async def stop(self, grace: float | None) -> None:
        """Stop the front end: it refuses new calls and gives those in flight ``grace`` seconds (None: none),
        as grpcio's server stops; this loop keeps answering them meanwhile. Returns once the process has ended."""
        self._stopping = True
        if self._link is not None and not self._link.closed and self._listening:
            self._link.send_json(STOP, 0, grace)
            try:
                await asyncio.wait_for(asyncio.shield(self._link.stopped), (grace or 0.0) + STOP_MARGIN_S)
            except TimeoutError:
                log.warning("the gRPC front end did not stop in time: killing it")
        await self._end_process(1.0)

    async def _end_process(self, wait_s: float) -> int | None:
        """Close the link, wait ``wait_s`` seconds for the process to end, then kill it; its exit code."""
        self._stopping = True
        if self._link is not None:
            self._link.close("stopping")
        process = self._process
        if process is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, process.wait, wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return await loop.run_in_executor(None, process.wait)
